"""Qwen-Image-2.1's transformer from one checkpoint file (core/single_file/): its stock tensors into the fast
model's, ComfyUI's fused SwiGLU as diffusers reads it, and its config read off a file that carries none."""

from ..core.single_file.fast_state import FamilyLayout
from ..core.single_file.formats import CheckpointFile
from ..core.single_file.model_loading import SingleFileModel


class QwenImage21SingleFile(SingleFileModel):
    family_keys = ("txt_in.text_norm.weight", "img_in.weight", "transformer_blocks.0.attn.norm_q.weight")
    other_families = {"txt_norm.weight": ("a Qwen-Image(-2512) transformer",
                                          "FastQwenImageTransformer.from_single_file")}

    @classmethod
    def infer_stock_config(cls, file: CheckpointFile) -> dict:
        """The config a file's shapes show; eps and causal_condition are QwenImage21Transformer2DModel's defaults
        (Qwen/Qwen-Image-2.1's), as diffusers' from_single_file takes that repo's config for a 2.1 file."""
        names = file.names
        defaults = cls.stock_config_fields
        head_dim = names["transformer_blocks.0.attn.norm_q.weight"][0]
        inner, in_features = names["img_in.weight"]
        cls.check_default_axes(file, head_dim)
        gate = names.get("transformer_blocks.0.img_mlp.gate_layer.weight") or (
            names["transformer_blocks.0.img_mlp.gate_up.weight"][0] // 2,)
        patch = defaults["patch_size"]
        return dict(num_layers=cls.block_count(file),
                    attention_head_dim=head_dim, num_attention_heads=inner // head_dim,
                    in_channels=in_features // patch ** 2, out_channels=names["proj_out.weight"][0] // patch ** 2,
                    context_in_dim=names["txt_in.in_layer.weight"][1], mlp_ratio=gate[0] // inner)


def layout(lora_sites: dict) -> FamilyLayout:
    return FamilyLayout(sites=lora_sites, renames={"attn.norm_q.weight": "norm_q", "attn.norm_k.weight": "norm_k"},
                        biases=False, fused_in_files={"img_mlp.gate_up": ("img_mlp.gate_layer", "img_mlp.proj")})
