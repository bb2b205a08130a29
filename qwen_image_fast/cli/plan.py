"""--dry-run: what a render command would run, decided by the registry (optimizations.py) from what the command
line says (the checkpoint's pipeline class, the device, the options), before anything loads."""

from ..pipelines.core.config import FastConfig
from ..pipelines.core.optimizations import CFG_ONLY, QWEN21, Facts, plans
from .models import STOCK_PRESET, TINY_MODEL_ID, Labels
from .option_names import option_of


def command_facts(config: FastConfig, labels: Labels, pipeline: str, device, shape, loaded: tuple = ()) -> Facts:
    """The Facts a pipeline built by this command would have (no offload hooks: the command adds none); loaded:
    what loading a --model file will do (SingleFiles.plan)."""
    import torch

    from ..pipelines.core.gpu_support import fp8_gemm_why_not
    from ..pipelines.core.model.attention import resolve_backend
    from ..pipelines.core.model.fp8_attention import KERNELS, LSE_KERNELS, fp8_attention_kernel

    fused = config.fused_transformer
    fp8_why = fp8_gemm_why_not(device) if fused and config.fp8 else None
    fp8 = fused and config.fp8 and fp8_why is None
    dtype = torch.float32 if labels.model == TINY_MODEL_ID else torch.bfloat16
    parallel = () if shape is None else ((("cfg2",) if shape.cfg > 1 else ())
                                         + ((f"ulysses{shape.ulysses}",) if shape.ulysses > 1 else ()))
    kernels = LSE_KERNELS if pipeline == QWEN21 else KERNELS  # 2.1 merges two calls (qwen_image21/block.py)
    fp8_attention, why = fp8_attention_kernel(config.fp8_attention, device, dtype, kernels) if fused else (None, None)
    return Facts(pipeline=pipeline, fused=fused, device=device.type, fp8=fp8, fast_accum=fp8 and config.fp8_fast_accum,
                 fp8_why=fp8_why,
                 fp8_attention=fp8_attention, fp8_attention_why=why,
                 attention=resolve_backend(config.attention, device, dtype) if fused else None, offload_hooks=False,
                 vae_2d=None, enhancer=labels.enhancer is not None,
                 parallel=parallel, loaded=loaded if fused else ())


def dry_run_report(config: FastConfig, labels: Labels, pipeline: str, device, shape, jobs, files=None) -> str:
    """files: --model FILE's (SingleFiles): what each file is, and what loading will keep, dequantize, requantize."""
    with_cfg = sum(job.cfg > 1 and job.negative_prompt is not None for job in jobs)
    sizes = ", ".join(dict.fromkeys(("sized from the input image" if job.width is None else
                                     f"{job.width}x{job.height}") + f" in {job.steps} steps" for job in jobs))
    lines = [f"dry run: model {labels.model} ({pipeline}), preset {labels.preset}, device {device}; {len(jobs)} "
             f"image(s) ({sizes}), {with_cfg} with CFG; nothing loaded or written"]
    if device.type == "cuda":
        from ..pipelines.core.gpu_support import describe_gpu

        lines.append(describe_gpu(device))
    if labels.preset == STOCK_PRESET:
        return "\n".join(lines + ["diffusers' own pipeline runs, untouched: none of the optimizations below"])
    rows = [("optimization", "option", "runs", "kind", "bound, or why it does not run")]
    loaded = files.plan(config, pipeline) if files is not None else None
    facts = command_facts(config, labels, pipeline, device, shape, loaded.applied if loaded else ())
    for opt, plan in plans(config, facts):
        runs = ", ".join(opt.label(value) for value in plan.values) if plan.values else "no" if plan.why_not else "off"
        if plan.values and opt.name in CFG_ONLY and with_cfg < len(jobs):
            runs += f" ({with_cfg} of {len(jobs)} images have CFG)" if with_cfg else " (no image has CFG: no)"
        note = plan.why_not or (describe(opt.bound) if opt.bound and plan.values else "")
        rows.append((opt.name, option_of(opt), runs, opt.kind, note))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(lines + ["  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4]
                              for row in rows] + (files.describe(loaded) if files is not None else []))


def describe(bound) -> str:
    tiny = f"<= {bound.tiny:g} (tiny fp32 config), " if bound.tiny is not None else ""
    return (f"final latents rel-RMS vs stock {tiny}<= {bound.full:g} and PSNR >= {bound.full_psnr_db:g} dB (real "
            "shapes, random weights)")
