"""The checks diffusers' own pipeline tests make (tests/pipelines/test_pipelines_common.py; those files are not in the
diffusers wheel and CI reaches no repository), made here for every fast pipeline class against its stock class:
the signatures, save_pretrained / from_pretrained round trips (variants, shards, pickle), dtype dicts and diffusers'
default dtype, components, and loading through the class-picking from_pretrained."""

import inspect
import json
import logging

import pytest
import torch
from helpers import assert_close, diffusers_warnings
from test_family import CASES, final_latents, stock
from test_pipeline import EXACT, stock_pipeline

import qwen_image_fast
from qwen_image_fast import FastConfig, QwenImageFastPipeline, from_pretrained, optimize
from qwen_image_fast.pipelines.qwen_image.family import IMAGE_CONDITIONED
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer

FAST_CLASSES = (QwenImageFastPipeline, *IMAGE_CONDITIONED)
CASE_OF = {"QwenImagePipeline": None} | {name: case_id for case_id, (name, _, _) in reversed(CASES.items())}


def stock_of(cls):
    name = cls.stock_class.__name__
    return stock_pipeline() if name == "QwenImagePipeline" else stock(CASE_OF[name])


def params(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("cls", FAST_CLASSES, ids=lambda cls: cls.__name__)
def test_signatures_are_the_stock_ones(cls):
    """diffusers' test_pipeline_call_signature, and what its loaders read from __init__ (expected modules)."""
    assert params(cls.__call__) == params(cls.stock_class.__call__)
    fast_init, stock_init = params(cls.__init__), params(cls.stock_class.__init__)
    assert fast_init[:len(stock_init)] == stock_init
    assert [name for name, *_ in fast_init[len(stock_init):]] == (
        ["fast_config", "enhance_prompt"] if cls is QwenImageFastPipeline else ["fast_config"])
    expected, optional = cls._get_signature_keys(cls)
    stock_expected, stock_optional = cls.stock_class._get_signature_keys(cls.stock_class)
    assert expected == stock_expected and set(optional) - set(stock_optional) == {
        name for name, *_ in fast_init[len(stock_init):]}
    assert getattr(qwen_image_fast, cls.__name__) is cls, "exported by name: a saved folder's model_index names it"


@pytest.mark.parametrize("cls", FAST_CLASSES, ids=lambda cls: cls.__name__)
def test_the_diffusers_constructor_converts(cls):
    """`FastClass(**stock.components)` (diffusers' test pattern: the pipeline class built from components), with the
    default fast_config: the transformer converted, the same components otherwise."""
    reference = stock_of(cls)
    pipe = cls(**reference.components, fast_config=EXACT)
    assert isinstance(pipe.transformer, FastQwenImageTransformer) and type(pipe).__name__ == cls.__name__
    assert pipe.components.keys() == reference.components.keys()
    assert pipe.fast_config == EXACT


@pytest.mark.parametrize("save", [dict(), dict(variant="fp16", max_shard_size="40KB"), dict(safe_serialization=False)],
                         ids=["plain", "variant-shards", "pickle"])
@pytest.mark.parametrize("cls", FAST_CLASSES, ids=lambda cls: cls.__name__)
def test_save_and_load_back_as_it_was(tmp_path, cls, save):
    """save_pretrained with diffusers' arguments, then qwen_image_fast.from_pretrained: the same class, the
    transformer's state bit for bit (FP8 weights not requantized), the VAE that decodes in 2D, every other tensor."""
    pipe = optimize(stock_of(cls), FastConfig())
    pipe.save_pretrained(tmp_path, **save)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == cls.__name__
    if "max_shard_size" in save:
        assert len(list((tmp_path / "transformer").glob("*.fp16-*.safetensors"))) > 1
    if save.get("safe_serialization") is False:
        assert list((tmp_path / "transformer").glob("*.bin"))
    with diffusers_warnings() as warned, diffusers_warnings(logging.INFO) as logged:
        loaded = from_pretrained(tmp_path, FastConfig(), variant=save.get("variant"))
    # diffusers' line for every component, the fast transformer's too (diffusers' test_save_load_local reads them)
    for name, class_name in (("transformer", pipe.transformer), ("vae", pipe.vae)):
        assert (f"Loaded {name} as {type(class_name).__name__} from `{name}` subfolder of {tmp_path}."
                in logged), (name, logged)
    # nothing of ours (e.g. that the transformer is not the stock class: the fast class holds its own); loading a
    # pickle save, diffusers says there is no safetensors file and that it unpickles, as for its own pipelines
    upstream = ("safetensors found in directory", "Defaulting to unsafe serialization")
    assert [message for message in warned if not any(text in message for text in upstream)] == []
    assert type(loaded) is cls and type(loaded.vae) is type(pipe.vae)
    for name in ("transformer", "vae"):
        before, after = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before), name


