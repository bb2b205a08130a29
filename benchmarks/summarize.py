"""Print markdown tables of the latest benchmark rows (kernels per op/shape/impl, transformer per impl/shape,
pipeline per variant/size, text per impl/batch/prompt, M=1 GEMV per op/impl) from results/*.jsonl, for
benchmarks/RESULTS.md.

    python3 benchmarks/summarize.py
"""

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def latest(name: str, key) -> dict:
    """The newest row of results/<name>.jsonl per key, among the rows of bench `name` (transformer.jsonl also
    holds bench_transformer --profile's "transformer-profile" rows, of other fields)."""
    rows = {}
    for line in (RESULTS / f"{name}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("bench", name) != name:
            continue
        k = key(row)
        if k not in rows or row.get("date", "") >= rows[k].get("date", ""):  # the newest run wins
            rows[k] = row
    return rows


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def kernels_table() -> str:
    rows = latest("kernels", lambda r: (r["op"], r["shape"], r["impl"]))
    ops = dict.fromkeys((op, shape) for op, shape, _ in rows)
    out = ["| op | shape | eager ms | compile ms | ours ms | ours GB/s | % of copy | vs compile | rel_err | commit |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for op, shape in ops:
        if op.startswith("gemm_"):
            continue
        e, c, t = (rows.get((op, shape, impl), {}) for impl in ("eager", "compile", "triton"))
        speedup = c["ms"] / t["ms"] if c.get("ms") and t.get("ms") else None
        pct = 100 * t["frac_of_copy_bw"] if t.get("frac_of_copy_bw") else None
        out.append(f"| {op} | {shape} | {fmt(e.get('ms'), '.4f')} | {fmt(c.get('ms'), '.4f')} | "
                   f"{fmt(t.get('ms'), '.4f')} | {fmt(t.get('gbps'), '.0f')} | {fmt(pct, '.0f')}% | "
                   f"{fmt(speedup, '.2f')}x | {fmt(t.get('rel_err'), '.1e')} | {t.get('commit')} |")
    out += ["", "| GEMM (M=8628) | shape | bf16 F.linear ms | TF/s | fp8_linear ms | TF/s | fp8 rel_err |",
            "|---|---|---|---|---|---|---|"]
    for op, shape in ops:
        if op.startswith("gemm_"):
            b, f = rows[(op, shape, "bf16_linear")], rows[(op, shape, "fp8_linear")]
            out.append(f"| {op} | {shape} | {fmt(b['ms'], '.3f')} | {fmt(b['tflops'], '.0f')} | {fmt(f['ms'], '.3f')} | "
                       f"{fmt(f['tflops'], '.0f')} | {fmt(f['rel_err'], '.1e')} |")
    return "\n".join(out)


def transformer_table() -> str:
    rows = latest("transformer", lambda r: (r["impl"], r["attention"], r["resolution"], r["batch"], r["padded_text"]))
    out = ["| impl | attention | resolution | B | padded text | ms | TF/s | rel_err vs eager | peak GiB | x floor "
           "| commit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        out.append(f"| {r['impl']} | {r['attention']} | {r['resolution']} | {r['batch']} | {r['padded_text']} | "
                   f"{r['ms']:.1f} | {r['tflops']:.0f} | {r['rel_err']:.2e} | {r['peak_gib']:.1f} | "
                   f"{r['ms_over_floor']:.2f} | {r['commit']} |")
    return "\n".join(out)


def pipeline_table() -> str:
    rows = latest("pipeline", lambda r: (r["variant"], r["resolution"], r["steps"], r.get("tokenizer", "byte-level")))
    out = ["| pipeline | size | steps | text tokenizer | s / image | ms / step | VAE ms | peak GiB | latent rel_err "
           "| PSNR dB | commit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (variant, resolution, steps, tokenizer), r in rows.items():
        out.append(f"| {r['impl']} {variant} | {resolution} | {steps} | {tokenizer} | {r['seconds']:.2f} | "
                   f"{r['ms_per_step']:.1f} | {r['vae_ms']:.1f} | {fmt(r['peak_gib'], '.1f')} | "
                   f"{fmt(r['latent_rel_err'], '.2e')} | {fmt(r['psnr'], '.1f')} | {r['commit']} |")
    return "\n".join(out)


def text_table() -> str:
    rows = latest("text", lambda r: (r["impl"], r["batch"], r["prompt_tokens"], r.get("case"),
                                     r.get("decode_tok_s") is None))
    out = ["| impl | case | B | prompt tokens | decode tok/s | decode timing | floor tok/s | prefill ms | seconds "
           "| commit |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        # rows before per-step timestamps took the difference of two generate lengths: prefill jitter leaks in,
        # badly at B > 1 (see RESULTS.md)
        method = r.get("decode_method") or ("two-length, unsound" if r["batch"] > 1 else "two-length")
        out.append(f"| {r['impl']} | {r.get('case') or '-'} | {r['batch']} | {r['prompt_tokens']} | "
                   f"{fmt(r.get('decode_tok_s'), '.1f')} | {method if r.get('decode_tok_s') else '-'} | "
                   f"{fmt(r.get('floor_tok_s'), '.0f')} | "
                   f"{fmt(r.get('prefill_ms'), '.2f')} | {fmt(r.get('seconds'), '.3f')} | {r['commit']} |")
    return "\n".join(out)


def gemv_table() -> str:
    rows = latest("gemv", lambda r: (r["op"], r["impl"]))
    out = ["| op | shape | impl | us | GB/s | copy % | rel_err | commit |", "|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        out.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {fmt(r.get('us'), '.2f')} | {fmt(r.get('gbps'), '.0f')} "
                   f"| {fmt(r.get('fraction_of_copy') and 100 * r['fraction_of_copy'], '.0f')} | "
                   f"{fmt(r.get('rel_err'), '.1e')} | {r['commit']} |")
    return "\n".join(out)


if __name__ == "__main__":
    print("## Kernels\n")
    print(kernels_table())
    print("\n## Transformer\n")
    print(transformer_table())
    print("\n## Pipeline\n")
    print(pipeline_table())
    print("\n## Text\n")
    print(text_table())
    print("\n## GEMV (M=1)\n")
    print(gemv_table())
