"""The fast Qwen3.5 text model: transformers' `Qwen3_5ForCausalLM` (5.17) rebuilt on fused kernels, with a static
hybrid cache and a decode step that can be captured in one CUDA graph.

Layers follow `config.layer_types` (Qwen3.5-9B: three Gated-DeltaNet layers, then one gated full-attention layer,
eight times). The residual stream rides beside the hidden states (the norms add it in, as in nano-vllm):

    add_rms_norm -> token mixer -> add_rms_norm -> gate_up GEMM -> silu_mul -> down GEMM
    Gated-DeltaNet: one GEMM for [qkv | z | b | a] -> causal conv + SiLU -> gated delta rule
                    -> gated_rms_norm(o, z) -> out GEMM
    attention:      one GEMM for [q and gate per head | k | v] -> rms_norm_rope(q), rms_norm_rope(k) -> SDPA
                    -> o * sigmoid(gate) -> o GEMM   (decode: K/V write + attention + gate in decode_attention)
At B=1 decode, one-row GEMMs run a Triton GEMV (see `linear`); the down GEMV computes silu_mul, the Gated-DeltaNet
out_proj GEMV its gated RMSNorm, in their prologues.

Entry points: forward (no cache, for parity tests), prefill (one sequence into one cache slot, from position 0, so
prompts of different lengths need no padding in the recurrence), decode (one token per sequence, each at its own
position). Positions are text-only, so the multimodal RoPE sections collapse to plain partial rotate-half RoPE.
Decode reads positions from the cache's device lengths and never synchronizes with the host, so generate.py captures
it, with sampling, in one CUDA graph.
"""

import functools
import logging
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.decode_attention import decode_attention
from ...kernels.gdn import causal_conv1d, chunk_gated_delta_rule_ref, conv_ring, gated_delta_rule_decode
from ...kernels.gemv import gated_rms_norm_gemv, gemv, silu_mul_gemv
from ...kernels.qk_norm_rope import rms_norm_rope
from ...kernels.rms_norm import add_rms_norm, gated_rms_norm, rms_norm
from ...kernels.swiglu import silu_mul

logger = logging.getLogger(__name__)


