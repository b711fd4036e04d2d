"""``--drafter auto``: measure the available drafters on the live request stream, keep the fastest.

Which drafter pays off depends on the workload (prompt lookup on RAG, suffix matching on repeated
requests, a draft model on open-ended text) and on the machine (on a CPU a multi-token verify is
expensive, so a drafter must be right often to beat plain decoding). The figure that decides is
the one the user feels: **tokens committed per second of drafting + verification**, measured by
wall clock from each round's ``propose`` to its ``on_verified``. Plain decoding ("none", a
drafter that proposes nothing) is a candidate like any other.

Policy, per session (the choice carries over from request to request):

1. *probe*: each candidate drafts ``probe_rounds`` rounds in turn; the first round of each turn
   is not timed (it may catch up on tokens the candidate has not seen);
2. *exploit*: the fastest candidate drafts. Rates are pooled tokens over pooled seconds (a rate
   over many rounds; single rounds swing threefold), history fading slowly;
3. *re-probe* every ``reprobe_every`` committed tokens (counted in tokens, not drafting rounds:
   while plain decoding is the choice the drafter is rarely asked, and a workload that turned
   repetitive must still be noticed), or at once when the current choice's rate over its
   last ~7 rounds falls below ``1 - margin`` times the best rate another candidate showed
   (acceptance changed: the conversation moved from copying to writing, say), then choose
   again. A candidate far behind the best (below 0.75x) sits out 1, 2, 4, then 8 re-probes
   while it keeps losing, so a hopeless drafter costs little.

A seeded sampling request gets the same tokens whichever candidate drafts its rounds (the
verifier's keyed draws: speclm.verifier), so its rounds are measured and chosen like any other's.

The choice is remembered per model (``memory``: a small JSON file under the cache directory,
keyed like the cost model by model file, backend, dtype, threads, device and the candidates):
the next session starts by exploiting it and probes again at the first periodic re-probe,
after ``reprobe_every // 4`` tokens.

Every decision (round, choice, reason, the rates it saw) goes into the request's
``RequestStats.drafter_report``, so the CLI and ``speclm bench`` show what was chosen and why.
Candidates that learn from the session's text (they have ``observe``, e.g. suffix matching) are
reset with every request and shown its final tokens; others are reset lazily, when first asked to
draft in a request, so an unused draft model costs nothing. Learners of the target's top-k
(token recycling) get that feedback while candidates are being probed and while one of them is
the choice; otherwise no round pays for a top-k over the vocabulary that nobody reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..cost_model import write_json
from ..errors import SpeclmError
from .base import Draft, DraftContext, Drafter, drafter_report, wanted_target_topk


class NoDrafter:
    """Proposes nothing: the round is a plain decoding step (the baseline every choice must beat)."""

    def reset(self, prompt_ids: torch.Tensor) -> None:
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        return Draft.empty(ctx.token_ids.device)

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass


@dataclass
class _Rate:
    """Measured tokens per second of one candidate: sums of tokens and seconds over timed rounds,
    older rounds fading by ``decay`` per new round (a rate over many rounds, not an average of
    per-round rates, which swing threefold between a 1-token and a 3-token round)."""

    decay: float
    tokens: float = 0.0
    seconds: float = 0.0
    drafted: float = 0.0
    accepted: float = 0.0

    @property
    def pooled(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        d = self.decay
        self.tokens = d * self.tokens + tokens
        self.seconds = d * self.seconds + seconds
        self.drafted = d * self.drafted + drafted
        self.accepted = d * self.accepted + accepted

    def fade(self, weight: float) -> None:
        """Keep ``weight`` of the history (before a new probe of this candidate)."""
        self.tokens *= weight
        self.seconds *= weight
        self.drafted *= weight
        self.accepted *= weight


class AutoDrafter:
    """Chooses among ``candidates`` (name -> (drafter, max draft length)) by measured speed."""

    def __init__(self, candidates: dict[str, tuple[Drafter, int]], probe_rounds: int = 8,
                 reprobe_every: int = 256, margin: float = 0.25, memory: Path | None = None) -> None:
        if not candidates:
            raise SpeclmError("auto needs at least one candidate drafter")
        if probe_rounds < 2:
            raise SpeclmError(f"auto probe_rounds must be >= 2, got {probe_rounds}")
        self.candidates = candidates
        self.names = list(candidates)
        self.probe_rounds = probe_rounds
        self.reprobe_every = reprobe_every
        self.margin = margin
        self._topk_any = max(wanted_target_topk(d) for d, _ in candidates.values())
        # per candidate: its rate over every timed round (slowly fading), and a short window of
        # the chosen one's recent rounds (to notice when its acceptance changes)
        self.rates: dict[str, _Rate] = {n: _Rate(decay=0.99) for n in self.names}
        self._recent = _Rate(decay=0.85)
        self._sit_out: dict[str, int] = dict.fromkeys(self.names, 0)  # re-probes to skip
        self._losses: dict[str, int] = dict.fromkeys(self.names, 0)  # clear losses in a row
        self.choice: str | None = None  # None until the first probe has finished
        self._queue: list[str] = list(self.names)  # candidates still to probe, in order
        self._probe_round = 0
        self._since_choice = 0  # tokens committed since the latest decision
        self._seen = 0  # tokens of the request counted so far
        self._round = 0  # rounds drafted in this session
        self._active: str | None = None
        self._timed = False  # whether this round counts (not when the candidate was just reset)
        self._t0 = 0.0
        self._drafted = 0
        self._prompt: torch.Tensor | None = None
        self._reset_done: set[str] = set()
        # the current request's tokens, for observe() at its end: the latest context (a view,
        # no copy per round) and what was emitted after it
        self._context: torch.Tensor | None = None
        self._tail: list[int] = []
        self._request: dict = {}
        self.memory = memory
        self.remembered = self._recall()

    def _recall(self) -> str | None:
        """Start from the choice remembered for this model, if any: no probe before it is used,
        the first re-probe after a quarter of the usual interval."""
        try:
            choice = json.loads(self.memory.read_text())["choice"] if self.memory else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if choice not in self.candidates:
            return None
        self.choice, self._queue = choice, []
        self._since_choice = self.reprobe_every - max(1, self.reprobe_every // 4)
        return choice

    @property
    def wants_target_topk(self) -> int:
        """The target's top-k per position, wanted while probing (any learner may be measured
        next) or while the choice learns from it; 0 otherwise."""
        if self._queue or self.choice is None:
            return self._topk_any
        return wanted_target_topk(self.candidates[self.choice][0])

    @property
    def probing(self) -> bool:
        """Measuring candidates (plain decoding among them): every round must reach them."""
        return bool(self._queue)

    # -- protocol ---------------------------------------------------------------------------
    def reset(self, prompt_ids: torch.Tensor) -> None:
        self._finish_request()
        self._prompt = prompt_ids
        self._reset_done = set()
        for name, (drafter, _) in self.candidates.items():
            if callable(getattr(drafter, "observe", None)):  # learners see every request
                drafter.reset(prompt_ids)
                self._reset_done.add(name)
        self._context, self._tail = prompt_ids, []
        self._seen = prompt_ids.shape[0]
        self._request = {"decisions": [], "rounds": dict.fromkeys(self.names, 0)}

    def propose(self, ctx: DraftContext) -> Draft:
        name = self._queue[0] if self._queue else self.choice
        drafter, cap = self.candidates[name]
        self._timed = name in self._reset_done
        if not self._timed:  # lazily: a candidate never asked costs nothing; this round's
            drafter.reset(self._prompt)  # prefill is not held against it
            self._reset_done.add(name)
        self._active = name
        n = ctx.token_ids.shape[0]  # tokens committed in rounds auto was not asked count too
        self._since_choice += max(0, n - self._seen)
        self._seen = n
        self._context, self._tail = ctx.token_ids, []
        self._t0 = time.perf_counter()
        draft = drafter.propose(replace(ctx, max_tokens=min(ctx.max_tokens, cap)))
        self._drafted = draft.num_tokens
        return draft

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        seconds = time.perf_counter() - self._t0
        name = self._active
        self.candidates[name][0].on_verified(num_accepted, emitted)
        self._tail += emitted
        self._seen += len(emitted)
        self._since_choice += len(emitted)
        self._round += 1
        self._request["rounds"][name] += 1
        if self._queue:
            self._probing(name, len(emitted), seconds, num_accepted)
        else:
            self._exploiting(name, len(emitted), seconds, num_accepted)

    def finish(self) -> None:
        """The request is over, however it ended: candidates holding resources let them go."""
        for drafter, _ in self.candidates.values():
            if callable(getattr(drafter, "finish", None)):
                drafter.finish()

    def on_target_topk(self, fed: torch.Tensor, topk_ids: torch.Tensor) -> None:
        for drafter, _ in self.candidates.values():  # learners learn from every round
            if wanted_target_topk(drafter):
                drafter.on_target_topk(fed, topk_ids)

    # -- policy -----------------------------------------------------------------------------
    def _probing(self, name: str, tokens: int, seconds: float, accepted: int) -> None:
        self._probe_round += 1
        if self._probe_round == 1:
            self.rates[name].fade(0.3)  # the new probe outweighs what the candidate did before
        elif self._timed:  # a turn's first round may be catching up on unseen tokens: not timed
            self.rates[name].add(tokens, seconds, self._drafted, accepted)
        if self._probe_round >= self.probe_rounds:
            self._probe_round = 0
            self._queue.pop(0)
            if not self._queue:
                self._decide("probed")

    def _exploiting(self, name: str, tokens: int, seconds: float, accepted: int) -> None:
        if self._timed:
            self.rates[name].add(tokens, seconds, self._drafted, accepted)
            self._recent.add(tokens, seconds, self._drafted, accepted)
        others = [self.rates[n].pooled for n in self.names if n != name]
        if self._since_choice >= self.reprobe_every:
            self._start_probe("periodic re-probe")
        elif (self._since_choice >= 2 * self.probe_rounds and others
              and self._recent.pooled < (1 - self.margin) * max(others)):
            self._start_probe(f"{name} fell to {self._recent.pooled:.1f} tok/s", everyone=True)

    def _start_probe(self, reason: str, everyone: bool = False) -> None:
        """Probe the others again, then the current choice, to compare like with like. On a
        periodic re-probe, clear losers sit out 1, 2, 4, 8 re-probes in a row as they keep
        losing; when the choice itself fell (the workload changed), everyone is probed."""
        queue = []
        for n in self.names:
            if n == self.choice:
                continue
            if self._sit_out[n] > 0 and not everyone:
                self._sit_out[n] -= 1
            else:
                queue.append(n)
        self._queue = queue + [self.choice]
        self._log("probe", reason)

    def _decide(self, reason: str) -> None:
        best = max(self.names, key=lambda n: self.rates[n].pooled)
        top = self.rates[best].pooled
        for n in self.names:  # a candidate far behind is probed less and less often
            if self.rates[n].pooled < 0.75 * top:
                self._losses[n] += 1
                self._sit_out[n] = min(8, 2 ** (self._losses[n] - 1))
            else:
                self._losses[n] = 0
        self._log(best, reason if best == self.choice or self.choice is None
                  else f"{reason}: switch from {self.choice}")
        self.choice = best
        self._recent = _Rate(decay=self._recent.decay)
        self._since_choice = 0
        if self.memory is not None:
            write_json(self.memory, {"choice": best, "rates": {n: round(r.pooled, 2) for n, r in self.rates.items()}})

    def _log(self, action: str, reason: str) -> None:
        self._request["decisions"].append({
            "round": self._round, "action": action, "reason": reason,
            "rates": {n: round(r.pooled, 2) for n, r in self.rates.items() if r.seconds > 0}})

    # -- reporting --------------------------------------------------------------------------
    def _finish_request(self) -> None:
        """Show learners the previous request's final tokens (rounds they sat out included)."""
        if self._context is None:
            return
        tokens = torch.cat([self._context, torch.tensor(self._tail, dtype=torch.long)])
        for drafter, _ in self.candidates.values():
            observe = getattr(drafter, "observe", None)
            if callable(observe):
                observe(tokens)
        self._context, self._tail = None, []

    def report(self) -> dict:
        rates = {n: {"tok_s": round(r.pooled, 2), "alpha": round(r.accepted / r.drafted, 3) if r.drafted else None}
                 for n, r in self.rates.items() if r.seconds > 0}
        used = {n: c for n, c in self._request.get("rounds", {}).items() if c}
        active = self.choice or (self._queue[0] if self._queue else None)
        figures = ", ".join(f"{n} {r['tok_s']:.1f}" for n, r in sorted(rates.items(), key=lambda x: -x[1]["tok_s"]))
        inner = drafter_report(self.candidates[active][0]) if active else None
        remembered = (" (remembered for this model)" if self.remembered is not None
                      and self.remembered == self.choice and not self._request.get("decisions") else "")
        summary = (f"auto: {'probing' if self.choice is None else 'chose ' + self.choice}{remembered}; "
                   f"tok/s {figures or 'not measured yet'}; rounds {used}; "
                   f"{len(self._request.get('decisions', []))} decision(s) this request")
        return {"summary": summary, "choice": self.choice, "rates": rates, "rounds": used,
                "decisions": list(self._request.get("decisions", [])),
                "choice_report": inner}
