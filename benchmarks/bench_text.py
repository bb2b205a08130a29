"""Qwen3.5 text benchmark (GPU): transformers' generate (eager, with fla-core when installed), transformers'
generate with a static cache + torch.compile, and ours (FastQwen35ForCausalLM + generate with a CUDA-graph step).

    python3 benchmarks/bench_text.py [--impls ours,hf-eager,hf-compile] [--batches 1,8] [--out DIR]   # on a GPU
    python3 benchmarks/bench_text.py --profile --impls ours --batches 1 --out DIR   # + kernel tables (DIR/*.txt)
    python3 benchmarks/bench_text.py --tiny                                                          # CPU logic check

Model: the Qwen3.5-9B shape (transformers' default Qwen3_5TextConfig: hidden 4096, 32 layers, vocab 248320) with
random bf16 weights (transformers' init, std 0.02), one copy shared by the HF impls and packed into ours.
Correctness gate, before any timing: logits of a 128-token prefill and 8 cached greedy decode steps, ours and HF
bf16 both against an fp32 copy of the model; ours must be within 2x of HF bf16's own error (+1e-3), and on CUDA
the graph-replayed decode must pick the eager decode's greedy tokens; otherwise no speed is reported (the
4B-shaped enhancer model passes the same gate). On CUDA, fla-core must be installed (else ours' prefill would be
the PyTorch reference). Then, with 128-token random prompts:
  decode tok/s: B * (N - 1) / (time from the first generated token to the last), from per-step host timestamps
      (ours: generate's stream callback; HF: a streamer), N = 64 new tokens, greedy, no stop token, median of 3
      after a warm-up; prefill is outside the interval (an earlier version timed two generate lengths and took
      the difference: the B=8 prefill's jitter did not cancel and gave impossible B=8 rates);
  prefill ms: one 128- and one 2048-token prompt (ours: prefill into a cache slot; HF: forward with
      logits_to_keep=1), median of 5 after warm-up;
  floor tok/s: B / (bytes a decode step must move / device-to-device copy bandwidth measured in this run), bytes =
      every weight read once (the embedding row only) + recurrent and conv states read and written + the KV cache
      read at the mean context.
Last, the prompt-enhancer case: a 4B-shaped Qwen3.5 (our guess of the released 4B: hidden 2560, 32 layers,
MLP 9216, tied embeddings; no checkpoint can be read here), one ~300-token chat prompt, 200 new tokens,
end to end (prefill + decode), ours only.
Rows go to results/text.jsonl.
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, copy_bandwidth_gbps, environment, sync  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.qwen35 import FastQwen35ForCausalLM, generate  # noqa: E402
from qwen_image_fast.pipelines.qwen35.model import fla_chunk_gated_delta_rule  # noqa: E402

IMPLS = ("ours", "hf-eager", "hf-compile")
PROMPT_TOKENS = 128
PREFILL_TOKENS = (128, 2048)
GATE_DECODE_STEPS = 8
REPEATS = 3  # timed runs after a warm-up (median)
WARM_UP = True  # off in the tiny CPU run: no graph to capture there
CONFIG_4B = dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                 tie_word_embeddings=True)
TINY_CONFIG = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=512)


def build_hf(config_kwargs: dict, device, dtype):
    """transformers' Qwen3_5ForCausalLM with its own random init, built on `device`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**config_kwargs)
    with torch.device(device):
        model = Qwen3_5ForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


def seconds(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)  # [B, T] int64 on the CPU


# ---- correctness gate


