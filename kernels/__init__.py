"""Triton kernels (installed as `qwen_image_fast.kernels`). Each op file holds the kernel, its launcher and
`<op>_ref`, the pure-PyTorch semantics it must reproduce. Nothing here knows about Qwen-Image."""
