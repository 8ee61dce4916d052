"""The HTTP front: a FastAPI app on Ray Serve, speaking OpenAI's Videos API.

    POST   /v1/videos                 create (multipart/form-data as the openai client sends
                                      it, or JSON); raydit's fields as extra form fields
    GET    /v1/videos                 list, newest first (`after`, `limit`, `order`)
    GET    /v1/videos/{id}            the video object (status, progress, error);
                                      `?wait=S` holds it until the video finishes (<= S s)
    GET    /v1/videos/{id}/content    video/mp4 once completed
    DELETE /v1/videos/{id}            queued: removed; running: stops at its next step
    GET    /healthz, /metrics (Prometheus text), /  (a small page: prompt, progress, player)

Every /v1 route needs `Authorization: Bearer TOKEN`. One Serve replica holds the service
and its `Engine`; the engine's own replicas (and ranks) are Ray actors it starts, so
`--replicas` scales the model, not the HTTP front. `build(args)` is the application
builder a Serve config file or a KubeRay RayService names
(`import_path: raydit.serve.app:build`).
"""


import base64
import binascii
import io
import os

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from raydit.models.registry import families
from raydit.runtime.video import playback_fps
from raydit.serve.auth import TOKEN_ENV, bearer_ok, token_digest
from raydit.serve.page import PAGE_HTML
from raydit.serve.schema import Limits, RequestError, lora_error, parse_body, resolve, scheduler_step_limit

MAX_IMAGE_BYTES = 20 * 1024 * 1024
# A request body: the image as base64 in JSON (4/3 of its bytes) or a multipart file, plus a
# megabyte for the fields. Larger bodies are refused before they are read into memory.
MAX_BODY_BYTES = MAX_IMAGE_BYTES * 4 // 3 + 1024 * 1024
# A finished video up to this size is sent as one body (no Range asked); larger ones stream.
WHOLE_BODY_BYTES = 8 * 1024 * 1024
app = FastAPI(title="raydit", summary="Video generation on Ray, OpenAI Videos API", docs_url="/docs",
              redoc_url=None)


class VideoFileResponse(FileResponse):
    """A file response read and sent in 1 MiB pieces instead of Starlette's 64 KiB: behind Ray
    Serve every piece is one message from the replica to the proxy, so a 10 MB video is 10
    of them instead of 160. Range requests (the page's player seeks) work as before."""

    chunk_size = 1 << 20


def video_file_response(path, filename: str, ranged: bool) -> Response:
    """A stored mp4: up to WHOLE_BODY_BYTES and no Range asked, one body read at once (one
    message from the replica to the proxy and no file thread: about half the front's CPU of
    a streamed small file); else streamed from the file (VideoFileResponse: 1 MiB pieces,
    Range requests)."""
    if not ranged and os.path.getsize(path) <= WHOLE_BODY_BYTES:
        with open(path, "rb") as f:
            body = f.read()
        return Response(body, media_type="video/mp4", headers={
            "content-disposition": f'attachment; filename="{filename}"', "accept-ranges": "bytes"})
    return VideoFileResponse(path, media_type="video/mp4", filename=filename)


def check_range(header: str, size: int) -> None:
    """A Range header Starlette's file response would refuse in plain text (400 with no
    JSON, or a bare 416), refused here in OpenAI's error shape with the same status."""
    try:  # Starlette's own parser (1.x), so the answer is the one it would give
        from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable

        parse = VideoFileResponse._parse_range_header
    except (ImportError, AttributeError):  # another Starlette: it answers bad ranges itself
        return
    try:
        parse(header, size)
    except MalformedRangeHeader as exc:
        raise RequestError(f"Range {header!r}: {exc.content.removeprefix('Range header: ').rstrip('.')}; give bytes=START-END "
                           f"within the video's {size} bytes", param="range") from None
    except RangeNotSatisfiable:
        raise RequestError(f"Range {header!r} starts beyond the video's {size} bytes; give bytes=START-END with "
                           f"START below {size}", param="range", status=416, code="range_not_satisfiable",
                           headers={"Content-Range": f"bytes */{size}"}) from None


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(RequestError)
async def _request_error(request: Request, exc: RequestError):
    return _error(exc.status, exc.message, exc.param, exc.code, exc.headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    # Routing errors (an unknown path or method) in the same shape as every other error.
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", None, code,
                  getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    parts, first = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x not in ("query", "path", "body")]
        field = ".".join(loc) or "request"
        first = first or field
        parts.append(f"{field}: {err.get('msg')}")
    return _error(400, "; ".join(parts), first, "invalid_value")


