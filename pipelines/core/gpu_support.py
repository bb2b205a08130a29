"""What each NVIDIA GPU generation runs, from its compute capability: one table that the FP8 GEMM, attention and
FP8-attention choices consult (fp8_gemm_why_not here, attention.resolve_backend,
fp8_attention.fp8_attention_kernel), so that `applied` and `render --dry-run` say what runs on a GPU and why the
rest does not. The rules restate the libraries' own capability checks, read from their source:

  capability      FP8 GEMMs (rowwise _scaled_mm,          attention "auto"             FP8 attention
                  Triton's e4m3 casts)
  < 8.0           no                                      PyTorch SDPA                 no
  8.0, 8.6, 8.7   no: both need 8.9                       cuDNN (PyTorch SDPA's)       no
  8.9 (Ada)       yes: PyTorch's CUTLASS sm89 kernel      cuDNN                        no
  9.0 (Hopper)    yes: cuBLASLt or CUTLASS sm90           FlashAttention-4             yes: cuDNN, FA3
  10.x            yes: CUTLASS sm100                      FlashAttention-4             no
  12.x            yes where PyTorch's build has the       cuDNN                        no
                  sm_120a rowwise kernel (probed)

- FP8 GEMMs: torch._scaled_mm refuses compute capability below 8.9, and Triton has no e4m3 type there. From 8.9 a
  GPU's first FP8 linear is preceded by a 16x16 rowwise _scaled_mm (rowwise_fp8_error): a wheel built without
  that capability's kernel ("Rowwise scaling is not currently supported on your device") then runs BF16 GEMMs,
  and says why, instead of failing in the first call.
- Attention: FlashAttention-4 is our Hopper and datacenter-Blackwell kernel (its 8.x and 12.x kernels are Ampere-
  style and were never measured here: attention="fa4" still runs them when named); elsewhere cuDNN through PyTorch
  SDPA, which needs 8.0; below it, PyTorch picks its own SDPA kernel.
- FP8 attention: our cuDNN graph takes Hopper's FP8 output form and FA3 is a Hopper kernel: 9.0 only.
- The Triton kernels of the transformer are row and elementwise kernels (no shared-memory tiles to size per GPU);
  their launch settings were tuned on Hopper and are the same everywhere.

MEASURED names the GPUs the suite and the benchmarks ran on; every other row is planned from source only.
"""

from dataclasses import dataclass
from functools import cache

import torch

MEASURED = {(9, 0): "H100, H200"}
FP8_MIN = (8, 9)


@dataclass(frozen=True)
class GpuSupport:
    capability: tuple[int, int]
    fp8_gemm_why: str | None  # None: FP8 GEMMs can run (a wheel may still lack the kernel: rowwise_fp8_error)
    fa4_auto: bool  # attention="auto" picks FlashAttention-4 (when installed and the model is fp16/bf16)
    cudnn: bool  # PyTorch's cuDNN SDPA runs here (else "auto" means PyTorch's own SDPA choice)
    fp8_attention_why: str | None  # None: our FP8 attention kernels run here

    @property
    def name(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def measured(self) -> str | None:
        """The GPUs measured at this capability (the GPU suite, the benchmarks), None where only planned."""
        return MEASURED.get(self.capability)


def support_of(capability: tuple[int, int]) -> GpuSupport:
    major, minor = capability
    shown = f"{major}.{minor}"
    fp8_why = None if capability >= FP8_MIN else (
        f"this GPU (compute capability {shown}) has no FP8 tensor cores: torch._scaled_mm and Triton's e4m3 need "
        "8.9 or newer; BF16 GEMMs run")
    fp8_attention_why = None if capability == (9, 0) else (
        f"runs on Hopper (compute capability 9.0) only; this GPU is {shown}")
    return GpuSupport(capability=capability, fp8_gemm_why=fp8_why, fa4_auto=major in (9, 10), cudnn=major >= 8,
                      fp8_attention_why=fp8_attention_why)


def support_on(device: torch.device) -> GpuSupport:
    return support_of(tuple(torch.cuda.get_device_capability(device)))


@cache
def rowwise_fp8_error(device_index: int) -> str | None:
    """None where a rowwise-scaled e4m3 torch._scaled_mm runs on this GPU, else its error (one 16x16 call, once)."""
    device = torch.device("cuda", device_index)
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    scale = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    return None


def fp8_gemm_why_not(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device` (None: they run; the CPU computes them as _scaled_mm would)."""
    if device.type != "cuda":
        return None
    why = support_on(device).fp8_gemm_why
    if why is None:
        error = rowwise_fp8_error(device.index if device.index is not None else torch.cuda.current_device())
        if error is not None:
            why = f"this PyTorch build has no rowwise FP8 GEMM for this GPU ({error}); BF16 GEMMs run"
    return why


def describe_gpu(device: torch.device) -> str:
    """One line for --dry-run: the GPU (CUDA `device`), its capability, and whether what runs there was measured."""
    support = support_on(device)
    measured = (f"measured on {support.measured}" if support.measured else
                "planned from the libraries' capability checks, not measured on this GPU generation")
    return f"GPU: {torch.cuda.get_device_name(device)} ({support.name}): {measured}"
