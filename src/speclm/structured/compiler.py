"""A :class:`~speclm.structured.spec.GrammarSpec` compiled for one tokenizer, by llguidance.

Why llguidance (over xgrammar, the other maintained engine): it installs as one small wheel with
no GPU-oriented dependencies (xgrammar's wheel requires triton and a TVM FFI runtime on Linux),
its matcher rolls back any number of tokens (``rollback(n)``), which is exactly what the verifier's
accept/reject needs, and it reports the tokens the grammar forces (``compute_ff_tokens``) for
jump-forward drafting. Its token masks are computed lazily from the tokenizer's trie, so a mask
costs tens of microseconds on a JSON schema with a 49k-token vocabulary (docs/architecture.md has
the measurements). It reads JSON schemas, regexes, its Lark dialect and llama.cpp's GBNF.

Compiling has two costs, both paid once and cached: the tokenizer's trie (about a second for a
49k vocabulary; cached per tokenizer and EOS set) and the grammar (microseconds to tens of
milliseconds; cached per spec, least recently used first out). A request's matcher is a copy
of the cached one, so starting a request costs no compilation. Bad schemas and grammars raise
:class:`~speclm.errors.SpeclmError` with llguidance's reason, on one line.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable

import llguidance
from llguidance import LLMatcher, LLTokenizer

from ..errors import SpeclmError
from .matcher import GrammarMatcher
from .spec import GrammarSpec

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF tokenizer -> {eos: LLTokenizer}
_TOKENIZERS_LOCK = threading.Lock()
ANY_OBJECT = '{"type": "object"}'
# JSON written one way: no free whitespace, ", " and ": " between items (the spacing models
# write). Free whitespace would let a small model pad forever, and would leave nothing forced
# (after "{" a newline could come as well as a key); a schema's "x-guidance" overrides this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def ll_tokenizer(tokenizer, eos_token_ids: Iterable[int]) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (its vocabulary as bytes, and a token
    trie), built once per tokenizer and EOS set (about a second for 49k tokens)."""
    eos = tuple(sorted(eos_token_ids)) or (tokenizer.eos_token_id,)
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.setdefault(tokenizer, {})
        if eos not in cached:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None or None in eos:
                raise SpeclmError("structured outputs need a fast (Rust) Hugging Face tokenizer "
                                  f"with an EOS token; this model has {type(tokenizer).__name__}")
            from llguidance.hf import from_tokenizer

            try:
                cached[eos] = from_tokenizer(tokenizer, eos_token=list(eos))
            except ValueError as exc:  # e.g. a decoder llguidance cannot read bytes through
                raise SpeclmError(f"structured outputs cannot use this model's tokenizer: "
                                  f"{_one_line(str(exc))}") from None
        return cached[eos]


def grammar_text(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar definition (not yet checked)."""
    try:
        if spec.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_STYLE)
        if spec.kind == "json_object":
            return LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_STYLE)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.source)
        return llguidance.grammar_from("grammar", spec.source)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise SpeclmError(f"the {spec.label} is invalid: {_one_line(str(exc))}") from None


class GrammarCompiler:
    """Compiles specs for one tokenizer and model; hands out one matcher per request.

    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary (padding rows): those tokens are never allowed. Thread-safe: the server checks
    specs on its request threads and the engine thread makes the matchers.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int], *,
                 cache_size: int = 64) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.cache_size = cache_size
        self._compiled: OrderedDict[GrammarSpec, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, spec: GrammarSpec | None) -> None:
        """Compile ``spec`` now (cached) so that a bad schema or grammar fails here."""
        if spec is not None:
            self._prototype(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher for one request, at the start of the output."""
        return GrammarMatcher(self._prototype(spec).deep_copy(), self.vocab_size, self.eos_token_ids)

    def _prototype(self, spec: GrammarSpec) -> LLMatcher:
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        tok = ll_tokenizer(self.tokenizer, self.eos_token_ids)
        grammar = grammar_text(spec)
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if failed:
            raise SpeclmError(f"the {spec.label} is invalid: {_one_line(messages[0])}")
        proto = LLMatcher(tok, grammar, log_level=0)
        if proto.is_error():
            raise SpeclmError(f"the {spec.label} is invalid: {_one_line(proto.get_error())}")
        with self._lock:
            self._compiled[spec] = proto
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return proto


def request_matcher(grammars: GrammarCompiler | None, spec: GrammarSpec | None) -> GrammarMatcher | None:
    """A request's matcher (None: unconstrained); a bad schema or grammar raises here."""
    if spec is None:
        return None
    if grammars is None:
        raise SpeclmError("structured outputs need the model's tokenizer: run through LLM, "
                          "or give Engine(grammars=GrammarCompiler(...))")
    return grammars.matcher(spec)


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's messages can span lines (a grammar excerpt under the reason): the first
    line, the line that names the error if another does, bounded."""
    lines = [part.strip() for part in message.splitlines() if part.strip()] or ["unknown error"]
    named = next((part for part in lines[1:] if part.lower().startswith("error:")), None)
    line = f"{lines[0]} {named}" if named else lines[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."
