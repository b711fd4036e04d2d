"""The one decoding loop: speculative decoding over a batch of requests, a step at a time.

Every request is a row of a batch: ``LLM.generate``, the CLI and ``speclm bench`` run a batch of
one (:func:`generate_tokens`), ``speclm serve`` a continuous batch that requests join and leave
between steps. Invariant per row: the target's cache slot holds every committed token but the
last (the *pending* token). One :meth:`Engine.step`:

1. retire rows that ended; admit waiting requests into free slots (speclm.slots); feed prompts
   to the target a chunk at a time under a per-step token budget (chunked prefill), so that a
   long prompt never holds running rows up for more than about one chunk's forward (a draft
   model's cache takes the same chunks, unless the batch policy finds that no draft pays at
   the batch's size: then the drafters sit out, and a row catches up when first asked to draft);
2. draft (speclm.proposals): each decoding row's drafter proposes a chain or a token tree; a
   row alone up to its own K (its measured acceptance and the target's cost:
   :class:`~speclm.draft_length.DraftLengthPolicy`), several rows up to the depth the batch
   policy plans from the measured cost of the step's (rows x tokens) and of drafting at that
   many rows, which may then cap deterministic chains further (speclm.batch.draft_policy);
3. verify: one target forward runs ``[pending_b, d_b1 .. d_bk]`` for every row at its own
   positions (logits [B, T, V]); the one verifier judges each row with the row's own sampling
   params and generator, so a row's tokens never depend on its neighbours;
4. commit: each row keeps its accepted path (a crop, or a tree compaction), its drafter hears
   the verdict (and gets the target's features or top-k when it asks: drafters/base.py), and
   the accepted tokens plus one recovered or bonus token are committed.

Plain decoding is the same loop with no drafter (K = 0), so the baseline shares the sampler, the
cache and the timing code with every speculative method. A step makes one host sync.

A request with structured outputs (``SamplingParams(json_schema=...)`` etc.) carries a grammar
matcher that follows its committed tokens; speclm.structured.drafts shapes its drafts (pruned to
the grammar, forced tokens drafted without the drafter), gives the verifier the grammar's mask at
every draft position, and advances over what each round commits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from .batch.draft_policy import BatchDraftConfig, BatchDraftPolicy
from .cost_model import CostModel
from .draft_length import DraftLengthConfig, DraftLengthPolicy, update_acceptance
from .drafters.base import (
    Draft,
    Drafter,
    parallel_tokens,
    wanted_target_topk,
)
from .errors import SpeclmError
from .models.base import CausalLM, device_clock
from .models.rows import RowsOutput, SlotRows, TargetRows, padded_groups
from .proposals import Proposals, row_alphas
from .sampling import SamplingParams, position_noise
from .sequence import Sequence
from .slots import arrange
from .stats import RequestStats
from .step import SeqOutput, Step, StepReport
from .structured.compiler import GrammarCompiler, request_matcher
from .structured.drafts import commit_round, draft_masks, drafter_accepted
from .verifier import verify


def _feature_layers(seqs: list[Sequence]) -> list[int]:
    """The hidden layers any of these rows' drafters reads (drafters/base.py)."""
    return sorted({i for s in seqs for i in getattr(s.drafter, "feature_layers", None) or ()})


def _features(out: RowsOutput, seq: Sequence, b: int, positions) -> None:
    """Hand row ``b``'s drafter its layers at ``positions``: [len, L * H]."""
    layers = getattr(seq.drafter, "feature_layers", None)
    if layers:
        seq.drafter.on_target_features(torch.cat([out.hidden_states[i][b, positions] for i in layers], -1))


