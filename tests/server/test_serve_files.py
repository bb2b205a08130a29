"""`qwen-image-fast serve --model FILE --base DIR --text-encoder FILE --vae FILE`: ComfyUI's three files (tiny, written
by tests/single_file_fixtures.py) served; a generations request through the official openai client equals render's
pipeline call from the same files in this process pixel for pixel, and says what loading the file did; a wrong file
stops serve before it starts (exit 2, one line)."""

import subprocess
import sys

import pytest
import torch
from serving import API_KEY, Server, decoded, in_process_images
from single_file_fixtures import write_comfy_files

SIZE = (32, 32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_comfy_files(tmp_path_factory.mktemp("comfy"))


def file_args(files) -> list[str]:
    return ["--model", str(files["transformer"]), "--base", str(files["base"]), "--text-encoder",
            str(files["text_encoder"]), "--vae", str(files["vae"])]


@pytest.fixture(scope="module")
def server(tmp_path_factory, files):
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = Server([*file_args(files), "--device", "cpu"], log)
    try:
        yield running.wait_ready()
    finally:
        running.stop()


def test_a_request_equals_the_pipeline_from_the_same_files(server, files):
    from qwen_image_fast import FastConfig
    from qwen_image_fast.cli.models import SingleFiles, load_pipeline

    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    answer = client.images.generate(prompt="a fox", size=f"{SIZE[0]}x{SIZE[1]}", extra_body={
        "seed": 3, "num_inference_steps": 2, "true_cfg_scale": 4.0, "negative_prompt": "blurry"})
    assert "single_file:comfyui_scaled_fp8" in answer.model_extra["applied"], answer.model_extra
    single = SingleFiles(str(files["transformer"]), str(files["base"]), str(files["text_encoder"]), str(files["vae"]))
    pipe = load_pipeline(single.transformer, "fast", FastConfig(), torch.device("cpu"), files=single)
    want = in_process_images(pipe, prompts=["a fox"], seeds=[3], size=SIZE, steps=2, cfg=4.0, negative="blurry")
    assert (decoded(answer.data[0].b64_json) == want[0]).all()


def test_a_wrong_file_stops_serve_before_it_starts(files):
    args = file_args(files)
    args[1] = str(files["vae"])  # a VAE file as the transformer
    done = subprocess.run([sys.executable, "-m", "qwen_image_fast", "serve", *args, "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "is not a QwenImageTransformer2DModel file" in last, done.stderr
