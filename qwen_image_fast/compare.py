"""Compare two folders of images paired by file name: PSNR, SSIM and max |A-B| per pair, labeled side-by-side grids
(A | B | amplified difference, JPEG) and an index.html report with relative paths.

PSNR = 10 log10(255^2 / MSE) over all pixels and RGB channels (inf for identical images). SSIM is scikit-image's
(7x7 window, per channel, averaged); it is imported only here, so the rest of the CLI works without it.

A comparison fails (Report.failures) when nothing pairs, when a pair cannot be measured (a file unreadable, the
sizes differ), or when a pair is below min_psnr.
"""

import html
import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .cli.output import read_settings

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
DIFF_GAIN = 8  # the difference panel shows |A-B| x 8, clipped to 255
PANEL_MIN, PANEL_MAX = 256, 768  # long side of a grid panel in pixels: small images scaled up, large ones down
HEADER, GAP = 26, 6


@dataclass
class Pair:
    name: str
    psnr: float | None  # dB; inf when identical; None when the sizes differ or a file is unreadable
    ssim: float | None  # None as psnr, or when an image is under 7 pixels a side
    max_abs_diff: int | None
    grid: str | None  # path relative to the report folder
    prompt: str | None  # from the settings embedded in A's image, if any
    model_note: str | None  # e.g. that tiny-random images are noise, from the embedded settings
    note: str = ""


@dataclass
class Report:
    pairs: list[Pair]
    only_a: list[str]
    only_b: list[str]
    min_psnr: float | None
    report_dir: Path

    def unmeasured(self) -> list[Pair]:
        """Pairs without a PSNR: a file unreadable, or the sizes differ."""
        return [p for p in self.pairs if p.psnr is None]

    def below(self) -> list[Pair]:
        """Measured pairs under min_psnr."""
        if self.min_psnr is None:
            return []
        return [p for p in self.pairs if p.psnr is not None and p.psnr < self.min_psnr]

    @property
    def model_notes(self) -> list[str]:
        return sorted({p.model_note for p in self.pairs if p.model_note})

    def failures(self) -> list[str]:
        """Why the comparison fails, one reason a line; [] when it passes."""
        reasons = [] if self.pairs else ["no pair: no file name is in both folders"]
        if self.unmeasured():
            reasons.append(f"{len(self.unmeasured())} pair(s) not measured (unreadable, or the sizes differ): "
                           + ", ".join(p.name for p in self.unmeasured()))
        if self.below():
            reasons.append(f"{len(self.below())} pair(s) below --min-psnr {self.min_psnr:g} dB: "
                           + ", ".join(p.name for p in self.below()))
        return reasons

    @property
    def passed(self) -> bool:
        return not self.failures()

    def verdict(self) -> str:
        """One line: pass, with what was checked, or FAIL with why."""
        if not self.passed:
            return "FAIL: " + "; ".join(self.failures())
        threshold = "" if self.min_psnr is None else f", none below --min-psnr {self.min_psnr:g} dB"
        return f"pass: {len(self.pairs)} pair(s) measured{threshold}"


def structural_similarity_function():
    try:
        from skimage.metrics import structural_similarity
    except ImportError as e:
        raise ValueError("compare needs scikit-image for SSIM: pip install scikit-image") from e
    return structural_similarity


def images_in(folder: Path) -> dict[str, Path]:
    """Image files by name; hidden files (a render's .tmp-* files) are left out."""
    return {p.name: p for p in sorted(folder.iterdir())
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")}


def load_rgb(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))  # [H, W, 3] uint8


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float | None:
    if min(a.shape[:2]) < 7:
        return None
    return float(structural_similarity_function()(a, b, channel_axis=2, data_range=255))


