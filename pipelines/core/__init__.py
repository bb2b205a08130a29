"""What the model families share: options and the optimization registry, FP8 linears, LoRA, attention, checkpoints,
and the runtime of a call (forward context, graphs, runner, offload, parallelism, step-cache rules)."""
