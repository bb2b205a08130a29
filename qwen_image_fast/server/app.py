"""The HTTP side: FastAPI routes, the API key, body limits, draining, and every error in OpenAI's shape.

    POST /v1/images/generations   JSON (protocol.py)            GET /v1/models    the served model and its LoRAs
    POST /v1/images/edits         multipart: image / image[], mask GET /health    200 once warmed up, else 503
    POST /v1/compare              PSNR / SSIM of two images     GET /metrics      Prometheus text
    GET  /                        the page (page.html)

With an API key every route but /health and the page needs `Authorization: Bearer KEY` (compared in constant time);
the page is static HTML that asks for the key and sends it with each call (a browser sends no bearer token when it
opens a page). A request waits for its images at most request_timeout_s (then 504, its queued images dropped); a
client that disconnects has its queued images dropped.
"""

import asyncio
import base64
import hmac
import io
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from .engine import Work
from .metrics import Metrics
from .protocol import ApiError, Served, parse_request
from .scheduler import Scheduler

PAGE = Path(__file__).with_name("page.html")
OPEN_PATHS = ("/health", "/")  # no API key: the health probe, and the page (it asks for the key itself)
POLL_S = 0.25  # how often a waiting request looks for its client having gone


@dataclass
class ServerState:
    served: Served
    scheduler: Scheduler
    metrics: Metrics
    settings: dict  # what every image records besides its request's fields: model, preset, options
    api_key: str | None = None
    request_timeout_s: float = 600.0
    max_body_bytes: int = 64 << 20
    draining: bool = False
    started: float = field(default_factory=time.time)


class BodyTooLarge(Exception):
    pass


def images_response(images: list[bytes], seeds: list[int], fields: dict) -> Response:
    """OpenAI's images response, {"created", "data": [{"b64_json", "seed"}, ...], then `fields`}, as JSON bytes:
    each image's base64 (ASCII, nothing to escape) is spliced in as bytes, rather than passed as a string through
    the JSON encoder, which takes ~19 ms a 4 MB image (a 1024x1024 noise PNG) on the CI machine, in the event
    loop's thread."""
    parts = [b'{"created":%d,"data":[' % int(time.time())]
    for i, (image, seed) in enumerate(zip(images, seeds)):
        parts += [b',' if i else b'', b'{"b64_json":"', base64.b64encode(image), b'","seed":%d}' % seed]
    parts += [b'],', json.dumps(fields, ensure_ascii=False, allow_nan=False, separators=(",", ":"))[1:].encode()]
    return Response(b"".join(parts), media_type="application/json")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def endpoint_of(path: str) -> str:
    return path.rsplit("/", 1)[-1] if path.startswith("/v1/") else path.strip("/") or "page"


