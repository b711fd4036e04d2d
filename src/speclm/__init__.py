"""speclm: lossless speculative decoding for Hugging Face causal language models."""

from .api import LLM, RequestOutput, StreamChunk
from .draft_length import DraftLengthConfig
from .drafters import Draft, DraftContext, Drafter, DraftModelDrafter, NgramDrafter
from .engine import generate_tokens
from .errors import SpeclmError
from .sampling import SamplingParams
from .stats import RequestStats
from .step import Step
from .verifier import Verdict, verify

__version__ = "0.1.0"

__all__ = [
    "LLM", "RequestOutput", "StreamChunk", "SamplingParams", "RequestStats", "SpeclmError",
    "Draft", "DraftContext", "Drafter", "DraftModelDrafter", "NgramDrafter", "DraftLengthConfig",
    "Step", "generate_tokens", "Verdict", "verify",
]
