"""``speclm serve``: flags, building the server, and running it on uvicorn (or Ray Serve)."""

from __future__ import annotations

import argparse
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpeclmError

DEFAULT_NGRAM_K = 10


@dataclass
class ServeOptions:
    """Everything needed to build one server (one Ray replica gets a copy)."""

    model: str = "default"
    gguf_file: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    speculative: bool = True  # prompt lookup (n-gram) drafts; False: plain decoding
    draft_max: int = DEFAULT_NGRAM_K
    adaptive: bool = True
    ngram_min: int = 2
    ngram_max: int = 3
    max_batch: int = 16
    prefill_chunk: int = 512  # most prompt tokens fed per step (chunked prefill)
    max_queue: int = 64
    api_key: str | None = None
    served_model_name: str | None = None
    max_body_bytes: int = 8 << 20
    shutdown_grace_s: float = 30.0
    host: str = "127.0.0.1"  # the bound address: a Host header naming it is served
    allowed_hosts: list[str] = field(default_factory=list)  # more Host names, without a key
    cors_origins: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Fail on bad values before any model is loaded."""
        from ..batch.draft_policy import BatchDraftConfig
        from ..drafters import NgramDrafter

        BatchDraftConfig(self.draft_max, self.adaptive)
        NgramDrafter(self.ngram_min, self.ngram_max)
        if self.max_batch < 1:
            raise SpeclmError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk < 1:
            raise SpeclmError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_queue < 0:
            raise SpeclmError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.api_key is not None and not self.api_key.strip():
            raise SpeclmError("--api-key is empty")
        if self.max_body_bytes < 1024:
            raise SpeclmError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.shutdown_grace_s < 0:
            raise SpeclmError(f"--shutdown-timeout must be >= 0, got {self.shutdown_grace_s}")
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise SpeclmError(f"--cors-allow-origin takes an origin such as "
                                  f"'https://app.example.com' or '*', got {origin!r}")

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if self.model == "default" else Path(self.model).name


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import add_target_flags

    g = add_target_flags(p)
    g.add_argument("--served-model-name", help="the model id clients send (default: 'default' "
                                               "or the model folder's name)")
    s = p.add_argument_group("speculative decoding")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--ngram", action="store_true",
                       help="draft by prompt lookup, per request (the default)")
    which.add_argument("--no-spec", action="store_true", help="plain decoding, no drafter")
    s.add_argument("--draft-max", type=int, default=DEFAULT_NGRAM_K,
                   help="K, most tokens drafted per request per step (default: %(default)s)")
    s.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="shrink K (down to 0, plain steps) as the batch grows, by measured step "
                        "cost (default: on)")
    s.add_argument("--ngram-min", type=int, default=2, help="smallest n-gram (default: 2)")
    s.add_argument("--ngram-max", type=int, default=3, help="largest n-gram (default: 3)")
    v = p.add_argument_group("server")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    v.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    v.add_argument("--max-batch", type=int, default=16,
                   help="most requests decoded together (default: %(default)s)")
    v.add_argument("--prefill-chunk", type=int, default=512,
                   help="most prompt tokens fed per step: a long prompt joins in chunks between "
                        "decode steps, so running streams wait about one chunk's forward, not "
                        "its whole prefill (default: %(default)s)")
    v.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for a batch row; beyond it: 429 (default: %(default)s)")
    v.add_argument("--api-key", default=os.environ.get("SPECLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $SPECLM_API_KEY, else none)")
    v.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds to let in-flight requests finish before "
                        "ending each with an error (default: %(default)s)")
    v.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without --api-key, requests are served only if their Host header names "
                        "a loopback address, localhost or the --host address (DNS-rebinding "
                        "protection); allow another name (repeatable; '*': any)")
    v.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN call the API from a browser (repeatable; "
                        "'*': any; default: none, no CORS headers)")
    v.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body; larger ones get 413 (default: %(default)s)")
    v.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = p.add_argument_group("Ray Serve (scale-out)")
    r.add_argument("--ray", action="store_true", help="run as Ray Serve replicas instead")
    r.add_argument("--replicas", type=int, default=1, help="replicas with --ray (default: 1)")
    r.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a local one)")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves per replica (default: %(default)s)")
    r.add_argument("--num-gpus-per-replica", type=float, default=0.0,
                   help="GPUs Ray reserves per replica (default: %(default)s)")


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    opts = ServeOptions(
        model=args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype,
        speculative=not args.no_spec, draft_max=args.draft_max, adaptive=args.adaptive,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, api_key=args.api_key, served_model_name=args.served_model_name,
        shutdown_grace_s=args.shutdown_timeout, host=args.host,
        allowed_hosts=args.allowed_host, cors_origins=args.cors_allow_origin,
        max_body_bytes=args.max_body_bytes,
    )
    opts.check()
    if not 0 < args.port < 65536:
        raise SpeclmError(f"--port must be in 1..65535, got {args.port}")
    if args.replicas < 1:
        raise SpeclmError(f"--replicas must be >= 1, got {args.replicas}")
    return opts


def build_app(opts: ServeOptions):
    """Load the model and build the FastAPI app (the worker starts with the app's lifespan)."""
    from ..api import LLM
    from ..drafters.registry import KINDS, parse_drafter
    from ..engine import Engine
    from ..models.rows import make_rows
    from .app import ServerConfig, ServerState, create_app
    from .metrics import ServerMetrics
    from .worker import EngineWorker

    spec = _drafter_text(opts) if opts.speculative else None
    if spec is not None and getattr(opts, "async_draft", False) and opts.max_batch > 1:
        # a worker thread drafts the next round while the target verifies: it uses cores that a
        # batched step's forward already keeps busy, so in a batch it only adds contention
        raise SpeclmError("--async drafts ahead for one request at a time: use it with --max-batch 1")
    backend = getattr(opts, "backend", "auto")
    if backend == "auto" and not getattr(opts, "compile", False) and not getattr(opts, "quantize", None):
        backend = "torch"  # the rows of a batch share one forward on eager torch
    llm = LLM(opts.model, None, device=opts.device, dtype=opts.dtype, gguf_file=opts.gguf_file,
              backend=backend, compile=getattr(opts, "compile", False), quantize=getattr(opts, "quantize", None))
    rows_drafters, needs_layers = None, False
    if spec is not None:  # one drafter per request, sharing the loaded weights
        rows_drafters = llm.row_drafters(
            spec, getattr(opts, "draft_max", None), draft_min=getattr(opts, "draft_min", 0),
            adaptive_draft=opts.adaptive, async_draft=getattr(opts, "async_draft", False),
            async_fanout=getattr(opts, "fanout", 8), ngram_min=opts.ngram_min, ngram_max=opts.ngram_max)
        needs_layers = KINDS[parse_drafter(spec).name].needs == "layers"  # a single-row cache per row
    rows = make_rows(llm.target, opts.max_batch, needs_layers=needs_layers)
    factory = draft_length = None
    if rows_drafters is not None:
        factory, draft_length = rows_drafters.factory, rows_drafters.draft_length
        factory(rows.handle(0))  # build one now: errors and one-time searches before serving
        llm.warmup(draft_length.draft_max)
    # the adaptive draft cap starts from the target's measured verify cost (cached per model)
    prior = llm.cost_model(1 + draft_length.draft_max) if draft_length is not None and draft_length.adaptive else None
    engine = Engine(rows, drafter_factory=factory, draft_length=draft_length, cost_prior=prior,
                    prefill_chunk=opts.prefill_chunk,
                    drafter_name=rows_drafters.name if rows_drafters is not None else "none")
    metrics = ServerMetrics()
    worker = EngineWorker(engine, llm.tokenizer, metrics, max_queue=opts.max_queue)
    config = ServerConfig(opts.model_name(), opts.api_key, opts.max_body_bytes, opts.shutdown_grace_s,
                          bind_host=opts.host, allowed_hosts=tuple(opts.allowed_hosts),
                          cors_origins=tuple(opts.cors_origins))
    return create_app(ServerState(llm, worker, metrics, config))


def _drafter_text(opts: ServeOptions) -> str:
    """The drafter spec the options ask for: --drafter, --draft-model or prompt lookup."""
    drafter = getattr(opts, "drafter", None)
    if getattr(opts, "draft_model", None):
        return f"draft:path={opts.draft_model}"
    return drafter or "ngram"


def _check_installed(modules: list[str], extra: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SpeclmError(f"speclm serve needs {', '.join(missing)}: pip install 'speclm[{extra}]'")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``speclm serve``."""
    _check_installed(["fastapi", "uvicorn", "prometheus_client"], "serve")
    if args.ray:
        _check_installed(["ray"], "ray")
    opts = options_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="speclm: %(levelname)s %(message)s")
    _warn_if_exposed(opts)
    if args.ray:
        from .ray_app import run_ray

        return run_ray(opts, args)
    app = build_app(opts)
    server = _drain_first_server(app, args, opts.shutdown_grace_s)
    server.run()
    return 0 if server.started else 1


def _warn_if_exposed(opts: ServeOptions) -> None:
    """Say so when a server without a key can be reached beyond this machine or by web pages."""
    from .guard import host_allowed

    log = logging.getLogger("speclm.serve")
    if opts.api_key is not None:
        return
    if not host_allowed(opts.host if ":" not in opts.host else f"[{opts.host}]", ()):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it; "
                    "requests are served only for Host names allowed by --allowed-host", opts.host)
    if opts.cors_origins:
        log.warning("--cors-allow-origin %s without --api-key: web pages from %s can use this "
                    "server through their visitors' browsers", ",".join(opts.cors_origins),
                    "any site" if "*" in opts.cors_origins else "those origins")


def _drain_first_server(app, args: argparse.Namespace, grace_s: float):
    """A uvicorn server whose shutdown drains speclm's requests before closing connections.

    uvicorn's own graceful shutdown waits for connections and then cancels the handlers, which
    cuts a running stream mid-body. Here, on SIGTERM/Ctrl-C, the engine first stops admitting
    (new requests and /health get 503), lets running requests finish for up to ``grace_s``, and
    ends the rest with an error event and ``[DONE]`` (a 503 body when not streaming); only then
    does uvicorn close the now idle connections."""
    import asyncio

    import uvicorn

    class DrainFirstServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            worker = app.state.speclm.worker
            draining = asyncio.ensure_future(asyncio.to_thread(worker.stop, grace_s))
            while not draining.done():
                if self.force_exit:  # a second Ctrl-C: no more grace
                    worker.hurry()
                await asyncio.wait({draining}, timeout=0.1)
            await asyncio.sleep(0.2)  # let the handlers write the events the stop sent them
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    return DrainFirstServer(config)
