"""Speculative speculative decoding (SSD, "Saguaro"): draft the next round while the target verifies.

In plain speculative decoding the draft model idles while the target verifies. Here, as soon as
a chain d_0 .. d_{k-1} is proposed, a worker thread predicts how verification may end and
drafts the next round for each likely ending. An *outcome* is (a, t): a draft tokens accepted,
then token t emitted at position a (recovered if a < k, bonus if a = k). Candidates for t are
the draft's own top tokens at position a, other than d_a (which the outcome rejects). The
fan-out budget goes to the outcomes with the highest estimated chance,

    P(end at a) * q_a(t) / (1 - q_a(d_a))   (a < k),    P(end at k) * q_k(t)   (a = k),

with P(end at a) = alpha^a (1 - alpha) from the running acceptance rate. All chosen outcomes
are drafted K tokens ahead together, one batched draft forward per token, as branches of a
token tree grown on the draft's own cache. When verification ends, a hit hands over the branch
(the draft's cache is compacted to it, so the next round starts at once); a miss falls back to
ordinary drafting. Correctness never depends on the speculation: every draft is verified, and
sampled branch tokens carry the q they were drawn from.

Threads: on CPU the worker runs with its own intra-op thread budget (``threads``; PyTorch
releases the GIL inside ops) and, for the request, the caller's budget shrinks by as much
(never below one), so target and drafter share the cores instead of oversubscribing them:
with OpenMP's spinning workers, three busy threads on two cores made a verify 4x slower
(measured, docs/benchmarks.md). On CUDA the worker works on its own stream. Its exceptions surface in the
caller at the next ``on_verified``; ``finish`` stops it at the end of the request.
"""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import SpeclmError
from ..sampling import argmax_last, sample_token, warp_probs
from ..tree import TreeMeta
from .base import Draft, DraftContext
from .draft_model import DraftModelDrafter


@dataclass
class _Branch:
    tokens: torch.Tensor  # [K] the next round's draft
    q_draft: torch.Tensor | None  # [K, V] sampling only
    logits: torch.Tensor  # [K, V] draft logits at each of those positions (the next speculation's input)
    nodes: list[int]  # tree nodes of t and the fed branch tokens, for compaction


@dataclass
class _Speculation:
    start: int  # committed length when the trunk was drafted (the pending token's slot + 1)
    trunk_len: int  # k
    branches: dict[tuple[int, int], _Branch]  # outcome (a, t) -> the branch drafted for it


def make_async(drafter: DraftModelDrafter, fanout: int = 8, threads: int = 1) -> AsyncDraftModelDrafter:
    """The asynchronous version of a chain-drafting draft model (same weights and cache)."""
    if not isinstance(drafter, DraftModelDrafter) or drafter.tree is not None or drafter.p_min > 0:
        raise SpeclmError("async drafting needs a draft model drafting chains (draft or distilled, "
                          "without tree= or p_min=)")
    return AsyncDraftModelDrafter(drafter.model, drafter.target_vocab_size, fanout, threads)


