"""A stock model's state dict written as each single-file format formats.py reads, by the rules of the tools that
make them (named at each): the test fixtures and the checkpoint benchmark's files. Not a converter for users: it
writes whatever weights it is given, quantized as those tools quantize.

FORMATS: "diffusers_bf16" (diffusers' keys, what save_file of a state dict gives), "comfyui_bf16" (ComfyUI's
`model.diffusion_model.` prefix), "comfyui_fp8" (every 2D block weight cast to e4m3fn, as ComfyUI's
"fp8_e4m3fn" weight dtype stores them), "comfyui_scaled_fp8" (the older convention: e4m3fn codes of w / s with
s = amax / 448 per tensor, `<layer>.scale_weight` fp32 scalars, `<layer>.scale_input` 1.0, a `scaled_fp8` marker:
comfy/ops.py scaled_fp8_ops, comfy/model_base.py state_dict_for_saving), "comfyui_quant_fp8" (the newer one:
`<layer>.weight_scale` and a `<layer>.comfy_quant` uint8 JSON {"format": "float8_e4m3fn"}: comfy/quant_ops.py),
"gguf_q8_0" (ComfyUI-GGUF's convert.py: block weights whose rows are whole Q8_0 blocks quantized, 1D and small
tensors F32, the rest F16; shapes reversed as ggml stores them), "gguf_q4_0" (the same with Q4_0).
"""

import json
from pathlib import Path

import torch

from ....kernels._utils import FP8_MAX
from .formats import COMFY_PREFIX, SCALED_FP8_MARKER

FORMATS = ("diffusers_bf16", "comfyui_bf16", "comfyui_fp8", "comfyui_scaled_fp8", "comfyui_quant_fp8", "gguf_q8_0",
           "gguf_q4_0")
GGUF_SMALL = 1024  # ComfyUI-GGUF convert.py: tensors of at most this many elements stay F32


def quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """The tensors the FP8 formats store in FP8: the 2D weights of the transformer blocks (ComfyUI's scaled files
    quantize the blocks' linear layers; embedders, norms and biases stay BF16)."""
    return name.startswith("transformer_blocks.") and name.endswith(".weight") and tensor.dim() == 2


def scaled_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn codes of tensor / s and s = amax / 448 (fp32 scalar), as ComfyUI's scaled-FP8 conversions make them."""
    w = tensor.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def write(state: dict[str, torch.Tensor], path, fmt: str, architecture: str = "qwen_image",
          quantized=quantized_weight, prefix: str | None = None) -> Path:
    """Write `state` (stock names) to path in format fmt (FORMATS); BF16 where the format keeps floats.
    quantized(name, tensor): which tensors the quantized formats quantize; prefix: the keys' (default: ComfyUI's
    diffusion-model prefix for the comfyui formats; a text encoder's file has none)."""
    path = Path(path)
    if fmt.startswith("gguf_"):
        return _write_gguf(state, path, fmt.removeprefix("gguf_"), architecture)
    from safetensors.torch import save_file

    prefix = ("" if fmt == "diffusers_bf16" else COMFY_PREFIX) if prefix is None else prefix
    out, metadata = {}, None
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu")
        if fmt in ("comfyui_fp8", "comfyui_scaled_fp8", "comfyui_quant_fp8") and quantized(name, tensor):
            layer = prefix + name.removesuffix(".weight")
            if fmt == "comfyui_fp8":
                out[prefix + name] = tensor.to(torch.float8_e4m3fn)
                continue
            codes, scale = scaled_fp8(tensor)
            out[prefix + name] = codes
            if fmt == "comfyui_scaled_fp8":
                out[f"{layer}.scale_weight"], out[f"{layer}.scale_input"] = scale, torch.ones(())
            else:
                out[f"{layer}.weight_scale"] = scale
                conf = json.dumps({"format": "float8_e4m3fn"}).encode()
                out[f"{layer}.comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
        else:
            out[prefix + name] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    if fmt == "comfyui_scaled_fp8":
        out[prefix + SCALED_FP8_MARKER] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path), metadata=metadata)
    return path


def quantize_q8_0(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, n * 32] -> GGUF Q8_0 bytes [rows, n * 34] uint8, in torch (threads; gguf's numpy takes minutes at 20B
    parameters) by gguf-py's rule (gguf/quants.py Q8_0): d = amax / 127 per block of 32 in fp32, q = x / d rounded
    half away from zero, d stored as fp16 (tests/pipelines/test_single_file.py checks it byte for byte)."""
    x = tensor.float().reshape(-1, 32)
    d = x.abs().amax(dim=1, keepdim=True) / 127
    scaled = x * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    raw = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return raw.reshape(tensor.shape[0], -1)


def _write_gguf(state: dict, path: Path, qtype_name: str, architecture: str) -> Path:
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name.upper()]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    near = "cuda" if torch.cuda.is_available() else "cpu"  # where Q8_0 blocks are computed (the benchmark's 20B)
    for name, tensor in state.items():
        tensor = tensor.detach()
        if tensor.dim() <= 1 or tensor.numel() <= GGUF_SMALL:
            writer.add_tensor(name, tensor.float().cpu().numpy())
        elif quantized_weight(name, tensor) and tensor.shape[-1] % block == 0:
            codes = (quantize_q8_0(tensor.to(near)).cpu().numpy() if qtype == gguf.GGMLQuantizationType.Q8_0 else
                     gguf.quants.quantize(tensor.float().cpu().numpy(), qtype))
            writer.add_tensor(name, codes, raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor.to(torch.float16).cpu().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
