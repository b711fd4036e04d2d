"""``speclm serve``: flags, building the server, and running it on uvicorn (or Ray Serve)."""

from __future__ import annotations

import argparse
import logging
import os

from ..errors import SpeclmError
from .build import DEFAULT_NGRAM_K, ServeOptions, build_app  # noqa: F401 (the public names)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..flags import add_backend_flags, add_target_flags

    g = add_target_flags(p)
    add_backend_flags(g)
    g.add_argument("--served-model-name", help="the model id clients send (default: 'default' "
                                               "or the model folder's name)")
    s = p.add_argument_group("speculative decoding (a drafter per request)")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--ngram", action="store_true",
                       help="draft by prompt lookup in each request's own text (the default)")
    which.add_argument("--drafter", metavar="NAME[:OPTS]",
                       help="a drafter by name, as for speclm generate: ngram, suffix, recycle, "
                            "layerskip[:skip=...], early-exit[:layers=N], draft:path=DIR, distilled, "
                            "quant[:bits=4], medusa:path=DIR, eagle:path=DIR, auto")
    which.add_argument("--draft-model", metavar="PATH",
                       help="draft with a smaller model sharing the target's tokenizer (HF folder, "
                            ".gguf or 'default'); loaded once, each request drafts on its own cache")
    which.add_argument("--no-spec", action="store_true", help="plain decoding, no drafter")
    s.add_argument("--draft-max", type=int, default=None,
                   help="K, most tokens drafted per request per step (default: the drafter's own: "
                        f"{DEFAULT_NGRAM_K} for prompt lookup, 5 for a draft model, ...)")
    s.add_argument("--draft-min", type=int, default=0,
                   help="drop deterministic drafts shorter than this (default: %(default)s)")
    s.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="choose K per request from its measured acceptance and the target's cost "
                        "model, and cap it (down to 0, plain steps) as the batch grows, by measured "
                        "step cost (default: on)")
    s.add_argument("--async", dest="async_draft", action="store_true",
                   help="draft the next round on a worker thread while the target verifies "
                        "(draft models; with --max-batch 1 only)")
    s.add_argument("--fanout", type=int, default=8,
                   help="with --async: outcomes drafted ahead per round (default: %(default)s)")
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
        backend=args.backend, compile=args.compile, quantize=args.quantize,
        speculative=not args.no_spec, drafter=args.drafter, draft_model=args.draft_model,
        draft_max=args.draft_max, draft_min=args.draft_min, adaptive=args.adaptive,
        async_draft=args.async_draft, fanout=args.fanout,
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
    from ..models.llamacpp import set_native_logging

    set_native_logging(args.verbose)
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