@torch.no_grad()
def gate(hf, ours, vocab: int, device) -> dict:
    """rel-RMS of ours and of HF bf16 against HF in fp32: prefill logits, then GATE_DECODE_STEPS cached steps
    (the tokens ours picks greedily, teacher-forced through both HF models without a cache). On CUDA the timed
    path, the CUDA-graph decode step, must also pick the same greedy tokens as the eager one."""
    prompt = random_prompts(1, PROMPT_TOKENS, vocab, seed=1)[0]
    new = generate(ours, [prompt.tolist()], GATE_DECODE_STEPS, cuda_graph=False)[0]
    graph_same = device.type != "cuda" or generate(ours, [prompt.tolist()], GATE_DECODE_STEPS)[0] == new
    cache = ours.new_cache(1, PROMPT_TOKENS + GATE_DECODE_STEPS)
    logits = [ours.prefill(prompt, cache, 0)]
    for token in new[:-1]:
        logits.append(ours.decode(torch.tensor([token], device=device), cache)[0])
    ours_logits = torch.stack(logits)  # [1 + steps - 1, V] fp32: the positions that predicted `new`
    ids = torch.cat([prompt, torch.tensor(new[:-1], dtype=torch.int64)])[None].to(device)
    keep = len(new)
    hf_bf16 = hf(ids, logits_to_keep=keep).logits[0].float()
    hf32 = copy.deepcopy(hf).float()
    ref = hf32(ids, logits_to_keep=keep).logits[0]
    del hf32
    if device.type == "cuda":
        torch.cuda.empty_cache()
    err_ours, err_hf = rel_rms_error(ours_logits, ref), rel_rms_error(hf_bf16, ref)
    return dict(gate_err_ours=err_ours, gate_err_hf_bf16=err_hf, gate_graph_tokens_equal=graph_same,
                gate_ok=err_ours <= 2 * err_hf + 1e-3 and graph_same)


def check_gate(hf, ours, vocab: int, device, name: str) -> dict:
    checked = gate(hf, ours, vocab, device)
    print(f"gate ({name}): ours {checked['gate_err_ours']:.3e}, HF bf16 {checked['gate_err_hf_bf16']:.3e} rel-RMS "
          f"vs HF fp32, graph tokens equal {checked['gate_graph_tokens_equal']} "
          f"-> {'ok' if checked['gate_ok'] else 'FAILED: no speed reported'}", flush=True)
    if not checked["gate_ok"]:
        sys.exit(1)
    return checked


# ---- timing


def ours_generate(ours, cache_len):
    def run(prompts: torch.Tensor, n: int) -> list[float]:
        """Generates n tokens per prompt; returns the host time at which each step's tokens were read (each read
        waits for its step)."""
        stamps = []
        generate(ours, prompts.tolist(), n, max_cache_len=cache_len,
                 stream=lambda step, tokens: stamps.append(time.perf_counter()))
        return stamps
    return run


def hf_generate(hf, cache_len, compiled: bool):
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """put() gets the prompt, then each step's tokens on the host (after the step)."""

        def __init__(self):
            self.stamps = []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            pass

    extra = dict(cache_implementation="static", max_cache_len=cache_len) if compiled else dict(disable_compile=True)

    def run(prompts: torch.Tensor, n: int) -> list[float]:
        ids = prompts.to(hf.device)
        streamer = Stamps()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0, streamer=streamer, **extra)
        return streamer.stamps[1:]  # drop the prompt's
    return run


def decode_tok_s(run, batch: int, vocab: int, n: int) -> float:
    """batch * (n - 1) tokens over the time from the first generated token (after prefill) to the last: the decode
    steps alone, median of REPEATS runs after a warm-up (compiles, captures graphs, allocates the cache)."""
    prompts = random_prompts(batch, PROMPT_TOKENS, vocab, seed=2)
    if WARM_UP:
        run(prompts, n)
    rates = []
    for _ in range(REPEATS):
        stamps = run(prompts, n)
        assert len(stamps) == n, f"{len(stamps)} step times for {n} new tokens"
        rates.append(batch * (n - 1) / (stamps[-1] - stamps[0]))
    return statistics.median(rates)


def prefill_ms(impl: str, model, tokens: int, vocab: int, device) -> float:
    ids = random_prompts(1, tokens, vocab, seed=3)
    if impl == "ours":
        cache = model.new_cache(1, tokens)
        fn = lambda: model.prefill(ids[0], cache, 0)  # noqa: E731
    else:
        ids = ids.to(device)
        fn = lambda: model(ids, logits_to_keep=1, use_cache=False)  # noqa: E731
    fn()
    return 1000 * statistics.median(seconds(fn, device) for _ in range(5))


