"""FP8 attention on Hopper, on the operands qkv_pack wrote into the joint [B, S, H, D] buffers (q, k: FP8 with the
RMSNorm bound's per-tensor scales; v: FP8 with a bound's scale where the block proved one, else quantized here by
quantize_fp8_heads); a padded prompt's keys at the end of each sample, counted out by seqused_k (attention.py).

    fa3    FlashAttention-3's FP8 forward (PyPI `tokenspeed-fa3`, module `flash_attn_interface`): descales per
           (sample, head) [B, H], BF16 output [B, S, H, D] (the output projection's rowwise quantization as today).
    cudnn  cuDNN's FP8 SDPA (PyPI `nvidia-cudnn-frontend`, a pygraph per shape): per-tensor descales; on Hopper the
           output is FP8 only. Its scale follows from v's without an amax pass: each output row is a combination
           of v's rows whose weights, the probabilities as e4m3 codes, each round up by at most 2^-4 of itself,
           so |o| <= (1 + 2^-4) max|v| and o's codes o / (v_scale * O_HEADROOM) stay within +-448.
Softmax scale 1/sqrt(D), non-causal, P (the probabilities) quantized with scale 448 inside cuDNN's kernel.
fp8_attention_ref is the semantics both approximate (dequantized operands, fp32 softmax attention): the GPU tests
hold each kernel to it, and the CPU tests run the blocks' FP8 wiring with it (it is never a user's choice).

Attention over two key sets quantized apart (Qwen-Image-2.1: the target's keys and values with this step's v scale,
the prefix cache's with the scale they were stored with) runs as one call per set, each returning its log-sum-exp
(fp8_attention_lse; FA3 only: cuDNN's FP8 SDPA returns none in inference), merged by kernels/attention_merge.py.

v's scale without an amax pass (v_weight_bound, lora_adds_to_v): v = x @ W_v.T + b with x a rowwise-FP8 operand
(|x_k| <= 448 * its row's scale) is bounded by 448 * max row scale * max_j ||W_v,j||_1 + max |b_v|
(kernels/output_bound.py computes it on the device from the row scales).
"""

import importlib.util
import math
from functools import cache

import torch
import torch.nn.functional as F

from ....kernels._utils import FP8_MAX
from ....kernels.qkv_pack import BOUND_MARGIN
from ....kernels.quantize_heads import quantize_fp8_heads
from ..gpu_support import support_on
from ..runtime.cuda_graph import read_by_graph
from .linear import FastLinear, Operand

INSTALL = "pip install 'qwen-image-fast[fp8-attention]'"
PACKAGES = {"cudnn": ("nvidia-cudnn-frontend", "cudnn"), "fa3": ("tokenspeed-fa3", "flash_attn_interface")}
KERNELS = ("cudnn", "fa3")  # in the order fp8_attention="auto" tries them
LSE_KERNELS = ("fa3",)  # those returning the log-sum-exp (fp8_attention_lse): two key sets' calls merged


@cache
def installed(kernel: str) -> bool:
    return importlib.util.find_spec(PACKAGES[kernel][1]) is not None


def fp8_attention_kernel(name: str, device: torch.device, dtype: torch.dtype,
                         kernels: tuple[str, ...] = KERNELS) -> tuple[str | None, str | None]:
    """FastTransformerConfig.fp8_attention on this device and dtype: (the kernel that runs, None), or (None, why
    not) for an "auto" that cannot run here ((None, None) for "off"). A named kernel that cannot run: ValueError,
    or ImportError naming the missing package. kernels: the model's, in the order "auto" tries them (a name
    outside them: the caller refuses it first)."""
    if name == "off":
        return None, None
    if device.type != "cuda":
        why = f"needs a CUDA GPU (the transformer runs on {device})"
    else:
        why = support_on(device).fp8_attention_why
        if why is None and dtype != torch.bfloat16:
            why = f"needs a bfloat16 model, this one is {dtype}"
    if why is None:
        candidates = list(kernels) if name == "auto" else [name]
        found = [kernel for kernel in candidates if installed(kernel)]
        if found:
            return found[0], None
        why = f"needs {' or '.join(PACKAGES[kernel][0] for kernel in candidates)} ({INSTALL})"
        if name != "auto":
            raise ImportError(f"fp8_attention={name!r} {why}")
    if name != "auto":
        raise ValueError(f"fp8_attention={name!r} {why}")
    return None, why


