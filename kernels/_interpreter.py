"""Triton's interpreter (TRITON_INTERPRET=1: the CPU tests, and any run without a GPU) without its repeated scans.

Triton 3.6's interpreter patches triton.language's builtins once per launch (GridExecutor.__call__ -> _patch_lang,
restored when the launch ends), and again at every call of a nested @triton.jit function
(InterpretedFunction.__call__ -> _patch_lang, never restored): each time an inspect.getmembers scan of triton.language,
its tensor class and tl.math, about 15 ms. Inside a launch the language is already patched, so a nested call's scan
only re-wraps the same builtins around the same interpreter builder. `skip_nested_patches` patches, at each launch,
both module objects a jit function may see the language by (`tl`, and `core` in Triton's standard library that
nested calls such as tl.max reach), and makes a nested call's patch return at once. Outside a launch, Triton's own
function runs. It changes no value a kernel computes (the kernel tests compare every kernel with its reference under
it) and cuts the CPU suite's interpreted time by about a sixth."""

import triton
import triton.language as tl

PATCHED_VERSIONS = ("3.6.",)  # the interpreter whose internals this follows; any other runs as Triton ships it


class EVERY_LANGUAGE:
    """What a launch patches: both names a @triton.jit function's module may see the language by (ours `tl`,
    Triton's own standard library, e.g. tl.max, `core`), so that no nested call has any left to patch."""

    __globals__ = {"tl": tl, "core": tl.core}


def skip_nested_patches() -> bool:
    """Install the skip once; False where the interpreter is not the one it follows."""
    from triton.runtime import interpreter

    if not triton.__version__.startswith(PATCHED_VERSIONS) or getattr(interpreter, "_nested_patches_skipped", False):
        return False
    patch_lang, grid_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = {"launch": False, "patched": False}  # inside a launch; its language patched

    def patch_lang_once_per_launch(fn):
        if state["launch"] and state["patched"]:  # a nested @triton.jit call inside a launch: already patched
            return interpreter._LangPatchScope()
        if not state["launch"]:  # a call outside any launch: Triton's own
            return patch_lang(fn)
        state["patched"] = True
        return patch_lang(EVERY_LANGUAGE)

    def launch(self, *args, **kwargs):
        outer = dict(state)
        state.update(launch=True, patched=False)
        try:
            return grid_call(self, *args, **kwargs)
        finally:  # GridExecutor.__call__ restored the language (its own scope) before returning
            state.update(outer)

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang_once_per_launch, launch
    interpreter._nested_patches_skipped = True
    return True
