"""from_single_file for the fast transformers: diffusers' ModelMixin.from_single_file arguments (config, subfolder,
torch_dtype, device, ...) and behaviour, over the formats formats.py reads, straight into the fast layout
(fast_state.py). A family's model class says how (SingleFileModel's class attributes)."""

import json
import re
from pathlib import Path

import torch

from ..config import FastTransformerConfig
from ..model.attention import resolve_backend
from ..hub import local_folder
from .fast_state import FamilyLayout, Loaded, load_file_into, plan_file_into
from .formats import CheckpointFile, CheckpointFileError

# diffusers' from_single_file arguments that only say where to find the config (used as given) or tune a loading
# path this one does not take (refused with the reason)
HUB_ARGUMENTS = ("token", "revision", "cache_dir", "local_files_only", "force_download", "proxies")
NOT_HERE = {
    "original_config": "an original (non-diffusers) YAML config: pass config= (a diffusers folder or hub id)",
    "quantization_config": "the fast model's FP8 is fast_config's (FastTransformerConfig(fp8=...))",
    "low_cpu_mem_usage": "loading always streams tensor by tensor",
    "disable_mmap": "a safetensors file is read through its memory map, a GGUF file with plain reads",
}


class SingleFileModel:
    """Mixin of the fast transformers. A family sets: single_file_layout (FamilyLayout), family_keys (tensors only
    its files hold, e.g. ("txt_norm.weight",)), other_families (a key of another family's files -> what to use
    instead), stock_config_fields (its stock model's config names) and infer_stock_config(file)."""

    single_file_layout: FamilyLayout
    family_keys: tuple[str, ...] = ()
    other_families: dict = {}
    stock_config_fields: dict = {}

    @classmethod
    def infer_stock_config(cls, file: CheckpointFile) -> dict:
        raise NotImplementedError

    @staticmethod
    def block_count(file: CheckpointFile) -> int:
        """The transformer blocks a file holds (transformer_blocks.<i>.*)."""
        return 1 + max(int(m.group(1)) for name in file.names if (m := re.match(r"transformer_blocks\.(\d+)\.", name)))

    @classmethod
    def check_default_axes(cls, file: CheckpointFile, head_dim: int):
        """A file read without config= takes the stock default rotary axes: they must split its heads."""
        axes = tuple(cls.stock_config_fields["axes_dims_rope"])
        if sum(axes) != head_dim:
            raise CheckpointFileError(
                f"{file.path}: attention heads of {head_dim} channels, which the default rotary axes {axes} do not "
                "split: pass config= (the model's diffusers folder or hub id, or a config dict)")

    @classmethod
    def meta_model(cls, run: FastTransformerConfig, stock_config: dict):
        """The model on the meta device (what no state_dict holds, computed on the CPU)."""
        raise NotImplementedError

    @classmethod
    def check_load(cls, run: FastTransformerConfig, device: torch.device, dtype: torch.dtype):
        """Before anything is read: the attention backend asked for runs there (else its clear error)."""
        if run.attention != "auto":
            resolve_backend(run.attention, device, dtype)

    @classmethod
    def check_family(cls, file: CheckpointFile):
        if all(key in file.names for key in cls.family_keys):
            return
        for key, use in cls.other_families.items():
            if key in file.names:
                raise CheckpointFileError(f"{file.path} holds {use[0]}, not a {cls.stock_model_name}: load it with "
                                          f"{use[1]}")
        first = next(iter(file.names), "(none)")
        raise CheckpointFileError(f"{file.path} is not a {cls.stock_model_name} file: it has no "
                                  f"{cls.family_keys[0]} (its first tensor is '{first}')")

    @classmethod
    def stock_config_from(cls, file: CheckpointFile, config, subfolder: str | None, hub: dict) -> dict:
        """config: a diffusers model folder or hub id (with subfolder; hub: hf_hub_download's arguments for a hub
        id), its config dict, or None: read off the file (infer_stock_config: shapes and ComfyUI's markers; what
        neither shows is refused there, never guessed). subfolder or hub arguments with no config to fetch are
        refused, not ignored."""
        idle = (["subfolder"] if subfolder is not None else []) + sorted(hub)
        if idle and (config is None or isinstance(config, dict)):  # nothing is fetched: they would change nothing
            raise ValueError(f"{', '.join(name + '=' for name in idle)} say where to fetch config= from (a diffusers "
                             f"folder or hub id); with config={'None' if config is None else 'a dict'} nothing is "
                             "fetched")
        if config is None:
            return cls.infer_stock_config(file)
        if isinstance(config, dict):
            values = dict(config)
        elif Path(config).expanduser().is_dir():  # a folder as it is (hub arguments say nothing of it)
            values = json.loads((local_folder(config, subfolder) / cls.config_name).read_text())
        else:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(str(config), cls.config_name, subfolder=subfolder, **hub)
            values = json.loads(Path(path).read_text())
        if values.get("_class_name") not in (cls.stock_model_name, cls.__name__, None):
            raise ValueError(f"config {config} is a {values.get('_class_name')} config, not a "
                             f"{cls.stock_model_name} one")
        return {name: value for name, value in values.items() if name in cls.stock_config_fields}

    @classmethod
    def from_single_file(cls, pretrained_model_link_or_path, *, config=None, subfolder: str | None = None,
                         torch_dtype: torch.dtype | None = None, device=None,
                         fast_config: FastTransformerConfig | None = None, **kwargs):
        """The fast model from one checkpoint file: a safetensors file in diffusers' or ComfyUI's layout (BF16,
        FP16, FP32, FP8 e4m3fn, ComfyUI's scaled FP8 in both its conventions) or a GGUF file. config: as diffusers'
        from_single_file takes it (a diffusers folder or hub id, with subfolder), or None: read off the file.
        torch_dtype: the dtype of all but the FP8 weights (default bfloat16, as the pipelines run); device: where the
        weights go, tensor by tensor (default: the CPU). fast_config: which linears run FP8 (default: the fast
        preset's). What loading kept, dequantized or requantized is in `applied` (core/single_file/fast_state.py)."""
        unsupported = sorted(set(kwargs) - set(HUB_ARGUMENTS))
        if unsupported:
            name = unsupported[0]
            takes = f"config, subfolder, torch_dtype, device, fast_config, {', '.join(HUB_ARGUMENTS)}"
            raise ValueError(f"{cls.__name__}.from_single_file does not take {name}=" +
                             (f": {NOT_HERE[name]}" if name in NOT_HERE else f" (it takes {takes})"))
        if not isinstance(pretrained_model_link_or_path, (str, bytes)) and not hasattr(pretrained_model_link_or_path,
                                                                                          "__fspath__"):
            raise TypeError(f"{cls.__name__}.from_single_file takes a file path, got "
                            f"{type(pretrained_model_link_or_path).__name__}")
        file = CheckpointFile(pretrained_model_link_or_path)
        cls.check_family(file)
        stock_config = cls.stock_config_from(file, config, subfolder, kwargs)
        run = FastTransformerConfig.of(fast_config or FastTransformerConfig())
        device = torch.device(device or "cpu")
        dtype = torch_dtype or torch.bfloat16
        cls.check_load(run, device, dtype)
        model = cls.meta_model(run, stock_config)
        model.single_file = load_file_into(model, file, cls.single_file_layout, device, dtype)
        return model.requires_grad_(False).eval()

    @classmethod
    def plan_single_file(cls, path, *, config=None, subfolder: str | None = None,
                         fast_config: FastTransformerConfig | None = None) -> Loaded:
        """What from_single_file would keep, dequantize or requantize, from the file's header alone."""
        file = CheckpointFile(path)
        cls.check_family(file)
        model = cls.meta_model(FastTransformerConfig.of(fast_config or FastTransformerConfig()),
                               cls.stock_config_from(file, config, subfolder, {}))
        return plan_file_into(model, file, cls.single_file_layout)
