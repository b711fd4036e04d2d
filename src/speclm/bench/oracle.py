"""The oracle drafter: acceptance under exact control, to measure the engine's own overhead.

It replays the target's greedy continuation of the prompt (computed beforehand with plain
decoding) and replaces each proposed token, independently with probability 1 - a, by another
token. Under greedy verification a token is then accepted with probability exactly a (given the
ones before it were), which is the i.i.d. acceptance the Leviathan bound assumes. Drafting costs
nothing, so measured speedup / bound is the engine's efficiency on the model at hand.
"""

from __future__ import annotations

import torch

from ..drafters.base import Draft, DraftContext


class OracleDrafter:
    def __init__(self, accept_rate: float, vocab_size: int, seed: int = 0) -> None:
        self.accept_rate = accept_rate
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)  # its own: never the request's
        self.continuation = torch.empty(0, dtype=torch.long)  # [T] the target's greedy output
        self._prompt_len = 0
        self.diverged = False  # the request left the replayed path (outputs differ from plain)

    def set_continuation(self, prompt_len: int, continuation: list[int]) -> None:
        """Install the target's greedy continuation for the next request."""
        self._prompt_len = prompt_len
        self.continuation = torch.tensor(continuation, dtype=torch.long)

    def reset(self, prompt_ids: torch.Tensor) -> None:
        if prompt_ids.shape[0] != self._prompt_len:
            raise RuntimeError("OracleDrafter: set_continuation() was not called for this prompt")
        self.diverged = False

    def propose(self, ctx: DraftContext) -> Draft:
        start = ctx.token_ids.shape[0] - self._prompt_len  # tokens generated so far
        if self.diverged or not torch.equal(ctx.token_ids[self._prompt_len :], self.continuation[:start]):
            self.diverged = True  # replaying plain's tokens here would measure nothing
            return Draft.empty()
        truth = self.continuation[start : start + ctx.max_tokens]  # [k]
        corrupt = torch.rand(truth.shape, generator=self.generator) >= self.accept_rate
        # a different token: shift by 1..V-1 so it can never equal the truth
        shift = torch.randint(1, self.vocab_size, truth.shape, generator=self.generator)
        tokens = torch.where(corrupt, (truth + shift) % self.vocab_size, truth)
        return Draft(tokens)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass
