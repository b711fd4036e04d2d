"""Drafters: everything that proposes tokens for the target to verify."""

from .base import Draft, DraftContext, Drafter
from .draft_model import DraftModelDrafter, check_vocab_compatible
from .ngram import NgramDrafter

__all__ = [
    "Draft", "DraftContext", "Drafter", "DraftModelDrafter", "NgramDrafter",
    "check_vocab_compatible",
]
