"""Dynamic draft trees (EAGLE-2): grow where the drafter is confident, then keep the best nodes.

A drafter that can score continuations of several tree nodes in one pass grows its tree level by
level. Every candidate carries the drafter's cumulative log-probability (its path confidence,
which tracks the chance the target accepts the whole path). At each depth only the ``top_k``
most confident new candidates are expanded (fed to the drafter); each expanded node offers its
``top_k`` best children as candidates. Finally the ``budget`` most confident candidates of all
depths are kept; a child's score never exceeds its parent's, so the kept set is a tree.

How many nodes to keep is a question of cost (:class:`TreeSizer`): where a verify is nearly free
(a GPU) the whole ``budget`` pays; on a CPU each node fed to the target costs a measurable part
of a plain step, and a weak drafter's low-confidence nodes cost more than they return. Given the
target's measured verify cost, the sizer keeps the ``n`` most confident nodes that maximise
expected tokens per second.

The children are chosen deterministically (top-k), so the verifier treats them as one-hot q: the
output stays exactly the target's, greedy or sampled, whatever size the tree is cut to (the size
depends on timing, never on the request's random draws).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import SpeclmError
from ..tree import TreeMeta
from .base import Draft


@dataclass(frozen=True)
class TreeShape:
    """How a dynamic tree grows: ``top_k`` children per expanded node and ``top_k`` nodes
    expanded per depth (the depth itself is the round's K), at most ``budget`` nodes kept;
    ``fit``: keep only the nodes that pay for the measured verify cost when it is known."""

    top_k: int = 4
    budget: int = 16
    fit: bool = True

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.budget < 1:
            raise SpeclmError(f"tree top_k and budget must be >= 1, got {self.top_k} and {self.budget}")


class TreeStepper(Protocol):
    def expand(self, tokens: torch.Tensor, fed: TreeMeta) -> torch.Tensor:
        """Feed ``tokens`` ([T]), the last T nodes of ``fed`` (every node expanded so far, in the
        order fed); return the drafter's log-probabilities for their next tokens: [T, V], over
        the same columns as the root's (a reduced draft vocabulary: ``grow_tree``'s ``vocab``)."""


class TreeSizer:
    """Chooses how many of a grown tree's nodes the target verifies, from measured costs.

    With the candidates sorted by path confidence ``s_i`` (the drafter's cumulative
    log-probability), keeping the first ``n`` gives

        E[tokens | n] = 1 + c * sum_{i < n} exp(s_i)     (each node's chance of being accepted)
        rate(n)       = E[tokens | n] / (draft_s + verify_s(n))

    and the sizer keeps the ``n`` in ``[1, budget]`` with the highest rate (at least one node, so
    that acceptance keeps being measured: whether to draft at all is the draft-length policy's
    call). ``c`` calibrates the drafter's confidence against what the target accepts: a moving
    average of accepted tokens over predicted ones, so an overconfident drafter's trees shrink.

    It also says when growing deeper cannot pay (:meth:`worth_expanding`): the next level's
    nodes together hold at most the frontier's confidence, so they add at most
    ``c * sum(exp(s_frontier))`` expected tokens, while expanding costs a drafter forward
    (``expand_s``, a moving average of measured ones); below ``rate * expand_s`` tokens no
    deeper level can raise the round's rate, however cheap its verify.
    """

    _EMA = 0.1

    def __init__(self) -> None:
        self.calibration = 1.0  # c: accepted / predicted, moving average
        self._accepted = 1.0  # moving averages of both sides of c
        self._predicted = 1.0
        self._pending: float | None = None  # predicted accepted tokens of the last kept tree
        self.expand_s: float | None = None  # seconds of one expansion (drafter forward), moving average

    def _best(self, sorted_scores: np.ndarray, budget: int, verify_s: Callable[[int], float],
              draft_s: float) -> tuple[int, float, float | None]:
        """(n, its rate, its expected accepted tokens) for the best count n in [1, budget]."""
        confidence = np.exp(np.asarray(sorted_scores[:budget], dtype=np.float64)).cumsum().tolist()  # [n]: sum of the first n
        best_n, best_rate = 1, -math.inf
        for n, expected in enumerate(confidence, start=1):
            rate = (1.0 + self.calibration * expected) / (draft_s + verify_s(n))
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n, best_rate, (confidence[best_n - 1] if confidence else None)

    def keep(self, sorted_scores: np.ndarray, budget: int, verify_s: Callable[[int], float],
             draft_s: float) -> int:
        """How many of the ``sorted_scores`` ([N] path log-confidences, best first) to keep."""
        best_n, _, self._pending = self._best(sorted_scores, budget, verify_s, draft_s)
        return best_n

    def worth_expanding(self, sorted_scores: np.ndarray, frontier_scores: np.ndarray, budget: int,
                        verify_s: Callable[[int], float], draft_s: float) -> bool:
        """Whether expanding the frontier ([F] path log-confidences) might raise the best rate
        the candidates so far ([N], best first) give; True while no expansion was timed."""
        if self.expand_s is None:
            return True
        _, rate, _ = self._best(sorted_scores, budget, verify_s, draft_s)
        gain = self.calibration * float(np.exp(np.asarray(frontier_scores, dtype=np.float64)).sum())  # tokens, at most
        return gain > rate * self.expand_s

    def timed_expansion(self, seconds: float) -> None:
        """One expansion (a drafter forward over a tree level) took ``seconds``."""
        w = self._EMA
        self.expand_s = seconds if self.expand_s is None else (1 - w) * self.expand_s + w * seconds

    def observe(self, num_accepted: int) -> None:
        """The target accepted ``num_accepted`` tokens of the tree last kept."""
        if self._pending is None:
            return
        w = self._EMA
        self._accepted = (1 - w) * self._accepted + w * num_accepted
        self._predicted = (1 - w) * self._predicted + w * self._pending
        self.calibration = min(2.0, max(0.02, self._accepted / max(self._predicted, 1e-6)))
        self._pending = None


def grow_tree(root_logprobs: torch.Tensor, stepper: TreeStepper, depth: int, shape: TreeShape,
              verify_s: Callable[[int], float] | None = None, sizer: TreeSizer | None = None,
              vocab: np.ndarray | None = None) -> Draft:
    """Grow a tree of at most ``depth`` levels from the pending token's draft log-probs ([V]).

    ``vocab`` ([V] token ids, a host array the drafter keeps), where the drafter scores a
    reduced draft vocabulary: the target's token id of each column (an EAGLE head's 8k columns
    need no 49k-wide log-softmax or top-k); None: column i is token i.

    Keeps ``shape.budget`` nodes, or, given the target's verify cost (``verify_s(n)``: seconds
    of a forward verifying n drafted tokens) and a ``sizer``, the number that pays best.
    Candidate bookkeeping lives on the host in numpy (a few dozen entries, where each torch op
    would cost more than its work); one sync per level brings the new candidates' top-k over.
    """
    started = time.perf_counter()
    k = min(shape.top_k, root_logprobs.shape[-1])

    def best(logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:  # [..., V] -> ([..., k], token ids)
        values, cols = (t.cpu().numpy() for t in torch.topk(logprobs.float(), k, dim=-1))
        return values, (cols if vocab is None else vocab[cols])

    scores, tokens = best(root_logprobs)  # [N] candidates' path confidences and tokens
    parent = np.full(k, -1, dtype=np.int64)  # [N] each candidate's parent candidate
    level = np.ones(k, dtype=np.int64)  # [N] depth of each candidate
    fed_index = np.full(k, -1, dtype=np.int64)  # [N] position among expanded nodes, or -1
    fed_parents = np.empty(0, dtype=np.int64)  # [F] parents of the expanded nodes, as positions
    frontier = np.arange(k)  # candidates to expand next
    sized = shape.fit and verify_s is not None and sizer is not None
    for d in range(2, depth + 1):
        # no child can be kept (the budget holds better candidates), or none can pay for its forward
        ranked = -np.sort(-scores)  # [N], best first
        if ranked.shape[0] >= shape.budget and ranked[shape.budget - 1] >= scores[frontier].max():
            break
        if sized and not sizer.worth_expanding(ranked, scores[frontier], shape.budget, verify_s,
                                               time.perf_counter() - started):
            break
        fed_index[frontier] = np.arange(fed_parents.shape[0], fed_parents.shape[0] + frontier.shape[0])
        up = parent[frontier]
        fed_parents = np.concatenate([fed_parents, np.where(up >= 0, fed_index[np.maximum(up, 0)], -1)])
        expand_started = time.perf_counter()
        logprobs = stepper.expand(torch.from_numpy(tokens[frontier]), TreeMeta.from_parents(fed_parents))  # [T, V]
        child_scores, child_tokens = best(logprobs)  # [T, k] each
        child_scores = (scores[frontier][:, None] + child_scores).ravel()  # cumulative
        new = np.arange(scores.shape[0], scores.shape[0] + child_scores.shape[0])
        scores = np.concatenate([scores, child_scores])
        tokens = np.concatenate([tokens, child_tokens.ravel()])
        parent = np.concatenate([parent, np.repeat(frontier, k)])
        level = np.concatenate([level, np.full(new.shape, d, dtype=np.int64)])
        fed_index = np.concatenate([fed_index, np.full(new.shape, -1, dtype=np.int64)])
        frontier = new[np.argsort(-child_scores, kind="stable")[:k]]
        if sizer is not None:
            sizer.timed_expansion(time.perf_counter() - expand_started)
    # keep the most confident; on equal scores the shallower first, so ancestors come first
    order = np.argsort(level, kind="stable")
    order = order[np.argsort(-scores[order], kind="stable")]
    budget = shape.budget
    if sized:
        budget = sizer.keep(scores[order], budget, verify_s, time.perf_counter() - started)
    kept = order[:budget]
    kept = kept[np.argsort(level[kept] * scores.shape[0] + kept)]  # topological order (distinct keys)
    position = np.full(scores.shape, -1, dtype=np.int64)
    position[kept] = np.arange(kept.shape[0])
    up = parent[kept]
    parents = np.where(up >= 0, position[np.maximum(up, 0)], -1)
    return Draft(torch.from_numpy(tokens[kept].astype(np.int64)), None, TreeMeta.from_parents(parents))
