"""One request's grammar state: which tokens may come next, and moving over tokens and back.

:class:`GrammarMatcher` wraps an llguidance matcher whose state is the request's committed
output. A speculative round walks it forward over draft tokens (to prune the draft and to build
the verifier's per-position masks) and rolls it back to the committed state before the commit
advances it over the tokens the verifier emitted; its state therefore always follows the
verifier's accept/reject exactly. Every call is O(tokens walked) on the host, never a loop over
the vocabulary in Python: llguidance writes each mask as a bitmask (32 tokens per int32 word,
a few microseconds) into a row of a buffer, and all the rows of a round are unpacked into one
bool tensor at once (one vectorised AND; unpacking mask by mask costs several times more).

EOS is a token like any other here: the grammar allows it only where the output is complete
(``accepting``), and once the grammar can take nothing more (``stopped``) EOS is all it allows.
llguidance refuses to consume an EOS once stopped although its mask allows it (and its
``validate_tokens`` counts it); this class takes such EOS tokens without moving llguidance, and
counts them, so that every advance is undone by a rollback of the same count.
"""

from __future__ import annotations

import torch
from llguidance import LLMatcher

_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)  # [32]: 1 << j


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmasks [R, W] int32 (bit j of word w: token 32 w + j) -> [R, vocab_size] bool."""
    bits = (words.unsqueeze(-1) & _BITS).ne(0).view(words.shape[0], -1)  # [R, 32 W]
    if bits.shape[1] < vocab_size:  # logits wider than the tokenizer: never allowed
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]))
    return bits[:, :vocab_size]


class GrammarMatcher:
    """Allowed-token masks, advance, rollback and forced tokens for one request.

    ``vocab_size`` is the model's logits width V; tokens past the tokenizer's vocabulary (V may
    be padded) are never allowed.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_words = (vocab_size + 31) // 32
        self._tail_eos = 0  # EOS tokens taken after the grammar stopped (llguidance took none)
        self.round = None  # the grammar's account of the round in flight (speclm.structured.drafts)

    # -- queries (no state change) -----------------------------------------------------------
    def buffer(self, rows: int) -> torch.Tensor:
        """[rows, W] int32: a buffer for ``rows`` bitmasks (see :meth:`fill`)."""
        return torch.zeros(rows, self.num_words, dtype=torch.int32)

    def fill(self, words: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into ``words[row]`` (a bitmask). ``words``
        comes from :meth:`buffer` (host, int32, contiguous). Called through the matcher itself,
        not ``llguidance.torch``, whose import runs ``torch.compile`` (and loads inductor) on
        every ``import speclm``."""
        line = words[row]
        self._m.unsafe_compute_mask_ptr(line.data_ptr(), line.numel() * line.element_size())

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        words = self.buffer(1)
        self.fill(words, 0)
        return unpack(words, self.vocab_size)[0]

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces from here (its fast-forward tokens: the
        forced bytes, tokenized canonically). A drafter need not be asked for them."""
        if limit <= 0 or self._m.is_stopped():
            return []
        return self._m.compute_ff_tokens()[:limit]

    @property
    def accepting(self) -> bool:
        """The output so far is complete: EOS is allowed."""
        return self._m.is_accepting()

    @property
    def stopped(self) -> bool:
        """The grammar can take nothing more but EOS: the request is finished."""
        return self._m.is_stopped()

    # -- moves ---------------------------------------------------------------------------------
    def advance(self, tokens: list[int]) -> int:
        """Consume as many of ``tokens`` as the grammar allows, in order; how many it took. A
        refused token leaves the state as it was before it."""
        taken = 0
        while taken < len(tokens):
            if self._m.is_stopped() and tokens[taken] in self.eos_token_ids:
                self._tail_eos += 1
                taken += 1
                continue
            moved = self._m.try_consume_tokens(tokens[taken:])
            if moved == 0:
                break
            taken += moved
        return taken

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` consumed tokens."""
        tail = min(count, self._tail_eos)
        self._tail_eos -= tail
        count -= tail
        if count and not self._m.rollback(count):
            raise RuntimeError(f"the grammar matcher could not roll back {count} tokens: "
                               f"{self._m.get_error()}")

    def masks_along(self, tokens: list[int]) -> torch.Tensor:
        """[len + 1, V] bool: the allowed tokens before each of ``tokens`` and after the last,
        walking forward over them (all must be allowed) and back again."""
        words = self.buffer(len(tokens) + 1)  # [len + 1, W]
        self.fill(words, 0)
        for i, token in enumerate(tokens):
            if self.advance([token]) != 1:
                self.rollback(i)
                raise RuntimeError(f"draft token {token} at {i} is outside the grammar (the draft "
                                   "should have been pruned)")
            self.fill(words, i + 1)
        self.rollback(len(tokens))
        return self.check(unpack(words, self.vocab_size))

    def check(self, masks: torch.Tensor) -> torch.Tensor:
        """``masks`` [R, V], unless a row allows nothing (the matcher failed: a bug)."""
        if not bool(masks.any(-1).all()):
            raise RuntimeError(f"the grammar allows no token: {self._m.get_error() or 'empty mask'}")
        return masks

    def commit(self, tokens: list[int]) -> int:
        """Advance over the tokens a round emitted; returns how many belong to the output: all
        up to the one after which the grammar stopped (that token included, EOS or not), so a
        complete output ends its request at once. A refused token before that is a bug."""
        for i, token in enumerate(tokens):
            if self.stopped:
                return i
            if self.advance([token]) != 1:
                raise RuntimeError(f"the verifier emitted token {token}, which the grammar "
                                   f"forbids: {self._m.get_error()}")
        return len(tokens)
