"""Joint attention for the Qwen-Image blocks: FlashAttention-4, cuDNN or PyTorch SDPA, with padded text masked.

The fast transformer packs each sample's joint sequence as [image, text] (qkv_pack writes the image stream at
offset 0 and the text after it). Non-causal attention does not depend on token order (RoPE is applied per token
before), and this order puts a right-padded prompt's padding at the end of the sample, so the valid keys are a
prefix of length `L_img + text_len` that FlashAttention-4 takes as `seqused_k`. Padded keys are never attended;
padded queries compute rows that only feed padded text tokens, which never reach the image output.
"""

import importlib.util
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import ATTENTION_BACKENDS as BACKENDS
from ..gpu_support import support_on


@cache
def fa4_available() -> bool:
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return False
    return True


FA4_DTYPES = (torch.float16, torch.bfloat16)


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """'auto' -> FlashAttention-4 on a Hopper or datacenter-Blackwell GPU (gpu_support.py) when importable and the
    model is fp16/bf16, else cuDNN SDPA on a GPU that has it (compute capability 8.0 on), else SDPA."""
    if name not in BACKENDS:
        raise ValueError(f"attention={name!r}; allowed: {', '.join(BACKENDS)}")
    cuda = device.type == "cuda"
    support = support_on(device) if cuda else None
    if name == "auto":
        if cuda and dtype in FA4_DTYPES and support.fa4_auto and fa4_available():
            return "fa4"
        return "cudnn" if cuda and support.cudnn else "sdpa"
    if name in ("fa4", "cudnn") and not cuda:
        raise ValueError(f"attention={name!r} needs a CUDA device, the model is on {device}")
    if name in ("fa4", "cudnn") and not support.cudnn:  # FlashAttention-4 and cuDNN SDPA both start at 8.0
        raise ValueError(f"attention={name!r} needs compute capability 8.0 or newer, this GPU is "
                         f"{support.capability[0]}.{support.capability[1]}: use attention='sdpa' or 'auto'")
    if name == "fa4" and dtype not in FA4_DTYPES:
        raise ValueError(f"attention='fa4' needs a float16/bfloat16 model, this one is {dtype}")
    if name == "fa4" and not fa4_available():
        raise ImportError("attention='fa4' needs FlashAttention-4: pip install 'qwen-image-fast[fa4]'")
    return name


class TextMask:
    """Per-forward view of the text mask for the [image, text] joint sequence.

    text_mask: [B, L_txt] bool/int, valid tokens first (right padding, what tokenizers produce; checked on the
    device without a host sync). seqused_k: int32 [B] valid keys per sample; key_mask: [B, 1, 1, S] bool for SDPA."""

    def __init__(self, text_mask: torch.Tensor, img_len: int):
        mask = text_mask.to(torch.bool)
        text_len = mask.sum(dim=1)
        prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < text_len[:, None]
        torch._assert_async((mask == prefix).all(), "text mask must be right-padded (valid tokens first)")
        self.seqused_k = (text_len + img_len).to(torch.int32)
        ones = torch.ones(mask.shape[0], img_len, dtype=torch.bool, device=mask.device)
        self.key_mask = torch.cat([ones, mask], dim=1)[:, None, None, :]

    @classmethod
    def of(cls, seqused_k: torch.Tensor, key_mask: torch.Tensor) -> "TextMask":
        """A TextMask of these tensors (the buffers that block graphs read, JointInputs.on_buffers)."""
        mask = cls.__new__(cls)
        mask.seqused_k, mask.key_mask = seqused_k, key_mask
        return mask


def joint_attention(q, k, v, mask: TextMask | None, backend: str) -> torch.Tensor:
    """q, k, v: [B, S, H, D] -> [B, S, H, D] contiguous, softmax scale 1/sqrt(D), non-causal."""
    if backend == "fa4":
        from flash_attn.cute import flash_attn_varlen_func

        out, _ = flash_attn_varlen_func(q, k, v, seqused_k=None if mask is None else mask.seqused_k)
        return out
    attn_mask = None if mask is None else mask.key_mask
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D] views
    if backend == "cudnn":
        # a mask rules cuDNN out on some torch builds; let SDPA pick among the rest then
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(backends, set_priority=True):
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask)
    else:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask)
    return out.transpose(1, 2).contiguous()
