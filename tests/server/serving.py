"""What the server tests share: a real `qwen-image-fast serve` process on a free loopback port, its engines' pids,
and the in-process render a served image must equal.

Each test module starts one server (a module-scoped fixture): starting one costs ~20 s on the CPU (two processes
import torch and diffusers, and the engine warms the tiny model up under Triton's interpreter).
"""

import base64
import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

API_KEY = "test-key-123"
READY_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`qwen-image-fast serve ARGS` on 127.0.0.1:<free port>, its output in LOG."""

    def __init__(self, args: list[str], log: Path, api_key: str | None = API_KEY):
        self.port, self.api_key, self.log = free_port(), api_key, log
        command = [sys.executable, "-m", "qwen_image_fast", "serve", "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        self.out = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self.out, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = f"http://127.0.0.1:{self.port}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=kwargs.pop("timeout", 120), **kwargs)

    def wait_ready(self):
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"not ready within {READY_TIMEOUT_S} s:\n{self.log.read_text()}")

    def engine_pids(self) -> list[int]:
        """The engine processes: the server's children (the spawn start method's resource tracker aside)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid and b"resource_tracker" not in cmdline:
                pids.append(int(stat.parent.name))
        return pids

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers(), timeout=10).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self.out.close()


def decoded(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image.convert("RGB"))


def in_process_images(pipe, *, prompts, seeds, size, steps, cfg, negative=None, images=()) -> list[np.ndarray]:
    """What render's run_batch gives for these images in one call of `pipe` (the call a server engine makes), as
    8-bit RGB."""
    from qwen_image_fast.cli.jobs import Job
    from qwen_image_fast.cli.run import run_batch
    from qwen_image_fast.server.engine import UploadedImage

    inputs = tuple(UploadedImage(data) for data in images)
    jobs = [Job(index=i, id=None, prompt=p, negative_prompt=negative, seed=s, width=size and size[0],
                height=size and size[1], steps=steps, cfg=cfg, images=inputs) for i, (p, s) in enumerate(zip(prompts, seeds))]
    return [np.asarray(image.convert("RGB")) for image in run_batch(pipe, jobs, None)]
