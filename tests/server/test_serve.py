"""`qwen-image-fast serve` under load, bad input, the API key and the page: the tiny text-to-image model with the
stock preset (diffusers' own pipeline: ~0.05 s an image on the CPU, so that 100 requests cost seconds), one real
server process on a loopback port for the module, driven by httpx and a headless Chromium (the fast preset through
the server: test_serve_fast.py). Its faults last, in order: a request past the 6 s timeout (long enough for
the 429 test's batches on a CPU that other test modules share), a client that goes away, kill -9 of the engine, SIGTERM (a SIGSTOP'd engine holds a batch in flight for as long as a test needs).

Requests batched together against the same requests served one at a time: within one 8-bit level, not bit for bit.
A batch pads its prompts' text to the longest and runs its GEMMs at another row count, and on the CPU that moves
fp32 outputs by ~5e-7 (stock diffusers itself: a list of prompts against each prompt alone), which can tip a
pixel's rounding.
"""

import base64
import concurrent.futures
import contextlib
import io
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from serving import API_KEY, Server, decoded

SIZE = (64, 64)
QUICK = dict(num_inference_steps=2, true_cfg_scale=1.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, lora_files):
    style, lora_dir = lora_files
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = Server(["--model", "tiny-random", "--preset", "baseline", "--device", "cpu", "--max-batch", "4",
                      "--max-wait-ms", "300", "--max-queue", "16", "--max-body-mb", "1", "--request-timeout", "6",
                      "--lora", f"style={style}",
                      "--lora-dir", str(lora_dir)], log)
    try:
        yield running.wait_ready()
    finally:
        running.stop()


def post(server, body, client=None, path="/v1/images/generations"):
    client = client or server.client()
    return client.post(path, json=body)


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
    batches = after["qwen_image_fast_batch_size_count"] - before.get("qwen_image_fast_batch_size_count", 0)
    for name in ("compute_seconds", "encode_seconds"):  # each batch's call and its images' encoding timed
        count, total = f"qwen_image_fast_{name}_count", f"qwen_image_fast_{name}_sum"
        assert after[count] - before.get(count, 0) == batches and after[total] > before.get(total, 0), name


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


def test_output_formats_random_seeds_and_lora_dir_names(server):
    """jpeg and webp as asked; no seed: a random one, returned; a LoRA named by its path inside --lora-dir."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    for fmt in ("jpeg", "webp"):
        answer = client.images.generate(prompt="a red fox", size="64x64", output_format=fmt, output_compression=80,
                                        extra_body=QUICK)
        assert answer.model_extra["seed_given"] is False and isinstance(answer.data[0].model_extra["seed"], int)
        with Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))) as image:
            assert image.format == fmt.upper() and image.size == SIZE
            assert json.loads(image.getexif()[0x010E])["seed"] == answer.data[0].model_extra["seed"]
    plain, deep = (decoded(client.images.generate(prompt="a red fox", size="64x64", extra_body=dict(
        seed=1, **QUICK, **extra)).data[0].b64_json) for extra in ({}, {"lora": {"name": "sub/deep", "scale": 1.0}}))
    assert not np.array_equal(plain, deep)


def test_a_request_failing_in_the_pipeline_is_500_and_the_others_are_served(server):
    with server.client() as client:
        failed = client.post("/v1/images/generations", json=dict(prompt="a", seed=1, loras=[{"name": "broken"}], **QUICK))
        error = failed.json()["error"]
        assert failed.status_code == 500 and error["type"] == "server_error" and "broken" in error["message"], failed.text
        assert "Traceback" not in failed.text
        for seed in (2, 3):
            assert client.post("/v1/images/generations", json=dict(prompt="a", seed=seed, **QUICK)).status_code == 200
    assert server.metrics()['qwen_image_fast_requests_total{endpoint="generations",outcome="engine_error"}'] == 1


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
    ({"prompt": "x" * 500}, "prompt", "513 tokens; the text encoder reads at most 512"),  # byte-level tokenizer
    ({"prompt": "a", "negative_prompt": "y" * 600}, "negative_prompt", "reads at most 512"),
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
        assert settings["prompt"] == "a paper boat on a pond" and settings["seed"] == 11
        assert settings["applied"] == []  # the stock preset: nothing of ours ran
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


def batches_run(server) -> float:
    return server.metrics()["qwen_image_fast_batch_size_count"]


def wait_until_idle(server, timeout=60):
    """No request queued, no engine running a batch, none encoding one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if all(metrics[f"qwen_image_fast_{name}"] == 0 for name in ("queue_requests", "engines_busy",
                                                                       "batches_encoding")):
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become idle")