class AsyncDraftModelDrafter(DraftModelDrafter):
    """A draft model that drafts ahead for likely verification outcomes while the target works."""

    def __init__(self, model, target_vocab_size: int, fanout: int = 8, threads: int = 1,
                 alpha_prior: float = 0.6) -> None:
        super().__init__(model, target_vocab_size)
        if fanout < 1 or threads < 1:
            raise SpeclmError(f"async drafting needs fanout >= 1 and threads >= 1, got {fanout}, {threads}")
        self.fanout = fanout
        self.threads = threads
        self.alpha = alpha_prior
        self._pool: ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        self._job: Future | None = None
        self._ready: _Branch | None = None
        self._trunk_logits: torch.Tensor | None = None  # [k, V] of the draft just proposed
        self._caller_threads: int | None = None  # the caller's intra-op threads before the split
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.hits = 0
        self.rounds = 0
        self.wait_s = 0.0  # time on_verified (the target's side) waited for the worker
        self.hits_at = [0] * 64  # per outcome position a
        self.rounds_at = [0] * 64

    # -- lifecycle ---------------------------------------------------------------------------
    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.finish()
        self._ready = None
        self._reset_counters()
        super().reset(prompt_ids)

    def finish(self) -> None:
        """Stop the worker (the engine calls this when a request ends, however it ends)."""
        if self._job is not None:
            self._job.cancel()
            try:
                self._job.result()
            except Exception:  # noqa: BLE001 - the request is over; nothing is waiting for it
                pass
            self._job = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._caller_threads is not None:
            torch.set_num_threads(self._caller_threads)
            self._caller_threads = None

    def report(self) -> dict:
        rate = self.hits / self.rounds if self.rounds else 0.0
        per_position = [h / r if r else None for h, r in zip(self.hits_at, self.rounds_at)]
        while per_position and per_position[-1] is None:
            per_position.pop()
        return dict(summary=f"async drafting: {self.hits}/{self.rounds} outcomes predicted "
                            f"(hit rate {rate:.2f}), target waited {self.wait_s:.2f} s for the drafter",
                    hits=self.hits, rounds=self.rounds, hit_rate=rate, hit_rate_by_position=per_position,
                    wait_s=self.wait_s, fanout=self.fanout)

    # -- the round -----------------------------------------------------------------------------
    def propose(self, ctx: DraftContext) -> Draft:
        branch, self._ready = self._ready, None
        if branch is not None and ctx.max_tokens > 0 and ctx.token_ids.shape[0] == self._synced:
            k = min(ctx.max_tokens, branch.tokens.shape[0])  # a hit: the draft was made already
            self._round_start = self._synced
            self._fed_drafts = min(self._fed_drafts, k - 1)
            draft = Draft(branch.tokens[:k].to(ctx.token_ids.device),
                          None if branch.q_draft is None else branch.q_draft[:k])
            self._trunk_logits = branch.logits[: k + 1]  # k + 1 rows when the branch was longer
        else:  # no branch, or rounds went by without drafting: forget what the cache got ahead
            if self.model.cache_length > self._synced:
                self.model.rollback(self._synced)
            draft = self._draft_recording(ctx)
        if draft.num_tokens:
            seed = 0  # branch draws need their own stream only when sampling (drawn on this thread)
            if not ctx.params.greedy:
                seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator, device=ctx.generator.device))
            self._start(draft, ctx, seed)
        return draft

    def _draft_recording(self, ctx: DraftContext) -> Draft:
        """Ordinary chain drafting (the base class's) that keeps the draft's logits at every position."""
        self._rows: list[torch.Tensor] = []
        draft = super().propose(ctx)
        if draft.num_tokens:
            self._trunk_logits = torch.cat(self._rows[: draft.num_tokens])  # [k, V]
        return draft

    def _seen(self, logits: torch.Tensor) -> torch.Tensor:
        self._rows.append(logits)
        return logits

    def _start(self, draft: Draft, ctx: DraftContext, seed: int) -> None:
        if self._pool is None:
            if self._stream is None:  # CPU: split the cores between the target and the worker
                self._caller_threads = torch.get_num_threads()
                torch.set_num_threads(max(1, self._caller_threads - self.threads))
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speclm-ssd",
                                            initializer=torch.set_num_threads, initargs=(self.threads,))
        trunk = draft.tokens.to(self.model.device)
        ready = None
        if self._stream is not None:  # the worker's stream waits for what this stream queued
            ready = torch.cuda.Event()
            ready.record()
        # in the caller's context: PyTorch's compiler settings are context variables
        self._job = self._pool.submit(contextvars.copy_context().run, self._speculate, trunk,
                                      self._trunk_logits, ctx.params, ctx.max_tokens, seed, ready)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        start = time.perf_counter()
        job, self._job = self._job, None
        speculation = job.result() if job is not None else None  # re-raises the worker's error
        self.wait_s += time.perf_counter() - start
        if speculation is None:
            super().on_verified(num_accepted, emitted)
            return
        trials = num_accepted + (1 if num_accepted < speculation.trunk_len else 0)
        self.alpha = 0.9 * self.alpha + 0.1 * num_accepted / max(1, trials)  # per-token acceptance
        outcome = (num_accepted, emitted[num_accepted])
        self.rounds += 1
        self.rounds_at[min(num_accepted, 63)] += 1
        # more tokens committed than the outcome (a grammar's forced tail): no branch drafted for that
        branch = speculation.branches.get(outcome) if len(emitted) == num_accepted + 1 else None
        n = speculation.start
        if branch is None:  # miss: keep the accepted trunk tokens, draft normally next round
            self.model.compact(n, list(range(min(num_accepted, speculation.trunk_len))))
            self._synced = self.model.cache_length
            return
        self.hits += 1
        self.hits_at[min(num_accepted, 63)] += 1
        self.model.compact(n, list(range(num_accepted)) + branch.nodes)
        self._synced = n + num_accepted + 1  # committed through t, the new pending token
        self._fed_drafts = len(branch.nodes) - 1
        self._ready = branch

    # -- the worker ----------------------------------------------------------------------------
    def _speculate(self, trunk: torch.Tensor, trunk_logits: torch.Tensor, params, depth: int,
                   seed: int, ready=None) -> _Speculation | None:
        if self._stream is not None:
            self._stream.wait_event(ready)  # the draft cache and trunk written on the caller's stream
            with torch.cuda.stream(self._stream):
                out = self._speculate_here(trunk, trunk_logits, params, depth, seed)
            self._stream.synchronize()
            return out
        return self._speculate_here(trunk, trunk_logits, params, depth, seed)

    @torch.inference_mode()
    def _speculate_here(self, trunk, trunk_logits, params, depth: int, seed: int) -> _Speculation | None:
        k = trunk.shape[0]
        n = self._round_start  # the pending token sits at slot n - 1; trunk node i at n + i
        if n + k + depth > self.model.max_context:
            return None
        cached = self.model.cache_length - n  # trunk nodes already fed (k - 1 for a fresh chain)
        if cached > k:  # a truncated branch: drop the nodes past the trunk
            self.model.rollback(n + k)
            cached = k
        if trunk_logits.shape[0] == k:  # the bonus position's distribution: feed the trunk's end
            last = self.model.forward(trunk[cached:], n + cached, num_logits=1).logits
            trunk_logits = torch.cat([trunk_logits, self._fit_vocab(last)])  # [k + 1, V]
        outcomes = self._choose_outcomes(trunk, trunk_logits.float())
        if not outcomes:
            return None
        gen = torch.Generator(device=self.model.device).manual_seed(seed)
        parents = list(range(-1, k - 1))  # the trunk, as tree nodes 0 .. k-1
        level_nodes = []
        for a, _ in outcomes:
            parents.append(a - 1)
            level_nodes.append(len(parents) - 1)
        fed = torch.tensor([t for _, t in outcomes], device=self.model.device)  # [B]
        nodes = [[i] for i in level_nodes]
        tokens, q_rows, logit_rows = [], [], []
        for level in range(depth):
            logits = self._fit_vocab(self.model.forward(
                fed, self.model.cache_length, num_logits=fed.shape[0],
                tree=TreeMeta.from_parents(parents)).logits)  # [B, V]
            logit_rows.append(logits)
            if params.greedy:
                q, nxt = None, argmax_last(logits)
            else:
                q = warp_probs(logits, params)
                nxt = sample_token(q, gen)
                q_rows.append(q)
            tokens.append(nxt)
            if level + 1 < depth:  # the last token of each branch is drafted, not fed
                base = len(parents)
                parents += [nodes[b][-1] for b in range(len(outcomes))]
                for b in range(len(outcomes)):
                    nodes[b].append(base + b)
                fed = nxt
        tokens_t = torch.stack(tokens, 1)  # [B, K]
        logits_t = torch.stack(logit_rows, 1)  # [B, K, V]
        q_t = torch.stack(q_rows, 1) if q_rows else None
        branches = {outcome: _Branch(tokens_t[b], None if q_t is None else q_t[b], logits_t[b], nodes[b])
                    for b, outcome in enumerate(outcomes)}
        return _Speculation(n, k, branches)

    def _choose_outcomes(self, trunk: torch.Tensor, logits: torch.Tensor) -> list[tuple[int, int]]:
        """The ``fanout`` most likely outcomes (a, t) given the draft's distributions [k + 1, V]."""
        k = trunk.shape[0]
        probs = torch.softmax(logits, -1)  # [k + 1, V]
        a = min(self.alpha, 0.99)
        reach = torch.tensor([a**i * (1 - a) for i in range(k)] + [a**k], dtype=probs.dtype)  # [k + 1]
        drafted = torch.zeros_like(probs[:, 0])
        drafted[:k] = probs[torch.arange(k), trunk.to(probs.device)]
        rejected = probs.clone()
        rejected[torch.arange(k), trunk.to(probs.device)] = 0.0  # a rejection never emits d_a
        scale = torch.where(torch.arange(k + 1) < k, 1.0 / (1.0 - drafted).clamp(min=1e-6), 1.0)
        value = rejected * (reach * scale).to(probs.device).unsqueeze(1)  # [k + 1, V]
        best = torch.topk(value.flatten(), min(self.fanout, value.numel())).indices
        return [(int(i) // value.shape[1], int(i) % value.shape[1]) for i in best.tolist()]
