"""Token recycling (Luo et al. 2024, "Turning Trash into Treasure"): training-free drafting from
the candidates the target itself ranked in earlier verification steps.

Every verify forward computes the target's distribution after each token it ran, and all but the
chosen token are normally thrown away. Recycling keeps, per token id, the ids of the target's
top-t next tokens the last time that token was run (a [V, t] table, kept across requests, as in
the paper). To draft, it walks the table from the last committed token: the table's best
successor of that token, then of that one, and so on. The draft is a function of the context and
of earlier target outputs only, so it is deterministic (one-hot q when sampling).

The paper drafts a *tree* from the table (each token's t candidates branch). Until the verifier
takes trees, this drafts the best path, a chain; :meth:`RecycleTable.children` is the per-token
candidate list a tree drafter expands.

The table learns through the drafter protocol's optional target feedback (``wants_target_topk``,
see drafters/base.py): the engine hands over the top-t ids of every verified position, taken on
the device before the round's one sync.
"""

from __future__ import annotations

import torch

from ..errors import SpeclmError
from .base import Draft, DraftContext

UNSEEN = -1  # table entry of a token the target has not yet been run on


class RecycleTable:
    """ids[v] = the target's top-t next-token ids after token v, best first (UNSEEN if never)."""

    def __init__(self, vocab_size: int, topk: int) -> None:
        if topk < 1:
            raise SpeclmError(f"token recycling needs topk >= 1, got {topk}")
        self.topk = topk
        self.ids = torch.full((vocab_size, topk), UNSEEN, dtype=torch.long)  # [V, t]

    def update(self, fed: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Record the target's candidates after each token it ran: fed [m], topk_ids [m, >= t].
        A token that appears twice in ``fed`` keeps one of its rows (both are the target's)."""
        rows = topk_ids[:, : self.topk].to("cpu", torch.long)  # [m, t]
        self.ids[fed.to("cpu", torch.long)] = rows

    def children(self, token: int) -> torch.Tensor:
        """The candidates after ``token``, best first: [t] (UNSEEN where unknown)."""
        return self.ids[token]

    def best_chain(self, start: int, length: int) -> list[int]:
        """Follow the best candidate from ``start`` for up to ``length`` tokens."""
        out, token = [], start
        for _ in range(length):
            token = int(self.ids[token, 0])  # the table lives on the CPU: no device sync
            if token == UNSEEN:
                break
            out.append(token)
        return out

    @property
    def filled(self) -> int:
        """Tokens with candidates in the table."""
        return int((self.ids[:, 0] != UNSEEN).sum())


class RecycleDrafter:
    """Draft the best path through a :class:`RecycleTable` learnt from the target's own top-k."""

    def __init__(self, vocab_size: int, topk: int = 8) -> None:
        self.table = RecycleTable(vocab_size, topk)
        self.wants_target_topk = topk  # the engine's cue to send on_target_topk feedback
        self._rounds = 0  # this request's rounds that produced a draft

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self._rounds = 0  # the table itself is kept across requests

    def propose(self, ctx: DraftContext) -> Draft:
        ids = ctx.token_ids  # [n]
        if ctx.max_tokens <= 0:
            return Draft.empty(ids.device)
        chain = self.table.best_chain(int(ids[-1]), ctx.max_tokens)
        self._rounds += bool(chain)
        return Draft(torch.tensor(chain, dtype=torch.long, device=ids.device))

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass  # the table learns from on_target_topk, every round

    def on_target_topk(self, fed: torch.Tensor, topk_ids: torch.Tensor) -> None:
        self.table.update(fed, topk_ids)  # fed [k + 1], topk_ids [k + 1, t]

    def report(self) -> dict:
        return {"summary": f"table holds candidates for {self.table.filled} tokens; "
                           f"drafted in {self._rounds} rounds",
                "table_tokens": self.table.filled}
