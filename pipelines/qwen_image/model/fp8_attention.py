"""FP8 attention on Hopper, on the operands qkv_pack (q, k: FP8 with the RMSNorm bound's per-tensor scales) and
quantize_fp8_heads (v) wrote into the joint [B, S, H, D] buffers; a padded prompt's keys at the end of each sample,
counted out by seqused_k (attention.py).

    fa3    FlashAttention-3's FP8 forward (PyPI `tokenspeed-fa3`, module `flash_attn_interface`): descales per
           (sample, head) [B, H], BF16 output [B, S, H, D] (the output projection's rowwise quantization as today).
    cudnn  cuDNN's FP8 SDPA (PyPI `nvidia-cudnn-frontend`, a pygraph per shape): per-tensor descales; on Hopper the
           output is FP8 only. Its scale is v's: each output row is a convex combination of v's rows, so
           |o| <= max|v|, and o's codes are o / v_scale within +-448 without an amax pass.
Softmax scale 1/sqrt(D), non-causal, P (the probabilities) quantized with scale 448 inside cuDNN's kernel.
"""

import importlib.util
import math
from functools import cache

import torch

FP8_ATTENTION_KERNELS = ("fa3", "cudnn")


@cache
def fa3_available() -> bool:
    return importlib.util.find_spec("flash_attn_interface") is not None


@cache
def cudnn_fp8_available() -> bool:
    return importlib.util.find_spec("cudnn") is not None


def fp8_attention_fa3(q8, k8, v8, q_scale, k_scale, v_scales, seqused_k) -> torch.Tensor:
    """q8, k8, v8: FP8 [B, S, H, D]; q_scale, k_scale: fp32 [1]; v_scales: fp32 [B, H]; seqused_k: int32 [B].
    Returns BF16 [B, S, H, D] (a new tensor: the package's custom op refuses an output buffer it is given)."""
    from flash_attn_interface import _flash_attn_forward

    b, _, h, d = q8.shape
    descales = [t.expand(b, h).contiguous() for t in (q_scale, k_scale)]
    out, *_ = _flash_attn_forward(q8, k8, v8, seqused_k=seqused_k, q_descale=descales[0], k_descale=descales[1],
                                  v_descale=v_scales, softmax_scale=1 / math.sqrt(d))
    return out


class CudnnFp8Attention:
    """cuDNN FP8 SDPA graphs by shape (built once each, on the device of the first call)."""

    P_SCALE = 448.0  # the probabilities [0, 1] -> e4m3 codes [0, 448]

    def __init__(self):
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
            graph.build([cudnn.heur_mode.A])
            workspace = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=device)
            constants = dict(descale_s=torch.full((1,), 1 / self.P_SCALE, device=device),
                             scale_s=torch.full((1,), self.P_SCALE, device=device),
                             seq_len_q=torch.full((b,), s, dtype=torch.int32, device=device),
                             amax=torch.empty(2, dtype=torch.float32, device=device))
            self.graphs[key] = (graph, handle, dict(q=q, k=k, v=v, o=o, amax_s=amax_s, amax_o=amax_o, **scalars,
                                                    **lens), workspace, constants)
        return self.graphs[key]

    def __call__(self, q8, k8, v8, q_scale, k_scale, v_scale, seqused_k, out8) -> torch.Tensor:
        """q8, k8, v8, out8: FP8 [B, S, H, D]; q_scale, k_scale, v_scale: fp32 [1] (v_scale also o's); seqused_k:
        int32 [B]. Returns out8 (o ~= out8 * v_scale)."""
        import cudnn

        graph, handle, t, workspace, c = self._graph(*q8.shape[:2], *q8.shape[2:], q8.device)
        cudnn.set_stream(handle, torch.cuda.current_stream(q8.device).cuda_stream)
        scale_o = 1.0 / v_scale
        graph.execute({t["q"]: q8, t["k"]: k8, t["v"]: v8, t["o"]: out8, t["descale_q"]: q_scale,
                       t["descale_k"]: k_scale, t["descale_v"]: v_scale, t["descale_s"]: c["descale_s"],
                       t["scale_s"]: c["scale_s"], t["scale_o"]: scale_o, t["seq_len_q"]: c["seq_len_q"],
                       t["seq_len_kv"]: seqused_k, t["amax_s"]: c["amax"][:1], t["amax_o"]: c["amax"][1:]},
                      workspace, handle=handle)
        return out8