def fit_panel(image: Image.Image) -> Image.Image:
    """Scale so the long side is in [PANEL_MIN, PANEL_MAX]: integer nearest-neighbour up (pixels stay visible)."""
    long_side = max(image.size)
    if long_side < PANEL_MIN:
        factor = -(-PANEL_MIN // long_side)
        return image.resize((image.width * factor, image.height * factor), Image.NEAREST)
    if long_side > PANEL_MAX:
        scale = PANEL_MAX / long_side
        return image.resize((round(image.width * scale), round(image.height * scale)), Image.LANCZOS)
    return image


def make_grid(a: np.ndarray, b: np.ndarray, titles: tuple[str, str, str]) -> Image.Image:
    """A | B | |A-B| x DIFF_GAIN, each under its title."""
    diff = np.clip(np.abs(a.astype(np.int16) - b.astype(np.int16)) * DIFF_GAIN, 0, 255).astype(np.uint8)
    panels = [fit_panel(Image.fromarray(x)) for x in (a, b, diff)]
    width, height = panels[0].size
    grid = Image.new("RGB", (3 * width + 2 * GAP, height + HEADER), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default(size=14)
    for i, (panel, title) in enumerate(zip(panels, titles)):
        x = i * (width + GAP)
        grid.paste(panel, (x, HEADER))
        draw.text((x + 4, 5), title, fill="black", font=font)
    return grid


def compare_pair(name: str, a_path: Path, b_path: Path, report_dir: Path, titles: tuple[str, str]) -> Pair:
    try:
        a, b = load_rgb(a_path), load_rgb(b_path)
        a_settings, b_settings = read_settings(a_path), read_settings(b_path)
    except (OSError, SyntaxError, ValueError) as e:  # not an image after all, truncated, a broken chunk
        return Pair(name, None, None, None, None, None, None, f"unreadable: {e}")
    prompt, model_note = a_settings.get("prompt"), a_settings.get("note") or b_settings.get("note")
    if a.shape != b.shape:
        note = f"sizes differ: {a.shape[1]}x{a.shape[0]} vs {b.shape[1]}x{b.shape[0]}"
        return Pair(name, None, None, None, None, prompt, model_note, note)
    max_abs_diff = int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
    grid = f"grids/{name}.jpg"
    make_grid(a, b, (*titles, f"|A-B| x{DIFF_GAIN} (max {max_abs_diff})")).save(report_dir / grid, quality=90)
    return Pair(name, psnr(a, b), ssim(a, b), max_abs_diff, grid, prompt, model_note)


def prepare_report_dir(out: str | Path) -> Path:
    report_dir = Path(out)
    try:
        (report_dir / "grids").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {report_dir}: cannot create the report folder ({e.strerror or e})") from e
    return report_dir


def compare_folders(a_dir: str | Path, b_dir: str | Path, report_dir: Path, min_psnr: float | None = None) -> Report:
    """Pair a_dir's and b_dir's images by file name, write grids and index.html into report_dir."""
    a_dir, b_dir = Path(a_dir), Path(b_dir)
    a_images, b_images = images_in(a_dir), images_in(b_dir)
    titles = (f"A: {a_dir.resolve().name}", f"B: {b_dir.resolve().name}")
    pairs = [compare_pair(name, a_images[name], b_images[name], report_dir, titles)
             for name in sorted(a_images.keys() & b_images.keys())]
    report = Report(pairs, sorted(a_images.keys() - b_images.keys()), sorted(b_images.keys() - a_images.keys()),
                    min_psnr, report_dir)
    write_html(report, a_dir, b_dir)
    return report


def format_number(value: float | None, digits: int) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.{digits}f}"


def write_html(report: Report, a_dir: Path, b_dir: Path):
    failing = {p.name for p in report.below() + report.unmeasured()}
    title = f"{html.escape(str(a_dir))} (A) vs {html.escape(str(b_dir))} (B)"
    rows = "\n".join(
        f'<tr class="{"fail" if p.name in failing else ""}"><td><a href="#{quote(p.name)}">{html.escape(p.name)}</a>'
        f"</td><td>{format_number(p.psnr, 2)}</td><td>{format_number(p.ssim, 4)}</td>"
        f"<td>{'-' if p.max_abs_diff is None else p.max_abs_diff}</td>"
        f"<td>{html.escape(p.note or p.prompt or '')}</td></tr>"
        for p in report.pairs)
    grids = "\n".join(
        f'<h3 id="{quote(p.name)}">{html.escape(p.name)}: PSNR {format_number(p.psnr, 2)} dB</h3>'
        f'<img src="{quote(p.grid)}" alt="{html.escape(p.name)}: A, B, difference">'
        for p in report.pairs if p.grid)
    unpaired = "".join(f"<li>only in A: {html.escape(n)}</li>" for n in report.only_a)
    unpaired += "".join(f"<li>only in B: {html.escape(n)}</li>" for n in report.only_b)
    verdict = f"<p><b>{html.escape(report.verdict())}</b></p>"
    notes = "".join(f"<p><b>Note: these images are {html.escape(note)}.</b></p>" for note in report.model_notes)
    (report.report_dir / "index.html").write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}} tr.fail{{background:#fdd}}
img{{max-width:100%}}</style></head>
<body><h1>{title}</h1>
<p>{len(report.pairs)} pair(s) by file name. Grids: A | B | |A-B| x{DIFF_GAIN}.</p>{verdict}{notes}
<table><tr><th>image</th><th>PSNR (dB)</th><th>SSIM</th><th>max |A-B|</th><th>prompt</th></tr>
{rows}
</table>
{f"<h2>Unpaired</h2><ul>{unpaired}</ul>" if unpaired else ""}
{grids}
</body></html>
""", encoding="utf-8")


def format_table(report: Report) -> str:
    width = max([len("image")] + [len(p.name) for p in report.pairs])
    lines = [f"{'image':<{width}}  {'PSNR dB':>8}  {'SSIM':>6}  {'max|A-B|':>8}"]
    for p in report.pairs:
        lines.append(f"{p.name:<{width}}  {format_number(p.psnr, 2):>8}  {format_number(p.ssim, 4):>6}  "
                     f"{'-' if p.max_abs_diff is None else p.max_abs_diff:>8}  {p.note}".rstrip())
    measured = [p for p in report.pairs if p.psnr is not None]
    if measured:
        lines.append(f"{len(report.pairs)} pair(s): worst PSNR {format_number(min(p.psnr for p in measured), 2)} dB, "
                     f"worst max|A-B| {max(p.max_abs_diff for p in measured)}")
    else:
        lines.append("no pair of images with the same name and size")
    lines += [f"only in A: {name}" for name in report.only_a] + [f"only in B: {name}" for name in report.only_b]
    lines += [f"note: these images are {note}" for note in report.model_notes]
    lines.append(report.verdict())
    lines.append(f"report: {report.report_dir / 'index.html'}")
    return "\n".join(lines)
