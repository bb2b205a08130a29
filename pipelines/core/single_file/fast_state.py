"""A fast transformer's weights from a single checkpoint file (formats.py), tensor by tensor onto the device.

Each model family says how its stock tensors become its fast model's (FamilyLayout: the LoRA sites map, which stock
block modules are which rows of which fused fast linear, and the renamed block tensors). A fast FP8 linear whose
parts the file stores as e4m3 codes with a scale per tensor (or per row) takes the codes as they are and the scale
on each of its rows: bit for bit what the file means, no dequantization. From BF16 / FP16 / FP32 parts it is
quantized as FastLinear.from_weight quantizes a stock weight (so a BF16 file gives the bits a diffusers folder of
the same weights gives). Anything else the file stores quantized is what the `applied` labels `dequantized:<source>`
(into a tensor the model keeps in its dtype: the file's value computed in fp32, rounded once to the dtype) and
`requantized:<source>` (into an FP8 linear from GGUF blocks, e5m2 codes or parts stored unlike each other: the
file's value in fp32, quantized to rowwise e4m3, a second rounding inside the fp8 bound) say.
"""

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from ....kernels.fp8 import quantize_fp8_rowwise_ref
from ..model.linear import FastLinear
from .formats import CheckpointFile, CheckpointFileError, Stored


@dataclass(frozen=True)
class FamilyLayout:
    """sites: stock block module -> (fast linear, part of its rows or None); renames: stock block tensor -> fast
    block tensor; biases: whether the stock linears have biases (False: the fast ones get zeros, as from_stock
    gives them)."""

    sites: dict
    renames: dict = field(default_factory=dict)
    biases: bool = True
    # a module some files store fused -> the stock modules it is, in row order (ComfyUI's Qwen-Image-2.1
    # img_mlp.gate_up: gate rows first, as diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers reads it)
    fused_in_files: dict = field(default_factory=dict)


