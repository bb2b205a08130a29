"""--lora PATH_OR_ID[:SCALE] -> a Lora: parsed (lora_argument), found and checked (resolve_lora); models.add_loras
loads it.

LoRAs (--lora, repeatable): each is checked before any model loads (a safetensors file holding LoRA tensors, on
disk or in the local Hugging Face cache) and hashed; `loras` ([{path, scale, sha256}], in the given order) is one
of the settings resume compares, by content and scale (not by path), so another LoRA set or strength is other work.
With the fast preset the LoRAs are fused: merged into the BF16 weights before they are quantized (an upstream
checkpoint), or folded into the FP8 weights (a fast checkpoint). --lightning: the Lightning LoRAs' few-step sampler
(lightning_scheduler; the recorded scheduler is "lightning"), 8 steps and no CFG unless given.
"""

import argparse
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

HUB_FILE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+/[\w./-]+\.safetensors$")  # OWNER/NAME/[FOLDER/]FILE
LORA_KEY_PARTS = ("lora_A", "lora_B", "lora_down", "lora_up", "lora.down", "lora.up", "lokr_")


@dataclass(frozen=True)
class Lora:
    """One --lora: the path or ID/file as given, the file on this machine, its strength and its content's sha256."""

    source: str
    file: Path
    scale: float
    sha256: str

    def record(self) -> dict:
        return {"path": self.source, "scale": self.scale, "sha256": self.sha256}


def lora_argument(text: str) -> tuple[str, float]:
    """PATH_OR_ID[:SCALE] -> (PATH_OR_ID, SCALE); SCALE defaults to 1. The file is checked later (resolve_lora)."""
    source, sep, tail = text.rpartition(":")
    if not sep:
        return text, 1.0
    try:
        scale = float(tail)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the part after the last ':' must be a scale (a number), got "
                                         f"{tail!r}") from None
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"{text!r}: the scale must be a finite number, got {tail!r}")
    if not source:
        raise argparse.ArgumentTypeError(f"{text!r}: no LoRA before the scale")
    return source, scale


def resolve_lora(source: str, scale: float) -> Lora:
    """--lora SOURCE[:SCALE] -> a Lora: a local .safetensors file, or OWNER/NAME/FILE.safetensors from the hub (the
    local cache under HF_HUB_OFFLINE=1), whose tensors include LoRA factors. ValueError naming it otherwise."""
    path = Path(source).expanduser()
    if path.is_dir():
        raise ValueError(f"--lora {source}: a folder; name the LoRA file in it ({source}/FILE.safetensors)")
    if path.exists():
        file = path
    else:
        parts = source.split("/")
        if not HUB_FILE.match(source):
            raise ValueError(f"--lora {source}: no such file, and not a file in a hub repo "
                             "(OWNER/NAME/FILE.safetensors)")
        from huggingface_hub import hf_hub_download

        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        try:
            file = Path(hf_hub_download(repo, filename))
        except Exception as e:  # not cached offline, no such repo or file, no network
            raise ValueError(f"--lora {source}: cannot get {filename} from the hub repo {repo} "
                             f"({type(e).__name__})") from None
    keys = safetensors_keys(file, source)
    if not any(part in key for key in keys for part in LORA_KEY_PARTS):
        raise ValueError(f"--lora {source}: not a LoRA (none of its {len(keys)} tensors is a LoRA factor: "
                         f"lora_A / lora_B / lora_down / lora_up; e.g. {sorted(keys)[:2]})")
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return Lora(source=source, file=file, scale=scale, sha256=digest.hexdigest())


def safetensors_keys(file: Path, source: str) -> list[str]:
    """The tensor names in a safetensors file's header (8-byte little-endian length, then JSON), without torch."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= 100_000_000:
                raise ValueError
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError
    except (OSError, ValueError, UnicodeDecodeError):
        raise ValueError(f"--lora {source}: not a safetensors file") from None
    return [key for key in header if key != "__metadata__"]