@functools.cache
def fla_chunk_gated_delta_rule():
    """fla-core's chunked gated delta rule (GPU prefill), or None, logged once, when fla-core is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        logger.warning("fla-core is not installed (pip install 'qwen-image-fast[text]'): Gated-DeltaNet prefill runs "
                       "the chunked PyTorch reference")
        return None
    return chunk_gated_delta_rule


def chunk_gated_delta_rule(q, k, v, a, beta, A_log, dt_bias):
    """q, k: [B, T, H, Dk]; v: [B, T, HV, Dv]; a, beta: [B, T, HV] (a: in_proj_a's output); A_log, dt_bias: [HV].
    The log decay g = -exp(A_log) * softplus(a + dt_bias) is taken in fp32 (upstream's casts); zero initial state,
    q/k L2-normalized. Returns (o [B, T, HV, Dv] in v's dtype, final state [B, HV, Dk, Dv] fp32)."""
    fla = fla_chunk_gated_delta_rule() if q.is_cuda else None
    if fla is None:
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # [B, T, HV] fp32
        return chunk_gated_delta_rule_ref(q, k, v, g, beta)
    # fla >= 0.5 maps value head j to q/k head j // (HV / H) itself (upstream repeats q and k first: two copies),
    # and computes g in its cumsum kernel (use_gate_in_kernel: the same fp32 formula), not in small launches here
    return fla(q, k, v, g=a, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
               use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias. On CUDA a single row (decode at B=1, prefill's last-token logits) goes to the Triton
    GEMV, which streams the weight in one pass where cuBLAS splits K for some shapes (kernels/gemv.py). Not on the
    CPU, where Triton runs in its interpreter (tests only) and a 248k-row lm_head is 15k programs a step;
    tests/kernels/test_gemv.py covers the kernel there, the GPU model tests cover this path."""
    return gemv(x, weight) if one_row_on_cuda(x) else F.linear(x, weight)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """linear(silu_mul(gate_up), weight); a single CUDA row in one GEMV kernel (no launch for silu_mul)."""
    return silu_mul_gemv(gate_up, weight) if one_row_on_cuda(gate_up) else F.linear(silu_mul(gate_up), weight)


def gated_rms_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor) -> torch.Tensor:
    """linear(gated_rms_norm(x, gate, norm_weight, eps) flattened per row, weight): x, gate [B, HV, Dv] ->
    [B, N]; a single CUDA row in one GEMV kernel (the norm in its prologue)."""
    if one_row_on_cuda(x.flatten(-2)):
        return gated_rms_norm_gemv(x, gate, norm_weight, weight, eps)
    return linear(gated_rms_norm(x, gate, norm_weight, eps).flatten(-2), weight)


def one_row_on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and x.numel() == x.shape[-1]


def frozen(t: torch.Tensor, device, dtype=None) -> nn.Parameter:
    return nn.Parameter(t.detach().to(device=device, dtype=dtype), requires_grad=False)


class Step(NamedTuple):
    """What every layer of one decode step shares; all device tensors."""

    cos: torch.Tensor  # [B, 1, R]
    sin: torch.Tensor  # [B, 1, R]
    pos: torch.Tensor  # [B] int64: each sequence's position = its cached length


class Layer(nn.Module):
    """The parts every decoder layer has: the two zero-centred norms and the SwiGLU MLP ([gate; up] packed)."""

    def __init__(self, layer, device, dtype):
        super().__init__()
        mlp = layer.mlp
        self.eps = layer.input_layernorm.eps
        self.input_norm = frozen(layer.input_layernorm.weight, device, dtype)  # [D]
        self.post_norm = frozen(layer.post_attention_layernorm.weight, device, dtype)  # [D]
        self.gate_up = frozen(torch.cat([mlp.gate_proj.weight.to(device), mlp.up_proj.weight.to(device)]),
                              device, dtype)  # [2I, D]
        self.down = frozen(mlp.down_proj.weight, device, dtype)  # [D, I]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up stays on cuBLAS even for one row: at that shape it is at least as fast as the GEMV (RESULTS.md)
        return silu_mul_linear(F.linear(x, self.gate_up), self.down)


class DeltaNetLayer(Layer):
    """A Gated-DeltaNet layer (`Qwen3_5GatedDeltaNet`). State per sequence: conv [C, K] (a ring of the last conv
    inputs, slot p % K holding position p's; model dtype) and recurrent [HV, Dk, Dv] fp32."""

    def __init__(self, layer, device, dtype):
        super().__init__(layer, device, dtype)
        attn = layer.linear_attn
        self.num_k_heads, self.num_v_heads = attn.num_k_heads, attn.num_v_heads
        self.head_k_dim, self.head_v_dim = attn.head_k_dim, attn.head_v_dim
        self.key_dim, self.value_dim, self.conv_dim = attn.key_dim, attn.value_dim, attn.conv_dim
        self.norm_eps = attn.norm.variance_epsilon
        weights = [p.weight.to(device) for p in (attn.in_proj_qkv, attn.in_proj_z, attn.in_proj_b, attn.in_proj_a)]
        self.in_proj = frozen(torch.cat(weights), device, dtype)  # [C + Vd + 2 HV, D]
        self.conv_weight = frozen(attn.conv1d.weight[:, 0], device, dtype)  # [C, K]
        self.A_log = frozen(attn.A_log, device, dtype)  # [HV]
        self.dt_bias = frozen(attn.dt_bias, device, dtype)  # [HV]
        self.norm_weight = frozen(attn.norm.weight, device, dtype)  # [Dv]
        self.out_proj = frozen(attn.out_proj.weight, device, dtype)  # [D, Vd]

    def new_state(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv = self.in_proj.new_zeros(batch, self.conv_dim, self.conv_weight.shape[1])
        recurrent = self.in_proj.new_zeros(batch, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                           dtype=torch.float32)
        return conv, recurrent

    def _project(self, x: torch.Tensor):
        """[..., D] -> mixed qkv [..., C], z [..., Vd], b [..., HV], a [..., HV] (views of one GEMM output)."""
        hv = self.num_v_heads
        return linear(x, self.in_proj).split([self.conv_dim, self.value_dim, hv, hv], dim=-1)

    def forward(self, x: torch.Tensor, cos, sin, state=None) -> torch.Tensor:
        """x: [B, T, D] from position 0 (no positions: cos, sin unused). state: None, or (conv [B, C, K],
        recurrent [B, HV, Dk, Dv]) to receive the state after the last token."""
        bsz, t, _ = x.shape
        qkv, z, b, a = self._project(x)
        # q, k, v each contiguous: fla would copy strided views of one [B, T, C] output
        (q, k, v), conv_state = causal_conv1d(qkv, self.conv_weight, split=(self.key_dim, self.key_dim, self.value_dim))
        if state is not None:
            state[0].copy_(conv_ring(conv_state, t))  # the decode step's layout; the next token is at position t
        q = q.view(bsz, t, self.num_k_heads, self.head_k_dim)
        k = k.view(bsz, t, self.num_k_heads, self.head_k_dim)
        v = v.view(bsz, t, self.num_v_heads, self.head_v_dim)
        o, final_state = chunk_gated_delta_rule(q, k, v, a, b.sigmoid(), self.A_log, self.dt_bias)  # [B, T, HV, Dv]
        if state is not None:
            state[1].copy_(final_state)
        y = gated_rms_norm(o, z.reshape(bsz, t, self.num_v_heads, self.head_v_dim), self.norm_weight, self.norm_eps)
        return linear(y.view(bsz, t, self.value_dim), self.out_proj)

    def decode(self, x: torch.Tensor, step: Step, state) -> torch.Tensor:
        """x: [B, 1, D]; state: (conv, recurrent), updated in place by the fused kernel."""
        bsz = x.shape[0]
        qkv, z, b, a = self._project(x[:, 0])  # [B, C], [B, Vd], [B, HV], [B, HV]
        o = gated_delta_rule_decode(qkv, a, b, state[0], step.pos, self.conv_weight, self.A_log, self.dt_bias,
                                    state[1], self.num_k_heads, self.head_k_dim, self.head_v_dim)  # [B, HV, Dv]
        z = z.view(bsz, self.num_v_heads, self.head_v_dim)
        return gated_rms_norm_linear(o, z, self.norm_weight, self.norm_eps, self.out_proj)[:, None]  # [B, 1, D]


class AttentionLayer(Layer):
    """A gated full-attention layer (`Qwen3_5Attention`): q_proj gives per head [query | gate]; zero-centred
    q/k norms; partial RoPE; output * sigmoid(gate). State per sequence: K and V [max_len, KVH, D]."""

    def __init__(self, layer, device, dtype):
        super().__init__(layer, device, dtype)
        attn = layer.self_attn
        if attn.q_proj.bias is not None:
            raise NotImplementedError("attention_bias=True: Qwen3.5 checkpoints have no attention biases")
        self.head_dim = attn.head_dim
        self.num_heads = attn.config.num_attention_heads
        self.num_kv_heads = attn.config.num_key_value_heads
        weights = [p.weight.to(device) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv_proj = frozen(torch.cat(weights), device, dtype)  # [2 H D + 2 KVH D, D]
        self.q_norm = frozen(attn.q_norm.weight, device, dtype)  # [D]
        self.k_norm = frozen(attn.k_norm.weight, device, dtype)  # [D]
        self.norm_eps = attn.q_norm.eps
        self.o_proj = frozen(attn.o_proj.weight, device, dtype)  # [D_model, H D]

    def new_state(self, batch: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return self.qkv_proj.new_zeros(shape), self.qkv_proj.new_zeros(shape)

    def _project(self, x: torch.Tensor, cos, sin):
        """x: [B, S, D] -> q [B, S, H, D] and k [B, S, KVH, D] (normed and rotated), v [B, S, KVH, D],
        gate [B, S, H, D] (a view)."""
        b, s, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = linear(x, self.qkv_proj).split([2 * h * d, kvh * d, kvh * d], dim=-1)
        qg = qg.view(b, s, h, 2 * d)
        q = rms_norm_rope(qg[..., :d], self.q_norm, cos, sin, self.norm_eps)
        k = rms_norm_rope(k.view(b, s, kvh, d), self.k_norm, cos, sin, self.norm_eps)
        return q, k, v.view(b, s, kvh, d), qg[..., d:]

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate: [B, S, H, D] -> [B, S, D_model]."""
        b, s = o.shape[:2]
        return linear(o.reshape(b, s, -1) * torch.sigmoid(gate.reshape(b, s, -1)), self.o_proj)

    def forward(self, x: torch.Tensor, cos, sin, state=None) -> torch.Tensor:
        """x: [B, T, D] from position 0; cos, sin: [B, T, R]. state: None, or (K, V) [B, L, KVH, D] to receive
        positions 0..T-1."""
        t = x.shape[1]
        q, k, v, gate = self._project(x, cos, sin)
        if state is not None:
            state[0][:, :t] = k
            state[1][:, :t] = v
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)  # [B, H, T, D]
        return self._output(o.transpose(1, 2), gate)

    def decode(self, x: torch.Tensor, step: Step, state) -> torch.Tensor:
        """x: [B, 1, D]. One kernel pair writes this token's K/V at each sequence's position, attends over the cache
        up to it and applies the sigmoid gate."""
        b = x.shape[0]
        k_cache, v_cache = state  # [B, L, KVH, D]
        q, k, v, gate = self._project(x, step.cos, step.sin)
        o = decode_attention(q[:, 0], k[:, 0], v[:, 0], k_cache, v_cache, step.pos, gate=gate[:, 0])  # [B, H, D]
        return linear(o.view(b, 1, self.num_heads * self.head_dim), self.o_proj)


class HybridCache:
    """Static decode state for `batch` sequences of up to `max_len` tokens, allocated once: per Gated-DeltaNet layer
    (conv [B, C, K], recurrent [B, HV, Dk, Dv] fp32), per attention layer (K, V [B, max_len, KVH, D]), each
    sequence's cached length (= the position of its next token) on the device, and the RoPE tables of positions
    0..max_len-1 (a decode step gathers its rows: no per-step cos/sin kernels)."""

    def __init__(self, model: "FastQwen35ForCausalLM", batch: int, max_len: int):
        device = model.device
        self.batch, self.max_len = batch, max_len
        self.states = [layer.new_state(batch, max_len) for layer in model.layers]
        self.lengths = torch.zeros(batch, dtype=torch.int64, device=device)  # [B]
        cos, sin = model.rope(torch.arange(max_len, device=device)[None])  # [1, L, R] each
        self.cos, self.sin = cos[0], sin[0]  # [L, R]


class FastQwen35ForCausalLM(nn.Module):
    """Qwen3.5 text model with packed weights; built from a transformers Qwen3_5ForCausalLM (which stays usable)."""

    def __init__(self, hf_model, device, dtype):
        super().__init__()
        text = getattr(hf_model.model, "language_model", hf_model.model)  # a vision-language model's text tower
        self.config = text.config
        rotary = text.rotary_emb
        if "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
            raise NotImplementedError(f"rope_type={rotary.rope_type!r}: only length-independent RoPE is supported")
        self.register_buffer("inv_freq", rotary.inv_freq.detach().float().to(device), persistent=False)  # [R/2]
        self.attention_scaling = rotary.attention_scaling
        self.embed_tokens = frozen(text.embed_tokens.weight, device, dtype)  # [V, D]
        tied = hf_model.lm_head.weight is text.embed_tokens.weight
        self.lm_head = self.embed_tokens if tied else frozen(hf_model.lm_head.weight, device, dtype)  # [V, D]
        self.norm = frozen(text.norm.weight, device, dtype)  # [D], same eps as the layers' norms (rms_norm_eps)
        kinds = {"linear_attention": DeltaNetLayer, "full_attention": AttentionLayer}
        self.layers = nn.ModuleList(kinds[kind](layer, device, dtype)
                                    for kind, layer in zip(self.config.layer_types, text.layers))

    @classmethod
    @torch.no_grad()
    def from_transformers(cls, hf_model, device=None, dtype=None) -> "FastQwen35ForCausalLM":
        """hf_model: a transformers Qwen3_5ForCausalLM, or a Qwen3_5ForConditionalGeneration (its text tower is
        used). device, dtype: None keeps the model's. The stock model stays where it is; weights already on `device`
        in `dtype` that need no packing are shared with it."""
        device = torch.device(device) if device is not None else hf_model.device
        return cls(hf_model, device, dtype)

    @classmethod
    def from_pretrained(cls, path_or_id: str, device=None, dtype=torch.bfloat16, **kwargs) -> "FastQwen35ForCausalLM":
        """Loads a Qwen3.5 checkpoint (local folder or hub id) through transformers on the CPU and converts it.
        Vision-language checkpoints load only their text weights (transformers maps model.language_model.* onto
        Qwen3_5ForCausalLM and skips the vision tower). device None: CUDA when available. kwargs go to
        transformers' from_pretrained (revision, local_files_only, ...)."""
        from transformers import Qwen3_5ForCausalLM

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        hf_model = Qwen3_5ForCausalLM.from_pretrained(path_or_id, dtype=dtype, **kwargs)
        return cls.from_transformers(hf_model, device=device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def new_cache(self, batch: int, max_len: int) -> HybridCache:
        return HybridCache(self, batch, max_len)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [B, S] int64 -> cos, sin [B, S, R] in the model's dtype (upstream: fp32, then cast)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, S, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(self.dtype), (emb.sin() * self.attention_scaling).to(self.dtype)

    def _layers(self, h: torch.Tensor, mix, states) -> torch.Tensor:
        """Embeddings [B, S, D] through every layer and the final norm; mix(layer, x, state) runs a token mixer."""
        first = self.layers[0]
        x, residual = rms_norm(h, first.input_norm, first.eps, zero_centered=True), h
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, state, next_norm in zip(self.layers, states, next_norms):
            h = mix(layer, x, state)
            x, residual = add_rms_norm(h, residual, layer.post_norm, layer.eps, zero_centered=True)
            h = layer.mlp(x)
            x, residual = add_rms_norm(h, residual, next_norm, layer.eps, zero_centered=True)
        return x

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] (no padding, no cache). Returns logits [B, T, vocab] in the model's dtype."""
        b, t = input_ids.shape
        input_ids = input_ids.to(self.device)
        cos, sin = self.rope(torch.arange(t, device=self.device).expand(b, t))
        h = self._layers(F.embedding(input_ids, self.embed_tokens),
                         lambda layer, x, state: layer(x, cos, sin), [None] * len(self.layers))
        return linear(h, self.lm_head)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: HybridCache, slot: int) -> torch.Tensor:
        """input_ids: [T], one sequence, from position 0: replaces whatever `slot` of the cache held.
        Returns the last token's logits [vocab] fp32."""
        t = input_ids.numel()
        if not 0 < t <= cache.max_len:
            raise ValueError(f"prompt length {t}: must be between 1 and the cache's max_len={cache.max_len}")
        if not 0 <= slot < cache.batch:
            raise ValueError(f"slot={slot}: the cache holds {cache.batch} sequences")
        ids = input_ids.to(self.device).view(1, t)
        cos, sin = self.rope(torch.arange(t, device=self.device)[None])
        states = [tuple(s[slot:slot + 1] for s in state) for state in cache.states]
        h = self._layers(F.embedding(ids, self.embed_tokens),
                         lambda layer, x, state: layer(x, cos, sin, state), states)
        cache.lengths[slot] = t
        return linear(h[0, -1], self.lm_head).float()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """tokens: [B] int64, one per cache slot, each at its sequence's position (its cached length, advanced by
        one). No host synchronization, step-independent shapes. Returns logits [B, vocab] fp32."""
        pos = cache.lengths  # [B]
        step = Step(cache.cos[pos][:, None], cache.sin[pos][:, None], pos)  # the same values rope(pos) gives
        h = self._layers(F.embedding(tokens[:, None], self.embed_tokens),
                         lambda layer, x, state: layer.decode(x, step, state), cache.states)
        cache.lengths += 1
        return linear(h[:, 0], self.lm_head).float()
