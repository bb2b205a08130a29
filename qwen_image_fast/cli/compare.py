"""Compare two folders of images: pair what is the same image in both (the prompt, seed, size and input images that
a render recorded), then PSNR, SSIM and max |A-B| per pair, labeled side-by-side grids (A | B | amplified
difference, JPEG) and an index.html report with relative paths and both sides' settings.

Pairing. Each image's settings are its manifest.jsonl line, else the settings embedded in the file (cli/output.py).
Two images pair when they agree on IDENTITY, whatever their file names and formats (a PNG folder pairs with a WebP
one); everything else (steps, cfg, preset, options, applied, ...) may differ, and the report shows what does. An
image left over pairs by file stem only when the two agree on IDENTITY after all (else the pair is refused and the
report names the differing fields) or, for images that record no settings (not rendered by this tool), with
by_name=True (--by-name). Nothing is ever paired by its name alone without --by-name.

PSNR = 10 log10(255^2 / MSE) over all pixels and RGB channels, and the alpha channel when either image has one
(Qwen-Image-2.1 renders RGBA; inf for identical images). SSIM is scikit-image's (7x7 window, per channel,
averaged); it is imported only here, so the rest of the CLI works without it. The grids show RGB.

A comparison fails (Report.failures) when a pair is refused, when a pair cannot be measured (a file unreadable, the
sizes differ), or when a pair is below min_psnr. When nothing pairs at all it writes no report (`no_pairs_reason`).
"""

import html
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .manifest import content_identity, read_records, recorded_settings
from .output import QUALITY

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
# What an image is: two images are comparable only when they agree on these (input images and masks by content).
IDENTITY = ("prompt", "seed", "width", "height", "images", "mask")
# Recorded per image but not a setting of it: never shown as a difference.
NOT_SETTINGS = ("file", "id", "index", "time", "rank", "seconds", "enhance_seconds", "note", "enhancer_note",
                "blocks_computed")
DIFF_GAIN = 8  # the difference panel shows |A-B| x 8, clipped to 255
PANEL_MIN, PANEL_MAX = 256, 768  # long side of a grid panel in pixels: small images scaled up, large ones down
HEADER, GAP = 26, 6


@dataclass
class ImageFile:
    """One image file of a folder and its settings ({} when it records none)."""

    path: Path
    settings: dict

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def stem(self) -> str:
        return self.path.stem


def identity(settings: dict) -> str:
    return json.dumps([content_identity(key, settings.get(key)) for key in IDENTITY], sort_keys=True)


def differing(a: dict, b: dict, keys) -> list[str]:
    return [key for key in keys if content_identity(key, a.get(key)) != content_identity(key, b.get(key))]


def shown(key: str, value, limit: int = 40) -> str:
    """A setting as a difference shows it: input images, masks and LoRAs by content (sha256, its first 12 digits),
    cut to `limit` characters."""
    def abbreviate(v):
        if isinstance(v, (list, tuple)):
            return [abbreviate(x) for x in v]
        return v[:12] if isinstance(v, str) and len(v) == 64 else v

    text = repr(abbreviate(content_identity(key, value)) if key in ("images", "mask", "loras") else value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class Pair:
    a: ImageFile
    b: ImageFile
    how: str  # "settings": they agree on IDENTITY; "name": --by-name, settings missing on a side
    psnr: float | None = None  # dB; inf when identical; None when the sizes differ or a file is unreadable
    ssim: float | None = None  # None as psnr, or when an image is under 7 pixels a side
    max_abs_diff: int | None = None
    grid: str | None = None  # path relative to the report folder
    note: str = ""

    @property
    def name(self) -> str:
        return self.a.name if self.a.name == self.b.name else f"{self.a.name} = {self.b.name}"

    @property
    def differences(self) -> list[str]:
        """The settings the two sides differ in (IDENTITY agrees), e.g. "steps 50 | 8"."""
        keys = [k for k in {**self.a.settings, **self.b.settings} if k not in NOT_SETTINGS]
        a, b = self.a.settings, self.b.settings
        def one_side_only(x: dict, y: dict) -> str:  # what ran on one side only; "-": nothing the other lacks
            return ", ".join(str(v) for v in x.get("applied", []) if v not in y.get("applied", [])) or "-"

        return [f"applied on one side only: {one_side_only(a, b)} | {one_side_only(b, a)}" if key == "applied" else
                f"{key} {shown(key, a.get(key))} | {shown(key, b.get(key))}" for key in differing(a, b, keys)]

    @property
    def computed(self) -> str:
        """With a step cache on a side: the fraction of the transformer's blocks each side's call computed."""
        fractions = [image.settings.get("blocks_computed") for image in (self.a, self.b)]
        if fractions == [None, None]:
            return ""

        def percent(image, fraction):  # an image rendered without a step cache computed every block
            cached = any(label.startswith("step_cache") for label in image.settings.get("applied", []))
            return f"{100 * fraction:.0f}%" if fraction is not None else "-" if cached else "100%"

        return "blocks computed " + " | ".join(percent(image, f) for image, f in zip((self.a, self.b), fractions))

    @property
    def model_note(self) -> str | None:
        return self.a.settings.get("note") or self.b.settings.get("note")


@dataclass
class Refused:
    """Two images of the same file stem that are not the same image (or record no settings, without --by-name)."""

    a: ImageFile
    b: ImageFile
    why: str


@dataclass
class Pairing:
    pairs: list[Pair]
    refused: list[Refused]
    only_a: list[str]
    only_b: list[str]

    def no_pairs_reason(self) -> str | None:
        """One line when nothing is comparable (no report is written then), else None."""
        if self.pairs:
            return None
        if self.refused:
            return (f"no comparable pair: {len(self.refused)} image(s) of the same name are not the same image "
                    f"({self.refused[0].a.name}: {self.refused[0].why})")
        return ("no comparable pair: no image of A has the same prompt, seed, size and input images as one of B "
                "(nor the same file name)")


@dataclass
class Report:
    pairs: list[Pair]
    refused: list[Refused]
    only_a: list[str]
    only_b: list[str]
    min_psnr: float | None
    report_dir: Path
    a_dir: Path = field(default=Path("A"))
    b_dir: Path = field(default=Path("B"))

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
        reasons = [] if self.pairs else ["no comparable pair"]
        if self.refused:
            reasons.append(f"{len(self.refused)} pair(s) refused (not the same image): "
                           + ", ".join(f"{r.a.name} ({r.why})" for r in self.refused))
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


def images_in(folder: Path) -> list[ImageFile]:
    """The folder's image files with their settings (manifest line, else embedded; {} when neither or the file
    cannot be read: measuring it says why). Hidden files (a render's .tmp-* files) are left out."""
    records = read_records(folder)
    return [ImageFile(path, recorded_settings(path, records)) for path in sorted(folder.iterdir())
            if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".")]


def match(left: list[ImageFile], right: list[ImageFile], same) -> list[tuple[ImageFile, ImageFile]]:
    """Pairs (l, r) with same(l, r), each image in at most one, in order; the matched images leave the lists."""
    matched = []
    for l_image in list(left):
        r_image = next((r for r in right if same(l_image, r)), None)
        if r_image is not None:
            matched.append((l_image, r_image))
            left.remove(l_image), right.remove(r_image)
    return matched


def pair_images(a_images: list[ImageFile], b_images: list[ImageFile], by_name: bool = False) -> Pairing:
    """The module docstring's pairing: by IDENTITY (several images of one identity on a side: by file name, then
    by stem, among them), then the rest by file stem, refused unless they agree or --by-name pairs images that
    record no settings."""
    left = [image for image in a_images if image.settings]
    right = [image for image in b_images if image.settings]
    by_identity = []
    for key in dict.fromkeys(identity(image.settings) for image in left):
        l_group = [image for image in left if identity(image.settings) == key]
        r_group = [image for image in right if identity(image.settings) == key]
        if len(l_group) == 1 and len(r_group) == 1:
            by_identity.append((l_group[0], r_group[0]))
        else:
            by_identity += match(l_group, r_group, lambda l, r: l.name == r.name)
            by_identity += match(l_group, r_group, lambda l, r: l.stem == r.stem)
    paired = {id(image) for pair in by_identity for image in pair}
    rest_a = [image for image in a_images if id(image) not in paired]
    rest_b = [image for image in b_images if id(image) not in paired]
    same_name = match(rest_a, rest_b, lambda l, r: l.name == r.name) + match(rest_a, rest_b,
                                                                             lambda l, r: l.stem == r.stem)
    pairs, refused = [Pair(l, r, "settings") for l, r in by_identity], []
    for l, r in same_name:
        if l.settings and r.settings:
            fields = differing(l.settings, r.settings, IDENTITY)
            refused.append(Refused(l, r, "; ".join(f"{key} {shown(key, l.settings.get(key))} vs "
                                                  f"{shown(key, r.settings.get(key))}" for key in fields)))
        elif by_name:
            pairs.append(Pair(l, r, "name"))
        else:
            sides = " and ".join(side for side, image in (("A", l), ("B", r)) if not image.settings)
            refused.append(Refused(l, r, f"no settings recorded in {sides} (not rendered by qwen-image-fast, or "
                                         "unreadable): --by-name pairs such images by file name"))
    return Pairing(sorted(pairs, key=lambda p: p.a.name), refused, [i.name for i in rest_a], [i.name for i in rest_b])


