"""The server's PNG writer (qwen_image_fast/server/png.py) against the pixels it was given: decoded by PIL (which
checks every chunk's CRC) and by zlib (which checks the stream's Adler-32), in each mode it takes, at sizes that are
one row, one column, or cut into many strips, with its text chunks read back as PIL reads PIL's."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast.cli.output import PNG_DESCRIPTION, read_settings, to_json
from qwen_image_fast.server import png
from qwen_image_fast.server.engine import encode

CHANNELS = {"L": 1, "LA": 2, "RGB": 3, "RGBA": 4}


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == png.SIGNATURE
    out, at = [], 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        out.append((kind, data[at + 8:at + 8 + length]))
        at += 12 + length
    return out


@pytest.mark.parametrize("mode", list(CHANNELS))
@pytest.mark.parametrize("size", [(1, 1), (7, 1), (1, 9), (33, 17), (64, 48)])
@pytest.mark.parametrize("strip_bytes", [1, 50, 1 << 19])  # a strip a row, a few rows, one strip
def test_pixels_and_text_come_back(mode, size, strip_bytes, monkeypatch):
    monkeypatch.setattr(png, "STRIP_BYTES", strip_bytes)
    rng = np.random.default_rng(sum(size) + strip_bytes)
    shape = (size[1], size[0]) + ((CHANNELS[mode],) if CHANNELS[mode] > 1 else ())
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    pixels[: shape[0] // 2] //= 16  # half smooth, so the deflate strips hold back-references too
    data = png.png_bytes(Image.fromarray(pixels, mode), {"Description": '{"prompt": "ein Fuchs im Schnee ü"}'})
    with Image.open(io.BytesIO(data)) as image:
        image.verify()  # every chunk's CRC
    with Image.open(io.BytesIO(data)) as image:
        assert image.mode == mode and image.size == size
        assert np.array_equal(np.asarray(image), pixels)
        assert image.text == {"Description": '{"prompt": "ein Fuchs im Schnee ü"}'}
    idat = b"".join(body for kind, body in chunks(data) if kind == b"IDAT")
    raw = zlib.decompress(idat)  # raises on a wrong Adler-32
    assert len(raw) == size[1] * (1 + size[0] * CHANNELS[mode])


def test_other_modes_are_left_to_pil():
    assert not png.supports(Image.new("P", (4, 4))) and not png.supports(Image.new("I;16", (4, 4)))
    assert png.supports(Image.new("RGB", (4, 4)))


def test_the_server_encodes_a_png_as_render_does():
    """encode's PNG holds the same pixels and settings as render's (PIL's writer), read back the same way."""
    pixels = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    settings = {"prompt": "a fox", "seed": 3, "applied": ["fused_transformer"]}
    served = encode(Image.fromarray(pixels), "png", 100, settings)
    assert [kind for kind, _ in chunks(served)] == [b"IHDR", b"iTXt", b"IDAT", b"IEND"]
    rendered = io.BytesIO()
    Image.fromarray(pixels).save(rendered, format="PNG")
    with Image.open(io.BytesIO(served)) as a, Image.open(rendered) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b)) and a.text == {PNG_DESCRIPTION: to_json(settings)}


def test_read_settings_reads_a_served_png(tmp_path):
    path = tmp_path / "served.png"
    path.write_bytes(encode(Image.new("RGB", (8, 8), (1, 2, 3)), "png", 100, {"seed": 5, "prompt": "ü"}))
    assert read_settings(path) == {"seed": 5, "prompt": "ü"}
