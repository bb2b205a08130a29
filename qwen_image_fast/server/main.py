"""`qwen-image-fast serve`: every option checked before anything loads (exit 2, one line), then the engines start
(one process per GPU, or --engines on the CPU), then uvicorn serves the app on --host:--port.

SIGTERM (and Ctrl-C) drain: from the signal on every new request gets 503, the requests in flight finish, and the
process exits 0 once none is left (or after --drain-timeout seconds).
"""

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path

API_KEY_ENV = "QWEN_IMAGE_FAST_API_KEY"


def served_of(args, model: str, pipeline: str, shape):
    """What the loaded model takes (protocol.Served), from the command's options and the checkpoint's config."""
    from ..cli.inputs import PIPELINE_INPUTS, QWEN21_PIPELINE
    from ..cli.jobs import (ASPECTS, LIGHTNING_CFG, LIGHTNING_STEPS, MIN_STEPS, NEGATIVE_PROMPT, QWEN21_CFG,
                            QWEN21_SIDE, QWEN21_STEPS, REAL_CFG, REAL_STEPS, TINY_SIZE, TINY_STEPS)
    from .protocol import Served

    inputs = PIPELINE_INPUTS[pipeline]
    edits = inputs.fewest > 0
    tiny = shape is not None and shape.test_size
    if pipeline == QWEN21_PIPELINE:
        steps, cfg, size = QWEN21_STEPS, QWEN21_CFG, (QWEN21_SIDE, QWEN21_SIDE)
    else:
        steps, cfg = (LIGHTNING_STEPS, LIGHTNING_CFG) if args.lightning else (REAL_STEPS, REAL_CFG)
        size = ASPECTS["1:1"]
    if tiny:
        steps, size = TINY_STEPS, (TINY_SIZE, TINY_SIZE)
    largest = shape.largest_side() if shape is not None else args.max_side
    transformer_config = {}
    if model != "tiny-random":
        import diffusers

        try:
            transformer_config = diffusers.QwenImageTransformer2DModel.load_config(model, subfolder="transformer")
        except (OSError, ValueError):
            pass
    return Served(model=model, pipeline=pipeline, endpoint="edits" if edits else "generations",
                  default_size=None if inputs.size_from_image is not None else size,
                  size_refused=inputs.size_from_image == "refused", max_side=min(largest, args.max_side),
                  count_tokens=None if pipeline == QWEN21_PIPELINE else token_counter(model),
                  rgba=pipeline == QWEN21_PIPELINE, default_steps=steps,
                  default_cfg=cfg, default_negative=NEGATIVE_PROMPT, min_steps=MIN_STEPS,
                  guidance_embeds=bool(transformer_config.get("guidance_embeds", False)),
                  images=(inputs.fewest, inputs.most), mask=inputs.mask == "required",
                  loras=tuple(name for name, _ in args.lora), lora_dir=args.lora_dir,
                  step_cache=getattr(args, "cache", None) is not None)


CHAT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"  # what follows the prompt in Qwen-Image's chat templates


def token_counter(model: str):
    """The tokens of a prompt that max_sequence_length counts: Qwen-Image's pipelines tokenize it inside a chat
    template and drop the template's prefix, so the prompt and the template's suffix (special tokens and newlines,
    which the tokenizer never merges with the prompt's own tokens)."""
    if model == "tiny-random":
        from ..pipelines.tiny import tiny_tokenizer

        tokenizer = tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer")
    return lambda text: len(tokenizer(text + CHAT_SUFFIX).input_ids)


def engine_devices(args) -> list[str]:
    """One engine per visible GPU (or per --device / --engines on the CPU)."""
    import torch

    if args.device is not None:
        return [args.device] * (args.engines or 1)
    if torch.cuda.is_available():
        count = args.engines or torch.cuda.device_count()
        if count > torch.cuda.device_count():
            raise ValueError(f"--engines {count}: {torch.cuda.device_count()} GPU(s) here, one engine each")
        return [f"cuda:{i}" for i in range(count)]
    return ["cpu"] * (args.engines or 1)


def check_loras(args):
    from ..cli.loras import resolve_lora

    names = set()
    for name, path in args.lora:
        if name in names:
            raise ValueError(f"--lora {name}=...: the name {name!r} is given twice")
        names.add(name)
        resolve_lora(path, 1.0)  # ValueError naming a file that is not there or holds no LoRA
    if args.lora_dir is not None and not Path(args.lora_dir).is_dir():
        raise ValueError(f"--lora-dir {args.lora_dir}: not a folder")


