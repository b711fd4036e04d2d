"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the current suffix.

Training-free and nearly free to run, it pays off when the output repeats the input
(summarisation, RAG, code edits). Its drafts are deterministic, so the verifier treats them as
one-hot q (accepted with probability p(token) when sampling).

Example with ``min_n=2, max_n=3`` on ``[1, 2, 3, 4, 2, 3]``: the 3-gram ``[4, 2, 3]`` never
occurred before, the 2-gram ``[2, 3]`` did at index 1, so the draft is ``[4, 2, 3, ...]``, the
tokens that followed it (up to K).
"""

from __future__ import annotations

import torch

from ..errors import SpeclmError
from .base import Draft, DraftContext


class NgramDrafter:
    """Propose the continuation of the longest suffix n-gram (max_n down to min_n) that occurred
    earlier in prompt + output, taking its most recent occurrence."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise SpeclmError(f"n-gram sizes need 1 <= min <= max, got min={min_n} max={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def reset(self, prompt_ids: torch.Tensor) -> None:
        pass  # stateless: everything it needs is in the context

    def propose(self, ctx: DraftContext) -> Draft:
        ids = ctx.token_ids  # [n]
        total = ids.shape[0]
        if ctx.max_tokens <= 0:
            return Draft.empty(ids.device)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = ids[total - n :]  # [n]
            windows = ids[: total - 1].unfold(0, n, 1)  # [total - n, n]; excludes the suffix itself
            hits = torch.nonzero((windows == suffix).all(dim=1)).flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the most recent occurrence
                return Draft(ids[start : start + ctx.max_tokens].clone())
        return Draft.empty(ids.device)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass
