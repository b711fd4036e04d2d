"""Method specs for the benchmark: ``name[:key=value,...]``, checked before any model loads.

    plain                            speclm plain decoding (the baseline every speedup uses)
    DRAFTER[:options,k=K,adaptive=1] any speclm drafter (drafters/registry.py: ngram, suffix,
                                     recycle, layerskip, early-exit, draft, distilled, auto) with
                                     its options, its draft length K (default: the drafter's;
                                     the adaptive policy's upper bound) and adaptive=0 for a
                                     fixed K
    oracle:a=0.7[,k=4]               replays the target's greedy continuation, each token kept
                                     with probability a (acceptance controlled exactly)
    hf                               transformers generate(), plain
    hf-lookup[:k=10]                 generate(prompt_lookup_num_tokens=k)
    hf-assisted:path=PATH[,k=5]      generate(assistant_model=...)
    hf-early-exit[:layers=N]         generate(assistant_early_exit=N) (default: a third of layers)
    llamacpp                         llama.cpp's own plain decoding (greedy sampler in C)
    llamacpp-lookup[:k=10,ngram=2]   llama-cpp-python's own prompt lookup (LlamaPromptLookupDecoding)
    llama-server[:spec=TYPE,k=K,kmin=M,ngram=N,draft=GGUF]
                                     llama.cpp's C++ server, one request at a time, with its own
                                     speculation: spec=none (default), ngram-simple, ngram-map-k,
                                     ngram-map-k4v, ngram-mod, ngram-cache or draft-simple (with
                                     draft=GGUF); k: draft length, kmin: minimum draft, ngram: lookup
                                     n-gram size (each type's own flag; scripts/build-llama-server.sh)

plain, the drafters and oracle also take engine options, so one run compares backends:
backend=torch|llamacpp|auto, compile=1, quantize=int8|int4|gguf, dtype=bfloat16 (default: the
command's --backend/--compile/--quantize/--dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..drafters.registry import KINDS
from ..errors import SpeclmError
from ..specs import REQUIRED, OptionString, parse_options

# which backend runs a speclm method (None: the command's own flag)
ENGINE_OPTIONS = {"backend": (str, None), "compile": (int, None), "quantize": (str, None),
                  "dtype": (str, None)}
# name -> {option: (type, default)}
_SCHEMA: dict[str, dict[str, tuple[type, object]]] = {
    "plain": {**ENGINE_OPTIONS},
    **{name: {**kind.options, "k": (int, kind.default_k), "adaptive": (int, 1), **ENGINE_OPTIONS}
       for name, kind in KINDS.items()},
    "oracle": {"a": (float, REQUIRED), "k": (int, 4), "seed": (int, 0), **ENGINE_OPTIONS},
    "hf": {},
    "hf-lookup": {"k": (int, 10)},
    "hf-assisted": {"path": (str, REQUIRED), "k": (int, 5)},
    "hf-early-exit": {"layers": (int, 0), "k": (int, 5)},
    "llamacpp": {},
    "llamacpp-lookup": {"k": (int, 10), "ngram": (int, 2)},
    "llama-server": {"spec": (str, "none"), "k": (int, None), "kmin": (int, None), "ngram": (int, None),
                     "draft": (str, None)},
}
_TORCH_OPTIONS = ("compile", "quantize", "dtype")  # engine options only the torch backend takes
_UNSET = {"compile": 0, "quantize": None, "dtype": "auto"}  # each one's "not asked for"
LLAMACPP_PEERS = ("llamacpp", "llamacpp-lookup", "llama-server")  # run on llama.cpp, on the GGUF
PEERS = ("hf", "hf-lookup", "hf-assisted", "hf-early-exit", *LLAMACPP_PEERS)
_BENCH_ONLY = ("k", "adaptive", *ENGINE_OPTIONS)  # options of the run, not of the drafter


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as the user wrote it: the row name in every table
    name: str  # one of _SCHEMA
    options: dict = field(default_factory=dict, hash=False)

    @property
    def is_peer(self) -> bool:
        """Run by transformers' or llama.cpp's own generation, not by speclm's engine."""
        return self.name in PEERS

    def engine(self, defaults: tuple) -> tuple:
        """(backend, compile, quantize, dtype) this method runs on: its own engine options over
        the command's ``defaults``. The method's own options decide its backend: torch options
        of its own (compile, quantize, dtype) without a backend of its own make it ``auto``
        (which they resolve to torch), and ``backend=llamacpp`` of its own drops the command's
        torch options. Peers run on their own (see bench/runner.py)."""
        own = {key: self.options.get(key) for key in ENGINE_OPTIONS}
        values = {key: default if own[key] is None else own[key]
                  for key, default in zip(ENGINE_OPTIONS, defaults)}
        if own["backend"] is None and any(own[key] not in (None, 0) for key in _TORCH_OPTIONS):
            values["backend"] = "auto"
        if own["backend"] == "llamacpp":
            values.update({key: _UNSET[key] for key in _TORCH_OPTIONS if own[key] is None})
        return tuple(values[key] for key in ENGINE_OPTIONS)

    @property
    def k(self) -> int:
        return int(self.options.get("k") or 0)

    def short_label(self) -> str:
        """The label with each path option cut to its last component (``medusa:path=medusa-smollm2``)."""
        if not any(isinstance(v, str) and "/" in v for v in self.options.values()):
            return self.label
        head, _, rest = self.label.partition(":")
        parts = []
        for i, item in enumerate(rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq and i == 0 and "/" in key:  # a bare first option is the path
                key = Path(key.rstrip("/")).name
            elif eq and "/" in value:
                value = Path(value.rstrip("/")).name
            parts.append(key + eq + value)
        return head + ":" + ",".join(parts)

    @property
    def drafter(self) -> OptionString | None:
        """The speclm drafter this method runs (its own options only), or None."""
        if self.name not in KINDS:
            return None
        return OptionString(self.label, self.name,
                            {k: v for k, v in self.options.items() if k not in _BENCH_ONLY})


def parse_method(text: str) -> MethodSpec:
    """Parse and validate one ``--method`` value; errors name the problem in one line."""
    parsed = parse_options(text, _SCHEMA, what="method")
    name, options = parsed.name, parsed.options
    if options.get("k") is not None and options["k"] < 1:
        raise SpeclmError(f"method spec {text!r}: k must be >= 1")
    if name == "oracle" and not 0.0 <= options["a"] <= 1.0:
        raise SpeclmError(f"method spec {text!r}: a must be in [0, 1]")
    if name in KINDS:
        try:
            KINDS[name].check({k: v for k, v in options.items() if k not in _BENCH_ONLY})
        except SpeclmError as exc:
            raise SpeclmError(f"method spec {text!r}: {exc}") from None
    if options.get("backend") not in (None, "auto", "torch", "llamacpp"):
        raise SpeclmError(f"method spec {text!r}: backend must be auto, torch or llamacpp")
    from ..models.quantize import CHOICES

    if options.get("quantize") not in (None, *CHOICES):
        raise SpeclmError(f"method spec {text!r}: quantize must be one of {', '.join(CHOICES)}")
    if name == "llamacpp-lookup" and options["ngram"] < 1:
        raise SpeclmError(f"method spec {text!r}: ngram must be >= 1")
    if name == "llama-server":
        from .llama_server import server_args

        try:
            server_args(options)
        except SpeclmError as exc:
            raise SpeclmError(f"method spec {text!r}: {exc}") from None
    if name == "hf-assisted" and options["path"] != "default" and not Path(options["path"]).expanduser().exists():
        raise SpeclmError(f"method spec {text!r}: model path {options['path']!r} does not exist")
    return MethodSpec(parsed.label, name, options)