def load_pair(a_path: Path, b_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Both images as [H, W, 3] uint8 RGB, or [H, W, 4] RGBA when either has an alpha channel (an image without
    one is opaque)."""
    with Image.open(a_path) as a, Image.open(b_path) as b:
        mode = "RGBA" if "A" in a.getbands() or "A" in b.getbands() else "RGB"
        return np.asarray(a.convert(mode)), np.asarray(b.convert(mode))


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
    if diff.shape[2] == 4:  # RGBA: the difference panel shows each pixel's largest channel difference, alpha's too
        diff = diff.max(axis=2, keepdims=True).repeat(3, axis=2)
    panels = [fit_panel(Image.fromarray(np.ascontiguousarray(x[..., :3]))) for x in (a, b, diff)]
    width, height = panels[0].size
    grid = Image.new("RGB", (3 * width + 2 * GAP, height + HEADER), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default(size=14)
    for i, (panel, title) in enumerate(zip(panels, titles)):
        x = i * (width + GAP)
        grid.paste(panel, (x, HEADER))
        draw.text((x + 4, 5), title, fill="black", font=font)
    return grid


LOSSY = {".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}  # as render writes them, at cli.output.QUALITY


def format_note(path_a: Path, path_b: Path, a: np.ndarray, b: np.ndarray) -> str:
    """When one side is a lossless file and the other a lossy one, what the format alone costs: the lossless side's
    pixels written in the other's format (render's quality) against themselves, in dB; "" otherwise."""
    kinds = [LOSSY.get(path.suffix.lower()) for path in (path_a, path_b)]
    if (kinds[0] is None) == (kinds[1] is None):
        return ""
    lossless, lossy_format = (a, kinds[1]) if kinds[0] is None else (b, kinds[0])
    if lossy_format == "JPEG":  # no alpha in a JPEG
        lossless = lossless[..., :3]
    out = io.BytesIO()
    Image.fromarray(lossless).save(out, format=lossy_format, quality=QUALITY)
    with Image.open(out) as image:
        alone = psnr(lossless, np.asarray(image.convert("RGBA" if lossless.shape[2] == 4 else "RGB")))
    side = "B" if kinds[0] is None else "A"
    return (f"{side} is {lossy_format} (lossy): the format alone costs {format_number(alone, 1)} dB here (the "
            f"other side written as {lossy_format} at quality {QUALITY})")


def measure(pair: Pair, report_dir: Path, titles: tuple[str, str]):
    """PSNR, SSIM, max |A-B| and the grid of one pair, or a note saying why it cannot be measured."""
    try:
        a, b = load_pair(pair.a.path, pair.b.path)
    except (OSError, SyntaxError, ValueError) as e:  # not an image after all, truncated, a broken chunk
        pair.note = f"unreadable: {e}"
        return
    if a.shape != b.shape:
        pair.note = f"sizes differ: {a.shape[1]}x{a.shape[0]} vs {b.shape[1]}x{b.shape[0]}"
        return
    pair.max_abs_diff = int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
    pair.psnr, pair.ssim = psnr(a, b), ssim(a, b)
    pair.note = format_note(pair.a.path, pair.b.path, a, b)
    pair.grid = f"grids/{pair.a.name}.jpg"
    make_grid(a, b, (*titles, f"|A-B| x{DIFF_GAIN} (max {pair.max_abs_diff})")).save(report_dir / pair.grid,
                                                                                      quality=90)


def prepare_report_dir(out: str | Path) -> Path:
    report_dir = Path(out)
    try:
        (report_dir / "grids").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {report_dir}: cannot create the report folder ({e.strerror or e})") from e
    return report_dir


def compare_pairs(pairing: Pairing, a_dir: str | Path, b_dir: str | Path, report_dir: Path,
                  min_psnr: float | None = None) -> Report:
    """Measure the pairs of pair_images(a_dir, b_dir), write their grids and index.html into report_dir."""
    a_dir, b_dir = Path(a_dir), Path(b_dir)
    titles = (f"A: {a_dir.resolve().name}", f"B: {b_dir.resolve().name}")
    for pair in pairing.pairs:
        measure(pair, report_dir, titles)
    report = Report(pairing.pairs, pairing.refused, pairing.only_a, pairing.only_b, min_psnr, report_dir, a_dir,
                    b_dir)
    write_html(report)
    return report


def compare_folders(a_dir: str | Path, b_dir: str | Path, report_dir: Path, min_psnr: float | None = None,
                    by_name: bool = False) -> Report:
    pairing = pair_images(images_in(Path(a_dir)), images_in(Path(b_dir)), by_name)
    return compare_pairs(pairing, a_dir, b_dir, report_dir, min_psnr)


def format_number(value: float | None, digits: int) -> str:
    return "-" if value is None else "inf" if math.isinf(value) else f"{value:.{digits}f}"


def settings_table(pair: Pair) -> str:
    """Both sides' settings, one row each, the differing rows marked."""
    keys = [k for k in {**pair.a.settings, **pair.b.settings} if k not in NOT_SETTINGS]
    differ = set(differing(pair.a.settings, pair.b.settings, keys))
    rows = "".join(f'<tr class="{"differs" if key in differ else ""}"><td>{html.escape(key)}</td>'
                   f"<td>{html.escape(str(pair.a.settings.get(key, '-')))}</td>"
                   f"<td>{html.escape(str(pair.b.settings.get(key, '-')))}</td></tr>" for key in keys)
    return f"<table><tr><th>setting</th><th>A</th><th>B</th></tr>{rows}</table>" if keys else ""


