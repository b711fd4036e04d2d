"""Prometheus metrics: requests, tokens, latency, time to first token, batching and speculation.

Each server owns its registry (so several apps can live in one process, as in the tests). The
engine thread records step figures; the request handlers record request figures. Speculation is
reported as counters (drafted, accepted, per draft position judged/accepted) from which alpha,
tau and per-position acceptance follow, and as gauges holding those ratios since start.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from ..step import StepReport

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # requests
        self.requests = Counter("speclm_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("speclm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("speclm_generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram("speclm_request_latency_seconds", "Generation request latency, "
                                 "arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("speclm_time_to_first_token_seconds", "Arrival to first generated "
                              "token", buckets=_TTFT_BUCKETS, registry=r)
        self.running = Gauge("speclm_running_requests", "Requests in the decoding batch", registry=r)
        self.waiting = Gauge("speclm_waiting_requests", "Requests queued for a batch row", registry=r)
        self.failures = Counter("speclm_request_failures", "Requests that ended in an error",
                                ["reason"], registry=r)
        # batching
        self.steps = Counter("speclm_engine_steps", "Decode steps (one target forward each)", registry=r)
        self.step_seconds = Histogram("speclm_step_seconds", "Target forward + verification time "
                                      "per decode step", buckets=_STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("speclm_batch_size", "Rows per decode step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.prefill_tokens = Counter("speclm_prefill_tokens", "Prompt tokens prefilled", registry=r)
        # speculation
        self.draft_cap = Gauge("speclm_spec_draft_length", "Draft cap K chosen for the last step "
                               "(0: plain step)", registry=r)
        self.draft_cap_hist = Histogram("speclm_spec_draft_length_per_step", "Draft cap K per "
                                        "decode step", buckets=(0, 1, 2, 3, 4, 6, 8, 10, 12, 16),
                                        registry=r)
        self.spec_off_steps = Counter("speclm_spec_off_steps", "Decode steps the batch policy ran "
                                      "plain (K = 0): drafts cut, or drafters not asked", registry=r)
        self.drafted = Counter("speclm_spec_drafted_tokens", "Draft tokens verified", registry=r)
        self.accepted = Counter("speclm_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.row_forwards = Counter("speclm_spec_row_forwards", "Rows verified (one per request "
                                    "per step)", registry=r)
        self.committed = Counter("speclm_spec_committed_tokens", "Tokens committed by decode steps",
                                 registry=r)
        self.alpha = Gauge("speclm_spec_alpha", "Accepted / drafted tokens since start", registry=r)
        self.tau = Gauge("speclm_spec_tau", "Tokens committed per row forward since start", registry=r)
        self.judged_at = Counter("speclm_spec_position_judged", "Draft tokens judged at this "
                                 "draft position", ["position"], registry=r)
        self.accepted_at = Counter("speclm_spec_position_accepted", "Draft tokens accepted at "
                                   "this draft position", ["position"], registry=r)
        self.acceptance_at = Gauge("speclm_spec_acceptance_by_position", "P(accepted | judged) "
                                   "per draft position since start", ["position"], registry=r)
        # per drafter (auto: the candidate it chose for the request), from finished requests
        by = ["drafter"]
        self.drafter_requests = Counter("speclm_drafter_requests", "Finished requests by the "
                                        "drafter that ran them", by, registry=r)
        self.drafter_drafted = Counter("speclm_drafter_drafted_tokens", "Draft tokens verified, "
                                       "by drafter", by, registry=r)
        self.drafter_accepted = Counter("speclm_drafter_accepted_tokens", "Draft tokens accepted, "
                                        "by drafter", by, registry=r)
        self.drafter_tokens = Counter("speclm_drafter_generation_tokens", "Tokens generated, by "
                                      "drafter", by, registry=r)
        self.drafter_forwards = Counter("speclm_drafter_target_forwards", "Row forwards (tau = "
                                        "generation tokens / forwards), by drafter", by, registry=r)
        # structured outputs (finished constrained requests)
        self.structured_requests = Counter("speclm_structured_requests", "Finished requests with "
                                           "a JSON schema, JSON object, regex or grammar", registry=r)
        self.structured_forced = Counter("speclm_structured_forced_tokens", "Draft tokens the "
                                         "grammar forced (drafted without the drafter)", registry=r)
        self.structured_forced_accepted = Counter("speclm_structured_forced_accepted_tokens",
                                                  "Forced draft tokens accepted", registry=r)
        self.structured_rejected = Counter("speclm_structured_grammar_rejected_tokens", "Drafted "
                                           "tokens the grammar cut before verification", registry=r)
        self.structured_drafted = Counter("speclm_structured_drafted_tokens", "Draft tokens "
                                          "verified on constrained requests (forced included)", registry=r)
        self.structured_accepted = Counter("speclm_structured_accepted_tokens", "Draft tokens "
                                           "accepted on constrained requests", registry=r)
        self._totals = [0, 0, 0, 0]  # drafted, accepted, committed, row forwards
        self._positions: list[list[int]] = []  # [judged, accepted] per position

    def record_step(self, report: StepReport, spec_enabled: bool) -> None:
        """Called by the engine thread after every step."""
        if report.prefill_rows:
            self.prefill_tokens.inc(report.prefill_tokens)
        if not report.batch_size:
            return
        self.steps.inc()
        self.step_seconds.observe(report.decode_s)
        self.batch_size.observe(report.batch_size)
        self.committed.inc(report.committed)
        self.row_forwards.inc(report.batch_size)
        totals = self._totals
        totals[2] += report.committed
        totals[3] += report.batch_size
        self.tau.set(totals[2] / totals[3])
        if not spec_enabled:
            return
        self.draft_cap.set(report.draft_cap)
        self.draft_cap_hist.observe(report.draft_cap)
        if report.policy_plain:
            self.spec_off_steps.inc()
        self.drafted.inc(report.drafted)
        self.accepted.inc(report.accepted)
        totals[0] += report.drafted
        totals[1] += report.accepted
        if totals[0]:
            self.alpha.set(totals[1] / totals[0])
        for i, (judged, accepted) in enumerate(zip(report.judged_per_position,
                                                   report.accepted_per_position)):
            if i == len(self._positions):
                self._positions.append([0, 0])
            if judged:
                pos = self._positions[i]
                pos[0] += judged
                pos[1] += accepted
                label = str(i + 1)
                self.judged_at.labels(label).inc(judged)
                self.accepted_at.labels(label).inc(accepted)
                self.acceptance_at.labels(label).set(pos[1] / pos[0])

    def record_request(self, stats) -> None:
        """Called once per finished request with its stats: the per-drafter counters."""
        label = drafter_label(stats)
        self.drafter_requests.labels(label).inc()
        self.drafter_drafted.labels(label).inc(stats.drafted_tokens)
        self.drafter_accepted.labels(label).inc(stats.accepted_tokens)
        self.drafter_tokens.labels(label).inc(stats.generated_tokens)
        self.drafter_forwards.labels(label).inc(stats.target_forwards)
        if stats.constrained:
            self.structured_requests.inc()
            self.structured_forced.inc(stats.forced_tokens)
            self.structured_forced_accepted.inc(stats.forced_accepted)
            self.structured_rejected.inc(stats.grammar_rejected_tokens)
            self.structured_drafted.inc(stats.drafted_tokens)
            self.structured_accepted.inc(stats.accepted_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def drafter_label(stats) -> str:
    """The drafter that ran a request: ``auto``'s choice when it made one, else its name."""
    choice = (stats.drafter_report or {}).get("choice")
    return f"{stats.drafter}:{choice}" if choice else stats.drafter
