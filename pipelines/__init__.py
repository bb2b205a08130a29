"""The model code: core/ (what every family shares) below the families qwen_image/, qwen_image21/ and qwen35/.

This package wires one family into another through the core: a name given as enhance_prompt= (the 2512 pipeline's
prompt enhancer) resolves in core/prompt_enhancer.py with the Qwen3.5 loader registered here. The loader imports
qwen35/ on first use, so importing the package stays light (the CLI's --help imports no torch).
"""

from .core.prompt_enhancer import register_loader


def load_qwen35_enhancer(enhance_prompt, device=None):
    from .qwen35.enhance import load_enhancer

    return load_enhancer(enhance_prompt, device)


register_loader(load_qwen35_enhancer)