def plan_serve(args):
    """Every option checked (ValueError naming the first that is wrong; nothing loads), then what serve_forever
    takes: (served, scheduler, metrics, image settings, API key)."""
    from ..cli.devices import check_kernels_on, resolve_device, with_memory_options
    from ..cli.inputs import PIPELINE_INPUTS, QWEN21_PIPELINE, check_pipeline_options
    from ..cli.models import check_model, pipeline_class, resolve_model, single_files
    from ..cli.parser import command_config
    from ..cli.sizes import SHRINKS_INPUTS, ModelShape
    from ..pipelines.tiny import CONDITION_AREA_DIVISOR
    from .engine import EngineSpec, Work
    from .metrics import Metrics
    from .scheduler import Scheduler

    check_model(args.model)
    files = single_files(args)  # --model FILE: its configs and other components from --base
    devices = engine_devices(args)
    device = resolve_device(devices[0], 0, None)
    model, _ = resolve_model(args.model, device)
    source = files.base if files else model  # where the configs and the tokenizer are read
    config = command_config(args)
    check_kernels_on(device, config)
    pipeline = pipeline_class(source)
    if pipeline not in PIPELINE_INPUTS:
        raise ValueError(f"--model {model} is a {pipeline} checkpoint; serve runs {', '.join(PIPELINE_INPUTS)}")
    check_pipeline_options(pipeline, source, config, lightning=args.lightning, fmt="png")
    config = with_memory_options(config, args.max_memory, args.preset, pipeline, None, args.max_batch, "--max-batch")
    if files is not None:  # each file's header read: a wrong or broken file is refused before anything starts
        files.check(config, pipeline)
    check_loras(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    shape = ModelShape.of(source, pipeline)
    served = served_of(args, source, pipeline, shape)
    if config.max_memory_gib is not None:  # what the budget is planned for (memory.check_within_plan): 400 beyond
        from ..pipelines.loading import memory_plan

        plan = memory_plan(pipeline)
        served = dataclasses.replace(served, max_steps=plan.steps, max_pixels=plan.side ** 2)
        if pipeline == QWEN21_PIPELINE:  # its plan's prefix (qwen_image21/memory.py): a longer prompt is a 400
            from ..pipelines.qwen_image21.memory import PLANNED_TEXT_TOKENS
            from ..pipelines.qwen_image21.pipeline import prefix_token_counter

            served = dataclasses.replace(served, count_tokens=prefix_token_counter(source),
                                         max_prompt_tokens=PLANNED_TEXT_TOKENS,
                                         prompt_limit="this server's --max-memory is planned for prompts of at "
                                                      "most {limit} tokens")
    settings = dict(model=files.label if files else model, preset=args.preset,
                    endpoint=f"/v1/images/{served.endpoint}")
    warm_up = {} if served.endpoint == "edits" else dict(
        width=served.default_size[0], height=served.default_size[1], steps=served.min_steps, cfg=served.default_cfg,
        guidance_scale=None, works=(Work("warm-up", served.default_negative if served.default_cfg > 1 else None, 0,
                                         "png", 100, {}),))
    shrink = CONDITION_AREA_DIVISOR if shape is not None and shape.test_size and pipeline in SHRINKS_INPUTS else None
    specs = [EngineSpec(model=model, preset=args.preset, config=config, device=d, loras=tuple(args.lora), files=files,
                        lora_dir=args.lora_dir, lightning=args.lightning, max_memory=args.max_memory,
                        warm_up=warm_up, shrink_inputs=shrink) for d in devices]
    metrics = Metrics()
    scheduler = Scheduler(specs, args.max_batch, args.max_wait_ms / 1000, args.max_queue, metrics)
    return served, scheduler, metrics, settings, api_key


def serve_forever(args, served, scheduler, metrics, settings, api_key) -> int:
    import uvicorn

    from .app import ServerState, create_app

    state = ServerState(served=served, scheduler=scheduler, metrics=metrics, settings=settings, api_key=api_key,
                        request_timeout_s=args.request_timeout, max_body_bytes=int(args.max_body_mb * (1 << 20)))

    @contextlib.asynccontextmanager
    async def engines(app):
        await scheduler.start()
        yield
        scheduler.stop()

    app = create_app(state, lifespan=engines)

    class Server(uvicorn.Server):
        """uvicorn's server, draining on SIGTERM / SIGINT: 503 for new requests, in-flight ones finish first."""

        def handle_exit(self, sig, frame):
            if state.draining:  # a second signal: stop now
                return super().handle_exit(sig, frame)
            state.draining = True
            self.drain_task = asyncio.get_event_loop().create_task(drain())

    async def drain():
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.drain_timeout
        while scheduler.in_flight() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        server.should_exit = True

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                                   timeout_graceful_shutdown=args.drain_timeout))
    print(f"serving {served.model} ({served.pipeline}, /v1/images/{served.endpoint}) on "
          f"http://{args.host}:{args.port} with {len(scheduler.specs)} engine(s) on "
          f"{', '.join(spec.device for spec in scheduler.specs)}; ready at /health once warmed up"
          + ("; API key required" if api_key else ""), flush=True)
    server.run()
    return 0 if server.started else 1
