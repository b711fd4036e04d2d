"""A smaller model with the target's tokenizer drafts K tokens autoregressively.

The draft keeps its own KV cache in step with the committed tokens: after verification it rolls
back to the accepted prefix and, next round, feeds only what it has not seen (the recovered or
bonus token, plus the last draft token when everything was accepted).

With sampling, tokens are drawn from q = warp(draft logits) with the same warp as the target and
those q rows go to the verifier; a seeded request's draws use the noise the target draws the
same positions with (speclm.verifier), so a draft agrees with the target wherever q and p do.
With a :class:`~.tree_search.TreeShape` the draft grows a dynamic
token tree instead of a chain (EAGLE-2's search, run on the draft model with tree masks); its
children are top-k picks, so the verifier treats them as deterministic. With ``p_min > 0`` drafting stops early when the draft's top
probability falls below it (llama.cpp's ``--draft-p-min``): low-confidence tokens are usually
rejected, and each one costs a draft forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import SpeclmError
from ..models.base import CausalLM
from ..sampling import argmax_last, keyed_choice, sample_token, warp_probs
from .base import Draft, DraftContext
from .tree_search import TreeShape, TreeSizer, grow_tree


def check_vocab_compatible(target_tokenizer: object, draft_tokenizer: object) -> None:
    """The draft must speak the target's token ids; raise a clear error if it does not."""
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = sum(1 for tok, idx in target_vocab.items() if draft_vocab.get(tok) != idx)
    raise SpeclmError(
        f"draft model's tokenizer differs from the target's ({len(draft_vocab)} vs "
        f"{len(target_vocab)} tokens, {differing} target tokens missing or renumbered); "
        "a draft model must share the target's vocabulary"
    )


def draw(q: torch.Tensor, ctx: DraftContext, depth: int) -> torch.Tensor:
    """A sampled draft token for chain position ``depth`` ([1, V] -> [1]): a seeded request's
    keyed draw with the noise the target draws that position with (so the draft is the target's
    own token wherever q and p agree there), else a draw with the request's generator."""
    row = ctx.noise(depth) if ctx.noise is not None else None  # [V]
    if row is not None and q.shape[-1] <= row.shape[-1]:
        return keyed_choice(q, row[None, : q.shape[-1]].to(q.device))
    return sample_token(q, ctx.generator)


def choose_draft_token(logits: torch.Tensor, ctx: DraftContext, p_min: float = 0.0,
                       depth: int = 0) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Chain position ``depth``'s draft token from the draft's ``logits`` [1, V]: the argmax for
    a greedy request (q one-hot, not returned), else a draw from q = warp(logits) with the
    target's warp (q [1, V] returned for the verifier; :func:`draw`). None when ``p_min > 0``
    and the top probability is below it (one host sync, so only when asked)."""
    params = ctx.params
    if params.greedy:
        q, token = None, argmax_last(logits)  # [1]
    else:
        q = warp_probs(logits, params)  # [1, V], the same warp as the target's p
        token = draw(q, ctx, depth)
    if p_min > 0:
        confidence = q if q is not None else torch.softmax(logits.float(), -1)
        if float(confidence.max()) < p_min:
            return None
    return token, q


def draft_chain(
    logits: torch.Tensor,
    max_tokens: int,
    ctx: DraftContext,
    step: Callable[[torch.Tensor, int], torch.Tensor],
    p_min: float = 0.0,
) -> Draft:
    """Draft up to ``max_tokens`` tokens autoregressively, one model call per token after the first.

    ``logits`` [1, V] predict the first draft token; ``step(token [1], i)`` feeds draft token i
    (0-based) to the model and returns the logits [1, V] for token i + 1. Each token is chosen
    by :func:`choose_draft_token`; sampled chains return their q rows for the verifier.
    """
    tokens: list[torch.Tensor] = []  # each [1]
    q_rows: list[torch.Tensor] = []  # each [1, V]; sampling only (greedy needs no q)
    for i in range(max_tokens):
        chosen = choose_draft_token(logits, ctx, p_min, i)
        if chosen is None:
            break
        tokens.append(chosen[0])
        if chosen[1] is not None:
            q_rows.append(chosen[1])
        if i + 1 < max_tokens:
            logits = step(chosen[0], i)
    return chain_draft(tokens, q_rows, logits.device)


def draft_chains(
    logits: torch.Tensor,
    ctxs: list[DraftContext],
    limits: list[int],
    step: Callable[[torch.Tensor, list[bool]], torch.Tensor],
    p_min: float = 0.0,
) -> list[Draft]:
    """:func:`draft_chain` for B rows at once, one model call per depth for all of them.

    ``logits`` [B, V] predict each row's first draft token; row b drafts at most ``limits[b]``
    tokens, chosen with its own context (params, generator) as a row drafted alone would: one
    argmax over the batch for the greedy rows, a draw from q = warp(logits) for each sampled row
    with its own generator or keyed noise (:func:`draw`). Then
    ``step(fed [B, 1], active)`` feeds each row's newest token and returns the next logits
    [B, V]; rows that stopped (their limit, or ``p_min``) are ``active[b] = False`` and feed a
    token whose result nobody reads. No host sync per depth unless ``p_min > 0`` (one then).
    """
    num_rows = len(ctxs)
    sampled = [b for b, ctx in enumerate(ctxs) if not ctx.params.greedy]
    chosen: list[torch.Tensor] = []  # per depth: [B]
    q_rows: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]  # row -> [1, V] each
    lengths = [0] * num_rows  # tokens drafted per row
    active = [limit > 0 for limit in limits]
    for depth in range(max(limits, default=0)):
        tokens = argmax_last(logits)  # [B]: the greedy rows' picks
        confidence = torch.softmax(logits.float(), -1).amax(-1) if p_min > 0 else None  # [B]
        for b in sampled:
            if active[b]:
                q = warp_probs(logits[b : b + 1], ctxs[b].params)  # [1, V], the target's warp
                tokens[b] = draw(q, ctxs[b], depth)[0]
                q_rows[b].append(q)
                if confidence is not None:
                    confidence[b] = q.amax()
        stopped = (confidence < p_min).tolist() if confidence is not None else [False] * num_rows
        for b in range(num_rows):
            if not active[b]:
                continue
            if stopped[b]:  # too unsure: this token is not drafted
                active[b] = False
                if q_rows[b]:  # a sampled row: its q goes with the token
                    q_rows[b].pop()
                continue
            lengths[b] += 1
            active[b] = depth + 1 < limits[b]
        chosen.append(tokens)
        if not any(active):
            break
        logits = step(tokens.view(num_rows, 1), active)
    drafted = torch.stack(chosen, 1) if chosen else logits.new_zeros(num_rows, 0, dtype=torch.long)  # [B, D]
    return [Draft(drafted[b, :n], torch.cat(q_rows[b]) if q_rows[b] else None) if n else Draft.empty(logits.device)
            for b, n in enumerate(lengths)]


def chain_draft(tokens: list[torch.Tensor], q_rows: list[torch.Tensor], device: torch.device) -> Draft:
    """The Draft of a chain drafted a token at a time (tokens [1] each, q rows [1, V] each)."""
    if not tokens:
        return Draft.empty(device)
    return Draft(torch.cat(tokens), torch.cat(q_rows) if q_rows else None)  # [k], q: [k, V]


def fit_vocab(logits: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[N, V_draft] -> [N, V_target]: padded embedding rows differ between checkpoints."""
    extra = target_vocab_size - logits.shape[-1]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits[..., :target_vocab_size]


