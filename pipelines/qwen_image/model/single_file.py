"""Qwen-Image-2512 (and its family's) transformer from one checkpoint file: how its stock tensors become the fast
model's (core/single_file/), and its config read off a file that carries none."""

from ...core.model.lora import BLOCK_SITES
from ...core.single_file.fast_state import FamilyLayout
from ...core.single_file.formats import CheckpointFile, CheckpointFileError
from ...core.single_file.model_loading import SingleFileModel

LAYOUT = FamilyLayout(sites=BLOCK_SITES, renames={f"attn.{n}.weight": n for n in (
    "norm_q", "norm_k", "norm_added_q", "norm_added_k")})
# ComfyUI's flag buffer of Qwen-Image-Edit-2511 files (comfy/model_detection.py: default_ref_method
# "index_timestep_zero"), which diffusers' config calls zero_cond_t
EDIT_2511_MARKER = "__index_timestep_zero__"
LAYERED_KEY = "time_text_embed.addition_t_embedding.weight"  # Qwen-Image-Layered (use_additional_t_cond)


class QwenImageSingleFile(SingleFileModel):
    single_file_layout = LAYOUT
    family_keys = ("txt_norm.weight", "img_in.weight", "transformer_blocks.0.attn.norm_q.weight")
    other_families = {"txt_in.text_norm.weight": ("a Qwen-Image-2.1 transformer",
                                                  "FastQwenImage21Transformer.from_single_file")}

    @classmethod
    def infer_stock_config(cls, file: CheckpointFile) -> dict:
        """The config a file's shapes and markers show; the rest is QwenImageTransformer2DModel's defaults (the
        Qwen-Image-2512 config). Qwen-Image-Layered's rotary layout is not in its weights: refused without
        config=."""
        names = file.names
        if LAYERED_KEY in names:
            raise CheckpointFileError(
                f"{file.path} is a Qwen-Image-Layered transformer (it has {LAYERED_KEY}), whose rotary layout its "
                "weights do not show: pass config= (its diffusers folder or hub id, subfolder='transformer')")
        head_dim = names["transformer_blocks.0.attn.norm_q.weight"][0]
        inner, in_channels = names["img_in.weight"]
        patch = cls.stock_config_fields["patch_size"]
        cls.check_default_axes(file, head_dim)
        return dict(num_layers=cls.block_count(file),
                    attention_head_dim=head_dim, num_attention_heads=inner // head_dim, in_channels=in_channels,
                    out_channels=names["proj_out.weight"][0] // patch ** 2,
                    joint_attention_dim=names["txt_in.weight"][1], zero_cond_t=EDIT_2511_MARKER in file.markers)
