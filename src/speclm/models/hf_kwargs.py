"""The keyword a transformers forward takes its KV cache under.

Recent transformers 5.x releases (5.24 has it) renamed ``past_key_values`` to ``cache`` on their
models' and layers' forwards (the old name warns, and goes in 5.40); earlier 5.x releases know
only ``past_key_values``. Every call site passes its cache as ``**{cache_kwarg(module): cache}``
(the name is read from the forward's signature once per class), so speclm runs without the
warning on either side of the rename.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import lru_cache


@lru_cache(maxsize=None)
def _name_for(fn: Callable) -> str:
    params = inspect.signature(fn).parameters  # follows the deprecation wrapper's __wrapped__
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(module) -> str:
    """``"cache"`` or ``"past_key_values"``: what ``module.forward`` takes its cache as."""
    return _name_for(type(module).forward)
