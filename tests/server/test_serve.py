"""`qwen-image-fast serve` on the tiny text-to-image model (fast preset, Triton's interpreter), one real server process
on a loopback port for the module, driven by the official openai client, httpx and a headless Chromium.

Served images are compared with render's pipeline call in this process (serving.in_process_images): equal pixel
for pixel when the server ran the same batch. Requests batched together against the same requests served one at a
time: within one 8-bit level, not bit for bit. A batch pads its prompts' text to the longest and runs its GEMMs
at another row count, and on the CPU that moves fp32 outputs by ~5e-7 (stock diffusers alike: a list of prompts
against each prompt alone), which can tip a pixel's rounding.
"""

import base64
import concurrent.futures
import io
import json
import os
import threading

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from helpers import tiny_lora
from serving import API_KEY, Server, decoded, in_process_images

SIZE = (64, 64)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    (root / "dir" / "sub").mkdir(parents=True)
    style = tiny_lora(root / "style.safetensors", seed=1)
    tiny_lora(root / "dir" / "other.safetensors", seed=2)
    tiny_lora(root / "dir" / "sub" / "deep.safetensors", seed=3)
    return style, root / "dir"


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_files):
    style, lora_dir = lora_files
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = Server(["--model", "tiny-random", "--device", "cpu", "--max-batch", "4", "--max-wait-ms", "300",
                      "--max-queue", "16", "--max-body-mb", "1", "--lora", f"style={style}", "--lora-dir", str(lora_dir)], log)
    try:
        yield running.wait_ready()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def pipe():
    """The pipeline the server's engine runs, in this process."""
    from qwen_image_fast import FastConfig
    from qwen_image_fast.cli.models import load_pipeline

    return load_pipeline("tiny-random", "fast", FastConfig(), torch.device("cpu"))


def post(server, body, client=None, path="/v1/images/generations"):
    client = client or server.client()
    return client.post(path, json=body)


def test_openai_client_generate_equals_the_pipeline_call(server, pipe):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    answer = client.images.generate(prompt="a red fox in snow", n=2, size="64x64",
                                    extra_body={"seed": 7, "num_inference_steps": 2, "negative_prompt": "blurry"})
    extra = answer.model_extra
    assert answer.created > 0 and answer.output_format == "png" and answer.size == "64x64"
    assert [image.model_extra["seed"] for image in answer.data] == [7, 8]
    assert "fused_transformer" in extra["applied"] and extra["batch_sizes"] == [2], extra
    want = in_process_images(pipe, prompts=["a red fox in snow"] * 2, seeds=[7, 8], size=SIZE, steps=2, cfg=4.0,
                             negative="blurry")
    for image, expected in zip(answer.data, want):
        assert np.array_equal(decoded(image.b64_json), expected)
    with Image.open(io.BytesIO(base64.b64decode(answer.data[1].b64_json))) as image:
        settings = json.loads(image.info["Description"])  # embedded as render embeds its images' settings
    assert settings["prompt"] == "a red fox in snow" and settings["seed"] == 8 and settings["steps"] == 2
    assert settings["negative_prompt"] == "blurry" and settings["applied"] == extra["applied"]
    # a client that gives no seed gets a random one, and is told which
    unseeded = client.images.generate(prompt="a red fox in snow", size="64x64",
                                      extra_body={"num_inference_steps": 2, "true_cfg_scale": 1.0})
    assert unseeded.model_extra["seed_given"] is False and isinstance(unseeded.data[0].model_extra["seed"], int)


