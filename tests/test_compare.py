"""`qwen-image-fast compare` on synthetic pairs with known metrics (PNG, so the pixels are exact), and its pairing:
by the settings an image records (prompt, seed, size, input images), across names and formats, never by name alone."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast.cli import compare
from qwen_image_fast.command import main
from qwen_image_fast.cli.output import save_image

OFFSETS = (1, 5, 20)  # uniform offsets: PSNR = 20 log10(255 / offset)


def rendered(folder, name: str, pixels: np.ndarray, prompt: str, seed: int = 0, **settings):
    """An image as a render writes it: its settings embedded (no manifest: compare reads either)."""
    folder.mkdir(exist_ok=True)
    save_image(Image.fromarray(pixels), folder / name, name.rsplit(".", 1)[1],
               dict(prompt=prompt, seed=seed, width=pixels.shape[1], height=pixels.shape[0], steps=50) | settings)


def main_output(argv, capsys) -> str:
    main(argv)
    return capsys.readouterr().out


@pytest.fixture
def pixels():
    return np.random.default_rng(0).integers(0, 200, size=(40, 48, 3), dtype=np.uint8)  # [H, W, RGB], room for +20


@pytest.fixture
def folders(tmp_path, pixels):
    """A and B: B = A + offset for offset-*.png, B = A for same.png, plus images only in A or only in B."""
    a_dir, b_dir = tmp_path / "baseline", tmp_path / "fast"
    for offset in OFFSETS:
        rendered(a_dir, f"offset-{offset}.png", pixels, f"offset {offset}")
        rendered(b_dir, f"offset-{offset}.png", pixels + offset, f"offset {offset}")
    rendered(a_dir, "same.png", pixels, "same")
    rendered(b_dir, "same.png", pixels, "same")
    rendered(a_dir, "only-a.png", pixels, "only a")
    rendered(b_dir, "only-b.png", pixels, "only b")
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


def test_alpha_is_compared_when_either_image_has_it(pixels, tmp_path):
    """RGBA images (Qwen-Image-2.1's) are compared on all four channels: the same RGB under another alpha differs
    (PSNR over 4 channels), and an RGB image pairs with an RGBA one as opaque."""
    opaque = np.concatenate([pixels, np.full_like(pixels[..., :1], 255)], axis=2)
    half = opaque.copy()
    half[..., 3] = 255 - 20
    rendered(tmp_path / "a", "x.png", opaque, "x")
    rendered(tmp_path / "b", "x.png", half, "x")
    rendered(tmp_path / "a", "y.png", pixels, "y")
    rendered(tmp_path / "b", "y.png", opaque, "y")
    report = compare.compare_folders(tmp_path / "a", tmp_path / "b", compare.prepare_report_dir(tmp_path / "report"))
    pairs = {pair.name: pair for pair in report.pairs}
    assert pairs["x.png"].max_abs_diff == 20
    assert pairs["x.png"].psnr == pytest.approx(20 * math.log10(255 / 20) + 10 * math.log10(4), abs=1e-9)
    assert pairs["y.png"].psnr == math.inf
    assert (tmp_path / "report" / pairs["x.png"].grid).is_file()


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
    """Images that record no settings pair by name with --by-name only."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    Image.new("RGB", (32, 32)).save(a_dir / "x.png")
    Image.new("RGB", (64, 32)).save(b_dir / "x.png")
    Image.new("RGB", (32, 32)).save(a_dir / "y.png")
    (b_dir / "y.png").write_bytes(b"not an image")
    Image.new("RGB", (32, 32)).save(a_dir / "z.png")
    Image.new("RGB", (32, 32)).save(b_dir / "z.png")
    assert main(["compare", str(a_dir), str(b_dir), "--out", str(tmp_path / "r"), "--by-name"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: 2 pair(s) not measured (unreadable, or the sizes differ): x.png, y.png" in out
    assert "sizes differ: 32x32 vs 64x32" in out and "unreadable" in out
    assert "FAIL: 2 pair(s) not measured" in (tmp_path / "r" / "index.html").read_text()


def test_nothing_paired_exits_1_with_one_line_and_writes_no_report(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "a" / "x.png")
    for threshold in ([], ["--min-psnr", "30"]):
        assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r"),
                     *threshold]) == 1
        assert capsys.readouterr().out.splitlines() == [
            "FAIL: no comparable pair: no image of A has the same prompt, seed, size and input images as one of B "
            "(nor the same file name)"]
        assert not (tmp_path / "r").exists()


def test_images_of_other_prompts_under_the_same_names_are_refused(folders, pixels, tmp_path, capsys):
    """The demo folder against one rendered from another prompt list: the same file names, unrelated images."""
    other = tmp_path / "other"
    for i, name in enumerate(["offset-1.png", "same.png"]):
        rendered(other, name, pixels, f"another prompt {i}")
    assert main(["compare", str(folders[0]), str(other), "--out", str(tmp_path / "r")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "FAIL: no comparable pair: 2 image(s) of the same name are not the same image (offset-1.png: prompt "
        "'offset 1' vs 'another prompt 0')"]
    assert not (tmp_path / "r").exists()
    # one comparable pair beside them: measured, and the comparison still fails, naming the refused ones
    rendered(other, "offset-5.png", pixels, "offset 5", seed=7)
    rendered(other, "x.png", pixels + 5, "offset 5")
    assert main(["compare", str(folders[0]), str(other), "--out", str(tmp_path / "r")]) == 1
    out = capsys.readouterr().out
    assert "offset-5.png = x.png" in out and "34.15" in out
    assert ("FAIL: 2 pair(s) refused (not the same image): offset-1.png (prompt 'offset 1' vs 'another prompt 0'), "
            "same.png (prompt 'same' vs 'another prompt 1')") in out
    assert "only in B: offset-5.png" in out  # A's offset-5.png is x.png; this one has another seed
    assert "refused: offset-1.png and offset-1.png: prompt" in (tmp_path / "r" / "index.html").read_text()


def test_pairs_across_formats_and_names_and_shows_both_sides_settings(folders, pixels, tmp_path, capsys):
    """A PNG folder against a WebP one of the same jobs, in another order (other names), rendered with other steps."""
    webp = tmp_path / "webp"
    for i, offset in enumerate(reversed(OFFSETS)):
        rendered(webp, f"{i:05d}.webp", pixels, f"offset {offset}", steps=8, preset="fast")
    assert main(["compare", str(folders[0]), str(webp), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "offset-1.png = 00002.webp" in out and "offset-20.png = 00000.webp" in out
    assert "A | B: steps 50 | 8; preset None | 'fast'" in out
    assert "only in A: only-a.png" in out and "only in A: same.png" in out
    # the same pixels on both sides of offset-1's pair: all of its PSNR is the format's, and the note says so
    [line] = [line for line in out.splitlines() if line.startswith("offset-1.png = 00002.webp")]
    pair_psnr = float(line.split()[3])
    assert f"B is WEBP (lossy): the format alone costs {pair_psnr:.1f} dB here" in line, line
    assert "lossy" not in main_output(["compare", str(folders[0]), str(folders[1]), "--out", str(tmp_path / "p")],
                                      capsys)
    html = (tmp_path / "r" / "index.html").read_text()
    assert '<tr class="differs"><td>steps</td><td>50</td><td>8</td></tr>' in html
    assert "<tr class=\"\"><td>prompt</td><td>offset 1</td><td>offset 1</td></tr>" in html


def test_settings_come_from_the_manifest_when_there_is_one(folders, pixels, tmp_path, capsys):
    """A manifest line wins over the embedded settings (a file without any, as a JPEG re-save would leave it)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    Image.fromarray(pixels + 5).save(plain / "renamed.png")  # no embedded settings
    assert main(["compare", str(folders[0]), str(plain), "--out", str(tmp_path / "r")]) == 1
    capsys.readouterr()
    line = dict(file="renamed.png", prompt="offset 5", seed=0, width=48, height=40, steps=50, time=1.0)
    (plain / "manifest.jsonl").write_text(json.dumps(line) + "\n")
    assert main(["compare", str(folders[0]), str(plain), "--out", str(tmp_path / "r")]) == 0
    assert "offset-5.png = renamed.png     34.15" in capsys.readouterr().out


def test_input_images_are_compared_by_content(pixels, tmp_path, capsys):
    """Two edits of different input images are not the same image, even with the same prompt and seed."""
    image = lambda digest: [{"path": "/anywhere/in.png", "sha256": digest}]  # noqa: E731
    rendered(tmp_path / "a", "e.png", pixels, "make it blue", images=image("aa"))
    rendered(tmp_path / "b", "e.png", pixels, "make it blue", images=image("bb"))
    rendered(tmp_path / "c", "e.png", pixels, "make it blue", images=[{"path": "/elsewhere.png", "sha256": "aa"}])
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "r")]) == 1
    assert "images ['aa'] vs ['bb']" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "r")]) == 0


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