class FileView:
    """A checkpoint file's tensors under the stock model's names: a fused module of the file (fused_in_files) as
    its parts, each an equal share of its rows (FP8 codes keep their scale)."""

    def __init__(self, file: CheckpointFile, layout: FamilyLayout):
        self.file, self.path, self.label = file, file.path, file.label
        self._split: dict[str, tuple[str, int, int]] = {}  # part name -> (file name, index, of)
        names = dict(file.names)
        for name, shape in file.names.items():
            module, _, leaf = name.rpartition(".")
            block, _, inner = module.partition(".")[2].partition(".")
            parts = layout.fused_in_files.get(inner) if module.startswith("transformer_blocks.") else None
            if parts:
                del names[name]
                for i, part in enumerate(parts):
                    part_name = f"transformer_blocks.{block}.{part}.{leaf}"
                    names[part_name] = (shape[0] // len(parts), *shape[1:])
                    self._split[part_name] = (name, i, len(parts))
        self.names = names

    def get(self, name: str, peek: bool = False, device="cpu") -> Stored:
        read = self.file.peek if peek else (lambda key: self.file.get(key, device))
        if name not in self._split:
            return read(name)
        fused, i, of = self._split[name]
        stored = read(fused)
        rows = stored.values.shape[0] // of
        scale = stored.scale
        if scale is not None and scale.numel() > 1:
            scale = scale.reshape(-1)[i * rows:(i + 1) * rows]
        return Stored(stored.values[i * rows:(i + 1) * rows].clone(), scale, stored.source)


@dataclass
class Loaded:
    """What loading did: `applied` pairs (registry name, value) and, for --dry-run, which tensors each touched."""

    file_label: str
    touched: dict = field(default_factory=lambda: defaultdict(set))  # (kind, source) -> {"img_mod.1.weight", ...}

    def note(self, kind: str, source: str, name: str):
        self.touched[(kind, source)].add(re.sub(r"^transformer_blocks\.\d+\.", "", name))

    @property
    def applied(self) -> tuple[tuple[str, str], ...]:
        return (("single_file", self.file_label),) + tuple(sorted(self.touched))

    def describe(self) -> list[str]:
        return [f"{kind} from {source}: {', '.join(sorted(names))}" for (kind, source), names in
                sorted(self.touched.items())]


def _linears(model, layout: FamilyLayout) -> dict[str, list[str]]:
    """Fast linear path -> its stock modules in row order."""
    linears = {}
    for i in range(len(model.transformer_blocks)):
        parts = defaultdict(list)
        for inner, (linear, part) in layout.sites.items():
            parts[linear].append((part or 0, f"transformer_blocks.{i}.{inner}"))
        for linear, stock in parts.items():
            linears[f"transformer_blocks.{i}.{linear}"] = [name for _, name in sorted(stock)]
    return linears


def _sources(model, layout: FamilyLayout, linears: dict) -> dict[str, str]:
    """Every other fast tensor -> the stock tensor it is."""
    renamed = {}
    for i in range(len(model.transformer_blocks)):
        for stock, fast in layout.renames.items():
            renamed[f"transformer_blocks.{i}.{fast}"] = f"transformer_blocks.{i}.{stock}"
    return {key: renamed.get(key, key) for key in model.state_dict(keep_vars=True)
            if key.rsplit(".", 1)[0] not in linears}


def check_names(file: "FileView", model, layout: FamilyLayout) -> tuple[dict, dict]:
    """The file holds exactly the model's tensors at their shapes (read from the header, nothing loaded): else
    CheckpointFileError naming the first missing, unknown or misshapen key."""
    linears = _linears(model, layout)
    sources = _sources(model, layout, linears)
    state = model.state_dict(keep_vars=True)
    wanted = {}  # stock name -> expected shape (None: checked per linear below)
    for key, stock in sources.items():
        wanted[stock] = tuple(state[key].shape)
    for path, parts in linears.items():
        linear = model.get_submodule(path)
        rows = linear.out_features // len(parts)
        for stock in parts:
            wanted[f"{stock}.weight"] = (rows, linear.in_features)
            if layout.biases:
                wanted[f"{stock}.bias"] = (rows,)
    missing = [name for name in wanted if name not in file.names]
    if missing:
        raise CheckpointFileError(f"{file.path}: missing '{missing[0]}' ({len(missing)} of the model's "
                                  f"{len(wanted)} tensors missing)")
    unknown = [name for name in file.names if name not in wanted]
    if unknown:
        raise CheckpointFileError(f"{file.path}: unknown key '{unknown[0]}' ({len(unknown)} tensors this model "
                                  "does not have)")
    for name, shape in wanted.items():
        if tuple(file.names[name]) != shape:
            raise CheckpointFileError(f"{file.path}: '{name}' has shape {tuple(file.names[name])}; this model's is "
                                      f"{shape} (a file of another size: pass the matching config)")
    return linears, sources


def keeps_codes(linear: FastLinear, parts: list[Stored]) -> bool:
    """Whether the fast linear takes its parts' e4m3 codes and scales as the file stores them."""
    return linear.fp8 and all(p.e4m3_codes for p in parts)


def note_linear(loaded: Loaded, path: str, linear: FastLinear, parts: list[Stored]):
    """What becomes of the parts the file stores quantized, when the codes are not kept: requantized into an FP8
    linear, dequantized into a BF16 one."""
    if keeps_codes(linear, parts):
        return
    for p in parts:
        if p.quantized:
            loaded.note("requantized" if linear.fp8 else "dequantized", p.source, f"{path}.weight")


def _linear_state(path: str, linear: FastLinear, parts: list[Stored], biases: list[Stored] | None, dtype, device,
                  loaded: Loaded) -> dict:
    if biases is None:  # no stock biases: zeros give the output dtype and add nothing (as from_stock does)
        bias = torch.zeros(linear.out_features, dtype=dtype, device=device)
    else:
        bias = torch.cat([b.value(dtype) for b in biases]).to(device)
    state = {f"{path}.bias": bias}
    note_linear(loaded, path, linear, parts)
    if keeps_codes(linear, parts):  # the file's codes and scales, as they are
        state[f"{path}.weight_q"] = torch.cat([p.values for p in parts]).to(device)
        state[f"{path}.weight_scale"] = torch.cat([p.row_scales() for p in parts]).to(device)
        return state
    quantized = [p for p in parts if p.quantized]
    if linear.fp8:
        weight = torch.cat([p.value(torch.float32) for p in parts]) if quantized else \
            torch.cat([p.values.to(dtype) for p in parts])
        q, s = quantize_fp8_rowwise_ref(weight.to(device))
        state[f"{path}.weight_q"], state[f"{path}.weight_scale"] = q, s.view(-1)
    else:
        state[f"{path}.weight"] = torch.cat([p.value(dtype) for p in parts]).to(device)
    return state


def plan_file_into(model, file: CheckpointFile, layout: FamilyLayout) -> Loaded:
    """What load_file_into will keep, dequantize or requantize, from the file's header alone (--dry-run)."""
    file = FileView(file, layout)
    linears, sources = check_names(file, model, layout)
    loaded = Loaded(file.label)
    for path, parts in linears.items():
        stored = [file.get(f"{stock}.weight", peek=True) for stock in parts]
        note_linear(loaded, path, model.get_submodule(path), stored)
    for key, stock in sources.items():
        stored = file.get(stock, peek=True)
        if stored.quantized:
            loaded.note("dequantized", stored.source, key)
    return loaded


def load_file_into(model, file: CheckpointFile, layout: FamilyLayout, device, dtype: torch.dtype) -> Loaded:
    """Fill `model` (built on the meta device with the file's config) from `file`, one tensor at a time onto
    device; returns what was kept, dequantized or requantized."""
    file = FileView(file, layout)
    linears, sources = check_names(file, model, layout)
    loaded = Loaded(file.label)
    state = {}
    for path, parts in linears.items():
        stored = [file.get(f"{stock}.weight", device=device) for stock in parts]
        biases = [file.get(f"{stock}.bias", device=device) for stock in parts] if layout.biases else None
        state.update(_linear_state(path, model.get_submodule(path), stored, biases, dtype, device, loaded))
        del stored, biases
    for key, stock in sources.items():
        stored = file.get(stock, device=device)
        if stored.quantized:
            loaded.note("dequantized", stored.source, key)
        state[key] = (stored.value(dtype) if stored.values.is_floating_point() else stored.values).to(device)
    model.load_state_dict(state, strict=True, assign=True)
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__}: {left} neither loaded nor computed (still on the meta device)")
    return loaded