def fp8_attention(kernel: str, q8, k8, v, q_scale, k_scale, valid_keys, v_scale: torch.Tensor | None = None,
                  dtype: torch.dtype = torch.bfloat16,
                  o_scales: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The joint attention in FP8 by `kernel`: q8, k8 FP8 [B, S, H, D] (qkv_pack's, with its scales [1]); v FP8
    with v_scale [1] (qkv_pack's, from a bound), or without it in the model's dtype, quantized here (per (sample,
    head) for FA3, per tensor for cuDNN, amax over the valid keys). Returns (o, None) with o BF16 [B, S, H, D], or
    (o8, scale [1]) with o ~= o8 * scale (cuDNN's FP8 output). dtype: the model's (bfloat16 for the kernels; the
    reference's output takes it). o_scales: cuDNN's (v_scale * O_HEADROOM, its reciprocal) [1] each where the
    caller computed them with v_scale (kernels/output_bound.py), else computed here."""
    if v_scale is None:
        if o_scales is not None:  # they were computed with a v scale; v measured here has another
            raise ValueError("o_scales come with the v_scale they were computed with; v_scale is None")
        v8, v_scales = quantize_fp8_heads(v, valid_keys, per_tensor=kernel == "cudnn", q_dtype=q8.dtype)
        v_scale = v_scales[0, 0].reshape(1)
    else:
        v8, v_scales = v, None
    if kernel == "cudnn":
        return CUDNN(q8, k8, v8, q_scale, k_scale, v_scale, valid_keys, torch.empty_like(q8), o_scales=o_scales)
    if v_scales is None:  # FA3 and the reference take a scale per (sample, head)
        v_scales = v_scale.expand(*v.shape[:1], v.shape[2]).contiguous()
    if kernel == "fa3":
        return fp8_attention_fa3(q8, k8, v8, q_scale, k_scale, v_scales, valid_keys), None
    if kernel == "reference":  # the tests' (module docstring)
        return fp8_attention_ref(q8, k8, v8, q_scale, k_scale, v_scales, valid_keys).to(dtype), None
    raise ValueError(f"fp8 attention kernel {kernel!r}; allowed: cudnn, fa3")


def fp8_attention_ref(q8, k8, v8, q_scale, k_scale, v_scales, valid_keys) -> torch.Tensor:
    """The semantics the FP8 kernels approximate: the dequantized operands' fp32 softmax attention, keys past
    valid_keys[b] masked. Returns [B, S, H, D] BF16."""
    b, s, h, _ = q8.shape
    q, k = q8.float() * q_scale, k8.float() * k_scale
    v = v8.float() * v_scales[:, None, :, None]
    keys = torch.arange(s, device=q8.device)[None, :] < valid_keys[:, None]  # [B, S]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=keys[:, None, None, :])
    return out.transpose(1, 2).to(torch.bfloat16)


def fp8_attention_lse(kernel: str, q8, k8, v8, q_scale, k_scale, v_scales, valid_keys=None,
                      dtype: torch.dtype = torch.bfloat16):
    """q8: FP8 [B, S, H, D]; k8, v8: FP8 [B, K, H, D]; q_scale, k_scale: fp32 [1] or [B, H]; v_scales: fp32 [B, H];
    valid_keys: int32 [B] (each sample's first valid keys) or None (all K). Returns (o BF16 [B, S, H, D], lse fp32
    [B, H, S], the natural log-sum-exp of each query's scaled scores) by `kernel`: "fa3", or the tests'
    "reference" (its o rounded to BF16, then in `dtype`: the CPU tests' fp32 models)."""
    if kernel == "fa3":
        from flash_attn_interface import _flash_attn_forward

        b, _, h, d = q8.shape
        descales = [t if t.shape == (b, h) else t.expand(b, h).contiguous() for t in (q_scale, k_scale)]
        out, lse, *_ = _flash_attn_forward(q8, k8, v8, seqused_k=valid_keys, q_descale=descales[0],
                                           k_descale=descales[1], v_descale=v_scales.contiguous(),
                                           softmax_scale=1 / math.sqrt(d))
        return out, lse
    if kernel == "reference":
        out, lse = fp8_attention_lse_ref(q8, k8, v8, q_scale, k_scale, v_scales, valid_keys)
        return out.to(dtype), lse
    raise ValueError(f"fp8 attention kernel {kernel!r} with a log-sum-exp; allowed: fa3")


def fp8_attention_lse_ref(q8, k8, v8, q_scale, k_scale, v_scales, valid_keys=None):
    """fp8_attention_lse's semantics: the dequantized operands' fp32 softmax attention, keys past valid_keys[b]
    masked; (o BF16 [B, S, H, D], lse fp32 [B, H, S])."""
    b, _, h, _ = q8.shape
    q, k = (x.float() * scale.expand(b, h)[:, None, :, None] for x, scale in ((q8, q_scale), (k8, k_scale)))
    v = v8.float() * v_scales[:, None, :, None]
    scores = torch.einsum("bshd,bkhd->bhsk", q, k) / math.sqrt(q.shape[-1])
    if valid_keys is not None:
        keys = torch.arange(k.shape[1], device=q8.device)[None, :] < valid_keys[:, None]  # [B, K]
        scores = scores.masked_fill(~keys[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhsk,bkhd->bshd", torch.softmax(scores, dim=-1).nan_to_num(0.0), v)
    return out.to(torch.bfloat16).contiguous(), lse.contiguous()


def lora_adds_to_v(linear: FastLinear, inner: int) -> bool:
    """Whether adapters on a fused QKV linear add to its v rows [2 * inner, 3 * inner) now."""
    lora = linear.lora
    return lora is not None and any(
        row1 > 2 * inner and lora.in_effect(site) for site, (_, row1) in lora.sites.items())


def v_bound_terms(x: Operand, linear: FastLinear, inner: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """v's bound terms (v_weight_bound over the v rows [2 * inner, 3 * inner)) for the QKV linear `linear` on its
    operand x, or None where the bound does not hold: x or the weight not FP8, or a LoRA adding to v's rows (v is
    then measured, quantize_fp8_heads)."""
    if not isinstance(x, tuple) or not linear.fp8 or lora_adds_to_v(linear, inner):
        return None
    terms = v_weight_bound(linear, slice(2 * inner, None))
    read_by_graph(*terms)  # cached for these weights, made before the forward
    return terms


def v_weight_bound(linear: FastLinear, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The v bound's weight terms of an FP8 QKV linear (module docstring): (max_j |bias_j| * BOUND_MARGIN / 448,
    max_j weight_scale_j * sum_k |weight_q_jk| * BOUND_MARGIN) over its v rows `rows`, fp32 [1] each, so that
    v's scale = bias_term + max row scale * row_term; computed once for these weights (fuse_lora rewrites them in
    place: their version says so)."""
    key = (linear.weight_q.data_ptr(), linear.weight_q._version, linear.weight_scale._version, linear.bias._version)
    cached = getattr(linear, "_v_bound", None)
    if cached is None or cached[0] != key:
        l1 = linear.weight_q[rows].float().abs().sum(dim=1) * linear.weight_scale[rows]
        bias_max = linear.bias[rows].float().abs().max()
        linear._v_bound = (key, ((bias_max * (BOUND_MARGIN / FP8_MAX)).reshape(1),
                                 (l1.max() * BOUND_MARGIN).reshape(1)))
    return linear._v_bound[1]


def fp8_attention_fa3(q8, k8, v8, q_scale, k_scale, v_scales, seqused_k) -> torch.Tensor:
    """q8, k8, v8: FP8 [B, S, H, D]; q_scale, k_scale: fp32 [1]; v_scales: fp32 [B, H]; seqused_k: int32 [B].
    Returns BF16 [B, S, H, D] (a new tensor: the package's custom op refuses an output buffer it is given)."""
    return fp8_attention_lse("fa3", q8, k8, v8, q_scale, k_scale, v_scales, seqused_k)[0]


class CudnnFp8Attention:
    """cuDNN FP8 SDPA graphs by shape (built once each, on the device of the first call). all_plans: every ranked
    plan built (benchmarks time them: plan_names, then a call with plan=i), else the heuristics' first that builds."""

    P_SCALE = 448.0  # the probabilities [0, 1] -> e4m3 codes [0, 448]
    # o's scale over v's: the rounded probabilities of a row can sum past 1 (module docstring), and a subnormal
    # code rounds by up to 2^-10 / 448 absolute: 1/8 of headroom covers both (e4m3's precision is relative: the
    # codes lose nothing but the bottom of their range)
    O_HEADROOM = 1.125

    def __init__(self, all_plans: bool = False):
        self.all_plans = all_plans
        self.graphs: dict[tuple, tuple] = {}

    def _graph(self, b: int, s: int, h: int, d: int, device: torch.device):
        key = (b, s, h, d, str(device))
        if key not in self.graphs:
            import cudnn

            handle = cudnn.create_handle()
            graph = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
                                  compute_data_type=cudnn.data_type.FLOAT, handle=handle)
            dims, strides = [b, h, s, d], [s * h * d, d, h * d, 1]  # [B, S, H, D] memory as cuDNN's [B, H, S, D]
            q, k, v = (graph.tensor(name=n, dim=dims, stride=strides, data_type=cudnn.data_type.FP8_E4M3)
                       for n in "qkv")
            scalars = {n: graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
                       for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
            lens = {n: graph.tensor(name=n, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
                    for n in ("seq_len_q", "seq_len_kv")}
            o, _, amax_s, amax_o = graph.sdpa_fp8(
                q, k, v, *scalars.values(), is_inference=True, attn_scale=1 / math.sqrt(d), use_causal_mask=False,
                use_padding_mask=True, **lens)
            o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(cudnn.data_type.FP8_E4M3)
            for amax in (amax_s, amax_o):
                amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
                    cudnn.data_type.FLOAT)
            if self.all_plans:
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans(cudnn.build_plan_policy.ALL)
                size = max(graph.get_workspace_size_plan_at_index(i) for i in range(graph.get_execution_plan_count()))
            else:
                graph.build([cudnn.heur_mode.A])
                size = graph.get_workspace_size()
            workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
            constants = dict(descale_s=torch.full((1,), 1 / self.P_SCALE, device=device),
                             scale_s=torch.full((1,), self.P_SCALE, device=device),
                             seq_len_q=torch.full((b,), s, dtype=torch.int32, device=device),
                             amax=torch.empty(2, dtype=torch.float32, device=device))
            self.graphs[key] = (graph, handle, dict(q=q, k=k, v=v, o=o, amax_s=amax_s, amax_o=amax_o, **scalars,
                                                    **lens), workspace, constants)
        return self.graphs[key]

    def plan_names(self, q8) -> list[str]:
        graph = self._graph(*q8.shape, q8.device)[0]
        return [graph.get_plan_name_at_index(i) for i in range(graph.get_execution_plan_count())]

    def __call__(self, q8, k8, v8, q_scale, k_scale, v_scale, seqused_k, out8, plan: int | None = None,
                 o_scales: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q8, k8, v8, out8: FP8 [B, S, H, D]; q_scale, k_scale, v_scale: fp32 [1]; seqused_k: int32 [B]. Returns
        (out8, o_scale [1]): o ~= out8 * o_scale, o_scale = v_scale * O_HEADROOM. plan: an index of plan_names
        (all_plans), else the built one. o_scales: (o_scale, 1 / o_scale) [1] each, computed with v_scale by the
        caller (one kernel for the lot: kernels/output_bound.py), else here."""
        import cudnn

        graph, handle, t, workspace, c = self._graph(*q8.shape, q8.device)
        if o_scales is None:
            o_scale = v_scale * self.O_HEADROOM
            o_scales = (o_scale, 1.0 / o_scale)
        o_scale, inv_o_scale = o_scales
        cudnn.set_stream(handle, torch.cuda.current_stream(q8.device).cuda_stream)
        pack = {t["q"]: q8, t["k"]: k8, t["v"]: v8, t["o"]: out8, t["descale_q"]: q_scale, t["descale_k"]: k_scale,
                t["descale_v"]: v_scale, t["descale_s"]: c["descale_s"], t["scale_s"]: c["scale_s"],
                t["scale_o"]: inv_o_scale, t["seq_len_q"]: c["seq_len_q"], t["seq_len_kv"]: seqused_k,
                t["amax_s"]: c["amax"][:1], t["amax_o"]: c["amax"][1:]}
        if plan is None:
            graph.execute(pack, workspace, handle=handle)
        else:
            graph.execute_plan_at_index(pack, workspace, plan, handle=handle)
        return out8, o_scale


CUDNN = CudnnFp8Attention()