def decode_bytes(ours: FastQwen35ForCausalLM, batch: int, context: int) -> int:
    """Bytes one decode step must move: weights once (one embedding row per sequence), states read + written,
    the KV cache read over `context` tokens."""
    weights = sum(p.numel() * p.element_size() for name, p in ours.named_parameters() if name != "embed_tokens")
    if ours.lm_head is ours.embed_tokens:
        weights += ours.lm_head.numel() * ours.lm_head.element_size()
    cache = ours.new_cache(batch, 1)
    state = 0
    for layer, (a, b) in zip(ours.layers, cache.states):
        if hasattr(layer, "num_v_heads"):  # Gated-DeltaNet: conv + recurrent state, read and written
            state += 2 * (a.numel() * a.element_size() + b.numel() * b.element_size())
        else:  # attention: K and V read over the context
            state += 2 * batch * context * layer.num_kv_heads * layer.head_dim * a.element_size()
    return weights + state + batch * ours.embed_tokens.shape[1] * ours.embed_tokens.element_size()


# ---- profile


def profile_ours(ours, vocab: int, out_dir: Path | None) -> str:
    """Kernel tables of ours: 8 eager decode steps at B=1 (beside the graph-replayed step time) and the 128- and
    2048-token prefills (host time against device time: the launches, not the math, bound a short prefill)."""
    from torch.profiler import ProfilerActivity, profile

    from qwen_image_fast.pipelines.qwen35.generate import Sampling, decoder_for

    decoder = decoder_for(ours, 1, 512, cuda_graph=True)
    decoder.prepare(Sampling())
    ours.prefill(random_prompts(1, PROMPT_TOKENS, vocab, seed=5)[0], decoder.cache, 0)
    replay_ms = 1000 * statistics.median(seconds(lambda: decoder.step(Sampling()), ours.device) for _ in range(20))
    cache = ours.new_cache(1, 512)
    ours.prefill(random_prompts(1, PROMPT_TOKENS, vocab, seed=5)[0], cache, 0)
    tokens = torch.zeros(1, dtype=torch.int64, device=ours.device)
    sections = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            ours.decode(tokens, cache)
        torch.cuda.synchronize()
    events = prof.key_averages()
    sections.append(f"decode B=1: graph replay {replay_ms:.3f} ms per step; below, 8 eager steps (an operator row's "
                    f"device time repeats its kernels' rows; the foot's totals count each kernel once)\n"
                    + events.table(sort_by="self_device_time_total", row_limit=25))
    for n_tokens in PREFILL_TOKENS:
        ids = random_prompts(1, n_tokens, vocab, seed=6)[0]
        cache = ours.new_cache(1, n_tokens)
        ours.prefill(ids, cache, 0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ours.prefill(ids, cache, 0)
            torch.cuda.synchronize()
        events = prof.key_averages()
        sort = "self_device_time_total" if n_tokens > PROMPT_TOKENS else "self_cpu_time_total"
        sections.append(f"prefill {n_tokens} tokens (host and device totals at the foot of the table)\n"
                        + events.table(sort_by=sort, row_limit=25))
    text = "\n\n".join(sections)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"profile_text_ours_{os.environ.get('BENCH_COMMIT', 'local')}.txt").write_text(text)
    return text


