"""``speclm bench``: methods side by side on a prompt workload, timed fairly, with bounds."""

from .methods import MethodSpec, parse_method
from .metrics import leviathan_bound
from .oracle import OracleDrafter

__all__ = ["MethodSpec", "OracleDrafter", "leviathan_bound", "parse_method"]
