"""Single checkpoint files (ComfyUI and diffusers safetensors, GGUF) read tensor by tensor into the fast transformers:
formats.py reads a file as it means each tensor, fast_state.py puts them into a fast model's layout,
model_loading.py is from_single_file, writers.py writes each format (test fixtures, the checkpoint benchmark)."""