class Gate:
    """The API key and draining, as plain ASGI middleware (Starlette's BaseHTTPMiddleware wraps `receive`, and a
    request behind it never sees its client disconnect)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, path = self.state, scope["path"]
        error = None
        if state.api_key is not None and path not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {state.api_key}".encode()):
                state.metrics.request(endpoint_of(path), "unauthorized")
                error = ApiError(401, "a valid API key is required: send Authorization: Bearer KEY",
                                 code="invalid_api_key")
        if error is None and state.draining and path != "/health":
            state.metrics.request(endpoint_of(path), "unavailable")
            error = ApiError(503, "the server is shutting down: send this request to another one", type="server_error",
                             code="shutting_down")
        if error is not None:
            return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="qwen-image-fast", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.server = state

    app.add_middleware(Gate, state=state)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        return error_response(ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error"))

    @app.get("/health")
    async def health():
        ready, engines = state.scheduler.ready, len(state.scheduler.engines)
        status = ("draining" if state.draining else "ok" if ready else
                  "failed" if len(state.scheduler.failures) == engines else "loading")
        body = {"status": status, "engines_ready": ready, "engines": engines}
        if state.scheduler.failures:
            body["failures"] = state.scheduler.failures
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        served = state.served
        return {"object": "list", "data": [{
            "id": served.model, "object": "model", "created": int(state.started), "owned_by": "qwen-image-fast",
            "pipeline": served.pipeline, "endpoint": f"/v1/images/{served.endpoint}", "loras": list(served.loras),
            "lora_dir": served.lora_dir is not None, "step_cache": served.step_cache,
            "default_size": None if served.default_size is None else "{}x{}".format(*served.default_size),
            "default_steps": served.default_steps, "default_true_cfg_scale": served.default_cfg}]}

    @app.get("/metrics")
    async def metrics():
        scheduler = state.scheduler
        busy = sum(engine.busy is not None for engine in scheduler.engines)
        encoding = sum(len(engine.encoding) for engine in scheduler.engines)
        return PlainTextResponse(state.metrics.render(len(scheduler.pending), scheduler.queued_images(),
                                                      scheduler.ready, busy, encoding, len(scheduler.engines)),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text())

    @app.post("/v1/images/generations")
    async def generations(request: Request):
        return await serve(request, "generations")

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        return await serve(request, "edits")

    @app.post("/v1/compare")
    async def compare(request: Request):
        body = await json_body(request)
        return compare_images(body)

    async def serve(request: Request, endpoint: str):
        try:
            if endpoint == "generations":
                body, files = await json_body(request), None
            else:
                body, files = await form_body(request)
            result = await render(request, endpoint, body, files)
        except ApiError as e:
            outcome = {400: "bad_request", 413: "bad_request", 429: "queue_full", 504: "timeout",
                       503: "unavailable"}.get(e.status, "engine_error")
            state.metrics.request(endpoint, outcome)
            return error_response(e)
        except BodyTooLarge:
            state.metrics.request(endpoint, "bad_request")
            return error_response(ApiError(413, f"the request body is over {state.max_body_bytes >> 20} MiB",
                                           code="body_too_large"))
        if result is None:
            state.metrics.request(endpoint, "disconnected")
            return JSONResponse({}, status_code=499)
        state.metrics.request(endpoint, "ok")
        return result

    async def render(request: Request, endpoint: str, body: dict, files) -> Response | None:
        if not state.scheduler.ready:
            raise ApiError(503, "no engine is ready yet (the model is loading or restarting): retry shortly",
                           type="server_error", code="not_ready", headers={"Retry-After": "5"})
        parsed = parse_request(body, state.served, endpoint, files)
        record = image_record(parsed, state.settings)
        works = [Work(prompt=parsed.prompt, negative_prompt=parsed.negative_prompt, seed=parsed.seed + i,
                      output_format=parsed.output_format, output_compression=parsed.output_compression,
                      settings=dict(record, seed=parsed.seed + i))
                 for i in range(parsed.n)]
        item = state.scheduler.submit(parsed, works)
        deadline = time.perf_counter() + state.request_timeout_s
        while not item.future.done():
            if time.perf_counter() > deadline:
                state.scheduler.drop(item)
                item.finish(ApiError(504, f"not rendered within {state.request_timeout_s:g} s (queued images "
                                          "dropped)", type="server_error", code="timeout"))
                break
            if await request.is_disconnected():
                state.scheduler.drop(item)
                item.finish(None)
                return None
            await asyncio.wait({item.future}, timeout=POLL_S)
        done = item.future.result()  # raises the ApiError it failed with
        if done is None:
            return None
        state.metrics.images += parsed.n
        return images_response([done.results[i] for i in range(parsed.n)], [parsed.seed + i for i in range(parsed.n)],
                               {"output_format": parsed.output_format, "size": size_of_image(done.results[0]),
                                "applied": done.applied, "batch_sizes": done.batch_sizes, "seed": parsed.seed,
                                "seed_given": parsed.seed_given})

    async def json_body(request: Request) -> dict:
        raw = await read_limited(request)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return body

    async def form_body(request: Request) -> tuple[dict, dict]:
        if "multipart/form-data" not in request.headers.get("content-type", ""):
            raise ApiError(400, "the edits endpoint takes multipart/form-data (image files and fields)",
                           code="invalid_content_type")
        length = int(request.headers.get("content-length") or 0)
        if length > state.max_body_bytes:
            raise BodyTooLarge()
        try:
            form = await request.form(max_files=64, max_fields=128, max_part_size=state.max_body_bytes)
        except Exception as e:
            raise ApiError(400, f"the multipart body cannot be read ({type(e).__name__}: {e})",
                           code="invalid_multipart") from None
        body, files = {}, {"image": [], "mask": []}
        for key, value in form.multi_items():
            if hasattr(value, "read"):  # an uploaded file
                name = "image" if key in ("image", "image[]") else key
                if name not in files:
                    raise ApiError(400, f"{key}: unexpected file; files go in image (or image[]) and mask",
                                   param=key, code="invalid_value")
                files[name].append(await value.read())
            elif key in body:
                raise ApiError(400, f"{key}: given twice", param=key, code="invalid_value")
            else:
                body[key] = value
        if isinstance(body.get("step_cache"), str):  # numbers as text are read by protocol.integer / number
            body["step_cache"] = {"true": True, "false": False}.get(body["step_cache"], body["step_cache"])
        return body, files

    async def read_limited(request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > state.max_body_bytes:
                raise BodyTooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    return app


def image_record(parsed, settings: dict) -> dict:
    """What a request's images record (embedded in the file, as render's images record theirs), each with its own
    seed in place of the request's."""
    record = dict(prompt=parsed.prompt, negative_prompt=parsed.negative_prompt, seed=parsed.seed, width=parsed.width,
                  height=parsed.height, steps=parsed.steps, cfg=parsed.cfg, **settings)
    if parsed.images:
        import hashlib

        record["images"] = [{"sha256": hashlib.sha256(data).hexdigest()} for data in parsed.images]
    if parsed.loras:
        record["loras"] = [{"name": name, "weight": weight} for name, weight in parsed.loras]
    if not parsed.step_cache:
        record["step_cache"] = False
    return record


def size_of_image(data: bytes) -> str:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return f"{image.width}x{image.height}"


def compare_images(body: dict) -> dict:
    """{"a": base64 image, "b": base64 image} -> PSNR, SSIM and max |A-B| (cli/compare.py's measures)."""
    import numpy as np
    from PIL import Image

    from ..cli import compare

    arrays = []
    for side in ("a", "b"):
        value = body.get(side)
        if not isinstance(value, str):
            raise ApiError(400, f"{side}: a base64-encoded image is required", param=side, code="invalid_value")
        try:
            with Image.open(io.BytesIO(base64.b64decode(value, validate=True))) as image:
                arrays.append(np.asarray(image.convert("RGB")))
        except Exception:
            raise ApiError(400, f"{side}: not a base64-encoded image PIL reads", param=side,
                           code="invalid_value") from None
    a, b = arrays
    if a.shape != b.shape:
        raise ApiError(400, f"the images differ in size: {a.shape[1]}x{a.shape[0]} and {b.shape[1]}x{b.shape[0]}",
                       param="b", code="invalid_value")
    psnr = compare.psnr(a, b)
    return {"psnr": None if psnr == float("inf") else psnr, "identical": psnr == float("inf"),
            "ssim": compare.ssim(a, b), "max_abs": int(np.abs(a.astype(int) - b.astype(int)).max())}