def write_html(report: Report):
    failing = {p.name for p in report.below() + report.unmeasured()}
    title = f"{html.escape(str(report.a_dir))} (A) vs {html.escape(str(report.b_dir))} (B)"
    rows = "\n".join(
        f'<tr class="{"fail" if p.name in failing else ""}"><td><a href="#{quote(p.name)}">{html.escape(p.name)}</a>'
        f"</td><td>{format_number(p.psnr, 2)}</td><td>{format_number(p.ssim, 4)}</td>"
        f"<td>{'-' if p.max_abs_diff is None else p.max_abs_diff}</td>"
        f"<td>{html.escape(p.note or str(p.a.settings.get('prompt', '')))}</td>"
        f"<td>{html.escape('; '.join(p.differences + ([p.computed] if p.computed else [])))}</td></tr>"
        for p in report.pairs)
    grids = "\n".join(
        f'<h3 id="{quote(p.name)}">{html.escape(p.name)}: PSNR {format_number(p.psnr, 2)} dB</h3>'
        + (f'<img src="{quote(p.grid)}" alt="{html.escape(p.name)}: A, B, difference">' if p.grid else "")
        + settings_table(p)
        for p in report.pairs)
    unpaired = "".join(f"<li>refused: {html.escape(r.a.name)} and {html.escape(r.b.name)}: {html.escape(r.why)}</li>"
                       for r in report.refused)
    unpaired += "".join(f"<li>only in A: {html.escape(n)}</li>" for n in report.only_a)
    unpaired += "".join(f"<li>only in B: {html.escape(n)}</li>" for n in report.only_b)
    verdict = f"<p><b>{html.escape(report.verdict())}</b></p>"
    notes = "".join(f"<p><b>Note: these images are {html.escape(note)}.</b></p>" for note in report.model_notes)
    (report.report_dir / "index.html").write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}} tr.fail{{background:#fdd}}
tr.differs{{background:#ffd}} img{{max-width:100%}}</style></head>
<body><h1>{title}</h1>
<p>{len(report.pairs)} pair(s) of the same image (prompt, seed, size, input images). Grids: A | B | |A-B|
x{DIFF_GAIN}; under each, both sides' settings (differences highlighted).</p>{verdict}{notes}
<table><tr><th>image</th><th>PSNR (dB)</th><th>SSIM</th><th>max |A-B|</th><th>prompt</th><th>A | B differ in</th></tr>
{rows}
</table>
{f"<h2>Not paired</h2><ul>{unpaired}</ul>" if unpaired else ""}
{grids}
</body></html>
""", encoding="utf-8")


def format_table(report: Report) -> str:
    width = max([len("image")] + [len(p.name) for p in report.pairs])
    lines = [f"{'image':<{width}}  {'PSNR dB':>8}  {'SSIM':>6}  {'max|A-B|':>8}"]
    for p in report.pairs:
        lines.append(f"{p.name:<{width}}  {format_number(p.psnr, 2):>8}  {format_number(p.ssim, 4):>6}  "
                     f"{'-' if p.max_abs_diff is None else p.max_abs_diff:>8}  {p.note}".rstrip())
        if p.differences:
            lines.append(f"{'':<{width}}  A | B: " + "; ".join(p.differences))
        if p.computed:
            lines.append(f"{'':<{width}}  A | B: {p.computed}")
        if p.how == "name":
            lines.append(f"{'':<{width}}  paired by file name (--by-name): a side records no settings")
    measured = [p for p in report.pairs if p.psnr is not None]
    if measured:
        lines.append(f"{len(report.pairs)} pair(s): worst PSNR {format_number(min(p.psnr for p in measured), 2)} dB, "
                     f"worst max|A-B| {max(p.max_abs_diff for p in measured)}")
    lines += [f"refused: {r.a.name} and {r.b.name}: {r.why}" for r in report.refused]
    lines += [f"only in A: {name}" for name in report.only_a] + [f"only in B: {name}" for name in report.only_b]
    lines += [f"note: these images are {note}" for note in report.model_notes]
    lines.append(report.verdict())
    lines.append(f"report: {report.report_dir / 'index.html'}")
    return "\n".join(lines)
