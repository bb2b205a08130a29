"""What diffusers' transformers (QwenImageTransformer2DModel, QwenImage21Transformer2DModel) offer that the fast
ones cannot honour: each raises NotImplementedError saying what to do instead (a silent no-op would run something
else than asked)."""

BASELINE_ADVICE = "keep the stock transformer (FastConfig.preset('baseline')) for it"
LORA_ADVICE = ("load the LoRA with pipe.load_lora_weights(...) (or transformer.load_lora_adapter(...)) on the fast "
               "pipeline, before or after optimize()")
ATTENTION_ADVICE = ("the fast transformer runs its own fused attention; choose it with FastConfig(attention=...) "
                    "(auto, fa4, cudnn, sdpa), or " + BASELINE_ADVICE)
HOTSWAP_ADVICE = ("hotswapping is not needed here: load another adapter and set_adapters() switches without "
                  "recompiling (CUDA graphs are recaptured)")


def refuse(model, method: str, advice: str):
    raise NotImplementedError(f"{type(model).__name__}.{method}: {advice}")


class Unsupported:
    """Mixed into the fast transformers before diffusers' ModelMixin, whose versions these replace. The model names
    its stock class (stock_model_name) and what to use for parallelism (parallel_advice)."""

    stock_model_name: str
    parallel_advice = "use FastConfig(parallel='cfg' | 'ulysses')"

    def enable_gradient_checkpointing(self, *args, **kwargs):
        refuse(self, "enable_gradient_checkpointing",
               f"the fast transformer is inference-only; train diffusers' {self.stock_model_name}")

    def set_attention_backend(self, *args, **kwargs):
        refuse(self, "set_attention_backend", ATTENTION_ADVICE)

    def reset_attention_backend(self, *args, **kwargs):
        refuse(self, "reset_attention_backend", ATTENTION_ADVICE)

    def set_attn_processor(self, *args, **kwargs):
        refuse(self, "set_attn_processor", ATTENTION_ADVICE)

    def set_default_attn_processor(self, *args, **kwargs):
        refuse(self, "set_default_attn_processor", ATTENTION_ADVICE)

    @property
    def attn_processors(self):
        refuse(self, "attn_processors", ATTENTION_ADVICE)

    def enable_xformers_memory_efficient_attention(self, *args, **kwargs):
        refuse(self, "enable_xformers_memory_efficient_attention", ATTENTION_ADVICE)

    def set_use_memory_efficient_attention_xformers(self, *args, **kwargs):
        refuse(self, "set_use_memory_efficient_attention_xformers", ATTENTION_ADVICE)

    def enable_npu_flash_attention(self, *args, **kwargs):
        refuse(self, "enable_npu_flash_attention", ATTENTION_ADVICE)

    def set_use_npu_flash_attention(self, *args, **kwargs):
        refuse(self, "set_use_npu_flash_attention", ATTENTION_ADVICE)

    def enable_xla_flash_attention(self, *args, **kwargs):
        refuse(self, "enable_xla_flash_attention", ATTENTION_ADVICE)

    def set_use_xla_flash_attention(self, *args, **kwargs):
        refuse(self, "set_use_xla_flash_attention", ATTENTION_ADVICE)

    def fuse_qkv_projections(self, *args, **kwargs):
        refuse(self, "fuse_qkv_projections", "its Q/K/V projections are fused per stream already")

    def unfuse_qkv_projections(self, *args, **kwargs):
        refuse(self, "unfuse_qkv_projections",
               "its Q/K/V projections stay fused per stream; keep the stock transformer for unfused ones")

    def enable_layerwise_casting(self, *args, **kwargs):
        refuse(self, "enable_layerwise_casting",
               "its block linears are stored in FP8 already (FastConfig(fp8=True)); the other layers stay in the "
               "model's dtype")

    def compile_repeated_blocks(self, *args, **kwargs):
        refuse(self, "compile_repeated_blocks",
               "its forward is fused Triton kernels, replayed from CUDA graphs by the fast pipeline "
               "(FastConfig(cuda_graphs=True)); torch.compile of it is not supported")

    def enable_parallelism(self, *args, **kwargs):
        refuse(self, "enable_parallelism",
               "diffusers' context parallelism is not supported on the fast transformer; " + self.parallel_advice)

    def dequantize(self, *args, **kwargs):
        refuse(self, "dequantize", f"rebuild it from the BF16 checkpoint instead: {type(self).__name__}."
                                   f"from_diffusers({self.stock_model_name}.from_pretrained(...), "
                                   "FastTransformerConfig(fp8=False))")

    def add_adapter(self, *args, **kwargs):
        refuse(self, "add_adapter", "adding an untrained adapter (training) is not supported; " + LORA_ADVICE)

    def enable_lora_hotswap(self, *args, **kwargs):
        refuse(self, "enable_lora_hotswap", HOTSWAP_ADVICE)

    def save_lora_adapter(self, *args, **kwargs):
        refuse(self, "save_lora_adapter",
               "save the LoRA file you loaded; the fast transformer keeps adapters as loaded")
