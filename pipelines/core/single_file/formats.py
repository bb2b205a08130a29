"""Reading one checkpoint file, tensor by tensor, as the file means each tensor: a safetensors file in diffusers' or
ComfyUI's key layout (BF16 / FP16 / FP32, FP8 e4m3fn plain casts, ComfyUI's two scaled-FP8 conventions) or a GGUF
file (the `gguf` package). Nothing is read before it is asked for: peak host memory is one tensor.

The formats, as ComfyUI and ComfyUI-GGUF read them (sources named at each rule):
- Keys: ComfyUI's full checkpoints prefix the diffusion model's keys with `model.diffusion_model.`
  (comfy/sd.py load_diffusion_model_state_dict strips it); its Qwen-Image key names are diffusers' own
  (comfy/ldm/qwen_image/model.py mirrors QwenImageTransformer2DModel's module names).
- Plain FP8: a weight stored as float8_e4m3fn means its codes (ComfyUI casts it to the compute dtype).
- Scaled FP8, the older convention (comfy/ops.py scaled_fp8_ops, comfy/model_detection.py): a `scaled_fp8` marker
  tensor, and per layer `<layer>.scale_weight`, an fp32 scalar: the weight means codes * scale_weight.
  `<layer>.scale_input` is a static input scale for ComfyUI's optional FP8 matmul: a runtime choice (our FP8 GEMMs
  quantize activations per row), not part of what the weight means.
- Scaled FP8, the newer convention (comfy/quant_ops.py, comfy/ops.py mixed_precision_ops): per layer
  `<layer>.comfy_quant`, a uint8 tensor holding UTF-8 JSON {"format": ...}, or the same per layer in the header's
  `_quantization_metadata` ({"layers": {layer: {...}}}); with "float8_e4m3fn" (or "float8_e5m2"),
  `<layer>.weight_scale` is the fp32 scale (a scalar; one per output row is read as such) and
  `<layer>.input_scale` a runtime input scale as above. Other formats (mxfp8, nvfp4, int8 ...) are refused.
- GGUF (city96/ComfyUI-GGUF loader.py): `general.architecture` "qwen_image"; ComfyUI's key names; the shape is
  the ggml one reversed unless `comfy.gguf.orig_shape.<name>` gives it; a quantized tensor means its blocks
  dequantized (gguf.quants.dequantize, in fp32: for Q8_0, fp16 scale x int8 code, exact).
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.safetensors_file import SAFETENSORS_DTYPES, CheckpointFileError, MappedFile, SafetensorsFile

COMFY_PREFIX = "model.diffusion_model."
SCALED_FP8_MARKER = "scaled_fp8"
# keys that say how other tensors are stored, never a tensor of the model
SCALE_SUFFIXES = (".scale_weight", ".weight_scale")
RUNTIME_SUFFIXES = (".scale_input", ".input_scale", ".comfy_quant")
COMFY_FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


Q8_0_BLOCK = 32  # values a Q8_0 block holds: an fp16 scale d, then 32 int8 codes q (34 bytes); a value is d * q


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 bytes [..., n * 34] -> fp32 [..., n * 32]: d * q, exact in fp32 (11 x 8 significant bits)."""
    blocks = raw.reshape(-1, 2 + Q8_0_BLOCK)
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*raw.shape[:-1], -1)


