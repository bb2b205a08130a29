"""Reading diffusers model folders: a whole fast checkpoint (load_weights), or one tensor at a time of a stock one
(CheckpointWeights: the BF16 masters of the FP8 weights, for fuse_lora)."""

import json
from pathlib import Path

import torch
from diffusers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFETENSORS_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    _add_variant,
)


def local_folder(path_or_id, subfolder: str | None) -> Path:
    """A local folder as is; a hub repo id: its snapshot (the subfolder's files only)."""
    path = Path(path_or_id)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path_or_id), allow_patterns=[f"{subfolder}/*"] if subfolder else None))
    return path / subfolder if subfolder else path


def weight_files(folder: Path, variant: str | None = None) -> list[Path]:
    """The weight files of a model folder as ModelMixin.save_pretrained names them (safetensors or pickle, one file
    or shards with an index, with the variant in the name if given)."""
    for single, index in ((SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        single, index = folder / _add_variant(single, variant), folder / _add_variant(index, variant)
        if index.exists():
            return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        if single.exists():
            return [single]
    if variant is not None:  # diffusers' own message for a variant that is not there
        raise ValueError(f"You are trying to load the model files of the `variant={variant}`, but no such modeling "
                         f"files are available (in {folder}).")
    raise FileNotFoundError(f"{folder} has no {_add_variant(SAFETENSORS_WEIGHTS_NAME, variant)} or "
                            f"{_add_variant(WEIGHTS_NAME, variant)} (nor a sharded index of either)")


def load_weights(folder: Path, device: torch.device, variant: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a diffusers model folder onto device."""
    from safetensors.torch import load_file

    state = {}
    for file in weight_files(folder, variant):
        if file.suffix == ".safetensors":
            state.update(load_file(file, device=str(device)))
        else:
            state.update(torch.load(file, map_location=device, weights_only=True))
    return state


class CheckpointWeights:
    """The stock transformer's weights as its diffusers folder stores them, read one tensor at a time in `dtype`:
    the BF16 masters of the FP8 weights, for fold_lora. Each is used only if it quantizes to the FP8 weight exactly
    (FastQwenImageTransformer._master), so a model changed since it was loaded falls back, saying so."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        self.folder, self.dtype = folder, dtype
        self._files = None

    @classmethod
    def of(cls, stock) -> "CheckpointWeights | None":
        """Where diffusers loaded `stock` from (config._name_or_path: the transformer folder), if it is one."""
        folder = Path(str(stock.config.get("_name_or_path") or ""))
        has = any((folder / f).is_file() for f in (SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME))
        return cls(folder, stock.dtype) if str(folder) and has else None

    def get(self, name: str, device) -> torch.Tensor:
        from safetensors import safe_open

        if self._files is None:
            index = self.folder / SAFE_WEIGHTS_INDEX_NAME
            if index.exists():
                self._files = json.loads(index.read_text())["weight_map"]
            else:
                with safe_open(self.folder / SAFETENSORS_WEIGHTS_NAME, framework="pt") as f:
                    self._files = dict.fromkeys(f.keys(), SAFETENSORS_WEIGHTS_NAME)
        with safe_open(self.folder / self._files[name], framework="pt", device=str(device)) as f:
            return f.get_tensor(name).to(self.dtype)
