"""Sampling parameters and the logits warp shared by target and draft.

Speculative sampling is lossless only if the draft's q and the target's p are transformed by the
*same* warp (temperature, then top-k, then top-p). Both sides therefore call :func:`warp_probs`,
and both sample through :func:`sample_token`, which takes an explicit ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import SpeclmError
from .structured.spec import GrammarSpec, grammar_spec


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` ([..., V] -> [...] int64): the first maximal index, a NaN counting as the
    maximum, as PyTorch defines it. On CPU float32/float64 tensors it runs numpy's vectorized
    loop, which gives the same indices ~10x faster (PyTorch 2.13's CPU argmax over a 49k
    vocabulary: ~42 us a row against ~4 us; a greedy verify of 8 rows 270 against 28 us)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(np.asarray(x.numpy().argmax(-1), dtype=np.int64))
    return x.argmax(-1)


GREEDY_BELOW = 1e-5  # temperatures under this are greedy (as in vLLM): 1/T would overflow


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy decoding (token-identical to plain greedy decoding under
    speculation); so does any temperature below ``GREEDY_BELOW`` (1e-5), where sampling is
    greedy in all but name and ``logits / T`` would overflow. ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` makes sampling
    reproducible: the token at each output position is then a function of the seed, the
    position and the target's distribution there alone (:class:`PositionNoise`), so a seeded
    request returns the same tokens with any drafter, any draft length, with or without
    speculation and whatever else is batched with it; ``None`` draws a fresh seed.

    Structured outputs (at most one; speclm.structured): ``json_schema`` (a dict or its JSON
    text), ``json_object`` (any JSON object), ``regex`` (the whole output matches it) or
    ``grammar`` (Lark-style or GBNF). Tokens the constraint forbids get probability 0 before
    the warp, in the target's p and the draft's q alike, so speculation stays lossless for the
    constrained distribution; the request ends when the constraint is complete and allows
    nothing more (or when the model picks EOS where the constraint allows it).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    structured: GrammarSpec | None = field(default=None, init=False, repr=False, compare=False)
    #   the checked constraint of the four fields above (set by validate)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SpeclmError` naming the first invalid field."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SpeclmError(f"seed must be in [0, 2**63), got {self.seed}")
        if not (self.temperature >= 0):  # also rejects NaN
            raise SpeclmError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpeclmError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise SpeclmError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise SpeclmError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise SpeclmError("stop strings must be non-empty")
        self.structured = grammar_spec(self.json_schema, self.json_object, self.regex, self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's only source of randomness."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the sampling distribution: temperature, then top-k, then top-p.

    logits: [N, V] (any float dtype) -> probs: [N, V] float32 (float64 if logits are float64).
    Greedy params return the one-hot distribution of the argmax, so that greedy is a special case
    of sampling everywhere it matters.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(argmax_last(logits), logits.shape[-1]).to(dtype)
    # shift so each row's largest logit is 0 before scaling: (logits - max) / T is <= 0, so no
    # temperature or logit magnitude can overflow to inf - inf = NaN (exp(0) = 1 keeps the sum
    # positive); +inf logits (an overflowed low-precision model) tie at 0 instead of giving NaN
    top = logits.amax(-1, keepdim=True)  # [N, 1]
    logits = torch.where(logits == top, 0.0, logits - top) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(probs < nucleus_floor(probs, params.top_p), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The least probability top-p keeps in each row ([N, V] -> [N, 1]).

    Top-p keeps the most probable tokens until their mass reaches ``top_p``: a token is kept iff
    the tokens more probable than it hold less than ``top_p``, so tokens tied in probability are
    kept or dropped together (no sort order decides between them) and the kept set is every
    token with ``p >= floor``. Only the sorted values are needed, not the order of the tokens:
    on a CPU numpy sorts them (its vectorized sort: ~0.2 ms for a row of 49k where PyTorch
    2.13's CPU sort took 6-30 ms on a 2-core Xeon, more than a decoding step).
    """
    if probs.device.type == "cpu" and probs.dtype in (torch.float32, torch.float64) and not probs.requires_grad:
        ascending = np.sort(probs.numpy(), axis=-1)
        top = torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1]))  # [N, V] descending
    else:
        top = torch.sort(probs, dim=-1, descending=True).values  # [N, V]
    kept = (torch.cumsum(top, dim=-1) - top) < top_p  # [N, V]: a prefix of each row
    last = kept.sum(-1, keepdim=True).clamp_min(1) - 1  # [N, 1]: the last kept position
    return top.gather(-1, last)


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row of probs ([N, V] -> [N]) without a host sync.

    Uses the exponential-race trick: argmax(p / E) with E ~ Exp(1) is a draw from p.
    """
    return keyed_choice(probs, torch.empty_like(probs).exponential_(1.0, generator=generator))


_MASK64 = (1 << 64) - 1


def _position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for (request seed, output position): SplitMix64's finalizer over
    both, so neighbouring positions and seeds get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class PositionNoise:
    """A seeded sampling request's Exp(1) draws, one per (output position, token), each
    position's a function of the seed and the position alone.

    The target's token at output position i is :func:`keyed_choice` of its p there with row i,
    so it is the same token in a plain step and in any verify, whatever was drafted. Each row is
    drawn once, when a round first reaches its position, and dropped once the output has passed
    it (a request holds the rows of at most one round: [K + 1, V] float32)."""

    def __init__(self, seed: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.seed, self.vocab_size, self.device = seed, vocab_size, torch.device(device)
        self._rows: dict[int, torch.Tensor] = {}  # position -> [V]

    def row(self, position: int) -> torch.Tensor:
        """Output position ``position``'s draws ([V] float32, on the request's device)."""
        found = self._rows.get(position)
        if found is None:
            gen = torch.Generator().manual_seed(_position_seed(self.seed, position))
            u = torch.rand(self.vocab_size, generator=gen, dtype=torch.float64)  # [V] in [0, 1)
            # E = -log(1 - u), in float64 so that no draw rounds to 0 (which would win any race)
            found = u.neg_().log1p_().neg_().to(torch.float32).to(self.device)
            self._rows[position] = found
        return found

    def rows(self, first: int, count: int) -> torch.Tensor:
        """Positions ``first .. first + count - 1`` ([count, V]); rows before ``first`` are
        dropped (the output has passed them)."""
        for stale in [p for p in self._rows if p < first]:
            del self._rows[stale]
        return torch.stack([self.row(first + i) for i in range(count)])


def position_noise(params: SamplingParams, vocab_size: int,
                   device: torch.device | str = "cpu") -> PositionNoise | None:
    """A seeded sampling request's :class:`PositionNoise`, or None for greedy and unseeded ones."""
    if params.greedy or params.seed is None:
        return None
    return PositionNoise(params.seed, vocab_size, device)


def keyed_choice(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race with given draws ([N, V], [N, V] Exp(1) -> [N]): argmax p / E, an
    exact draw from p when E is fresh. With a seeded request's :class:`PositionNoise` rows it
    is a function of (p, position) alone, and it moves only where two tokens' p / E nearly tie,
    so kernels that round p a little differently rarely change it. A zero-probability token is
    never chosen, even against a draw of exactly 0."""
    return torch.argmax(torch.where(probs > 0, probs / noise.to(probs.dtype), -1.0), dim=-1)
