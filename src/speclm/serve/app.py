"""The OpenAI-compatible HTTP application (FastAPI): routes, streaming, auth and errors.

Every request is validated completely (JSON, types, ranges, model name, prompt length against
the context) before it is queued, so a user mistake is a 4xx with an OpenAI error body and a
stream only starts once the request is known to be good. Streams are server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``; a client that disconnects has its request
aborted, which frees its batch row at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SpeclmError
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, chunk_body,
                       completion_body, new_id, parse_request, speculation, sse, usage)
from .worker import Event, EngineWorker

log = logging.getLogger("speclm.serve")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
_POLL_S = 0.5  # how often a waiting handler checks whether its client is still there


@dataclass
class ServerConfig:
    model_name: str  # the id served in /v1/models and required in requests
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    shutdown_grace_s: float = 30.0


class ServerState:
    """What the routes need: the tokenizer side of an :class:`~speclm.api.LLM`, the worker."""

    def __init__(self, llm, worker: EngineWorker, metrics: ServerMetrics, config: ServerConfig) -> None:
        self.llm, self.worker, self.metrics, self.config = llm, worker, metrics, config
        self.max_context = llm.target.max_context
        self.vocab_size = llm.target.vocab_size
        self.server_id = f"{socket.gethostname()}:{os.getpid()}"


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        await run_in_threadpool(state.worker.stop, state.config.shutdown_grace_s)

    app = FastAPI(title="speclm", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(_Guard, state=state)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                     f"{exc.detail}", type=kind).body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(APIError(400, str(exc.errors()[0].get("msg"))).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        return {"status": "ok", "load": state.worker.load}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(state, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(state, request, "completion")

    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.config.model_name, "object": "model", "created": 0, "owned_by": "speclm",
            "max_model_len": state.max_context}


def _check_model(state: ServerState, name: str) -> None:
    if name != state.config.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{state.config.model_name!r}", param="model", code="model_not_found")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
    return bytes(body)


def _encode(state: ServerState, req) -> list[int]:
    """Prompt token ids; chat messages go through the model's chat template."""
    if isinstance(req, ChatCompletionRequest):
        return state.llm.encode(req.chat_messages())
    if isinstance(req.prompt, list):  # token ids
        if any(not 0 <= t < state.vocab_size for t in req.prompt):
            raise APIError(400, f"prompt token ids must be in [0, {state.vocab_size})", param="prompt")
        return list(req.prompt)
    return state.llm.encode(req.prompt)


async def _generate(state: ServerState, request: Request, kind: str):
    arrival = time.perf_counter()
    raw = await _read_body(request, state.config.max_body_bytes)
    req = parse_request(raw, ChatCompletionRequest if kind == "chat" else CompletionRequest)
    _check_model(state, req.model)
    try:
        prompt_ids = await run_in_threadpool(_encode, state, req)
    except SpeclmError as exc:
        raise APIError(400, str(exc), param="messages" if kind == "chat" else "prompt") from None
    ctx, n = state.max_context, len(prompt_ids)
    wanted = req.requested_max_tokens if kind == "chat" else req.max_tokens
    if n >= ctx or (wanted is not None and n + wanted > ctx):
        raise APIError(400, f"this model's context is {ctx} tokens; the prompt has {n}"
                       + (f" and {wanted} more were requested" if wanted else ""),
                       param="messages" if kind == "chat" else "prompt",
                       code="context_length_exceeded")
    try:
        params = req.sampling_params(wanted if wanted is not None else ctx - n)
    except SpeclmError as exc:
        raise APIError(400, str(exc)) from None
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    handle = state.worker.submit(rid, prompt_ids, params)
    timing = _Timing(state, arrival, n)
    events = _events(state, request, handle)
    if req.stream:
        return StreamingResponse(_stream(state, req, kind, rid, events, timing),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, last = [], None
    async for event in events:
        if event.error is not None:
            raise event.error
        timing.on_event(event)
        text.append(event.text)
        last = event
    if last is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    return completion_body(kind, rid, state.config.model_name, "".join(text), last.finish_reason,
                           last.stats)


class _Timing:
    """Time to first token and request latency, into the metrics."""

    def __init__(self, state: ServerState, arrival: float, prompt_tokens: int) -> None:
        self.metrics, self.arrival, self.prompt_tokens = state.metrics, arrival, prompt_tokens
        self.first = True

    def on_event(self, event: Event) -> None:
        if self.first and event.token_ids:
            self.first = False
            self.metrics.ttft.observe(time.perf_counter() - self.arrival)
        if event.finish_reason is not None:
            self.metrics.latency.observe(time.perf_counter() - self.arrival)
            self.metrics.prompt_tokens.inc(self.prompt_tokens)
            self.metrics.generation_tokens.inc(event.stats.generated_tokens)


async def _events(state: ServerState, request: Request, handle) -> AsyncIterator[Event]:
    """The request's events until it finishes or fails; aborts it if the client disconnects
    or the consumer stops early."""
    getter: asyncio.Future | None = None
    finished = False
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(handle.events.get())
            done, _ = await asyncio.wait({getter}, timeout=_POLL_S)
            if getter not in done:
                if await request.is_disconnected():
                    return
                continue
            event, getter = getter.result(), None
            finished = event.finish_reason is not None or event.error is not None
            yield event
            if finished:
                return
    finally:
        if getter is not None:
            getter.cancel()
        if not finished:
            state.worker.abort(handle.request_id)


async def _stream(state: ServerState, req, kind: str, rid: str, events: AsyncIterator[Event],
                  timing: _Timing) -> AsyncIterator[bytes]:
    model = state.config.model_name
    try:
        if kind == "chat":
            yield sse(chunk_body(kind, rid, model, "", None, first=True))
        async for event in events:
            if event.error is not None:
                yield sse(event.error.body())
                break
            timing.on_event(event)
            if event.text:
                yield sse(chunk_body(kind, rid, model, event.text, None))
            if event.finish_reason is not None:
                final = chunk_body(kind, rid, model, None, event.finish_reason)
                final["speclm"] = speculation(event.stats)
                yield sse(final)
                if req.include_usage:
                    tail = chunk_body(kind, rid, model, None, None)
                    tail["choices"], tail["usage"] = [], usage(event.stats)
                    yield sse(tail)
        yield sse("[DONE]")
    finally:
        await events.aclose()


class _Guard:
    """ASGI middleware: bearer-token auth (every route but /health), per-route request counts,
    and a header naming the server process (which replica answered, under Ray)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status = [500]
        server_header = (b"x-speclm-server", self.state.server_id.encode())

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), server_header]
            await send(message)

        try:
            if self._expected is not None and path != "/health" and not self._authorized(scope):
                error = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer "
                                 "<key>'", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send_wrapper)
                return
            await self.app(scope, receive, send_wrapper)
        finally:
            self.state.metrics.requests.labels(route, str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
