"""Reading diffusers model folders: a whole fast checkpoint (FastCheckpoint: its config and weights, for both
families' fast transformers' from_pretrained), or one tensor at a time of a stock one (CheckpointWeights: the BF16
masters of the FP8 weights, for fuse_lora)."""

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

from ..config import FastTransformerConfig
from ..hub import local_folder
from .linear import FP8_TENSORS
from .safetensors_file import SafetensorsFile


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
    """Every tensor of a diffusers model folder onto device: safetensors files one tensor at a time through
    SafetensorsFile (the host holds one tensor, not the file: a 20 GB FP8 transformer read straight onto a GPU)."""
    state = {}
    for file in weight_files(folder, variant):
        if file.suffix == ".safetensors":
            weights = SafetensorsFile(file)
            state.update((name, weights.get_tensor(name, device)) for name in weights.keys())
        else:
            state.update(torch.load(file, map_location=device, weights_only=True))
    return state


class FastCheckpoint:
    """A folder a fast transformer's save_pretrained wrote: its config.json (the stock model's config plus
    "fast_config") and weights (the FP8 ones with their fp32 scales, as stored)."""

    def __init__(self, model_class, path_or_id, subfolder: str | None, unsupported: dict):
        name = model_class.__name__
        if unsupported:  # e.g. a diffusers pipeline's loader (device_map, low_cpu_mem_usage, ...)
            raise ValueError(
                f"{path_or_id} holds a qwen-image-fast transformer (FP8 block linears, fused layout), which "
                f"diffusers' own pipelines and loaders cannot load (arguments {', '.join(sorted(unsupported))} are "
                f"not supported): load the pipeline with qwen_image_fast.from_pretrained(folder), or this model with "
                f"{name}.from_pretrained(folder, subfolder='transformer', device=...)")
        self.folder = local_folder(path_or_id, subfolder)
        self.saved = json.loads((self.folder / model_class.config_name).read_text())
        if self.saved.get("_class_name") != name or "fast_config" not in self.saved:
            raise ValueError(
                f"{self.folder} holds a {self.saved.get('_class_name')} checkpoint, not a {name} one; convert a "
                f"stock model with {name}.from_diffusers({model_class.stock_model_name}.from_pretrained(...)), or "
                "load the pipeline with qwen_image_fast.from_pretrained(...)")
        self.stored = FastTransformerConfig.from_dict(self.saved["fast_config"])

    def run_config(self, fast_config: FastTransformerConfig | None) -> FastTransformerConfig:
        """How to run it: fast_config (its fp8 and bf16_linears must be the stored ones; fp8_fast_accum, attention
        and fp8_attention may differ), or None: as saved, but attention "auto" and fp8_attention "off" (the
        loader's to choose, as the pipelines' from_pretrained does: a lossy one is never turned on by a folder)."""
        run = (FastTransformerConfig.of(fast_config) if fast_config is not None
               else FastTransformerConfig(**{**self.stored.to_dict(), "attention": "auto", "fp8_attention": "off"}))
        stored = self.stored
        if (run.fp8, run.bf16_linears) != (stored.fp8, stored.bf16_linears):
            raise ValueError(
                f"{self.folder} stores the block linears with fp8={stored.fp8}, bf16_linears="
                f"{list(stored.bf16_linears)}; fast_config asks for fp8={run.fp8}, bf16_linears="
                f"{list(run.bf16_linears)}: pass a config with the stored values, or convert the stock checkpoint "
                "with the ones you want")
        return run

    def stock_config(self, names) -> dict:
        return {name: self.saved[name] for name in names if name in self.saved}

    def load_into(self, model: torch.nn.Module, device: torch.device, variant: str | None,
                  torch_dtype: torch.dtype | None):
        """Every tensor onto device, into `model` (built on the meta device; what no state_dict holds, it computed
        on a real one); torch_dtype casts all but the FP8 weights and their fp32 scales."""
        state = load_weights(self.folder, device, variant)
        if torch_dtype is not None:
            state = {name: t if name.rsplit(".", 1)[-1] in FP8_TENSORS else t.to(torch_dtype)
                     for name, t in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"{type(model).__name__}: {left} neither loaded nor computed (still on the meta device)")


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
