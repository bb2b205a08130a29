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
    verdict = capsys.readouterr().out.splitlines()[-2]  # the last line names the report
    assert verdict == ("pass: 4 pair(s) measured, none below --min-psnr 20 dB" if status == 0 else
                       "FAIL: 2 pair(s) below --min-psnr 40 dB: offset-20.png, offset-5.png")


def test_unmeasurable_pairs_fail_without_a_threshold_and_say_why(tmp_path, capsys):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    Image.new("RGB", (32, 32)).save(a_dir / "x.png")
    Image.new("RGB", (64, 32)).save(b_dir / "x.png")
    Image.new("RGB", (32, 32)).save(a_dir / "y.png")
    (b_dir / "y.png").write_bytes(b"not an image")
    Image.new("RGB", (32, 32)).save(a_dir / "z.png")
    Image.new("RGB", (32, 32)).save(b_dir / "z.png")
    assert main(["compare", str(a_dir), str(b_dir), "--out", str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 2 pair(s) not measured (unreadable, or the sizes differ): x.png, y.png" in out
    assert "sizes differ: 32x32 vs 64x32" in out and "unreadable" in out
    assert "FAIL: 2 pair(s) not measured" in (tmp_path / "r" / "index.html").read_text()


def test_nothing_paired_fails_and_says_why(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "x.png")
    for threshold in ([], ["--min-psnr", "30"]):
        assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r"),
                     *threshold]) == 1
        out = capsys.readouterr().out
        assert "FAIL: no pair: no file name is in both folders" in out and "0 pair(s) below" not in out


@pytest.mark.parametrize("make_args, message", [
    (lambda a, b, missing: [a, b, "--min-psnr", "nan"], "argument --min-psnr: must be a finite number, got 'nan'"),
    (lambda a, b, missing: [a, b, "--min-psnr", "inf"], "argument --min-psnr: must be a finite number, got 'inf'"),
    (lambda a, b, missing: [a, b, "--min-psnr=-1"], "argument --min-psnr: must be >= 0, got '-1'"),
    (lambda a, b, missing: [a, b, "--min-psnr", "x"], "argument --min-psnr: must be a number, got 'x'"),
    (lambda a, b, missing: [missing, b], "missing: not a folder"),
], ids=["nan", "inf", "negative", "not-a-number", "missing-folder"])
def test_bad_arguments_exit_2_with_one_line_and_write_no_report(make_args, message, folders, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *make_args(*map(str, folders), str(tmp_path / "missing")), "--out", str(tmp_path / "r")])
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: qwen-image-fast compare") and error.startswith("qwen-image-fast compare: error: ")
    assert message in error and not (tmp_path / "r").exists()
