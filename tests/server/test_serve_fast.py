"""`qwen-image-fast serve` with the fast preset (the tiny model, Triton's interpreter), a step cache and LoRAs: what
the official openai client gets equals render's pipeline call in this process pixel for pixel; per-request LoRAs
switch on the unfused path without reloading; step_cache false runs a request without the server's cache rule.
"""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from serving import API_KEY, Server, decoded, in_process_images

SIZE = (64, 64)
CACHE = "every:2,1,0"  # the tiny model's 2 blocks: the second one runs on one step in 2


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_files):
    style, lora_dir = lora_files
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = Server(["--model", "tiny-random", "--device", "cpu", "--cache", CACHE, "--lora", f"style={style}",
                      "--lora-dir", str(lora_dir)], log)
    try:
        yield running.wait_ready()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def pipe():
    """The pipeline the server's engine runs, in this process."""
    from qwen_image_fast import FastConfig
    from qwen_image_fast.cli.models import load_pipeline
    from qwen_image_fast.pipelines.core.config import DBCache

    return load_pipeline("tiny-random", "fast", FastConfig(cache=DBCache.parse(CACHE)), torch.device("cpu"))


def test_openai_client_generate_equals_the_pipeline_call(server, pipe):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    answer = client.images.generate(prompt="a red fox in snow", n=2, size="64x64",
                                    extra_body={"seed": 7, "num_inference_steps": 4, "negative_prompt": "blurry"})
    extra = answer.model_extra
    assert answer.created > 0 and answer.output_format == "png" and answer.size == "64x64"
    assert [image.model_extra["seed"] for image in answer.data] == [7, 8]
    assert {"fused_transformer", "step_cache"} <= {label.split(":")[0] for label in extra["applied"]}, extra
    assert extra["batch_sizes"] == [2]
    want = in_process_images(pipe, prompts=["a red fox in snow"] * 2, seeds=[7, 8], size=SIZE, steps=4, cfg=4.0,
                             negative="blurry")
    for image, expected in zip(answer.data, want):
        assert np.array_equal(decoded(image.b64_json), expected)
    with Image.open(io.BytesIO(base64.b64decode(answer.data[1].b64_json))) as image:
        settings = json.loads(image.info["Description"])  # embedded as render embeds its images' settings
    assert settings["prompt"] == "a red fox in snow" and settings["seed"] == 8 and settings["steps"] == 4
    assert settings["negative_prompt"] == "blurry" and settings["applied"] == extra["applied"]


def test_step_cache_off_for_one_request(server, pipe):
    body = dict(prompt="a cat", seed=2, num_inference_steps=4, true_cfg_scale=1.0)
    with server.client() as client:
        cached, uncached = (client.post("/v1/images/generations", json=body | extra).json()
                            for extra in ({}, {"step_cache": False}))
    assert any(label.startswith("step_cache") for label in cached["applied"])
    assert not any(label.startswith("step_cache") for label in uncached["applied"]), uncached["applied"]
    config = pipe.fast_config
    try:
        pipe.fast_config = config.replace(cache=None)
        want = in_process_images(pipe, prompts=["a cat"], seeds=[2], size=SIZE, steps=4, cfg=1.0)[0]
    finally:
        pipe.fast_config = config
    assert np.array_equal(decoded(uncached["data"][0]["b64_json"]), want)
    assert not np.array_equal(decoded(cached["data"][0]["b64_json"]), want)


def test_per_request_loras_switch_without_reloading(server, pipe, lora_files):
    style, _ = lora_files
    base = dict(prompt="a red fox", seed=3, num_inference_steps=2, true_cfg_scale=1.0)
    with server.client() as client:
        def image(**extra):
            answer = client.post("/v1/images/generations", json=base | extra)
            assert answer.status_code == 200, answer.text
            return decoded(answer.json()["data"][0]["b64_json"])

        styled = image(loras=[{"name": "style", "weight": 0.7}])
        plain = image()
        several = image(loras=[{"name": "other", "weight": 1.0}, {"name": "style", "weight": 0.5}])
        again = image(loras=[{"name": "style", "weight": 0.7}])
    assert np.array_equal(styled, again)  # switching away and back leaves nothing behind
    assert len({a.tobytes() for a in (styled, plain, several)}) == 3
    pipe.load_lora_weights(str(style), adapter_name="style")
    try:
        pipe.set_adapters(["style"], [0.7])
        want_styled = in_process_images(pipe, prompts=["a red fox"], seeds=[3], size=SIZE, steps=2, cfg=1.0)[0]
        pipe.disable_lora()
        want_plain = in_process_images(pipe, prompts=["a red fox"], seeds=[3], size=SIZE, steps=2, cfg=1.0)[0]
    finally:
        pipe.delete_adapters(["style"])
    assert np.array_equal(styled, want_styled) and np.array_equal(plain, want_plain)