@contextlib.contextmanager
def frozen(pid: int):
    """The engine stopped (SIGSTOP) until the block ends: a batch sent to it stays in flight for as long as the test
    needs, whatever the machine's speed."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_past_its_timeout_504_and_a_queued_request_is_never_rendered(server):
    wait_until_idle(server)
    before = batches_run(server)
    [engine] = server.engine_pids()
    with frozen(engine), concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, server, dict(prompt="running", seed=1, **QUICK))
        time.sleep(0.5)  # sent to the engine; the next one (another step count: its own batch) queues behind it
        queued = pool.submit(post, server, dict(prompt="queued", seed=2, num_inference_steps=3, true_cfg_scale=1.0))
        for answer in (running.result(), queued.result()):  # the server's --request-timeout is 6 s
            assert answer.status_code == 504 and answer.json()["error"]["code"] == "timeout", answer.text
    wait_until_idle(server)
    assert batches_run(server) - before == 1  # the running one's batch finished unused; the queued one never ran


def test_a_client_that_goes_away_has_its_queued_work_dropped(server):
    wait_until_idle(server)
    before, metrics = batches_run(server), server.metrics()
    gone = 'qwen_image_fast_requests_total{endpoint="generations",outcome="disconnected"}'
    [engine] = server.engine_pids()
    with frozen(engine), concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(post, server, dict(prompt="running", seed=1, **QUICK))
        time.sleep(0.3)
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(base_url=server.url, headers=server.headers(), timeout=0.5) as impatient:
                impatient.post("/v1/images/generations", json=dict(prompt="impatient", seed=3, num_inference_steps=3,
                                                                   true_cfg_scale=1.0))
        time.sleep(0.5)  # the server notices within its 0.25 s poll
    assert running.result().status_code in (200, 504)
    wait_until_idle(server)
    assert batches_run(server) - before == 1
    assert server.metrics()[gone] - metrics.get(gone, 0) == 1


def test_kill_9_of_the_engine_gives_503_then_it_restarts(server):
    wait_until_idle(server)
    [engine] = server.engine_pids()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        os.kill(engine, signal.SIGSTOP)  # never continued: killed while its batch is in flight
        running = pool.submit(post, server, dict(prompt="running", seed=1, **QUICK))
        time.sleep(0.5)
        os.kill(engine, signal.SIGKILL)
        answer = running.result()
    assert answer.status_code == 503 and "engine 0 stopped" in answer.json()["error"]["message"], answer.text
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.3)
    later = post(server, dict(prompt="after the restart", seed=4, **QUICK))
    assert later.status_code == 200 and server.engine_pids() != [engine]
    assert server.metrics()["qwen_image_fast_engine_restarts_total"] == 1


def test_sigterm_drains_then_exits_0(server):
    wait_until_idle(server)
    [engine] = server.engine_pids()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with frozen(engine):
            running = pool.submit(post, server, dict(prompt="in flight", seed=5, **QUICK))
            time.sleep(0.3)
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            refused = post(server, dict(prompt="too late", seed=6, **QUICK))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
        assert running.result().status_code == 200
    assert server.process.wait(60) == 0


def test_the_images_response_is_the_json_of_its_fields():
    """The response body, built with each image's base64 spliced in as bytes (app.images_response), parses to what
    json.dumps of the same object gives: one and two images, fields with non-ASCII text and nesting."""
    import base64
    import json
    import os

    from qwen_image_fast.server.app import images_response

    fields = {"output_format": "png", "size": "64x48", "applied": ["fp8", "attention:fa4"], "batch_sizes": [2],
              "seed": 7, "seed_given": True, "note": "ein Fuchs im Schnee ü \" \\ \n"}
    for n in (1, 2):
        images = [os.urandom(1000 + i) for i in range(n)]
        response = images_response(images, [7 + i for i in range(n)], fields)
        body = json.loads(response.body)
        assert response.media_type == "application/json"
        assert body.pop("created") > 0
        assert body == {"data": [{"b64_json": base64.b64encode(image).decode(), "seed": 7 + i}
                                 for i, image in enumerate(images)], **fields}