def _read_token_digest(options: dict) -> str:
    """On the replica: $RAYDIT_API_TOKEN, else the token file (never created here)."""
    from raydit.serve.auth import load_or_create_token

    if os.environ.get(TOKEN_ENV):
        return token_digest(os.environ[TOKEN_ENV].strip())
    path = options.get("token_file")
    if path and os.path.isfile(os.path.expanduser(path)):
        return token_digest(load_or_create_token(os.path.expanduser(path))[0])
    raise ValueError(
        f"no API token on the serving node: set {TOKEN_ENV} (e.g. from a Kubernetes secret) or "
        "token_file to an existing file; raydit serve never runs without one"
    )


def _decode_image(data: bytes, where: str) -> bytes:
    """An uploaded reference image, checked and re-encoded as PNG."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(f"{where}: image is {len(data)} bytes; at most {MAX_IMAGE_BYTES}", param="input_reference")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError):
        raise RequestError(f"{where}: not an image PIL can read (PNG, JPEG, WebP, ...)",
                           param="input_reference") from None
    out = io.BytesIO()
    image.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def _too_large(size: str) -> RequestError:
    return RequestError(f"the request body is {size}; at most {MAX_BODY_BYTES} bytes (a reference image "
                        f"of at most {MAX_IMAGE_BYTES} bytes and the fields)", status=413,
                        code="request_too_large")


async def _bounded(request: Request) -> Request:
    """`request` with its body read, refused with a 413 past MAX_BODY_BYTES: at once by its
    Content-Length, or as soon as a body sent in chunks (no length) grows past it, so that
    no oversized upload is held in memory. The body is handed on as a fresh Request."""
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        raise _too_large(f"{int(length)} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large(f"over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


async def _read_body(request: Request) -> tuple[dict, bytes | None]:
    """Form (multipart or urlencoded) or JSON -> (fields, reference image as PNG or None)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in ("multipart/form-data", "application/x-www-form-urlencoded", "application/json", ""):
        raise RequestError(
            f"content-type {ctype!r} is not accepted; send multipart/form-data or application/json", status=415,
            code="unsupported_media_type",
        )
    request = await _bounded(request)
    image = None
    if ctype in ("multipart/form-data", "application/x-www-form-urlencoded"):
        form = await request.form()
        data: dict = {}
        for key in form.keys():
            values = form.getlist(key)
            if len(values) > 1:
                raise RequestError(f"{key}: given {len(values)} times; give it once", param=key)
            value = values[0]
            if key == "input_reference":
                if isinstance(value, str):
                    raise RequestError("input_reference: upload the image as a file", param="input_reference")
                image = _decode_image(await value.read(), "input_reference")
            elif not isinstance(value, str):
                raise RequestError(f"{key}: a file was uploaded; only input_reference takes a file", param=key)
            else:
                data[key] = value
        return data, image
    # JSON
    try:
        data = await request.json()
    except ValueError:
        raise RequestError("the body is not valid JSON", param=None) from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object of fields", param=None)
    ref = data.pop("input_reference", None)
    if ref is not None:
        url = ref.get("image_url") if isinstance(ref, dict) else None
        if not isinstance(url, str) or not url.startswith("data:image/") or "," not in url:
            raise RequestError(
                "input_reference: in JSON give {\"image_url\": \"data:image/png;base64,...\"} "
                "(or upload a file with multipart/form-data); file ids and remote URLs are not fetched",
                param="input_reference",
            )
        try:
            raw = base64.b64decode(url.split(",", 1)[1], validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("input_reference: the data URL is not valid base64",
                               param="input_reference") from None
        image = _decode_image(raw, "input_reference")
    return data, image


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=512,
    graceful_shutdown_timeout_s=60,
    health_check_period_s=10,
    health_check_timeout_s=60,
)
@serve.ingress(app)
class VideoAPI:
    """The service behind the HTTP routes; the Engine starts in this replica's process."""

    def __init__(self, options: dict, token_sha256: str | None = None):
        from raydit.runtime.engine import Engine
        from raydit.serve.config import engine_kwargs
        from raydit.serve.service import VideoService
        from raydit.serve.store import VideoStore

        self._digest = token_sha256 or _read_token_digest(options)
        store = VideoStore(options["output_dir"])
        self.engine = Engine(**engine_kwargs(options))
        self.lora_dir = options.get("lora_dir")
        spec = self.engine.spec
        max_steps, steps_by = options["max_steps"], "--max-steps"
        trained = scheduler_step_limit(self.engine.model_dir)
        if trained is not None and trained < max_steps:
            max_steps, steps_by = trained, "the timesteps the model's scheduler was trained with"
        self.limits = Limits(
            model=options["model"],
            max_frames=options.get("frames") or spec.default_frames,
            max_height=options.get("height") or spec.default_height,
            max_width=options.get("width") or spec.default_width,
            max_steps=max_steps,
            steps_limited_by=steps_by,
            # What a request leaves out: --default-steps, else the model's pipeline's own (as its guidance).
            default_steps=min(options.get("default_steps") or self.engine.call_defaults["num_inference_steps"],
                              max_steps),
            default_guidance=self.engine.call_defaults["guidance_scale"],
            fps=options.get("fps") or playback_fps(spec.frame_rate),  # as GenerationResult.save
            vae_temporal=spec.vae_temporal,
            guidance_options=tuple(getattr(families().get(spec.family), "option_names", ())),
            cache=self.engine.cache,
            model_dir=self.engine.model_dir,
        )
        # capacity: the engine's replicas as they are now (they may follow the queue).
        self.service = VideoService(self.engine, store, self.limits, max_queue=options["max_queue"])
        for note in self.service.notes:
            print(f"raydit serve: {note}", flush=True)

    def _auth(self, request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), self._digest):
            raise RequestError(
                "missing or wrong API token: send the header 'Authorization: Bearer TOKEN' "
                "(the token is in the server's --token-file or $RAYDIT_API_TOKEN)",
                status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )

    def _job(self, video_id: str):
        job = self.service.get(video_id)
        if job is None:
            raise RequestError(f"no video with id {video_id!r}", param="video_id", status=404, code="not_found")
        return job

    # -- open routes -------------------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page(self):
        return HTMLResponse(PAGE_HTML)

    @app.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "model": self.limits.model, "replicas": self.service.capacity,
                **self.service.counts()}

    @app.get("/metrics", include_in_schema=False)
    async def metrics(self):
        body, ctype = self.service.metrics_text()
        return Response(body, media_type=ctype)

    # -- /v1 ---------------------------------------------------------------------------------

    @app.post("/v1/videos")
    async def create(self, request: Request):
        self._auth(request)
        data, image = await _read_body(request)
        body = parse_body(data)
        params = resolve(body, self.limits, self.engine.spec, loras=self.engine.loras(), fused=self.engine.fused_lora)
        job = self.service.create(params, image_png=image)
        return self._video_response(job)

    @app.get("/v1/videos")
    async def list_videos(self, request: Request, after: str | None = None, limit: int = 20, order: str = "desc"):
        self._auth(request)
        if not 1 <= limit <= 100:
            raise RequestError(f"limit {limit} must be between 1 and 100", param="limit")
        if order not in ("asc", "desc"):
            raise RequestError(f"order {order!r} must be 'asc' or 'desc'", param="order")
        jobs, has_more = self.service.list(after=after, limit=limit, order=order)
        data = [self.service.video_object(j) for j in jobs]
        return {
            "object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
        }

    @app.get("/v1/videos/{video_id}")
    async def retrieve(self, request: Request, video_id: str, wait: float = 0.0):
        """`wait` (raydit's own, seconds): hold the answer until the video is finished, at
        most that long: a long poll (the openai client sends it as extra_query)."""
        from raydit.serve.service import MAX_WAIT_S

        self._auth(request)
        if not 0 <= wait <= MAX_WAIT_S:
            raise RequestError(f"wait {wait:g} must be between 0 and {MAX_WAIT_S:g} seconds "
                               "(ask again after a wait ends)", param="wait")
        job = self._job(video_id)
        if wait > 0:
            await self.service.wait_finished(video_id, wait)
            job = self._job(video_id)  # 404 if it was deleted meanwhile
        return self._video_response(job)

    def _video_response(self, job) -> JSONResponse:
        """A video object; while it is unfinished, with the poll interval the server advises
        (OpenAI's `openai-poll-after-ms`, which the openai client follows)."""
        body, ms = self.service.video_state(job)  # one moment's: a finished video gets no interval
        return JSONResponse(body, headers=None if ms is None else {"openai-poll-after-ms": str(ms)})

    @app.get("/v1/videos/{video_id}/content")
    async def content(self, request: Request, video_id: str, variant: str = "video"):
        self._auth(request)
        if variant != "video":
            raise RequestError(f"variant {variant!r} is not served; only 'video' (the mp4)", param="variant")
        job = self._job(video_id)
        if job.status != "completed":
            raise RequestError(
                f"video {video_id} is {job.status}; its content is ready when status is 'completed'",
                param="video_id", status=409, code="not_ready",
            )
        path = self.service.store.video_path(video_id)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:  # deleted since it was looked up
            raise RequestError(f"no video with id {video_id!r}", param="video_id", status=404,
                               code="not_found") from None
        if "range" in request.headers and "if-range" not in request.headers:
            check_range(request.headers["range"], size)
        return video_file_response(path, f"{video_id}.mp4", ranged="range" in request.headers)

    @app.delete("/v1/videos/{video_id}")
    async def delete(self, request: Request, video_id: str):
        self._auth(request)
        if not self.service.delete(video_id):
            raise RequestError(f"no video with id {video_id!r}", param="video_id", status=404, code="not_found")
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    # -- /v1/loras: LoRA adapters on every rank ----------------------------------------------

    def _lora_object(self, name: str, path: str) -> dict:
        """A LoRA as the API shows it: its path relative to --lora-dir (None when it was loaded
        from elsewhere at start: the server's own paths are not shown)."""
        from pathlib import Path

        shown = None
        if self.lora_dir and Path(path).resolve().is_relative_to(Path(self.lora_dir).resolve()):
            shown = str(Path(path).resolve().relative_to(Path(self.lora_dir).resolve()))
        fused = self.engine.fused_lora or {}
        return {"object": "lora", "name": name, "path": shown, "fused_scale": fused.get(name)}

    @app.post("/v1/loras")
    async def load_lora(self, request: Request):
        """Load a LoRA on every rank of every replica; waits for the requests running now."""
        from starlette.concurrency import run_in_threadpool

        from raydit.serve.schema import LoraCreate, lora_path

        self._auth(request)
        data, image = await _read_body(request)
        if image is not None:
            raise RequestError("input_reference: not a field of a LoRA", param="input_reference")
        body = parse_body(data, LoraCreate)
        file = lora_path(self.lora_dir, body.path)
        try:
            name = await run_in_threadpool(self.engine.load_lora, str(file), body.name, body.target)
        except ValueError as exc:
            raise lora_error(exc, self.lora_dir) from None
        return self._lora_object(name, str(file))

    @app.get("/v1/loras")
    async def list_loras(self, request: Request):
        self._auth(request)
        data = [self._lora_object(n, p) for n, p in sorted(self.engine.loras().items())]
        return {"object": "list", "data": data, "has_more": False}

    @app.delete("/v1/loras/{name}")
    async def unload_lora(self, request: Request, name: str):
        from starlette.concurrency import run_in_threadpool

        self._auth(request)
        if name not in self.engine.loras():
            raise RequestError(f"no LoRA named {name!r}; loaded: {', '.join(sorted(self.engine.loras())) or 'none'}",
                               param="name", status=404, code="not_found")
        try:
            await run_in_threadpool(self.engine.unload_lora, name)
        except ValueError as exc:
            raise lora_error(exc, self.lora_dir) from None
        return {"name": name, "object": "lora.deleted", "deleted": True}

    # -- Serve hooks -------------------------------------------------------------------------

    async def close_service(self) -> None:
        """Called through a handle by `raydit serve` before it deletes the application: stop
        taking requests, keep running ones as queued, and answer the long polls now (Serve
        drains the open HTTP requests before it calls __del__, and a long poll would hold
        that drain for its whole wait)."""
        from starlette.concurrency import run_in_threadpool

        await run_in_threadpool(self.service.close)

    def check_health(self):
        if not self.engine.replicas:
            raise RuntimeError("the engine has no replicas left")

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build(args: dict):
    """Application builder for Serve config files and KubeRay's RayService: `args` are
    `raydit serve` options (the same keys as serve.yaml). The token is read on the serving
    node from $RAYDIT_API_TOKEN or `token_file`."""
    from raydit.serve.config import resolve_serve_options

    options = resolve_serve_options({k.replace("-", "_"): v for k, v in (args or {}).items()})
    return VideoAPI.bind(options)