def test_batched_requests_equal_the_same_requests_one_at_a_time(server):
    prompts = ["a red fox", "a lighthouse on a cliff above a stormy sea", "a cat", "green hills under rain"]
    bodies = [dict(prompt=p, seed=100 + i, num_inference_steps=2, true_cfg_scale=1.0) for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda body: post(server, body).json(), bodies))
    alone = [post(server, body).json() for body in bodies]
    assert max(max(answer["batch_sizes"]) for answer in together) > 1, [a["batch_sizes"] for a in together]
    assert all(answer["batch_sizes"] == [1] for answer in alone)
    for t, a in zip(together, alone):
        x, y = decoded(t["data"][0]["b64_json"]).astype(int), decoded(a["data"][0]["b64_json"]).astype(int)
        assert np.abs(x - y).max() <= 1 and (x != y).mean() < 0.01, (np.abs(x - y).max(), (x != y).mean())


def test_64_requests_at_concurrency_16_all_answered_once(server):
    before = server.metrics()
    bodies = [dict(prompt=f"image number {i}", seed=1000 + i, num_inference_steps=2, true_cfg_scale=1.0)
              for i in range(64)]
    with server.client() as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda body: post(server, body, client), bodies))
    assert [a.status_code for a in answers] == [200] * 64, [a.text for a in answers if a.status_code != 200][:3]
    assert [a.json()["data"][0]["seed"] for a in answers] == [1000 + i for i in range(64)]
    pictures = {a.json()["data"][0]["b64_json"] for a in answers}
    assert len(pictures) == 64  # each its own image, none answered with another's
    after = server.metrics()
    ok = 'qwen_image_fast_requests_total{endpoint="generations",outcome="ok"}'
    assert after[ok] - before.get(ok, 0) == 64
    assert after["qwen_image_fast_images_total"] - before["qwen_image_fast_images_total"] == 64
    sizes = [size for a in answers for size in a.json()["batch_sizes"]]
    assert max(sizes) > 1 and after["qwen_image_fast_queue_requests"] == 0


def test_a_full_queue_answers_429_with_retry_after(server):
    before = server.metrics()
    bodies = [dict(prompt=f"queue {i}", seed=i, num_inference_steps=2, true_cfg_scale=1.0) for i in range(40)]
    barrier = threading.Barrier(40)

    def send(body):
        with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as client:
            barrier.wait()
            return client.post("/v1/images/generations", json=body)

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(send, bodies))
    refused = [a for a in answers if a.status_code == 429]
    assert refused and all(a.status_code in (200, 429) for a in answers), [a.status_code for a in answers]
    for answer in refused:
        assert int(answer.headers["Retry-After"]) >= 1
        assert answer.json()["error"]["type"] == "rate_limit_error" and "queue is full" in answer.json()["error"][
            "message"]
    full = 'qwen_image_fast_requests_total{endpoint="generations",outcome="queue_full"}'
    assert server.metrics()[full] - before.get(full, 0) == len(refused)


