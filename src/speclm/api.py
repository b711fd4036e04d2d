"""The Python API: ``LLM(model=..., speculative_model=..., num_speculative_tokens=...)``.

Everything funnels into :meth:`LLM.stream`, a generator of text deltas built on the engine's
token generator; ``generate``, ``chat``, the CLI and the benchmarks consume that one stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import torch

from .cost_model import WIDTHS, CostModel, cost_model, model_file
from .detokenize import IncrementalDetokenizer
from .draft_length import DraftLengthConfig
from .drafters import DraftModelDrafter, Drafter, check_vocab_compatible
from .drafters.base import max_draft_tokens
from .drafters.draft_rows import DraftRows
from .drafters.registry import KINDS, BuildContext, build_drafter, drafter_label, is_drafter_spec, parse_drafter
from .drafters.tree_search import TreeShape
from .engine import generate_tokens
from .errors import SpeclmError
from .models import LoadedModel, load_model
from .models.base import CausalLM
from .models.compiled import CompiledCausalLM
from .models.hf import HFCausalLM
from .models.loading import resolve_model_path
from .sampling import SamplingParams
from .specs import OptionString
from .stats import RequestStats
from .structured.compiler import GrammarCompiler

Message = dict[str, str]
Prompt = Union[str, Sequence[Message]]  # text, or chat messages ({"role", "content"} dicts)


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty)
    token_ids: list[int]  # tokens committed since the previous chunk
    finish_reason: str | None  # "stop", "length", or None while generating
    stats: RequestStats  # live: complete once finish_reason is set


@dataclass
class Speculation:
    """A drafter with its draft-length settings; ``name`` appears in stats."""

    drafter: Drafter
    draft_length: DraftLengthConfig
    name: str

    @property
    def widest(self) -> int:
        """The most tokens a round may verify beyond the pending one: the draft cap, or a tree
        drafter's node budget (plus a merged lookup branch) where that is larger. Warm-up and
        the cost model cover verifies this wide; a cost curve measured only up to the draft cap
        would price a 21-node tree by extrapolation."""
        return max_draft_tokens(self.drafter, self.draft_length.draft_max)


@dataclass
class RowDrafters:
    """A drafter setup for the rows of a batch: one drafter per row from ``factory``."""

    factory: Callable[[CausalLM | None], Drafter]  # the row's target handle -> its drafter
    draft_length: DraftLengthConfig
    name: str


@dataclass
class RequestOutput:
    prompt: Prompt
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats = field(repr=False)


def _needs_torch(speculative_model) -> bool:
    """Whether a drafter spec reads the target's layers or hidden states (torch backend only)."""
    if isinstance(speculative_model, OptionString):
        return KINDS[speculative_model.name].needs is not None
    if isinstance(speculative_model, str) and is_drafter_spec(speculative_model):
        return KINDS[speculative_model.strip().partition(":")[0]].needs is not None
    return False


