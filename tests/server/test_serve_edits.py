"""`qwen-image-fast serve` on a tiny Edit-2511-style checkpoint (EditPlus, stock preset): /v1/images/edits through the
official openai client (one image, and several as image[]) equals render's pipeline call in this process; what an
edit model refuses (a generations request, a mask, no image, a file that is not an image) is a 400 naming it.
Condition images are shrunk as render shrinks them for a test-size model (pipelines/tiny.py), here and in the server.
"""

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image
from serving import API_KEY, Server, decoded, in_process_images

from qwen_image_fast.server.protocol import ApiError, Served, parse_request


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import diffusers

    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    root = tmp_path_factory.mktemp("edit")
    tiny_pipeline(diffusers.QwenImageEditPlusPipeline, transformer_config=dict(zero_cond_t=True)).save_pretrained(
        root / "edit")
    return root / "edit"


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = Server(["--model", str(checkpoint), "--preset", "baseline", "--device", "cpu"], log)
    try:
        yield running.wait_ready()
    finally:
        running.stop()


def png(shape, seed) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def test_openai_client_edit_equals_the_pipeline_call(server, checkpoint, small_condition_images):
    import torch
    from openai import OpenAI

    from qwen_image_fast import FastConfig
    from qwen_image_fast.cli.models import load_pipeline

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    first, second = png((32, 48, 3), 0), png((40, 24, 3), 1)
    pipe = load_pipeline(str(checkpoint), "baseline", FastConfig(), torch.device("cpu"))  # as the engine loads it
    for images in ([first], [first, second]):
        files = [(f"in{i}.png", data, "image/png") for i, data in enumerate(images)]
        answer = client.images.edit(image=files if len(files) > 1 else files[0], prompt="make it blue",
                                    extra_body={"seed": 5, "num_inference_steps": 2, "negative_prompt": "blurry"})
        want = in_process_images(pipe, prompts=["make it blue"], seeds=[5], size=None, steps=2, cfg=4.0,
                                 negative="blurry", images=images)[0]
        got = decoded(answer.data[0].b64_json)
        assert answer.size == f"{got.shape[1]}x{got.shape[0]}" and np.array_equal(got, want), len(images)
    # n = 2: two calls of one image (an edit pipeline takes one prompt a call), seeds 5 and 6
    answer = client.images.edit(image=("in.png", first, "image/png"), prompt="make it blue", n=2,
                                extra_body={"seed": 5, "num_inference_steps": 2, "true_cfg_scale": 1.0})
    assert answer.model_extra["batch_sizes"] == [1, 1]
    for seed, image in zip((5, 6), answer.data):
        want = in_process_images(pipe, prompts=["make it blue"], seeds=[seed], size=None, steps=2, cfg=1.0,
                                 images=[first])[0]
        assert image.model_extra["seed"] == seed and np.array_equal(decoded(image.b64_json), want)


def test_what_an_edit_model_refuses(server):
    with server.client() as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat"})
        assert answer.status_code == 400 and "serves /v1/images/edits" in answer.json()["error"]["message"]
        cases = [
            ({}, {"prompt": (None, "x")}, "image", "required"),  # a multipart body of one text field
            ({"prompt": "x"}, {"image": ("a.txt", b"hello", "text/plain")}, "image", "not an image PIL reads"),
            ({"prompt": "x"}, {"image": ("a.png", png((8, 8, 3), 0), "image/png"),
                               "mask": ("m.png", png((8, 8, 3), 1), "image/png")}, "mask", "takes no mask"),
            ({"prompt": "x"}, {"picture": ("a.png", png((8, 8, 3), 0), "image/png")}, "picture", "unexpected file"),
            ({"prompt": "x", "n": "many"}, {"image": ("a.png", png((8, 8, 3), 0), "image/png")}, "n", "integer"),
            ({"prompt": "x", "lora": "{not json"}, {"image": ("a.png", png((8, 8, 3), 0), "image/png")}, "lora",
             "must be JSON"),
        ]
        for data, files, param, says in cases:
            answer = client.post("/v1/images/edits", data=data, files=files)
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == param and says in error["message"], answer.text
        answer = client.post("/v1/images/edits", json={"prompt": "x"})
        assert answer.status_code == 400 and "multipart/form-data" in answer.json()["error"]["message"]


