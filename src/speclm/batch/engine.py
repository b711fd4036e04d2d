"""Batched speculative decoding with continuous batching: one target forward per step.

Each step (see :meth:`BatchEngine.step`):

1. aborted requests leave; waiting requests join: their prompts (all but the last token, the
   pending one) are prefilled together in one ragged forward into free cache rows;
2. every running row drafts (its own drafter, up to ``draft_max``); the policy picks the cap K
   for this step from measured step cost (K = 0: a plain step). Seeded sampling requests keep
   their whole draft: how many random draws a round uses depends on its draft length, so a cap
   that depends on the rest of the batch would make a seeded request's tokens depend on its
   neighbours. With their own drafts, they draw exactly what the solo engine draws;
3. one target forward runs ``[pending_b, d_b1 .. d_bk_b]`` for all rows at their own positions
   (ragged rows padded to ``T = 1 + max k_b``), giving logits [B, T, V];
4. each row is judged by the one verifier with its own params and generator, and its cache row
   is rolled back to its own accepted prefix (ragged acceptance); one host sync per step;
5. finished rows leave and the remaining rows are compacted so that rows ``0..B-1`` run.

A row's computation depends only on its own tokens (the mask hides other rows and padding), so
each request's output is what it would be alone: greedy output is token-identical to the solo
engine, and a sampled request's tokens follow the target's distribution.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cost_model import CostModel
from ..draft_length import update_acceptance
from ..drafters.base import Draft, DraftContext, Drafter
from ..engine import Step
from ..errors import SpeclmError
from ..models.hf import HFCausalLM
from ..sampling import SamplingParams
from ..stats import RequestStats
from ..verifier import verify
from .draft_policy import BatchDraftConfig, BatchDraftPolicy
from .model import BatchModel
from .sequence import Sequence


@dataclass
class SeqOutput:
    """What one step committed for one request (EOS included when it ends the request)."""

    request_id: str
    step: Step
    stats: RequestStats  # live; complete once step.finish_reason is set


@dataclass
class StepReport:
    """What one engine step did, for metrics."""

    batch_size: int = 0  # rows in the decode forward (0: no decode this step)
    fed_per_row: int = 0  # T = 1 + the draft cap actually used
    draft_cap: int = 0  # K chosen by the policy (0: plain step)
    longest_draft: int = 0  # the longest draft proposed before the cap
    drafted: int = 0  # draft tokens verified, all rows
    accepted: int = 0
    committed: int = 0  # tokens committed, all rows
    decode_s: float = 0.0  # target forward + verification
    draft_s: float = 0.0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    judged_per_position: list[int] = field(default_factory=list)  # [K] rows judged at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [K] rows accepted there


class BatchEngine:
    """Continuous batching over one target model; requests join and leave between steps.

    Not thread-safe: one thread calls :meth:`add`, :meth:`abort` and :meth:`step`.
    """

    def __init__(
        self,
        target: HFCausalLM,
        *,
        max_batch: int = 16,
        drafter_factory: Callable[[], Drafter] | None = None,
        draft_config: BatchDraftConfig | None = None,
        max_prefill_tokens: int = 4096,
        drafter_name: str = "none",
        cost_prior: CostModel | None = None,  # the target's measured cost (LLM.cost_model)
    ) -> None:
        if max_batch < 1:
            raise SpeclmError(f"max batch must be >= 1, got {max_batch}")
        self.model = BatchModel(target, max_batch)
        self.max_batch = max_batch
        self.drafter_factory = drafter_factory
        self.draft_config = draft_config or BatchDraftConfig()
        self.policy = BatchDraftPolicy(self.draft_config, cost_prior) if drafter_factory is not None else None
        self.max_prefill_tokens = max_prefill_tokens
        self.drafter_name = drafter_name if drafter_factory is not None else "none"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] lives in cache slot i

    # -- requests --------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int] | torch.Tensor, params: SamplingParams) -> Sequence:
        """Queue a request; it joins the batch at the next step with a free row."""
        params.validate()
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
        n = int(prompt.shape[0])
        if n == 0:
            raise SpeclmError("the prompt is empty")
        if n >= self.model.max_context:
            raise SpeclmError(f"the prompt has {n} tokens but the model's context is "
                              f"{self.model.max_context}")
        limit = min(self.model.max_context, n + params.max_tokens)
        tokens = torch.empty(limit, dtype=torch.long)
        tokens[:n] = prompt
        drafter = self.drafter_factory() if self.drafter_factory is not None else None
        if drafter is not None:
            drafter.reset(prompt)
        seq = Sequence(request_id, params, params.make_generator(self.model.device), drafter,
                       tokens, n, n, limit, RequestStats(prompt_tokens=n, drafter=self.drafter_name))
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request; its row is freed at the start of the next step."""
        for seq in (*self.waiting, *self.running):
            if seq.request_id == request_id:
                seq.aborted = True
        self.waiting = deque(s for s in self.waiting if not s.aborted)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> list[Sequence]:
        """After a failed step: drop every running request (returned) and the whole cache."""
        dropped, self.running = self.running, []
        self.model.cache.clear()
        return dropped

    # -- the step --------------------------------------------------------------------------
    def step(self) -> tuple[list[SeqOutput], StepReport]:
        report = StepReport()
        self._retire()
        self._admit(report)
        outputs = self._decode(report) if self.running else []
        self._retire()
        if not self.has_work:
            self.model.cache.clear()  # idle: give the memory back
        return outputs, report

    def _admit(self, report: StepReport) -> None:
        """Prefill waiting requests into free rows (up to ``max_prefill_tokens`` prompt tokens
        per step, at least one request). Joiners of similar length share a ragged forward."""
        joining: list[Sequence] = []
        total = 0
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            fed = self.waiting[0].n - 1
            if joining and total + fed > self.max_prefill_tokens:
                break
            joining.append(self.waiting.popleft())
            total += fed
        if not joining:
            return
        start = time.perf_counter()
        joining.sort(key=lambda seq: seq.n)
        first = len(self.running)
        self.running += joining  # from here on, a failure (see reset) fails them too
        for lo, hi in _prefill_groups([seq.n - 1 for seq in joining]):
            group, longest = joining[lo:hi], joining[hi - 1].n - 1
            if longest == 0:
                continue  # one-token prompts: nothing to prefill (free rows hold length 0)
            fed = torch.zeros(len(group), longest, dtype=torch.long)  # [J, T] padded prompts
            for j, seq in enumerate(group):
                fed[j, : seq.n - 1] = seq.tokens[: seq.n - 1]
            self.model.forward(slice(first + lo, first + hi), fed, num_logits=1)
            self.model.set_lengths(torch.tensor([seq.n - 1 for seq in group]))
        elapsed = time.perf_counter() - start
        for seq in joining:
            seq.stats.prefill_time_s = elapsed
        report.prefill_rows = len(joining)
        report.prefill_tokens = total
        report.prefill_s = elapsed

    def _draft(self, report: StepReport) -> list[Draft]:
        start = time.perf_counter()
        drafts = []
        for seq in self.running:
            cap = min(self.draft_config.draft_max, seq.budget - 1) if seq.drafter is not None else 0
            draft = Draft.empty()
            if cap > 0:
                draft = seq.drafter.propose(DraftContext(seq.committed, cap, seq.params, seq.generator))
                if draft.num_tokens > cap or draft.q_draft is not None:
                    raise RuntimeError(f"{type(seq.drafter).__name__}: the batched engine takes "
                                       f"deterministic drafts of at most {cap} tokens")
            drafts.append(draft)
        report.longest_draft = max((d.num_tokens for d in drafts), default=0)
        if self.policy is not None:
            fixed = [s.fixed_draft for s in self.running]
            cap = self.policy.choose([d.num_tokens for d in drafts], [s.alpha for s in self.running],
                                     fixed)
            drafts = [d if f else Draft(d.tokens[:cap]) for d, f in zip(drafts, fixed)]
            report.draft_cap = cap
        report.draft_s = time.perf_counter() - start
        return drafts

    def _decode(self, report: StepReport) -> list[SeqOutput]:
        running = self.running
        drafts = self._draft(report)
        ks = [d.num_tokens for d in drafts]
        num_rows, width = len(running), 1 + max(ks)
        start = time.perf_counter()
        fed = torch.empty(num_rows, width, dtype=torch.long)  # [B, T]: pending, drafts, padding
        for b, (seq, draft) in enumerate(zip(running, drafts)):
            fed[b] = seq.tokens[seq.n - 1]
            fed[b, 1 : 1 + ks[b]] = draft.tokens
        if not torch.equal(self.model.cache.lengths[:num_rows],
                           torch.tensor([seq.n - 1 for seq in running])):
            raise RuntimeError("batch cache rows out of step with their sequences")
        logits = self.model.forward(slice(0, num_rows), fed, num_logits=width)  # [B, T, V]
        rows = []
        for b, (seq, draft) in enumerate(zip(running, drafts)):
            verdict = verify(logits[b, : ks[b] + 1], draft.to(logits.device), seq.params, seq.generator)
            padded = torch.nn.functional.pad(verdict.tokens, (0, width - ks[b] - 1))  # [T]
            rows.append(torch.cat([verdict.num_accepted.view(1), padded]))
        result = torch.stack(rows).tolist()  # [B, 1 + T]: the step's one host sync
        accepted = [r[0] for r in result]
        self.model.set_lengths(torch.tensor([seq.n + a for seq, a in zip(running, accepted)]))
        elapsed = time.perf_counter() - start
        if self.policy is not None:
            self.policy.update(num_rows, width, elapsed)
        report.batch_size, report.fed_per_row, report.decode_s = num_rows, width, elapsed
        report.judged_per_position = [0] * (width - 1)
        report.accepted_per_position = [0] * (width - 1)
        return [self._commit(seq, ks[b], accepted[b], result[b][1 : accepted[b] + 2], report)
                for b, seq in enumerate(running)]

    def _commit(self, seq: Sequence, drafted: int, accepted: int, emitted: list[int],
                report: StepReport) -> SeqOutput:
        if seq.drafter is not None and drafted > 0:
            seq.drafter.on_verified(accepted, emitted)
        seq.stats.record_round(drafted, accepted)
        seq.stats.draft_time_s += report.draft_s
        seq.stats.target_time_s += report.decode_s
        seq.alpha = update_acceptance(seq.alpha, drafted, accepted, 0.2)
        for i in range(min(drafted, accepted + 1)):
            report.judged_per_position[i] += 1
        for i in range(accepted):
            report.accepted_per_position[i] += 1
        report.drafted += drafted
        report.accepted += accepted
        seq.tokens[seq.n : seq.n + len(emitted)] = torch.tensor(emitted)
        seq.n += len(emitted)
        finish = None
        if not seq.params.ignore_eos:
            for i, tok in enumerate(emitted):
                if tok in self.model.eos_token_ids:
                    emitted, finish = emitted[: i + 1], "stop"
                    break
        seq.generated += len(emitted)
        report.committed += len(emitted)
        seq.stats.generated_tokens = seq.generated
        if finish is None and seq.budget <= 0:
            finish = "length"
        seq.finish_reason = finish
        if finish is not None:
            seq.stats.total_time_s = time.perf_counter() - seq.arrival
        return SeqOutput(seq.request_id, Step(emitted, finish), seq.stats)

    def _retire(self) -> None:
        """Remove finished and aborted rows, moving the last row into each hole."""
        cache, i = self.model.cache, 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.finish_reason is None and not seq.aborted:
                i += 1
                continue
            last = len(self.running) - 1
            if last != i:
                cache.move(last, i)
            else:
                cache.release(i)
            self.running[i] = self.running[last]
            self.running.pop()


def _prefill_groups(lengths: list[int], waste: float = 0.25, slack: int = 64) -> list[tuple[int, int]]:
    """Split sorted prompt lengths into [lo, hi) groups that share one padded forward: a group
    grows while its padding stays under ``waste`` of its tokens (or it is at most ``slack``
    tokens wide), so short prompts batch together and a long one does not pad the rest."""
    groups, lo = [], 0
    for hi in range(1, len(lengths) + 1):
        if hi == len(lengths):
            groups.append((lo, hi))
            break
        padded = (hi + 1 - lo) * lengths[hi]
        real = sum(lengths[lo : hi + 1])
        if padded > slack and padded - real > waste * real:
            groups.append((lo, hi))
            lo = hi
    return groups
