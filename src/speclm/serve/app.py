"""The OpenAI-compatible HTTP application (FastAPI): routes, streaming, auth and errors.

Every request is validated completely (JSON, types, ranges, model name, prompt length against
the context) before it is queued, so a user mistake is a 4xx with an OpenAI error body and a
stream only starts once the request is known to be good. Streams are server-sent events in
OpenAI's chunk format, ending with ``data: [DONE]``. A client that disconnects (streaming or
not) has its request aborted the moment the connection closes, which frees its batch row at the
next step; it is counted as status 499. Bodies are parsed off the event loop, so one large
request cannot stall the others. The Host check, the API key and the per-status counts are in
:mod:`speclm.serve.guard`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SpeclmError
from .guard import DISCONNECTED, Guard
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, chunk_body,
                       completion_body, new_id, parse_request, speculation, sse, usage)
from .worker import Event, EngineWorker

log = logging.getLogger("speclm.serve")


@dataclass
class ServerConfig:
    model_name: str  # the id served in /v1/models and required in requests
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    shutdown_grace_s: float = 30.0
    bind_host: str = "127.0.0.1"  # a Host header naming it is always served
    allowed_hosts: tuple[str, ...] = ()  # more Host names served without a key ("*": any)
    cors_origins: tuple[str, ...] = ()  # origins whose pages may call the API (none: no CORS)


class ServerState:
    """What the routes need: the tokenizer side of an :class:`~speclm.api.LLM`, the worker."""

    def __init__(self, llm, worker: EngineWorker, metrics: ServerMetrics, config: ServerConfig) -> None:
        self.llm, self.worker, self.metrics, self.config = llm, worker, metrics, config
        self.max_context = llm.target.max_context
        self.vocab_size = llm.target.vocab_size


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        await run_in_threadpool(state.worker.stop, state.config.shutdown_grace_s)

    app = FastAPI(title="speclm", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.speclm = state
    app.add_middleware(Guard, state=state)
    if state.config.cors_origins:  # outermost: preflights are answered before the Guard
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        log.info("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        log.info("%s %s: %d %s", request.method, request.url.path, exc.status_code, exc.detail)
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                     f"{exc.detail}", type=kind).body(), status_code=exc.status_code,
                            headers=exc.headers)  # 405 keeps its Allow header

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        log.info("%s %s: 400 %s", request.method, request.url.path, exc.errors()[0].get("msg"))
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
        if state.worker.draining:  # load balancers: send new work elsewhere
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="shutting_down")
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


def _check_content_type(request: Request) -> None:
    """JSON bodies only: a web page can send text/plain or a form to any origin without asking
    (no CORS preflight), but not application/json."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(415, "the request body must be JSON, sent with 'Content-Type: "
                       f"application/json' (got {media or 'none'!r})", code="unsupported_media_type")


async def _generate(state: ServerState, request: Request, kind: str):
    arrival = time.perf_counter()
    _check_content_type(request)
    raw = await _read_body(request, state.config.max_body_bytes)
    # parsing a few MB of JSON takes a while: off the event loop, so other streams keep flowing
    req = await run_in_threadpool(parse_request, raw,
                                  ChatCompletionRequest if kind == "chat" else CompletionRequest,
                                  state.max_context)
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
        # compiling a schema can take a while (cached per schema): off the event loop
        await run_in_threadpool(state.llm.grammars.check, params.structured)
    except SpeclmError as exc:
        raise APIError(400, str(exc), param=req.constraint_param if req.constraint() else None) from None
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    retries = request.headers.get("x-stainless-retry-count")  # the openai clients send it
    handle = state.worker.submit(rid, prompt_ids, params,
                                 retries=int(retries) if retries and retries.isdigit() else None)
    timing = _Timing(state, arrival, n)
    events = _events(state, request, handle)
    if req.stream:
        return StreamingResponse(_stream(state, req, kind, rid, events, timing),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, last = [], None
    try:
        async for event in events:
            if event.error is not None:
                raise event.error
            timing.on_event(event)
            text.append(event.text)
            last = event
    finally:
        await events.aclose()
    if last is None or last.finish_reason is None:  # the client went away (counted as 499)
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
            self.metrics.record_request(event.stats)


async def _events(state: ServerState, request: Request, handle) -> AsyncIterator[Event]:
    """The request's events until it finishes or fails. If the client disconnects (noticed the
    moment its connection closes, while tokens flow or not) or the consumer stops early, the
    request is aborted, which frees its row at the engine's next step."""
    watcher = asyncio.ensure_future(_disconnect(request))
    getter: asyncio.Future | None = None
    finished = False
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(handle.events.get())
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done():
                return
            event, getter = getter.result(), None
            finished = event.finish_reason is not None or event.error is not None
            yield event
            if finished:
                return
    finally:
        watcher.cancel()
        if getter is not None:
            getter.cancel()
        if not finished:  # nobody will read the rest: the client went away
            state.worker.abort(handle.request_id)
            request.scope.setdefault("state", {})[DISCONNECTED] = True
            state.metrics.failures.labels("client_disconnect").inc()
            log.info("%s: 499 the client went away; request aborted", handle.request_id)


async def _disconnect(request: Request) -> None:
    """Returns when the client's connection closes (the body has been read by then, so the
    next ASGI message is the disconnect), or when the server cannot tell any more."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the transport failed: as good as gone
        log.debug("receive failed while watching for a disconnect", exc_info=True)


async def _stream(state: ServerState, req, kind: str, rid: str, events: AsyncIterator[Event],
                  timing: _Timing) -> AsyncIterator[bytes]:
    model = state.config.model_name
    usage_field = req.include_usage  # then every chunk has "usage": null but the usage chunk
    try:
        if kind == "chat":
            yield sse(chunk_body(kind, rid, model, "", None, first=True, usage_field=usage_field))
        async for event in events:
            if event.error is not None:
                yield sse(event.error.body())
                break
            timing.on_event(event)
            if event.text:
                yield sse(chunk_body(kind, rid, model, event.text, None, usage_field=usage_field))
            if event.finish_reason is not None:
                final = chunk_body(kind, rid, model, None, event.finish_reason, usage_field=usage_field)
                final["speclm"] = speculation(event.stats)
                yield sse(final)
                if req.include_usage:
                    tail = chunk_body(kind, rid, model, None, None)
                    tail["choices"], tail["usage"] = [], usage(event.stats)
                    yield sse(tail)
        yield sse("[DONE]")
    finally:
        await events.aclose()
