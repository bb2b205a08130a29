"""Rendering on a Ray cluster, for a user's own Ray Data pipeline: `ds.map_batches(Renderer, fn_constructor_kwargs=
{"spec": render_spec([...render's options...])}, num_gpus=1, compute=ray.data.ActorPoolStrategy(size=N),
batch_size=B)`. The stage itself lives in cli/ray_stage.py (it renders as `render` does); `render --engine ray`
drives it for a prompt file."""

from .cli.ray_stage import Renderer, RenderSpec, render_spec

__all__ = ["Renderer", "RenderSpec", "render_spec"]