def tiny_png(size=(32, 32)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


# (body, param, what the message says); each answered 400 with OpenAI's error object
BAD_GENERATIONS = [
    ({}, "prompt", "required"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": 5}, "prompt", "must be a string"),
    ({"prompt": "x" * 32001}, "prompt", "at most 32000"),
    ({"prompt": "a\ud800b"}, "prompt", "lone surrogate"),
    ({"prompt": "a", "n": 0}, "n", "1..10"),
    ({"prompt": "a", "n": 11}, "n", "1..10"),
    ({"prompt": "a", "n": "two"}, "n", "integer"),
    ({"prompt": "a", "n": True}, "n", "integer"),
    ({"prompt": "a", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "65x64"}, "size", "multiple of 16"),
    ({"prompt": "a", "size": "4096x4096"}, "size", "16..2048"),
    ({"prompt": "a", "size": "1024x1024", "width": 64}, "size", "not both"),
    ({"prompt": "a", "width": 64}, "height", "together"),
    ({"prompt": "a", "num_inference_steps": 1}, "num_inference_steps", "2..200"),
    ({"prompt": "a", "num_inference_steps": 201}, "num_inference_steps", "2..200"),
    ({"prompt": "a", "true_cfg_scale": "nan"}, "true_cfg_scale", "finite"),
    ({"prompt": "a", "true_cfg_scale": 25}, "true_cfg_scale", "0..20"),
    ({"prompt": "a", "true_cfg_scale": 1.0, "negative_prompt": "bad"}, "negative_prompt", "classifier-free"),
    ({"prompt": "a", "guidance_scale": 3.5}, "guidance_scale", "no guidance embedding"),
    ({"prompt": "a", "seed": -1}, "seed", "0.."),
    ({"prompt": "a", "seed": 2**64}, "seed", "0.."),
    ({"prompt": "a", "response_format": "url"}, "response_format", "b64_json only"),
    ({"prompt": "a", "output_format": "gif"}, "output_format", "png, jpeg, webp"),
    ({"prompt": "a", "output_compression": 50}, "output_compression", "lossless"),
    ({"prompt": "a", "output_format": "jpeg", "output_compression": 101}, "output_compression", "0..100"),
    ({"prompt": "a", "background": "transparent"}, "background", "opaque"),
    ({"prompt": "a", "quality": "hd"}, "quality", "no quality levels"),
    ({"prompt": "a", "stream": True}, "stream", "not served"),
    ({"prompt": "a", "style": "vivid"}, "style", "DALL-E 3"),
    ({"prompt": "a", "user": "u1"}, "user", "not recorded"),
    ({"prompt": "a", "colour": "red"}, "colour", "unknown field"),
    ({"prompt": "a", "model": "dall-e-3"}, "model", "serves 'tiny-random'"),
    ({"prompt": "a", "loras": [{"name": "nope"}]}, "loras", "unknown adapter 'nope'; loaded: style"),
    ({"prompt": "a", "loras": [{"name": "../style"}]}, "loras", "unknown adapter"),
    ({"prompt": "a", "loras": [{"name": "/etc/passwd"}]}, "loras", "unknown adapter"),
    ({"prompt": "a", "loras": [{"name": "style"}, {"name": "style"}]}, "loras", "named twice"),
    ({"prompt": "a", "loras": [{"name": "style", "weight": "x"}]}, "loras", "number"),
    ({"prompt": "a", "loras": {"name": "style"}}, "loras", "a list"),
    ({"prompt": "a", "lora": {"name": "style", "strength": 1}}, "lora", "unknown key 'strength'"),
    ({"prompt": "a", "step_cache": "off"}, "step_cache", "true or false"),
    ({"prompt": "a", "step_cache": True}, "step_cache", "runs no step cache"),
]


def test_bad_input_is_400_with_the_error_object(server):
    with server.client() as client:
        for body, param, says in BAD_GENERATIONS:
            answer = client.post("/v1/images/generations", content=json.dumps(body).encode())
            error = answer.json().get("error", {})
            assert answer.status_code == 400 and error.get("param") == param and says in error.get("message", ""), (
                body if len(str(body)) < 200 else param, answer.status_code, answer.text[:300])
            assert error["type"] == "invalid_request_error"
        for raw, says in ((b"{not json", "not JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not JSON")):
            answer = client.post("/v1/images/generations", content=raw)
            assert answer.status_code == 400 and says in answer.json()["error"]["message"], answer.text
        # the edits endpoint of a text-to-image model names the one it serves
        answer = client.post("/v1/images/edits", data={"prompt": "make it blue"},
                             files={"image": ("a.png", tiny_png(), "image/png")})
        assert answer.status_code == 400 and "serves /v1/images/generations" in answer.json()["error"]["message"]
        answer = client.post("/v1/images/generations", content=b"x" * (2 << 20))
        assert answer.status_code == 413 and "1 MiB" in answer.json()["error"]["message"]
    assert len(BAD_GENERATIONS) >= 30
    assert server.process.poll() is None  # no input brought it down


def test_api_key_on_every_route_but_health(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("get", "/v1/models"), ("get", "/metrics"), ("post", "/v1/images/generations")):
            answer = getattr(httpx, method)(f"{server.url}{path}", headers=headers, timeout=10)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", (path, headers)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    models = httpx.get(f"{server.url}/v1/models", headers=server.headers(), timeout=10).json()["data"][0]
    assert models["id"] == "tiny-random" and models["endpoint"] == "/v1/images/generations"
    assert models["loras"] == ["style"]


def test_per_request_loras_switch_without_reloading(server, pipe, lora_files):
    style, lora_dir = lora_files
    base = dict(prompt="a red fox", seed=3, num_inference_steps=2, true_cfg_scale=1.0)
    with server.client() as client:
        def image(**extra):
            answer = client.post("/v1/images/generations", json=base | extra)
            assert answer.status_code == 200, answer.text
            return decoded(answer.json()["data"][0]["b64_json"])

        styled = image(loras=[{"name": "style", "weight": 0.7}])
        plain = image()
        other = image(loras=[{"name": "other", "weight": 1.0}, {"name": "style", "weight": 0.5}])
        deep = image(lora={"name": "sub/deep", "scale": 1.0})
        again = image(loras=[{"name": "style", "weight": 0.7}])
    assert np.array_equal(styled, again)  # switching away and back leaves nothing behind
    assert len({a.tobytes() for a in (styled, plain, other, deep)}) == 4
    pipe.load_lora_weights(str(style), adapter_name="style")
    try:
        pipe.set_adapters(["style"], [0.7])
        want_styled = in_process_images(pipe, prompts=["a red fox"], seeds=[3], size=SIZE, steps=2, cfg=1.0)[0]
        pipe.disable_lora()
        want_plain = in_process_images(pipe, prompts=["a red fox"], seeds=[3], size=SIZE, steps=2, cfg=1.0)[0]
    finally:
        pipe.delete_adapters(["style"])
    assert np.array_equal(styled, want_styled) and np.array_equal(plain, want_plain)


def chromium_driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,1400"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def test_the_page_renders_and_compares_in_a_browser(server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ready
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = chromium_driver()
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 120)
        driver.find_element(By.ID, "api_key").send_keys(API_KEY)
        driver.execute_script("document.getElementById('api_key').dispatchEvent(new Event('change'))")
        wait.until(ready.text_to_be_present_in_element((By.ID, "model"), "tiny-random"))
        prompt = driver.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("a paper boat on a pond")
        driver.find_element(By.ID, "steps").send_keys("2")
        driver.find_element(By.ID, "seed").clear()
        driver.find_element(By.ID, "seed").send_keys("11")
        driver.find_element(By.ID, "render").click()
        wait.until(ready.text_to_be_present_in_element((By.ID, "status"), "done"))
        images = driver.find_elements(By.CSS_SELECTOR, "img.result")
        assert len(images) == 1 and driver.execute_script("return arguments[0].naturalWidth", images[0]) == 64
        settings = json.loads(driver.find_element(By.CSS_SELECTOR, ".settings").text)
        assert settings["prompt"] == "a paper boat on a pond" and settings["seed"] == 11 and settings["applied"]
        # side by side: the same prompt and seed at 3 steps against 2
        driver.find_element(By.ID, "compare").click()
        Select(driver.find_element(By.ID, "b_setting")).select_by_value("steps")
        driver.find_element(By.ID, "b_value").send_keys("3")
        driver.find_element(By.ID, "render").click()
        wait.until(ready.text_to_be_present_in_element((By.ID, "comparison"), "PSNR"))
        assert len(driver.find_elements(By.CSS_SELECTOR, "img.result")) == 2
        text = driver.find_element(By.ID, "comparison").text
        assert "dB" in text and "SSIM" in text, text
        if os.environ.get("QWEN_IMAGE_FAST_SCREENSHOT"):  # the README's picture
            driver.save_screenshot(os.environ["QWEN_IMAGE_FAST_SCREENSHOT"])
    finally:
        driver.quit()
