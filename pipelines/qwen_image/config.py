"""FastTransformerConfig: how the fast transformer stores and runs its block linears and attention.

Kept free of torch/diffusers imports: the package's config and the CLI's argument parsing import it.
"""

from dataclasses import asdict, dataclass

# The block linears that may run in FP8; (stream)_(layer). qkv is the per-stream fused Q/K/V projection.
FP8_LINEARS = ("img_qkv", "img_out", "img_fc1", "img_fc2", "txt_qkv", "txt_out", "txt_fc1", "txt_fc2")
ATTENTION_BACKENDS = ("auto", "fa4", "cudnn", "sdpa")


@dataclass(frozen=True)
class FastTransformerConfig:
    """fp8: run FP8_LINEARS in rowwise FP8 (False: BF16 mode, every GEMM in the model's dtype).
    bf16_linears: those of FP8_LINEARS kept in the model's dtype anyway (e.g. ("img_fc2",), which other engines
    found sensitive). fp8_fast_accum: cuBLAS's faster FP8 accumulation on Hopper (torchao's default).
    attention: "auto" (FlashAttention-4, else cuDNN, else SDPA) | "fa4" | "cudnn" | "sdpa".

    fp8 and bf16_linears decide how the weights are stored (a saved checkpoint keeps them); fp8_fast_accum and
    attention only how they run."""

    fp8: bool = True
    bf16_linears: tuple[str, ...] = ()
    fp8_fast_accum: bool = False
    attention: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "bf16_linears", tuple(self.bf16_linears))
        unknown = [name for name in self.bf16_linears if name not in FP8_LINEARS]
        if unknown:
            raise ValueError(f"bf16_linears={unknown}; allowed: {', '.join(FP8_LINEARS)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention={self.attention!r}; allowed: {', '.join(ATTENTION_BACKENDS)}")

    def is_fp8(self, name: str) -> bool:
        return self.fp8 and name in FP8_LINEARS and name not in self.bf16_linears

    @property
    def fp8_linears(self) -> tuple[str, ...]:
        return tuple(name for name in FP8_LINEARS if self.is_fp8(name))

    def to_dict(self) -> dict:
        return {**asdict(self), "bf16_linears": list(self.bf16_linears)}

    @classmethod
    def from_dict(cls, values: dict) -> "FastTransformerConfig":
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown FastTransformerConfig field(s) {unknown}; allowed: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**values)