# ---- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {', '.join(IMPLS)}")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tiny", action="store_true", help="tiny random model on the CPU (logic check)")
    parser.add_argument("--profile", action="store_true", help="also print kernel tables of ours (GPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        parser.error(f"--impls: unknown {unknown}; allowed: {', '.join(IMPLS)}")
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:  # the interpreter runs ours' recurrences (~1 s a decode step): short prompts, few steps, batch
        # 1, one timed run each; no CPU compile of HF's decode
        global PROMPT_TOKENS, GATE_DECODE_STEPS, REPEATS, WARM_UP
        PROMPT_TOKENS, GATE_DECODE_STEPS, REPEATS, WARM_UP, batches = 16, 3, 1, False, [1]
        impls = [i for i in impls if i != "hf-compile"]
    env = {} if args.tiny else environment()
    bandwidth = None if args.tiny else copy_bandwidth_gbps()
    new_tokens = 3 if args.tiny else 64
    cache_len = PROMPT_TOKENS + new_tokens + 8

    hf = build_hf(TINY_CONFIG if args.tiny else {}, device, dtype)
    ours = FastQwen35ForCausalLM.from_transformers(hf, device=device)
    vocab = hf.config.vocab_size
    if device.type == "cuda" and fla_chunk_gated_delta_rule() is None:
        sys.exit("fla-core is not installed: ours would time the PyTorch chunked reference as its prefill")
    checked = check_gate(hf, ours, vocab, device, "tiny" if args.tiny else "9B")
    base = dict(env, bench="text", model="Qwen3.5-9B shape, random weights", copy_gbps=bandwidth,
                decode_method="per-step", **checked)
    rows = []

    def emit(row):
        rows.append(row)
        if not args.tiny:
            append_results("text", [row], args.out)
        if row.get("case") == "enhance":
            print(f"enhance: {row['prompt_tokens']}-token prompt + {row['new_tokens']} new tokens, {row['model']}: "
                  f"{row['seconds']:.3f} s", flush=True)
            return
        floor = f"  floor {row['floor_tok_s']:.0f} tok/s ({row['fraction_of_floor']:.0%})" if row.get("floor_tok_s") else ""
        value = (f"decode {row['decode_tok_s']:8.1f} tok/s" if row.get("decode_tok_s") is not None
                 else f"prefill {row['prefill_ms']:8.2f} ms")
        print(f"{row['impl']:10} B={row['batch']:<2} prompt {row['prompt_tokens']:5d}  {value}{floor}", flush=True)

    runners = {"ours": lambda: ours_generate(ours, cache_len), "hf-eager": lambda: hf_generate(hf, cache_len, False),
               "hf-compile": lambda: hf_generate(hf, cache_len, True)}
    for impl in impls:
        run = runners[impl]()
        for batch in batches:
            tok_s = decode_tok_s(run, batch, vocab, new_tokens)
            floor = (None if bandwidth is None else
                     batch * bandwidth * 1e9 / decode_bytes(ours, batch, PROMPT_TOKENS + new_tokens // 2))
            emit(dict(base, impl=impl, batch=batch, prompt_tokens=PROMPT_TOKENS, new_tokens=new_tokens,
                      decode_tok_s=tok_s, prefill_ms=None, floor_tok_s=floor,
                      fraction_of_floor=None if floor is None else tok_s / floor))
        if impl != "hf-compile":  # compiled prefill is not what generate's compile covers
            for tokens in PREFILL_TOKENS if not args.tiny else (8,):
                emit(dict(base, impl=impl, batch=1, prompt_tokens=tokens, decode_tok_s=None,
                          prefill_ms=prefill_ms(impl, ours if impl == "ours" else hf, tokens, vocab, device)))
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if args.profile and device.type == "cuda":
        print(profile_ours(ours, vocab, args.out), flush=True)

    if "ours" in impls:  # the prompt-enhancer case, on a 4B-shaped model
        del ours, hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf4 = build_hf(TINY_CONFIG if args.tiny else CONFIG_4B, device, dtype)
        ours4 = FastQwen35ForCausalLM.from_transformers(hf4, device=device)
        checked4 = check_gate(hf4, ours4, hf4.config.vocab_size, device, "tiny" if args.tiny else "4B-shaped")
        del hf4
        params = sum(p.numel() for p in ours4.parameters())
        prompt = random_prompts(1, 32 if args.tiny else 300, ours4.embed_tokens.shape[0], seed=4)
        new_tokens = 4 if args.tiny else 200
        run = ours_generate(ours4, 512)
        if WARM_UP:
            run(prompt, new_tokens)  # warm-up and graph capture
        total = statistics.median(seconds(lambda: run(prompt, new_tokens), device) for _ in range(REPEATS))
        emit(dict(env, bench="text", impl="ours", case="enhance", model=f"4B-shaped guess, {params / 1e9:.2f}B params, "
                  "random weights", batch=1, prompt_tokens=prompt.shape[-1], new_tokens=new_tokens, seconds=total,
                  decode_tok_s=None, prefill_ms=None, **checked4))


if __name__ == "__main__":
    main()
