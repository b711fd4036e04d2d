"""Batched speculative decoding: a ragged KV cache, the batched step and its draft-length policy."""

from .draft_policy import BatchDraftConfig, BatchDraftPolicy, StepCostModel
from .engine import BatchEngine, SeqOutput, StepReport
from .model import BatchModel

__all__ = ["BatchDraftConfig", "BatchDraftPolicy", "BatchEngine", "BatchModel", "SeqOutput",
           "StepCostModel", "StepReport"]
