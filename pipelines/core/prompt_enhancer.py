"""Prompt enhancers by name, for the pipelines that rewrite prompts before encoding them (enhance_prompt=).

The core holds how a name becomes an enhancer; the package above the families (pipelines/__init__.py) registers
the loader of the family that provides them (qwen35/enhance.py load_enhancer), so the 2512 pipeline, which takes
enhance_prompt=True or a checkpoint, imports no other family. An enhancer is any object with an
enhance(prompts: list[str]) -> list[str] method.
"""

import os

_loader = None  # (True | a checkpoint path or hub id, device) -> an enhancer


def register_loader(loader):
    """The function that loads an enhancer from True (the default checkpoint) or a checkpoint path or hub id."""
    global _loader
    _loader = loader


def resolve_enhancer(enhance_prompt, device=None):
    """None / False: no enhancer. An object with an enhance(prompts) method (a PromptEnhancer): itself. True, or a
    str or path (a checkpoint folder or hub id; "tiny-random" for tests): what the registered loader loads
    (qwen35/enhance.py load_enhancer) on `device` (None: CUDA when available)."""
    if enhance_prompt is None or enhance_prompt is False:
        return None
    if callable(getattr(enhance_prompt, "enhance", None)):
        return enhance_prompt
    if enhance_prompt is True or isinstance(enhance_prompt, (str, os.PathLike)):
        if _loader is None:
            raise RuntimeError(f"enhance_prompt={enhance_prompt!r}: no prompt-enhancer loader is registered "
                               "(qwen_image_fast.pipelines registers the Qwen3.5 one), or pass an enhancer")
        return _loader(enhance_prompt, device)
    raise TypeError(f"enhance_prompt={enhance_prompt!r}; allowed: None, False, True, a checkpoint path or hub id, "
                    "or a PromptEnhancer")
