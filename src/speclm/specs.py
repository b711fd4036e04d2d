"""Option strings ``name[:key=value,...]``: drafters (``--drafter``, ``speculative_model=``) and
``speclm bench`` methods share this one parser, so both accept and reject exactly the same text.

A schema maps each option to ``(parser, default)``; a default of :data:`REQUIRED` makes the
option mandatory, ``None`` means "absent" (the drafter then decides, e.g. searches). A first item
without ``=`` is the path where the schema has one (``eagle:DIR`` = ``eagle:path=DIR``). List-valued
options take comma-separated items and ranges: in ``layerskip:skip=3,5,9-11,k=4`` the items ``5``
and ``9-11`` have no ``=`` and so continue ``skip``; ``k=4`` starts the next option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import SpeclmError

REQUIRED = object()  # schema default of an option that must be given
Schema = dict[str, tuple[Callable[[str], object], object]]


class IntList:
    """Parses ``3,5,9-11`` into ``(3, 5, 9, 10, 11)`` (sorted, without repeats)."""

    is_list = True
    __name__ = "list of integers"

    def __call__(self, text: str) -> tuple[int, ...]:
        out: set[int] = set()
        for item in filter(None, text.split(",")):
            lo, dash, hi = item.partition("-")
            if dash:
                first, last = int(lo), int(hi)
                if last < first:
                    raise ValueError(item)
                out.update(range(first, last + 1))
            else:
                out.add(int(item))
        return tuple(sorted(out))


class NameList:
    """Parses ``ngram,suffix`` into ``("ngram", "suffix")`` (order kept, without repeats)."""

    is_list = True
    __name__ = "list of names"

    def __call__(self, text: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))


def _type_name(kind: Callable) -> str:
    return getattr(kind, "__name__", "value")


@dataclass(frozen=True)
class OptionString:
    """A parsed option string; ``label`` is the text as written (the name in stats and tables)."""

    label: str
    name: str
    options: dict = field(default_factory=dict, hash=False)


def parse_options(text: str, schemas: dict[str, Schema], what: str = "method") -> OptionString:
    """Parse ``text`` against ``schemas`` (name -> schema); every error is one line."""
    name, _, rest = text.strip().partition(":")
    if name not in schemas:
        raise SpeclmError(f"unknown {what} {name!r} in {text!r}; choose from {', '.join(schemas)}")
    schema = schemas[name]
    raw: dict[str, str] = {}
    last: str | None = None
    for position, item in enumerate(filter(None, rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq and last is not None and getattr(schema[last][0], "is_list", False):
            raw[last] += "," + item  # another item of a list-valued option
            continue
        if not eq and position == 0 and "path" in schema:  # eagle:DIR is eagle:path=DIR
            raw["path"], last = item, "path"
            continue
        if not eq or key not in schema:
            known = ", ".join(schema) or "none"
            raise SpeclmError(f"malformed {what} spec {text!r}: {item!r} is not key=value "
                              f"with a known key (keys for {name}: {known})")
        raw[key], last = value, key
    options: dict = {}
    for key, value in raw.items():
        kind = schema[key][0]
        try:
            options[key] = kind(value)
        except ValueError:
            raise SpeclmError(f"{what} spec {text!r}: {key} must be a {_type_name(kind)}, "
                              f"got {value!r}") from None
    for key, (_, default) in schema.items():
        if key not in options:
            if default is REQUIRED:
                raise SpeclmError(f"{what} spec {text!r} needs {key}=...")
            options[key] = default
    return OptionString(text.strip().rstrip(":"), name, options)