def test_a_mask_of_another_size_and_a_size_where_the_image_sizes_are_refused():
    """What an inpainting model's server checks, in the parser both endpoints share."""
    served = Served(model="m", pipeline="QwenImageInpaintPipeline", endpoint="edits", default_size=None,
                    max_side=2048, default_steps=2, default_cfg=4.0, default_negative=" ", min_steps=2,
                    guidance_embeds=False, images=(1, 1), mask=True)
    image = {"image": [png((32, 48, 3), 0)]}
    with pytest.raises(ApiError, match="mask: required"):
        parse_request({"prompt": "x"}, served, "edits", image)
    with pytest.raises(ApiError, match=r"mask: 24x16: it must be the first image's size, 48x32"):
        parse_request({"prompt": "x"}, served, "edits", image | {"mask": [png((16, 24), 1)]})
    assert parse_request({"prompt": "x"}, served, "edits", image | {"mask": [png((32, 48), 1)]}).mask is not None
    sized_by_image = dataclasses.replace(served, pipeline="QwenImageEditInpaintPipeline", size_refused=True)
    with pytest.raises(ApiError, match="QwenImageEditInpaintPipeline sizes its output from the input image: leave "
                                       "size out"):
        parse_request({"prompt": "x", "size": "64x64"}, sized_by_image, "edits", image | {"mask": [png((32, 48), 1)]})


def test_an_rgba_model_refuses_jpeg_and_a_background():
    """Qwen-Image-2.1 renders RGBA: a JPEG would drop its alpha, and it has no background to make opaque."""
    served = Served(model="m", pipeline="QwenImage21Pipeline", endpoint="generations", default_size=(64, 64),
                    max_side=2048, default_steps=2, default_cfg=1.0, default_negative=" ", min_steps=2,
                    guidance_embeds=False, rgba=True)
    with pytest.raises(ApiError, match="output_format: QwenImage21Pipeline renders RGBA images, and JPEG has no alpha"):
        parse_request({"prompt": "x", "output_format": "jpeg"}, served, "generations")
    with pytest.raises(ApiError, match="background: 'opaque': QwenImage21Pipeline renders RGBA images"):
        parse_request({"prompt": "x", "background": "opaque"}, served, "generations")
    assert parse_request({"prompt": "x", "output_format": "webp"}, served, "generations").output_format == "webp"


def test_a_memory_budget_limits_the_size_and_steps():
    """serve --max-memory below 22 GiB plans one image of at most 1328x1328 pixels and 50 steps a call
    (memory.check_within_plan): beyond that is a 400 naming the field, not a 500 from the pipeline."""
    served = Served(model="m", pipeline="QwenImagePipeline", endpoint="generations", default_size=(64, 64),
                    max_side=2048, default_steps=2, default_cfg=4.0, default_negative=" ", min_steps=2,
                    guidance_embeds=False, max_steps=50, max_pixels=1328 * 1328)
    with pytest.raises(ApiError, match="size: 1664x1664 is more than the 1763584 pixels this server's --max-memory"):
        parse_request({"prompt": "x", "size": "1664x1664"}, served, "generations")
    with pytest.raises(ApiError, match="num_inference_steps: .*50"):
        parse_request({"prompt": "x", "num_inference_steps": 60}, served, "generations")
    assert parse_request({"prompt": "x", "size": "1664x928", "num_inference_steps": 50}, served,
                         "generations").steps == 50


def test_a_qwen21_memory_budget_counts_the_prompt_s_prefix_tokens(tmp_path):
    """serve --max-memory below 21 on Qwen-Image-2.1 plans a prefix of at most PLANNED_TEXT_TOKENS: the server counts
    a prompt's prefix tokens with diffusers' own template (prefix_token_counter, from the checkpoint's processor
    folder) exactly as the pipeline encodes it, and a longer prompt or negative prompt is a 400 naming the field."""
    import torch
    from diffusers import QwenImage21Pipeline

    from qwen_image_fast.pipelines.qwen_image21.pipeline import prefix_token_counter
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    pipe = QwenImage21Pipeline(**tiny_qwen21_components())
    pipe.processor.save_pretrained(tmp_path / "processor")
    count = prefix_token_counter(str(tmp_path))
    for prompt in ("a cat", "", "a red fox curled up asleep in fresh snow " * 5):
        embeds, mask, _ = pipe.encode_prompt(prompt, device=torch.device("cpu"))  # mask None: every token valid
        assert count(prompt) == (embeds.shape[1] if mask is None else int(mask.sum())), prompt
    served = Served(model="m", pipeline="QwenImage21Pipeline", endpoint="generations", default_size=(64, 64),
                    max_side=2048, default_steps=2, default_cfg=4.0, default_negative=" ", min_steps=2,
                    guidance_embeds=False, rgba=True, count_tokens=count, max_prompt_tokens=count("a cat"),
                    prompt_limit="this server's --max-memory is planned for prompts of at most {limit} tokens")
    assert parse_request({"prompt": "a cat"}, served, "generations").prompt == "a cat"
    with pytest.raises(ApiError, match=rf"prompt: {count('a cat and a dog')} tokens; this server's --max-memory is "
                                       rf"planned for prompts of at most {count('a cat')} tokens: shorten it"):
        parse_request({"prompt": "a cat and a dog"}, served, "generations")
    with pytest.raises(ApiError, match="negative_prompt: .* tokens; this server's --max-memory is planned"):
        parse_request({"prompt": "a cat", "negative_prompt": "blurry and dark", "true_cfg_scale": 4.0}, served,
                      "generations")