@pytest.mark.usefixtures("small_condition_images")
def test_loaded_pipelines_compute_what_they_computed(tmp_path):
    """A saved text-to-image and Edit-2511 pipeline render what they rendered before saving: to fp32 rounding (the
    weights are equal bit for bit, but CPU GEMMs round differently on the loaded tensors' memory alignment)."""
    t2i = optimize(stock_pipeline(), FastConfig())
    edit = optimize(stock("edit_plus_2511"), FastConfig())
    call = dict(prompt="a cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=2,
                output_type="latent")
    for name, pipe, latents in (
        ("t2i", t2i, lambda p: p(**call, generator=torch.Generator().manual_seed(0)).images),
        ("edit", edit, lambda p: final_latents(p, "edit_plus_2511")),
    ):
        pipe.save_pretrained(tmp_path / name)
        assert_close(latents(from_pretrained(tmp_path / name, FastConfig())), latents(pipe), 1e-6, name)


def test_dtype_as_diffusers_loads_it(tmp_path):
    """A BF16 folder, saved by a fast pipeline or by stock diffusers, loaded back: without a dtype every component in
    float32, diffusers' default (transformers >= 5 would give the text encoder the dtype it was saved in, and stock
    diffusers' first call then fails on mixed dtypes, as below), and it renders: from the stock folder, as stock
    diffusers told dtype=float32 does (fp32, 1e-5). A dtype dict by component ("default" for the rest), as
    diffusers' torch_dtype takes, gives diffusers' dtypes. The FP8 weights and scales come back as stored; an fp32
    save exactly."""
    from diffusers import QwenImagePipeline

    pipe = optimize(stock_pipeline().to(torch.bfloat16), FastConfig())
    pipe.save_pretrained(tmp_path / "fast")
    stock_pipeline().to(torch.bfloat16).save_pretrained(tmp_path / "stock")
    call = dict(prompt="a red fox", negative_prompt="blurry", height=48, width=48, num_inference_steps=2,
                output_type="latent")
    with pytest.raises(RuntimeError, match="same dtype"):  # what stock diffusers does without a dtype
        QwenImagePipeline.from_pretrained(tmp_path / "stock")(**call, generator=torch.Generator().manual_seed(0))
    for folder in ("fast", "stock"):
        ours = from_pretrained(tmp_path / folder, FastConfig() if folder == "fast" else EXACT)
        assert [getattr(ours, name).dtype for name in ("transformer", "vae", "text_encoder")] == [torch.float32] * 3
        latents = ours(**call, generator=torch.Generator().manual_seed(0)).images
        assert torch.isfinite(latents).all(), folder
    theirs = QwenImagePipeline.from_pretrained(tmp_path / "stock", dtype=torch.float32)
    assert_close(latents, theirs(**call, generator=torch.Generator().manual_seed(0)).images, 1e-5, "stock folder")
    by_component = dict(torch_dtype={"transformer": torch.bfloat16, "default": torch.float16})
    ours, theirs = from_pretrained(tmp_path / "fast", FastConfig(), **by_component), \
        QwenImagePipeline.from_pretrained(tmp_path / "stock", **by_component)
    for name in ("transformer", "vae", "text_encoder"):
        assert getattr(ours, name).dtype == getattr(theirs, name).dtype, name
    state = ours.transformer.state_dict()
    for key, value in pipe.transformer.state_dict().items():
        if key.endswith(("weight_q", "weight_scale")):
            assert torch.equal(state[key], value) and state[key].dtype == value.dtype, key
    fp32 = optimize(stock_pipeline(), EXACT)
    fp32.save_pretrained(tmp_path / "fp32")
    back = from_pretrained(tmp_path / "fp32", EXACT)
    assert all(torch.equal(a, b) for a, b in zip(back.transformer.state_dict().values(),
                                                 fp32.transformer.state_dict().values()))


