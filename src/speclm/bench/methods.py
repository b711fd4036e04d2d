"""Method specs for the benchmark: ``name[:key=value,...]``, checked before any model loads.

    plain                            speclm plain decoding (the baseline every speedup uses)
    ngram[:k=10,min=2,max=3,adaptive=0]
    draft:path=PATH[,k=5,p_min=0,adaptive=0]
    oracle:a=0.7[,k=4]               replays the target's greedy continuation, each token kept
                                     with probability a (acceptance controlled exactly)
    hf                               transformers generate(), plain
    hf-lookup[:k=10]                 generate(prompt_lookup_num_tokens=k)
    hf-assisted:path=PATH[,k=5]      generate(assistant_model=...)
    hf-early-exit[:layers=N]         generate(assistant_early_exit=N) (default: a third of layers)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpeclmError

# name -> {option: (type, default)}; a default of None means the option is required
_SCHEMA: dict[str, dict[str, tuple[type, object]]] = {
    "plain": {},
    "ngram": {"k": (int, 10), "min": (int, 2), "max": (int, 3), "adaptive": (int, 0)},
    "draft": {"path": (str, None), "k": (int, 5), "p_min": (float, 0.0), "adaptive": (int, 0)},
    "oracle": {"a": (float, None), "k": (int, 4), "seed": (int, 0)},
    "hf": {},
    "hf-lookup": {"k": (int, 10)},
    "hf-assisted": {"path": (str, None), "k": (int, 5)},
    "hf-early-exit": {"layers": (int, 0), "k": (int, 5)},
}


@dataclass(frozen=True)
class MethodSpec:
    label: str  # as the user wrote it: the row name in every table
    name: str  # one of _SCHEMA
    options: dict = field(default_factory=dict, hash=False)

    @property
    def is_peer(self) -> bool:
        """Run by transformers' own generate(), not by speclm's engine."""
        return self.name.startswith("hf")

    @property
    def k(self) -> int:
        return int(self.options.get("k", 0))


def parse_method(text: str) -> MethodSpec:
    """Parse and validate one ``--method`` value; errors name the problem in one line."""
    name, _, rest = text.strip().partition(":")
    if name not in _SCHEMA:
        raise SpeclmError(f"unknown method {name!r} in {text!r}; choose from {', '.join(_SCHEMA)}")
    schema = _SCHEMA[name]
    options: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in schema:
            known = ", ".join(schema) or "none"
            raise SpeclmError(f"malformed method spec {text!r}: {item!r} is not key=value "
                              f"with a known key (keys for {name}: {known})")
        kind = schema[key][0]
        try:
            options[key] = kind(value)
        except ValueError:
            raise SpeclmError(f"method spec {text!r}: {key} must be a {kind.__name__}, got {value!r}") from None
    for key, (_, default) in schema.items():
        if key not in options:
            if default is None:
                raise SpeclmError(f"method spec {text!r} needs {key}=...")
            options[key] = default
    if "k" in options and options["k"] < 1:
        raise SpeclmError(f"method spec {text!r}: k must be >= 1")
    if name == "oracle" and not 0.0 <= options["a"] <= 1.0:
        raise SpeclmError(f"method spec {text!r}: a must be in [0, 1]")
    if name == "ngram" and not 1 <= options["min"] <= options["max"]:
        raise SpeclmError(f"method spec {text!r}: need 1 <= min <= max")
    if "p_min" in options and not 0.0 <= options["p_min"] < 1.0:
        raise SpeclmError(f"method spec {text!r}: p_min must be in [0, 1)")
    if "path" in options and options["path"] != "default" and not Path(options["path"]).expanduser().exists():
        raise SpeclmError(f"method spec {text!r}: model path {options['path']!r} does not exist")
    return MethodSpec(text.strip().rstrip(":"), name, options)
