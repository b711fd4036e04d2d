"""Suffix matching across requests: draft what followed the same text earlier in the session.

Agents, code edits and templated output repeat themselves across requests: the same tool-call
scaffolding, the same file with one line changed, the same report layout. Prompt lookup only sees
the current request; this drafter (after SuffixDecoding, Oliaro et al. 2024) keeps every prompt
and output of the session in one bounded store and drafts the continuation of the longest
earlier match of the current context's suffix.

The store is an LZ77-style hash-chain index over a ring buffer of ``capacity`` tokens:

- ``tokens``: the ring; sequences are separated by a separator that never matches;
- for each anchor size a (default 2 and 6), ``head[hash(last a tokens)]`` is the newest position
  ending such an anchor, and ``prev[p]`` the previous position with the same anchor, so the
  occurrences of an anchor are a chain, newest first. A position is indexed once the token after
  it exists, so the context's own end never matches itself.

A query tries the longest anchor first, walks at most ``max_candidates`` links of its chain,
measures each candidate's match backwards (up to ``max_match`` tokens) and keeps the longest
(the newest on ties). Memory is bounded: writing into a full ring evicts the oldest token and
drops a chain head that pointed at it, so nothing grows past ``capacity`` positions.

Drafts are deterministic (one-hot q when sampling). ``factor`` caps the draft at
``factor x match length`` tokens (SuffixDecoding's spec factor): a long match earns a long
draft, a two-token match a short one, which matters where a long verify is expensive (CPUs).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence

import torch

from ..errors import SpeclmError
from .base import Draft, DraftContext

SEPARATOR = -1  # between sequences; equal to no token


class SuffixIndex:
    """A bounded store of token sequences, indexed by the anchors that end at each position."""

    def __init__(self, capacity: int = 1 << 18, anchors: Sequence[int] = (2, 6),
                 max_candidates: int = 32, max_match: int = 64) -> None:
        if capacity < 16:
            raise SpeclmError(f"suffix capacity must be >= 16 tokens, got {capacity}")
        if not anchors or min(anchors) < 1:
            raise SpeclmError(f"suffix anchor sizes must be >= 1, got {list(anchors)}")
        self.capacity = capacity
        self.anchors = tuple(sorted(set(anchors), reverse=True))  # longest first
        self.max_candidates = max_candidates
        self.max_match = max(max_match, self.anchors[0])
        self.tokens = array("q", [SEPARATOR]) * capacity  # ring: position p lives at p % capacity
        self.prev = {a: array("q", [-1]) * capacity for a in self.anchors}  # older position, same anchor
        self.head: dict[int, dict[int, int]] = {a: {} for a in self.anchors}  # anchor hash -> newest
        self.end = 0  # absolute position of the next token

    @property
    def oldest(self) -> int:
        """The oldest position still held."""
        return max(0, self.end - self.capacity)

    def _at(self, p: int) -> int:
        return self.tokens[p % self.capacity]

    def _anchor_key(self, last: int, a: int) -> int | None:
        """Hash of the a tokens ending at position ``last``; None if one is a separator or gone."""
        if last - a + 1 < self.oldest:
            return None
        window = tuple(self._at(p) for p in range(last - a + 1, last + 1))
        return None if SEPARATOR in window else hash(window)

    def start_sequence(self) -> None:
        """Begin a new sequence: no match runs across the boundary."""
        if self.end and self._at(self.end - 1) != SEPARATOR:
            self._append(SEPARATOR)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self._append(int(token))

    def _append(self, token: int) -> None:
        q = self.end
        if q >= self.capacity:  # evict position q - capacity, the oldest
            x = q - self.capacity
            for a in self.anchors:  # the anchor starting at x ends at x + a - 1: drop its head
                key = self._anchor_key(x + a - 1, a)
                if key is not None and self.head[a].get(key) == x + a - 1:
                    del self.head[a][key]
        self.tokens[q % self.capacity] = token
        self.end = q + 1
        if token == SEPARATOR:
            return
        for a in self.anchors:  # the anchor ending at q - 1 now has a continuation
            key = self._anchor_key(q - 1, a)
            if key is not None:
                self.prev[a][(q - 1) % self.capacity] = self.head[a].get(key, -1)
                self.head[a][key] = q - 1

    def longest_match(self, context: Sequence[int]) -> tuple[int, int]:
        """(position, length): where the longest match of ``context``'s suffix ends in the store,
        and how many tokens match; (-1, 0) when no anchor matches."""
        for a in self.anchors:
            if len(context) < a or SEPARATOR in context[-a:]:
                continue
            p = self.head[a].get(hash(tuple(context[-a:])), -1)
            best, best_len = -1, 0
            for _ in range(self.max_candidates):
                if p < self.oldest:
                    break
                length = self._match_length(p, context)
                if length > best_len:
                    best, best_len = p, length
                    if length >= min(self.max_match, len(context)):
                        break
                p = self.prev[a][p % self.capacity]
            if best_len >= a:  # a hash collision can give a shorter (false) match
                return best, best_len
        return -1, 0

    def _match_length(self, p: int, context: Sequence[int]) -> int:
        limit = min(self.max_match, len(context), p - self.oldest + 1)
        j = 0
        while j < limit and self._at(p - j) == context[-1 - j]:
            j += 1
        return j

    def continuation(self, p: int, length: int) -> list[int]:
        """Up to ``length`` tokens after position ``p``, stopping at a sequence boundary."""
        out = []
        for q in range(p + 1, min(p + 1 + length, self.end)):
            token = self._at(q)
            if token == SEPARATOR:
                break
            out.append(token)
        return out


class SuffixDrafter:
    """Draft the continuation of the longest earlier match of the context, across requests."""

    def __init__(self, capacity: int = 1 << 18, factor: float = 1.0, anchors: Sequence[int] = (2, 6),
                 max_candidates: int = 32) -> None:
        if not factor >= 0:
            raise SpeclmError(f"suffix factor must be >= 0 (0: no cap), got {factor}")
        self.index = SuffixIndex(capacity, anchors, max_candidates)
        self.factor = factor
        self._seen = 0  # tokens of the current request already in the index
        self._hits = self._rounds = 0

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.index.start_sequence()
        self.index.extend(prompt_ids.tolist())
        self._seen = int(prompt_ids.shape[0])
        self._hits = self._rounds = 0

    def observe(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """The final tokens of the request since ``reset``: index those not yet seen (the rounds
        it was not asked to draft, see drafters/base.py)."""
        tokens = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        self.index.extend(tokens[self._seen :])
        self._seen = max(self._seen, len(tokens))

    def propose(self, ctx: DraftContext) -> Draft:
        ids = ctx.token_ids  # [n]
        n = ids.shape[0]
        if n > self._seen:  # rounds that were not drafted (adaptive K = 0) did not report
            self.index.extend(ids[self._seen :].tolist())
            self._seen = n
        if ctx.max_tokens <= 0:
            return Draft.empty(ids.device)
        self._rounds += 1
        p, length = self.index.longest_match(ids[-self.index.max_match :].tolist())
        if length == 0:
            return Draft.empty(ids.device)
        budget = ctx.max_tokens if self.factor == 0 else min(ctx.max_tokens, math.ceil(self.factor * length))
        tokens = self.index.continuation(p, budget)
        self._hits += bool(tokens)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=ids.device))

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        self.index.extend(emitted)
        self._seen += len(emitted)

    def report(self) -> dict:
        held = self.index.end - self.index.oldest
        return {"summary": f"matched in {self._hits} of {self._rounds} rounds; index holds {held} "
                           f"tokens (capacity {self.index.capacity})",
                "hits": self._hits, "rounds": self._rounds, "index_tokens": held}
