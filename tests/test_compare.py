"""`qwen-image-fast compare` on synthetic pairs with known metrics (PNG, so the pixels are exact)."""

import math

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast import compare
from qwen_image_fast.cli import main

OFFSETS = (1, 5, 20)  # uniform offsets: PSNR = 20 log10(255 / offset)


@pytest.fixture
def folders(tmp_path):
    """A and B: B = A + offset for offset-*.png, B = A for same.png, plus files only in A or only in B."""
    rng = np.random.default_rng(0)
    a_dir, b_dir = tmp_path / "baseline", tmp_path / "fast"
    a_dir.mkdir(), b_dir.mkdir()
    image = rng.integers(0, 200, size=(40, 48, 3), dtype=np.uint8)  # [H, W, RGB], room for +20
    for offset in OFFSETS:
        Image.fromarray(image).save(a_dir / f"offset-{offset}.png")
        Image.fromarray(image + offset).save(b_dir / f"offset-{offset}.png")
    Image.fromarray(image).save(a_dir / "same.png")
    Image.fromarray(image).save(b_dir / "same.png")
    Image.fromarray(image).save(a_dir / "only-a.png")
    Image.fromarray(image).save(b_dir / "only-b.png")
    (b_dir / ".tmp-half-written.png").write_bytes(b"\x89PNG")  # a render's temporary file: ignored
    return a_dir, b_dir


def test_known_psnr_ssim_and_max_difference(folders, tmp_path):
    report = compare.compare_folders(*folders, compare.prepare_report_dir(tmp_path / "report"))
    pairs = {pair.name: pair for pair in report.pairs}
    assert sorted(pairs) == ["offset-1.png", "offset-20.png", "offset-5.png", "same.png"]
    for offset in OFFSETS:
        pair = pairs[f"offset-{offset}.png"]
        assert pair.psnr == pytest.approx(20 * math.log10(255 / offset), abs=1e-9)
        assert pair.max_abs_diff == offset
        assert pair.ssim < 1
    assert pairs["same.png"].psnr == math.inf and pairs["same.png"].ssim == pytest.approx(1.0)
    assert pairs["same.png"].max_abs_diff == 0
    assert report.only_a == ["only-a.png"] and report.only_b == ["only-b.png"]


def test_cli_report_grids_and_html(folders, tmp_path, capsys):
    report_dir = tmp_path / "report"
    assert main(["compare", *map(str, folders), "--out", str(report_dir)]) == 0
    table = capsys.readouterr().out
    assert "offset-5.png" in table and "34.15" in table and "only in A: only-a.png" in table
    html = (report_dir / "index.html").read_text()
    for name in ("offset-1.png", "offset-5.png", "offset-20.png", "same.png"):
        assert f'src="grids/{name}.jpg"' in html
        with Image.open(report_dir / "grids" / f"{name}.jpg") as grid:
            assert grid.format == "JPEG" and grid.width > 3 * grid.height  # A | B | difference, under titles
    assert "only in B: only-b.png" in html and ".tmp-" not in html


@pytest.mark.parametrize("min_psnr, status", [(20.0, 0), (40.0, 1)])
def test_min_psnr_sets_the_exit_status(folders, tmp_path, capsys, min_psnr, status):
    assert main(["compare", *map(str, folders), "--out", str(tmp_path / "r"), "--min-psnr", str(min_psnr)]) == status
    assert ("FAIL" in capsys.readouterr().out) == bool(status)


def test_different_sizes_and_unreadable_files_are_reported_and_fail_the_threshold(tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    Image.new("RGB", (32, 32)).save(a_dir / "x.png")
    Image.new("RGB", (64, 32)).save(b_dir / "x.png")
    Image.new("RGB", (32, 32)).save(a_dir / "y.png")
    (b_dir / "y.png").write_bytes(b"not an image")
    report = compare.compare_folders(a_dir, b_dir, compare.prepare_report_dir(tmp_path / "r"), min_psnr=10)
    x, y = report.pairs
    assert x.psnr is None and "sizes differ" in x.note
    assert y.psnr is None and "unreadable" in y.note
    assert not report.passed


def test_no_pair_fails_a_threshold_and_a_missing_folder_exits_2(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r")]) == 0
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r"),
                 "--min-psnr", "30"]) == 1
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(tmp_path / "missing"), str(tmp_path / "b"), "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2 and "not a folder" in capsys.readouterr().err
