"""The batched eager-torch target (a ragged KV cache) and the batch's draft-length policy."""

from .draft_policy import BatchDraftConfig, BatchDraftPolicy, StepCostModel
from .model import BatchModel

__all__ = ["BatchDraftConfig", "BatchDraftPolicy", "BatchModel", "StepCostModel"]