class DraftModelDrafter:
    """Autoregressive drafting with a (smaller) causal LM sharing the target's vocabulary."""

    def __init__(self, model: CausalLM, target_vocab_size: int, p_min: float = 0.0,
                 tree: TreeShape | None = None) -> None:
        if not 0.0 <= p_min < 1.0:
            raise SpeclmError(f"draft p_min must be in [0, 1), got {p_min}")
        if tree is not None and p_min > 0:
            raise SpeclmError("a draft tree already spends its budget by confidence: use p_min "
                              "with chain drafts only")
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.p_min = p_min
        self.tree = tree
        self.sizer = TreeSizer()  # how many tree nodes pay (trees only)
        self._synced = 0  # committed tokens held in the draft's cache
        self._round_start = 0  # committed length when the last draft was made
        self._fed_drafts = 0  # draft tokens of the last round that went through the draft model

    @property
    def max_draft_tokens(self) -> int:
        """A tree's node budget (0 for a chain): see speclm.drafters.base."""
        return self.tree.budget if self.tree is not None else 0

    def reset(self, prompt_ids: torch.Tensor) -> None:
        """Start a request with an empty draft cache: the prompt comes by :meth:`on_prefill`,
        chunk by chunk as the target prefills it (counted as prefill), or, where the engine
        skips that (a batch whose drafters sit out: speclm.engine), in the first :meth:`propose`."""
        self.model.reset()
        self._synced = 0
        self._round_start = 0
        self._fed_drafts = 0

    def on_prefill(self, held: torch.Tensor) -> None:
        """Catch the draft's cache up with ``held`` ([n]: the prompt tokens the target's cache
        now holds), as far as the draft's context allows."""
        usable = min(held.shape[0], self.model.max_context - 1) - self._synced
        if usable > 0:
            self.model.forward(held[self._synced : self._synced + usable], self._synced)
            self._synced += usable

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.target_vocab_size)

    def propose(self, ctx: DraftContext) -> Draft:
        ids = ctx.token_ids  # [n]
        total = ids.shape[0]
        # the draft runs positions up to total + K - 2; it may have a shorter context
        max_tokens = min(ctx.max_tokens, self.model.max_context - total + 1)
        self._fed_drafts = 0
        if max_tokens <= 0:
            self._round_start = self._synced  # nothing fed: on_verified keeps the cache as is
            return Draft.empty(ids.device)
        self._round_start = total
        pending = ids[self._synced :]  # [n - synced] tokens the draft has not seen (>= 1)
        logits = self.model.forward(pending, self._synced).logits  # [1, V_draft]
        self._synced = total
        if self.tree is not None:  # tree nodes are dropped from the cache after the round
            return grow_tree(torch.log_softmax(self._fit_vocab(logits)[0].float(), -1), self,
                             max_tokens, self.tree, ctx.verify_s, self.sizer)

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            self._fed_drafts += 1
            return self._seen(self._fit_vocab(self.model.forward(token, total + i).logits))

        draft = draft_chain(self._seen(self._fit_vocab(logits)), max_tokens, ctx, step, self.p_min)
        return Draft(draft.tokens.to(ids.device), draft.q_draft)  # q stays where the verifier runs

    def _seen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [1, V] at each chain position, as drafted (a hook for subclasses)."""
        return logits

    def expand(self, tokens: torch.Tensor, fed) -> torch.Tensor:
        """Tree search step: run the newest tree nodes, return their next-token log-probs [T, V]."""
        logits = self.model.forward(tokens, self.model.cache_length, num_logits=tokens.shape[0], tree=fed).logits
        return torch.log_softmax(self._fit_vocab(logits).float(), -1)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        self.sizer.observe(num_accepted)
        # Cached: committed prefix + the draft tokens fed. Keep those that were accepted.
        keep = self._round_start + min(num_accepted, self._fed_drafts)
        self.model.rollback(keep)
        self._synced = keep
