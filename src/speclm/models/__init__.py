"""Model backends: what the engine runs the target and draft models through."""

from .base import CausalLM, ForwardOutput
from .hf import HFCausalLM
from .loading import LoadedModel, load_model

__all__ = ["CausalLM", "ForwardOutput", "HFCausalLM", "LoadedModel", "load_model"]
