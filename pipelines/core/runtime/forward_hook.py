"""The hook on a fast transformer's forward (diffusers' hooks/ pattern: the module holds its hook, the rule is in the
hook's one method). While a fast pipeline's call runs, its runner's CallRun (runner.py) sits on the transformer,
and a forward that a diffusers loop calls goes through CallRun.new_forward (batched CFG by speculation, CUDA graphs);
with no hook the forward computes directly. A hook, not the forward context, so that the context holds only data.
"""

import contextlib


class HookedForward:
    """Mixin of a fast transformer: the hook its forward goes through (None: it computes)."""

    fast_forward_hook = None  # an object with new_forward(inputs: dict) -> the forward's output


@contextlib.contextmanager
def hook_on(module: HookedForward, hook):
    """`hook` on module's forward for the duration of the block (None: none), the previous one restored after."""
    previous = module.fast_forward_hook
    module.fast_forward_hook = hook
    try:
        yield
    finally:
        module.fast_forward_hook = previous