def test_from_pipe_and_optimize_share_the_components():
    """optimize(pipe) builds the fast pipeline around pipe's components (pipe keeps its class and takes the fast
    transformer and VAE, so the stock weights are not kept twice); from_pipe leaves the source pipeline stock."""
    reference = stock_pipeline()
    fast = optimize(reference, EXACT)
    assert type(reference).__name__ == "QwenImagePipeline" and reference.transformer is fast.transformer
    assert reference.text_encoder is fast.text_encoder and reference.vae is fast.vae
    source = stock_pipeline()
    derived = QwenImageFastPipeline.from_pipe(source, fast_config=EXACT)
    assert type(source.transformer).__name__ == "QwenImageTransformer2DModel"
    assert derived.text_encoder is source.text_encoder


def test_build_options_are_fixed_call_options_change():
    pipe = optimize(stock_pipeline(), EXACT)
    pipe.fast_config = pipe.fast_config.replace(scheduler="unipc", cuda_graphs=False, cfg_fraction=0.5)
    assert "scheduler:unipc" in pipe.applied and "cfg_fraction:0.5" in pipe.applied
    with pytest.raises(ValueError, match=r"\['fp8'\] are read when the pipeline is built"):
        pipe.fast_config = pipe.fast_config.replace(fp8=True)
    edit = optimize(stock("img2img"), EXACT)
    with pytest.raises(ValueError, match="scheduler: supported by the text-to-image"):
        edit.fast_config = edit.fast_config.replace(scheduler="unipc")


@pytest.mark.parametrize("load", [from_pretrained, QwenImageFastPipeline.from_pretrained])
def test_a_missing_folder_is_named(load, tmp_path):
    """A name that is neither an existing path nor shaped like a hub id: OSError (what stock raises for a checkpoint
    it cannot find) saying so, instead of the hub's validation or connection error."""
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(OSError, match="no-such-checkpoint: no such local folder, and not a hub id"):
        load(str(missing), device="cpu")


def test_the_base_knows_the_fast_classes_by_their_names():
    """core/pipeline/base.py names the families' fast classes without importing them (a saved folder's
    model_index.json names them so): the names must be the classes'."""
    from diffusers import AutoencoderKLQwenImage, AutoencoderKLQwenImage21

    from qwen_image_fast.pipelines.core.pipeline.base import FAST_TRANSFORMERS, FAST_VAES
    from qwen_image_fast.pipelines.qwen_image.model.vae import FastAutoencoderKLQwenImage
    from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer
    from qwen_image_fast.pipelines.qwen_image21.vae import FastAutoencoderKLQwenImage21

    assert FAST_TRANSFORMERS == (FastQwenImageTransformer.__name__, FastQwenImage21Transformer.__name__)
    assert FAST_VAES == {AutoencoderKLQwenImage.__name__: FastAutoencoderKLQwenImage.__name__,
                         AutoencoderKLQwenImage21.__name__: FastAutoencoderKLQwenImage21.__name__}