class Engine:
    """Continuous batching over the rows of one target; a single request is a batch of one.

    ``drafter_factory(handle)`` builds a drafter for each request that brings none, given its
    row's single-row target handle where the backend has one (``TargetRows.handle``).
    ``prefill_chunk``: most prompt tokens fed per step (None: whole prompts at once).
    ``grammars``: compiles the structured-output constraints of requests that have one.
    Not thread-safe: one thread calls :meth:`add`, :meth:`abort` and :meth:`step`.
    """

    def __init__(
        self,
        rows: TargetRows,
        *,
        drafter_factory: Callable[[CausalLM | None], Drafter] | None = None,
        draft_length: DraftLengthConfig | None = None,
        cost_prior: CostModel | None = None,
        prefill_chunk: int | None = None,
        drafter_name: str = "none",
        grammars: GrammarCompiler | None = None,
    ) -> None:
        if prefill_chunk is not None and prefill_chunk < 1:
            raise SpeclmError(f"the prefill chunk must be >= 1 token, got {prefill_chunk}")
        self.rows = rows
        self.max_batch = rows.num_slots
        self.drafter_factory = drafter_factory
        self.draft_length = draft_length or DraftLengthConfig()
        self.cost_prior = cost_prior
        self.prefill_chunk = prefill_chunk
        self.drafter_name = drafter_name if drafter_factory is not None else "none"
        self.grammars = grammars
        self.batch_policy = None
        if rows.num_slots > 1:  # the step's draft cap from measured (rows x tokens) cost
            self.batch_policy = BatchDraftPolicy(
                BatchDraftConfig(self.draft_length.draft_max, self.draft_length.adaptive), cost_prior,
                computed=rows.computed)
        self.proposals = Proposals(self.draft_length, self.batch_policy)
        # acceptance over the rounds of every row whose drafter the factory made (EMA per round):
        # a joining row starts from it, not from a blind prior (None: nothing verified yet)
        self.seen_alpha: float | None = None
        self.seen_t_draft: float | None = None  # the latest such row's drafting time (DraftLengthPolicy.t_draft)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] lives in slot i; decoding rows first

    @property
    def speculative(self) -> bool:
        """Requests get drafters by default."""
        return self.drafter_factory is not None

    # -- requests --------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int] | torch.Tensor, params: SamplingParams, *,
            drafter: Drafter | None = None, generator: torch.Generator | None = None,
            stats: RequestStats | None = None) -> Sequence:
        """Queue a request; it joins at the next step with a free slot. ``drafter``: this
        request's own (else one from the factory, if any); ``stats`` is filled in as it runs."""
        params.validate()
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).detach().to("cpu").flatten()
        n = int(prompt.shape[0])
        if n == 0:
            raise SpeclmError("the prompt is empty")
        if n >= self.rows.max_context:
            raise SpeclmError(f"the prompt has {n} tokens but the model's context is {self.rows.max_context}")
        limit = min(self.rows.max_context, n + params.max_tokens)
        tokens = torch.empty(limit, dtype=torch.long)
        tokens[:n] = prompt
        if stats is None:
            stats = RequestStats(drafter=self.drafter_name if drafter is None else type(drafter).__name__,
                                 backend=getattr(self.rows, "backend_name", "torch"))
        stats.prompt_tokens = n
        gen = generator if generator is not None else params.make_generator(self.rows.device)
        seq = Sequence(request_id, params, gen, drafter, tokens, n, limit, stats,
                       own_drafter=drafter is not None,
                       grammar=request_matcher(self.grammars, params.structured),
                       noise=position_noise(params, self.rows.vocab_size, self.rows.device))
        stats.constrained = seq.grammar is not None
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request; its row is freed at the start of the next step."""
        for seq in (*self.waiting, *self.running):
            if seq.request_id == request_id:
                seq.aborted = True
        for seq in [s for s in self.waiting if s.aborted]:
            seq.close()
        self.waiting = deque(s for s in self.waiting if not s.aborted)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reset(self) -> list[Sequence]:
        """After a failed step: drop every running request (returned) and the whole cache."""
        dropped, self.running = self.running, []
        for seq in dropped:
            seq.close()
        self.rows.clear()
        return dropped

    def close(self) -> None:
        """End every request now (their drafters stop, their stats are completed)."""
        for seq in self.waiting:
            seq.close()
        self.waiting.clear()
        for seq in self.running:
            seq.aborted = True
        self._retire()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> tuple[list[SeqOutput], StepReport]:
        report = StepReport()
        self._retire()
        if self._admit() | self._prefill(report):  # rows joined, or finished their prefill
            self.running = arrange(self.running, self.rows)
        decoding = sum(1 for s in self.running if s.decoding)
        outputs = self._decode(self.running[:decoding], report) if decoding else []
        self._retire()
        if not self.has_work:
            self.rows.clear()  # idle: give the memory back
        return outputs, report

    def _admit(self) -> bool:
        """Waiting requests take free slots, shortest prompt first (chunks pad less)."""
        joining = []
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            joining.append(self.waiting.popleft())
        for seq in sorted(joining, key=lambda s: s.n):
            seq.slot = len(self.running)
            self.running.append(seq)  # from here on, a failure (see reset) fails it too
            self.rows.release(seq.slot)
            if seq.drafter is None and self.drafter_factory is not None:
                seq.drafter = self.drafter_factory(self.rows.handle(seq.slot))
            if seq.drafter is not None:
                seq.drafter.reset(seq.committed)
                seq.policy = DraftLengthPolicy(self.draft_length, self.cost_prior, parallel_tokens(seq.drafter))
                if not seq.own_drafter and self.seen_alpha is not None:
                    seq.policy.start_from(self.seen_alpha, self.seen_t_draft)
                    seq.alpha = self.seen_alpha
        return bool(joining)

    def _prefill(self, report: StepReport) -> bool:
        """Feed prompts (all but the pending token), in slot order, up to the chunk budget."""
        budget = self.prefill_chunk or 1 << 62
        todo: list[tuple[Sequence, int]] = []
        for seq in self.running:
            if not seq.decoding and budget > 0:
                count = min(seq.n - 1 - seq.prefilled, budget)
                todo.append((seq, count))
                budget -= count
        if not todo:
            return False
        sit_out = self._drafters_sit_out()
        start = time.perf_counter()
        for group in padded_groups(todo):
            width = max(c for _, c in group)
            fed = torch.zeros(len(group), width, dtype=torch.long)  # [J, T] right-padded chunks
            for j, (seq, count) in enumerate(group):
                fed[j, :count] = seq.tokens[seq.prefilled : seq.prefilled + count]
            seqs = [s for s, _ in group]
            layers = _feature_layers(seqs)
            first = seqs[0].slot
            out = self.rows.forward(range(first, first + len(group)), fed, [c for _, c in group],
                                    logits=False, return_hidden=layers or False)
            for j, (seq, count) in enumerate(group):
                self.rows.keep(seq.slot, seq.prefilled + count, [])
                _features(out, seq, j, slice(0, count))
                seq.prefilled += count
                on_prefill = getattr(seq.drafter, "on_prefill", None)
                if on_prefill is not None and not sit_out:  # a draft cache takes the same chunk
                    on_prefill(seq.tokens[: seq.prefilled])
        elapsed = device_clock(self.rows.device) - start
        for seq, _ in todo:
            seq.stats.prefill_time_s += elapsed
        report.prefill_rows = len(todo)
        report.prefill_tokens = sum(c for _, c in todo)
        report.prefill_s = elapsed
        return True

    def _drafters_sit_out(self) -> bool:
        """Whether the running rows' drafters are expected to sit out: several rows, and the
        batch policy finds that no draft pays at this size. A joining row's draft cache then
        skips the prompt's chunks (it catches up when first asked to draft), so a busy server
        pays no draft prefill for requests that never draft."""
        rows = len(self.running)
        if rows < 2 or self.batch_policy is None:
            return False
        return not self.batch_policy.drafting_pays(rows, row_alphas(self.running), self.draft_length.draft_max)

    def _decode(self, batch: list[Sequence], report: StepReport) -> list[SeqOutput]:
        t0 = time.perf_counter()
        proposed = self.proposals(batch)  # step 2: drafts (speclm.proposals)
        drafts = proposed.drafts
        report.longest_draft, report.policy_plain = proposed.longest, proposed.skipped
        masks = [draft_masks(s.grammar, d) if s.grammar is not None else None for s, d in zip(batch, drafts)]
        t1 = device_clock(self.rows.device)
        # -- verify ------------------------------------------------------------------------
        ks = [d.num_tokens for d in drafts]
        width = 1 + max(ks)
        fed_rows = []
        for seq, draft in zip(batch, drafts):
            if seq.prefilled != self.rows.length(seq.slot) or seq.prefilled != seq.n - 1:
                raise RuntimeError("a cache row is out of step with its sequence")
            row = torch.cat([seq.tokens[seq.n - 1 : seq.n], draft.tokens.cpu()])  # [k + 1]
            fed_rows.append(row if row.shape[0] == width else F.pad(row, (0, width - row.shape[0])))
        fed = fed_rows[0].view(1, -1) if len(batch) == 1 else torch.stack(fed_rows)  # [B, T], right-padded
        trees = [d.tree for d in drafts] if any(d.tree is not None for d in drafts) else None
        layers = _feature_layers(batch)
        out = self.rows.forward(range(len(batch)), fed, [k + 1 for k in ks], trees=trees,
                                return_hidden=layers or False)
        rows, topks = [], []
        for b, (seq, draft) in enumerate(zip(batch, drafts)):
            logits = out.logits[b, : ks[b] + 1]  # [k + 1, V]
            allowed = masks[b].to(logits.device) if masks[b] is not None else None  # [k + 1, V]
            verdict = verify(logits, draft.to(logits.device), seq.params, seq.generator, allowed,
                             seq.round_noise(draft.depth))
            feedback = min(wanted_target_topk(seq.drafter), self.rows.vocab_size)
            # queued before the sync, so a drafter's feedback costs no extra sync: [k + 1, t]
            topks.append(logits.topk(feedback, dim=-1).indices if feedback else None)
            pad = width - 1 - ks[b]
            tokens, path = verdict.tokens, verdict.path
            if pad:
                tokens, path = F.pad(tokens, (0, pad)), F.pad(path, (0, pad))
            rows.append(torch.cat([verdict.num_accepted.view(1), tokens, path]))  # [2T]
        result = (rows[0].view(1, -1) if len(rows) == 1 else torch.stack(rows)).tolist()  # [B, 2T]: one sync
        outputs = []
        for b, (seq, draft) in enumerate(zip(batch, drafts)):
            num_accepted = result[b][0]
            emitted = result[b][1 : num_accepted + 2]
            path = result[b][1 + width : 1 + width + num_accepted]  # accepted node indices, in order
            self.rows.keep(seq.slot, seq.n, path)  # keeps [0, n) and the accepted nodes' entries
            seq.prefilled = seq.n + num_accepted
            _features(out, seq, b, [0] + [i + 1 for i in path])
            if proposed.asked[b]:
                seq.drafter.on_verified(drafter_accepted(seq.grammar, num_accepted), emitted)
            if topks[b] is not None:
                seq.drafter.on_target_topk(fed[b, : ks[b] + 1], topks[b])
            outputs.append((seq, draft, num_accepted, emitted))
        t2 = time.perf_counter()
        elapsed = t2 - t1
        if self.batch_policy is not None:
            self.batch_policy.update(len(batch), width, elapsed)
            if len(batch) > 1 and any(proposed.asked):  # what asking the drafters cost, less a
                # catch-up on rounds the rows sat out
                # per draft forward: the deepest draft made (p_min or the context may stop a
                # draft short of what was asked; nothing drafted measures no depth)
                self.batch_policy.update_drafting(t1 - t0 - proposed.catch_up_s, len(batch),
                                                  proposed.longest, proposed.catch_up_s)
        report.batch_size, report.fed_per_row, report.decode_s = len(batch), width, elapsed
        report.draft_s, report.draft_cap, report.catch_up_s = t1 - t0, width - 1, proposed.catch_up_s
        report.policy_plain = report.policy_plain or (width == 1 and report.longest_draft > 0)
        report.judged_per_position = [0] * (width - 1)
        report.accepted_per_position = [0] * (width - 1)
        return [self._commit(seq, draft, a, emitted, report) for seq, draft, a, emitted in outputs]

    def _commit(self, seq: Sequence, draft: Draft, accepted: int, emitted: list[int],
                report: StepReport) -> SeqOutput:
        drafted = draft.num_tokens
        stats = seq.stats
        stats.draft_time_s += report.draft_s
        stats.target_time_s += report.decode_s
        stats.record_round(drafted, accepted, draft.depth)
        if seq.policy is not None and report.batch_size > 1:
            # a shared step's time is the batch's (speclm.batch.draft_policy), not the row's own
            seq.policy.observe_acceptance(draft.depth, accepted)
        elif seq.policy is not None:
            # K is a depth; a catch-up on missed rounds is not what drafting K tokens costs
            seq.policy.update(draft.depth, accepted, report.draft_s - report.catch_up_s, report.decode_s)
        seq.alpha = update_acceptance(seq.alpha, drafted, accepted, 0.2)
        if drafted and not seq.own_drafter:  # (the first round: the row's own estimate)
            self.seen_alpha = row_alphas([seq])[0] if self.seen_alpha is None else update_acceptance(
                self.seen_alpha, drafted, accepted, 0.2)
            self.seen_t_draft = seq.policy.t_draft if seq.policy is not None else None
        for i in range(min(draft.depth, accepted + 1)):
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
                if tok in self.rows.eos_token_ids:
                    emitted, finish = emitted[: i + 1], "stop"
                    break
        if seq.grammar is not None:  # the grammar's end ends the request, ignore_eos or not
            emitted, done = commit_round(seq.grammar, emitted, accepted, drafted, stats)
            finish = "stop" if done else finish
        seq.generated += len(emitted)
        report.committed += len(emitted)
        stats.generated_tokens = seq.generated
        if finish is None and seq.budget <= 0:
            finish = "length"
        seq.finish_reason = finish
        if finish is not None:
            seq.close()
        return SeqOutput(seq.request_id, Step(emitted, finish), stats)

    # -- slots -----------------------------------------------------------------------------
    def _retire(self) -> None:
        """Free the slots of rows that ended, then re-arrange the rest."""
        ended = [s for s in self.running if s.finish_reason is not None or s.aborted]
        if not ended:
            return
        for seq in ended:
            seq.close()
            self.rows.release(seq.slot)
        self.running = [s for s in self.running if s.finish_reason is None and not s.aborted]
        self.running = arrange(self.running, self.rows)


def generate_tokens(
    target: CausalLM,
    prompt_ids: torch.Tensor,
    params: SamplingParams,
    *,
    drafter: Drafter | None = None,
    draft_length: DraftLengthConfig | None = None,
    stats: RequestStats | None = None,
    generator: torch.Generator | None = None,
    cost_model: CostModel | None = None,
    grammars: GrammarCompiler | None = None,
) -> Iterator[Step]:
    """Generate from ``prompt_ids`` ([n] int64) as a batch of one, yielding each round's
    committed tokens. ``stats`` (if given) is filled in as the generation runs, and is complete
    once the generator is exhausted or closed. ``cost_model``: the target's measured verify
    cost, the adaptive draft length's starting point (speclm.cost_model). ``grammars``: for
    structured outputs (``params.structured``)."""
    engine = Engine(SlotRows(target, 1), draft_length=draft_length, cost_prior=cost_model,
                    grammars=grammars)
    engine.add("request", prompt_ids, params, drafter=drafter, generator=generator, stats=stats)
    try:
        while engine.has_work:
            outputs, _ = engine.step()
            for out in outputs:
                yield out.step
    finally:
        engine.close()
