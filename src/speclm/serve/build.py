"""Building one server from its options: the model, the engine over its rows, the drafters per
request, the worker and the app (``speclm serve`` and each Ray replica call :func:`build_app`)."""

from __future__ import annotations

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
    backend: str = "auto"  # auto: eager torch (rows batched in one forward) unless compile/quantize
    compile: bool = False
    quantize: str | None = None
    speculative: bool = True  # False: plain decoding
    drafter: str | None = None  # a drafter spec as for --drafter (None: prompt lookup)
    draft_model: str | None = None  # a draft model path (= drafter "draft:path=...")
    draft_max: int | None = None  # None: the drafter's own default K
    draft_min: int = 0
    adaptive: bool = True
    async_draft: bool = False
    fanout: int = 8
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
        from ..draft_length import DraftLengthConfig
        from ..drafters import NgramDrafter
        from ..drafters.registry import parse_drafter

        DraftLengthConfig(self.draft_max or max(1, self.draft_min), self.draft_min, self.adaptive)
        NgramDrafter(self.ngram_min, self.ngram_max)
        if self.speculative:
            parse_drafter(_drafter_text(self))
        if self.backend not in ("auto", "torch", "llamacpp"):
            raise SpeclmError(f"--backend must be auto, torch or llamacpp, got {self.backend!r}")
        from ..models.quantize import CHOICES

        if self.quantize not in (None, *CHOICES):
            raise SpeclmError(f"--quantize must be one of {', '.join(CHOICES)}, got {self.quantize!r}")
        if self.speculative and self.async_draft and self.max_batch > 1:
            # a worker thread drafts the next round while the target verifies: it uses cores that
            # a batched step's forward already keeps busy, so in a batch it only adds contention
            raise SpeclmError("--async drafts ahead for one request at a time: use it with --max-batch 1")
        if self.fanout < 1:
            raise SpeclmError(f"--fanout must be >= 1, got {self.fanout}")
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


def build_app(opts: ServeOptions):
    """Load the model and build the FastAPI app (the worker starts with the app's lifespan).
    The model is loaded, compiled and warmed on the thread that will step it (speclm.serve.owner)."""
    from .app import ServerConfig, ServerState, create_app
    from .metrics import ServerMetrics
    from .owner import OwnerThread
    from .worker import EngineWorker

    owner = OwnerThread()
    try:
        llm, engine = owner.call(build_engine, opts)
    except BaseException:
        owner.close()
        raise
    metrics = ServerMetrics()
    worker = EngineWorker(engine, llm.tokenizer, metrics, max_queue=opts.max_queue, owner=owner)
    config = ServerConfig(opts.model_name(), opts.api_key, opts.max_body_bytes, opts.shutdown_grace_s,
                          bind_host=opts.host, allowed_hosts=tuple(opts.allowed_hosts),
                          cors_origins=tuple(opts.cors_origins))
    return create_app(ServerState(llm, worker, metrics, config))


def build_engine(opts: ServeOptions):
    """The model, its rows, one drafter per request and the engine over them, warmed up."""
    from ..api import LLM
    from ..drafters.base import max_draft_tokens
    from ..drafters.registry import grows_trees, parse_drafter
    from ..engine import Engine
    from ..models.rows import make_rows

    spec = _drafter_text(opts) if opts.speculative else None
    backend = opts.backend
    if backend == "auto" and not opts.compile and not opts.quantize:
        backend = "torch"  # the rows of a batch share one forward on eager torch
    llm = LLM(opts.model, None, device=opts.device, dtype=opts.dtype, gguf_file=opts.gguf_file,
              backend=backend, compile=opts.compile, quantize=opts.quantize)
    rows_drafters, needs_trees = None, False
    if spec is not None:  # one drafter per request, sharing the loaded weights
        rows_drafters = llm.row_drafters(
            spec, opts.draft_max, draft_min=opts.draft_min, adaptive_draft=opts.adaptive,
            async_draft=opts.async_draft, async_fanout=opts.fanout, ngram_min=opts.ngram_min, ngram_max=opts.ngram_max,
            max_batch=opts.max_batch)
        needs_trees = grows_trees(parse_drafter(spec))  # llama.cpp batches chains only
    rows = make_rows(llm.target, opts.max_batch, needs_trees=needs_trees)
    factory = draft_length = None
    if rows_drafters is not None:
        factory, draft_length = rows_drafters.factory, rows_drafters.draft_length
        first = factory(rows.handle(0))  # build one now: errors and one-time searches before serving
        layers = getattr(first, "feature_layers", None) or ()  # EAGLE/Medusa read the target's features
    else:
        layers = ()
    warm_rows = getattr(rows, "warmup", None)  # the compiled path's batched steps
    # the widest verify: the draft cap, or a tree drafter's node budget where that is larger
    widest = max_draft_tokens(first, draft_length.draft_max) if draft_length is not None else 0
    if callable(warm_rows):
        warm_rows(widest, layers=layers)
    elif draft_length is not None:
        llm.warmup(widest, layers=layers)
    # the adaptive draft cap starts from the target's measured verify cost (cached per model)
    prior = llm.cost_model(1 + widest) if draft_length is not None and draft_length.adaptive else None
    engine = Engine(rows, drafter_factory=factory, draft_length=draft_length, cost_prior=prior,
                    prefill_chunk=opts.prefill_chunk,
                    drafter_name=rows_drafters.name if rows_drafters is not None else "none",
                    grammars=llm.grammars)
    return llm, engine


def _drafter_text(opts: ServeOptions) -> str:
    """The drafter spec the options ask for: --drafter, --draft-model or prompt lookup."""
    if opts.draft_model:
        return f"draft:path={opts.draft_model}"
    return opts.drafter or "ngram"