class LLM:
    """A target model plus (optionally) a drafter.

    Args:
        model: ``"default"`` (embedded SmolLM2-135M-Instruct), an HF model folder, or a GGUF file.
        speculative_model: ``None`` (plain decoding); a drafter by name with options, as in
            ``--drafter`` (``"ngram"``, ``"suffix"``, ``"recycle"``, ``"layerskip"``,
            ``"layerskip:skip=3,5-9"``, ``"early-exit:layers=10"``, ``"distilled"``, ``"quant:bits=4"``,
            ``"auto"``, ...; see ``speclm.drafters.registry``); a draft model (folder, GGUF file or
            ``"default"``) sharing the target's tokenizer; or a ``Drafter`` object.
        num_speculative_tokens: K, the most tokens drafted per round (``--draft-max``); None
            takes the drafter's own default (10 for prompt lookup, 5 for a draft model, ...).
        draft_min: drafts shorter than this are dropped (``--draft-min``).
        draft_p_min: a draft model stops when its top probability falls below this.
        adaptive_draft: choose K each round (up to ``num_speculative_tokens``; 0: a plain
            step) from the live acceptance and the target's measured cost model (see
            :meth:`cost_model`); False drafts ``num_speculative_tokens`` every round.
        async_draft: speculative speculative decoding: while the target verifies, the draft
            model drafts the next round for the ``async_fanout`` likeliest verification outcomes
            on a worker thread (a draft model only).
        ngram_min, ngram_max: n-gram sizes tried by prompt lookup (longest first).
        device, dtype: where and in what precision to run (``"auto"`` picks CUDA/bf16 if present).
        gguf_file: a GGUF file name inside ``model`` when ``model`` is a folder.
        backend: ``"torch"`` (transformers), ``"llamacpp"`` (a GGUF file through llama.cpp; needs
            ``pip install 'speclm[llamacpp]'``) or ``"auto"``: llama.cpp for a GGUF file on the CPU
            when it is installed and the drafter does not need the target's layers or hidden
            states (layerskip, early-exit, medusa, eagle), torch otherwise. ``stats.backend``
            says which one ran.
        compile: the torch fast path: a static KV cache and ``torch.compile``d decode and
            verify steps (bfloat16 where the hardware has it, unless ``dtype`` says otherwise).
        quantize: ``"int8"`` or ``"int4"`` weight-only quantization on the torch fast path, or
            ``"gguf"``: a GGUF model's own Q4_0/Q4_1 blocks run as they are stored (no second
            rounding; models/gguf_int4.py).
    """

    def __init__(
        self,
        model: str | None = "default",
        speculative_model: str | Drafter | None = None,
        num_speculative_tokens: int | None = None,
        *,
        draft_min: int = 0,
        draft_p_min: float = 0.0,
        adaptive_draft: bool = True,
        async_draft: bool = False,
        async_fanout: int = 8,
        ngram_min: int = 2,
        ngram_max: int = 3,
        device: str | None = "cpu",
        dtype: str | torch.dtype | None = None,
        gguf_file: str | None = None,
        backend: str | None = "auto",
        compile: bool = False,
        quantize: str | None = None,
    ) -> None:
        if backend in (None, "auto") and _needs_torch(speculative_model):
            backend = "torch"
        self._loaded: LoadedModel = load_model(model, device=device, dtype=dtype, gguf_file=gguf_file,
                                               backend=backend, compile=compile, quantize=quantize)
        self._device, self._dtype = device, dtype
        self.tokenizer = self._loaded.tokenizer
        self.target = self._loaded.backend
        self._cost: CostModel | None = None
        self._grammars: GrammarCompiler | None = None
        self.speculation = self.make_speculation(
            speculative_model, num_speculative_tokens, draft_min=draft_min,
            draft_p_min=draft_p_min, adaptive_draft=adaptive_draft, async_draft=async_draft,
            async_fanout=async_fanout, ngram_min=ngram_min, ngram_max=ngram_max,
        )
        self.warmup(self.speculation)

    def warmup(self, speculation: Speculation | int | None = None, *,
               layers: Sequence[int] = ()) -> None:
        """Compile the fast path's steps for ``speculation``'s widest verify (its draft cap or
        its drafter's tree budget, whichever is larger; or a bare draft cap K) now, rather than
        in the middle of a request (each step serves every cache size, so requests of any length);
        for a drafter that reads the target's features (or ``layers`` with a bare K), the steps
        that return them. A no-op for the eager and llama.cpp backends."""
        warm = getattr(self.target, "warmup", None)
        if not callable(warm):
            return
        k = speculation or 0
        if isinstance(speculation, Speculation):  # a tree may verify more tokens than K
            k = speculation.widest
            # EAGLE/Medusa: the steps that return features
            layers = getattr(speculation.drafter, "feature_layers", None) or ()
        warm(k, layers=layers)

    def make_speculation(
        self,
        speculative_model: str | OptionString | Drafter | None,
        num_speculative_tokens: int | None = None,
        **options,
    ) -> Speculation | None:
        """Build a drafter setup for this target (arguments as in the constructor; a parsed
        drafter spec from ``speclm.drafters.registry.parse_drafter`` is also accepted).

        Pass the result to :meth:`stream` to run several setups over one loaded target.
        """
        if speculative_model is None:
            return None
        if isinstance(speculative_model, Drafter):
            if options.get("async_draft"):
                from .drafters.ssd import make_async

                speculative_model = make_async(speculative_model, options.get("async_fanout", 8))
            draft_length = DraftLengthConfig(5 if num_speculative_tokens is None else num_speculative_tokens,
                                             options.get("draft_min", 0), options.get("adaptive_draft", True))
            return Speculation(speculative_model, draft_length, type(speculative_model).__name__)
        rows = self.row_drafters(speculative_model, num_speculative_tokens, **options)
        return Speculation(rows.factory(self.target), rows.draft_length, rows.name)

    def row_drafters(
        self,
        speculative_model: str | OptionString,
        num_speculative_tokens: int | None = None,
        *,
        draft_min: int = 0,
        draft_p_min: float = 0.0,
        adaptive_draft: bool = True,
        async_draft: bool = False,
        async_fanout: int = 8,
        ngram_min: int = 2,
        ngram_max: int = 3,
        max_batch: int = 1,
    ) -> RowDrafters:
        """A drafter spec (as in the constructor) checked once, and a factory that builds a
        drafter of it for each row of a batch (speclm.engine): ``factory(handle)`` gets the
        row's own target handle (self-drafting runs the target's layers on that row's cache) and
        shares every loaded weight (draft models, trained heads) with the drafters before it.
        With ``max_batch`` > 1, chain drafts of a draft model on eager torch or the compiled
        path (the quantized self-draft's among them) come from one group of ``max_batch`` rows
        that drafts every row in one forward per depth (drafters/draft_rows.py)."""
        spec = self._drafter_spec(speculative_model, draft_p_min, ngram_min, ngram_max, async_draft,
                                  async_fanout)
        k = KINDS[spec.name].default_k if num_speculative_tokens is None else num_speculative_tokens
        draft_length = DraftLengthConfig(k, draft_min, adaptive_draft)  # checked before building
        loaded: dict[str, object] = {}  # draft models by path, loaded once and forked per row
        groups: dict[tuple[str, float], DraftRows | None] = {}  # batched draft rows per draft

        def load_draft(path: str, p_min: float, tree: TreeShape | None = None, *,
                       make: Callable[[], CausalLM] | None = None) -> DraftModelDrafter:
            """A draft-model drafter over the draft ``path`` names (loaded once; ``make``
            builds it where it is not a model file: the quantized self-draft)."""
            if path not in loaded:
                loaded[path] = make() if make is not None else self._load_draft_backend(path)
            backend = loaded[path]
            if max_batch > 1 and tree is None and (type(backend) is HFCausalLM or isinstance(backend, CompiledCausalLM)):
                if (path, p_min) not in groups:
                    try:
                        groups[path, p_min] = DraftRows(backend, self.target.vocab_size, max_batch, p_min)
                    except SpeclmError:  # attention layers the ragged cache cannot batch
                        groups[path, p_min] = None
                if groups[path, p_min] is not None:
                    return groups[path, p_min].member()
            return DraftModelDrafter(backend.fork() if built else backend, self.target.vocab_size,
                                     p_min=p_min, tree=tree)

        built: list[bool] = []

        def factory(handle: CausalLM | None = None) -> Drafter:
            target = handle if handle is not None else self.target
            drafter = build_drafter(spec, BuildContext(target, self.tokenizer, self._loaded.path,
                                                       load_draft, progress=not built))
            built.append(True)
            return drafter

        return RowDrafters(factory, draft_length, drafter_label(spec))

    def _drafter_spec(self, speculative_model, draft_p_min: float, ngram_min: int, ngram_max: int,
                      async_draft: bool, async_fanout: int) -> OptionString:
        if isinstance(speculative_model, OptionString):
            spec = speculative_model
        elif isinstance(speculative_model, str) and is_drafter_spec(speculative_model):
            spec = parse_drafter(speculative_model, defaults={"min": ngram_min, "max": ngram_max,
                                                              "p_min": draft_p_min})
        elif isinstance(speculative_model, str):  # a draft model: folder, GGUF file or "default"
            options = {key: default for key, (_, default) in KINDS["draft"].options.items()}
            options.update(path=speculative_model, p_min=draft_p_min)
            KINDS["draft"].check(options)
            spec = OptionString(f"draft:{speculative_model}", "draft", options)
        else:
            raise SpeclmError(f"speculative_model must be None, a drafter name, a path or a Drafter, "
                              f"got {type(speculative_model).__name__}")
        if async_draft:
            schema = KINDS[spec.name].options
            if "async" not in schema:
                raise SpeclmError(f"async drafting needs a draft model (draft, distilled, quant or a model "
                                  f"path), not {spec.name}")
            defaults = {key: default for key, (_, default) in schema.items()}
            spec = OptionString(spec.label, spec.name,
                                {**defaults, **spec.options, "async": 1, "fanout": async_fanout})
            KINDS[spec.name].check(spec.options)
        return spec

    def _load_draft_backend(self, spec: str) -> CausalLM:
        if resolve_model_path(spec) == self._loaded.path:  # self-drafting: share the weights
            return self.target.fork()
        if self.backend_name == "llamacpp":  # a GGUF draft runs on llama.cpp too
            draft = load_model(spec, device=self._device, dtype=self._dtype, backend="auto")
        else:
            draft = load_model(spec, device=self._device, dtype=self._dtype or self.target.dtype, backend="torch")
        check_vocab_compatible(self.tokenizer, draft.tokenizer)
        return draft.backend

    def cost_model(self, max_width: int = 1) -> CostModel:
        """The target's verify cost (seconds per forward of T tokens, T up to ``max_width``):
        cached per model file, backend, dtype, threads and device, else measured now (a few
        seconds, once) and cached (speclm.cost_model)."""
        if self._cost is None or self._cost.asked < min(max_width, WIDTHS[-1]):
            self._cost = cost_model(self.target, model_file(self.target, self._loaded.path),
                                    max_width=max_width)
        return self._cost

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler for this model's tokenizer (built on first use)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.target.vocab_size,
                                             self.target.eos_token_ids)
        return self._grammars

    # -- prompts ---------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids for a text prompt, or for chat messages through the chat template."""
        if isinstance(prompt, str):
            if not prompt:
                raise SpeclmError("the prompt is empty")
            return self.tokenizer(prompt)["input_ids"]
        return self.tokenizer(self.render_chat(prompt), add_special_tokens=False)["input_ids"]

    def render_chat(self, messages: Sequence[Message]) -> str:
        """The model's chat template applied to ``messages``, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpeclmError(f"model {self._loaded.name!r} has no chat template; "
                              "give a plain text prompt instead")
        if not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise SpeclmError("chat messages must be a non-empty list of {'role': ..., 'content': ...}")
        try:
            return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as exc:  # jinja2 raises TemplateError subclasses with the template's words
            raise SpeclmError(f"the chat template rejected these messages: {exc}") from None

    # -- generation ------------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        speculative: bool | Speculation = True,
    ) -> Iterator[StreamChunk]:
        """Generate, yielding text deltas as tokens are accepted.

        ``speculative=False`` runs plain decoding through the same engine (the baseline); a
        :class:`Speculation` from :meth:`make_speculation` replaces this LLM's own.
        """
        params = params or SamplingParams()
        params.validate()
        self.grammars.check(params.structured)  # a bad schema or grammar fails before any work
        prompt_ids = torch.tensor(self.encode(prompt), dtype=torch.long)
        spec = speculative if isinstance(speculative, Speculation) else (
            self.speculation if speculative else None)
        stats = RequestStats(drafter=spec.name if spec is not None else "none", backend=self.backend_name)
        cost = None
        if spec is not None and spec.draft_length.adaptive:
            cost = self.cost_model(1 + spec.widest)
            stats.cost_model = cost.summary()
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        steps = generate_tokens(
            self.target, prompt_ids, params,
            drafter=spec.drafter if spec is not None else None,
            draft_length=spec.draft_length if spec is not None else None,
            stats=stats, generator=params.make_generator(self.target.device), cost_model=cost,
            grammars=self.grammars,
        )
        delivered = 0  # tokens handed to the caller
        try:
            for step in steps:
                text, kept, finish = detok.feed(step.tokens, step.finish_reason)
                delivered += len(kept)
                if finish is not None:
                    steps.close()  # finalise stats before the last chunk goes out
                    stats.generated_tokens = delivered  # none past a stop string
                yield StreamChunk(text, kept, finish, stats)
                if finish is not None:
                    return
        finally:
            steps.close()

    def _collect(self, prompt: Prompt, params: SamplingParams | None, speculative: bool | Speculation) -> RequestOutput:
        text, ids, chunk = [], [], None
        for chunk in self.stream(prompt, params, speculative=speculative):
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
        return RequestOutput(prompt, "".join(text), ids, chunk.finish_reason, chunk.stats)

    def generate(
        self,
        prompts: str | Sequence[str],
        params: SamplingParams | None = None,
        *,
        speculative: bool | Speculation = True,
    ) -> list[RequestOutput]:
        """Complete each text prompt (no chat template); one output per prompt, in order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self._collect(p, params, speculative) for p in prompts]

    def chat(
        self, messages: Sequence[Message], params: SamplingParams | None = None, *,
        speculative: bool | Speculation = True,
    ) -> RequestOutput:
        """Answer a conversation (a list of role/content messages) through the chat template."""
        if isinstance(messages, str):
            raise SpeclmError("chat() takes a list of messages; use generate() for plain text")
        return self._collect(messages, params, speculative)

    @property
    def backend_name(self) -> str:
        """Which backend runs the target: ``torch``, ``torch-compiled...`` or ``llamacpp``."""
        return getattr(self.target, "backend_name", "torch")

    @property
    def drafter(self) -> Drafter | None:
        return self.speculation.drafter if self.speculation is not None else None

    @property
    def model_path(self) -> Path:
        return self._loaded.path