@dataclass
class Stored:
    """One tensor as the file means it: `values` (a float tensor, or FP8 codes when `scale` is set: they mean
    codes * scale in fp32, scale a scalar or one per row) and how the file stores it (`source`: "bf16", "fp8_e4m3fn",
    "fp8_e4m3fn_scaled", "gguf_q8_0", ...)."""

    values: torch.Tensor
    scale: torch.Tensor | None
    source: str

    @property
    def e4m3_codes(self) -> bool:
        """Codes our rowwise-FP8 weights can take as they are (e4m3fn, one scale for the tensor or per row)."""
        return self.scale is not None and self.values.dtype == torch.float8_e4m3fn

    @property
    def quantized(self) -> bool:
        return self.scale is not None or self.source.startswith("gguf_q")

    def row_scales(self) -> torch.Tensor:
        """The scale of each row [rows] fp32."""
        return self.scale.float().reshape(-1).expand(self.values.shape[0]).contiguous()

    def value(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """What the file means, computed in fp32 (codes x scale), rounded once to dtype."""
        if self.scale is None:
            return self.values.to(dtype)
        scale = self.scale.float().reshape(-1, *([1] * (self.values.dim() - 1))) if self.scale.numel() > 1 else \
            self.scale.float()
        return (self.values.float() * scale).to(dtype)


def float_source(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def stored_source(dtype: torch.dtype, scaled: bool) -> str:
    """How a safetensors tensor of `dtype` is stored: "fp8_e4m3fn(_scaled)", "fp8_e5m2(_scaled)", "bf16", ..."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return ("fp8_e4m3fn" if dtype == torch.float8_e4m3fn else "fp8_e5m2") + ("_scaled" if scaled else "")
    return float_source(dtype)


class CheckpointFile:
    """A single checkpoint file: `names` (the model's tensor names, prefix stripped) -> shape; `get(name)` reads one
    as Stored. `layout` ("diffusers" | "comfyui" | "gguf"), `markers` (ComfyUI's flags found in the file, e.g.
    "__index_timestep_zero__", its Edit-2511 marker)."""

    def __init__(self, path):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise CheckpointFileError(f"{path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        self.kind = "gguf" if magic == b"GGUF" else "safetensors"
        self.markers: set[str] = set()
        if self.kind == "gguf":
            self._open_gguf()
        else:
            self._open_safetensors()

    # ---- safetensors

    def _open_safetensors(self):
        self._file = SafetensorsFile(self.path)
        keys, metadata = self._file.keys(), self._file.metadata
        prefixed = [k for k in keys if k.startswith(COMFY_PREFIX)]
        self.layout = "comfyui" if prefixed else "diffusers"
        if prefixed and len(prefixed) != len(keys):
            other = next(k for k in keys if not k.startswith(COMFY_PREFIX))
            raise CheckpointFileError(f"{self.path}: mixes ComfyUI's '{COMFY_PREFIX}' keys with others ('{other}'): "
                                      "a whole-checkpoint file; extract its diffusion model")
        self._key = {k.removeprefix(COMFY_PREFIX): k for k in keys}
        quant = self._quant_configs(metadata)
        self._scales: dict[str, str] = {}  # weight name -> its scale's key
        self._formats: dict[str, str] = {}  # weight name -> how it is stored
        names = {}
        for name in self._key:
            if name == SCALED_FP8_MARKER or name.endswith("." + SCALED_FP8_MARKER):
                self.markers.add(SCALED_FP8_MARKER)
            elif name.endswith(SCALE_SUFFIXES):
                layer = name.rsplit(".", 1)[0]
                self._scales[layer + ".weight"] = self._key[name]
            elif name.endswith(RUNTIME_SUFFIXES):
                continue
            elif name.startswith("__") and name.endswith("__"):  # ComfyUI's flag buffers
                self.markers.add(name)
            else:
                names[name] = self._file.shape(self._key[name])
        self.names = names
        for weight in self._scales:
            if weight not in names:
                raise CheckpointFileError(f"{self.path}: a scale for '{weight}', which the file does not hold")
        for layer, conf in quant.items():
            fmt = conf.get("format")
            if fmt not in COMFY_FP8_FORMATS:
                raise CheckpointFileError(
                    f"{self.path}: layer '{layer}' is stored as ComfyUI's '{fmt}'; qwen-image-fast reads FP8 "
                    f"({', '.join(COMFY_FP8_FORMATS)}) with a per-tensor scale, BF16, FP16, FP32 and GGUF files")
            self._formats[layer + ".weight"] = fmt

    def _quant_configs(self, metadata: dict) -> dict[str, dict]:
        """ComfyUI's newer per-layer quantization configs: `<layer>.comfy_quant` tensors and the header's
        `_quantization_metadata`; layer names prefix-stripped."""
        configs = {}
        if "_quantization_metadata" in metadata:
            for layer, conf in json.loads(metadata["_quantization_metadata"]).get("layers", {}).items():
                configs[layer.removeprefix(COMFY_PREFIX)] = conf
        for name, key in self._key.items():
            if name.endswith(".comfy_quant"):
                raw = self._file.get_tensor(key)
                configs[name.removesuffix(".comfy_quant")] = json.loads(raw.numpy().tobytes().decode())
        return configs

    def _get_safetensors(self, name: str, device) -> Stored:
        values = self._file.get_tensor(self._key[name], device)
        scale_key = self._scales.get(name)
        if values.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            fmt = self._formats.get(name)
            if fmt is not None and COMFY_FP8_FORMATS[fmt] != values.dtype:
                raise CheckpointFileError(f"{self.path}: '{name}' is {values.dtype} but its comfy_quant says {fmt}")
            scale = (self._file.get_tensor(scale_key, device).float() if scale_key is not None
                     else torch.ones((), dtype=torch.float32, device=device))
            if scale.numel() not in (1, values.shape[0]):
                raise CheckpointFileError(
                    f"{self.path}: '{name}' has a scale of shape {tuple(scale.shape)}; qwen-image-fast reads one scale "
                    f"per tensor or per output row ({values.shape[0]}), not per block")
            return Stored(values, scale, stored_source(values.dtype, scale_key is not None))
        if scale_key is not None:
            raise CheckpointFileError(f"{self.path}: '{name}' is {values.dtype} with a scale: not a format this reads")
        return Stored(values, None, float_source(values.dtype))

    # ---- GGUF

    def _open_gguf(self):
        try:
            import gguf
        except ImportError:
            raise CheckpointFileError(f"{self.path} is a GGUF file: pip install 'qwen-image-fast[gguf]' (the gguf "
                                      "package) to read it") from None
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as e:
            raise CheckpointFileError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        field = reader.get_field("general.architecture")
        self.architecture = field.contents() if field is not None else None
        if self.architecture is not None and not self.architecture.startswith("qwen_image"):
            raise CheckpointFileError(f"{self.path}: a GGUF of '{self.architecture}', not of a Qwen-Image model")
        self.layout = "gguf"
        self._gguf, self._bytes = gguf, MappedFile(self.path)
        self._tensors, names = {}, {}
        for tensor in reader.tensors:
            name = tensor.name.removeprefix(COMFY_PREFIX)
            if name.startswith("__") and name.endswith("__"):
                self.markers.add(name)
                continue
            shape_field = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
            shape = (tuple(int(d) for d in shape_field.contents()) if shape_field is not None
                     else tuple(int(d) for d in reversed(tensor.shape)))
            self._tensors[name], names[name] = tensor, shape
        self.names = names

    def _get_gguf(self, name: str, device) -> Stored:
        """The tensor's bytes read as MappedFile reads (not through the reader's own memory map, whose touched pages
        would stay resident), decoded on `device`."""
        tensor, shape = self._tensors[name], self.names[name]
        raw = self._bytes.read(tensor.data_offset, tensor.n_bytes, device)
        qtype = self._gguf.GGMLQuantizationType
        floats = {qtype.BF16: torch.bfloat16, qtype.F16: torch.float16, qtype.F32: torch.float32}
        if tensor.tensor_type in floats:
            values = raw.view(floats[tensor.tensor_type]).reshape(shape)
            return Stored(values, None, float_source(values.dtype))
        if tensor.tensor_type == qtype.Q8_0:  # in torch, exactly as gguf's numpy does it
            values = dequantize_q8_0(raw.reshape(shape[0], -1))
        else:
            import numpy as np

            values = torch.from_numpy(np.ascontiguousarray(self._gguf.quants.dequantize(
                raw.cpu().numpy().reshape(shape[0], -1), tensor.tensor_type), dtype=np.float32)).to(device)
        return Stored(values.reshape(shape), None, f"gguf_{tensor.tensor_type.name.lower()}")

    def get(self, name: str, device="cpu") -> Stored:
        """`name` as the file means it, its bytes read onto `device` (what is computed from them, computed there)."""
        device = torch.device(device)
        return self._get_gguf(name, device) if self.kind == "gguf" else self._get_safetensors(name, device)

    def peek(self, name: str) -> Stored:
        """How `name` is stored, from the header alone: a Stored on the meta device (for --dry-run)."""
        shape = self.names[name]
        if self.kind == "gguf":
            source = f"gguf_{self._tensors[name].tensor_type.name.lower()}"
            dtype = {"gguf_bf16": torch.bfloat16, "gguf_f16": torch.float16}.get(source, torch.float32)
            return Stored(torch.empty(shape, dtype=dtype, device="meta"), None,
                          source if source.startswith("gguf_q") else float_source(dtype))
        dtype = SAFETENSORS_DTYPES[self._file.dtype_name(self._key[name])]
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        return Stored(torch.empty(shape, dtype=dtype, device="meta"), torch.empty((), device="meta") if fp8 else None,
                      stored_source(dtype, name in self._scales))

    def sources(self) -> set[str]:
        """How the file's tensors are stored, without reading them (dtype names from the header)."""
        if self.kind == "gguf":
            return {f"gguf_{t.tensor_type.name.lower()}" for t in self._tensors.values()}
        return {stored_source(SAFETENSORS_DTYPES[self._file.dtype_name(self._key[n])], n in self._scales)
                for n in self.names}

    @property
    def label(self) -> str:
        """The file's format in a word, for `applied` and the benchmarks: "comfyui_scaled_fp8", "comfyui_fp8",
        "comfyui_bf16", "diffusers_bf16", "gguf_q8_0", ... (several storages: joined by "+")."""
        if self.kind == "gguf":
            quantized = sorted(s.removeprefix("gguf_") for s in self.sources() if s.startswith("gguf_q"))
            return "gguf_" + ("+".join(quantized) if quantized else "float")
        sources = self.sources()
        fp8 = sorted(s for s in sources if s.startswith("fp8"))
        if fp8:
            main = "+".join(re.sub(r"^fp8_e4m3fn", "fp8", s).replace("fp8_scaled", "scaled_fp8") for s in fp8)
        else:
            main = "+".join(sorted(sources))
        return f"{self.layout}_{main}"

    def describe(self) -> str:
        """One line for --dry-run: what the file is."""
        kinds = ", ".join(sorted(self.sources()))
        marks = f"; markers {sorted(self.markers)}" if self.markers else ""
        keys = {"comfyui": ", ComfyUI's keys", "gguf": ""}.get(self.layout, "")
        return f"{self.path.name}: {self.kind}{keys}, {len(self.names)} tensors ({kinds}){marks}"
