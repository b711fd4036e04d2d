"""Per-request statistics: what was drafted, accepted, and where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0  # decode-time target forwards (prefill excluded)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    judged_per_position: list[int] = field(default_factory=list)  # [K_max] rounds in which
    #   draft position i was judged (drafted, and every earlier position accepted)
    accepted_per_position: list[int] = field(default_factory=list)  # [K_max] accepted at i
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0  # decode-time target forwards + verification
    total_time_s: float = 0.0
    drafter: str = "none"
    backend: str = "torch"  # what ran the target: torch, torch-compiled..., llamacpp
    cost_model: str | None = None  # the target's measured verify cost the draft length used
    constrained: bool = False  # structured outputs: a grammar masked every token
    forced_tokens: int = 0  # draft tokens the grammar forced (drafted without the drafter)
    forced_accepted: int = 0  # of those, accepted (a forced tokenization can lose to another)
    grammar_rejected_tokens: int = 0  # drafter tokens cut off before verification (forbidden)
    drafter_report: dict | None = None  # the drafter's own account of the request (see
    #   drafters/base.py): e.g. which drafter ``auto`` chose, when and why, with measured rates

    def record_round(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One target forward that judged ``drafted`` tokens (tree nodes) reaching ``depth``
        positions (a chain: depth = drafted) and accepted ``accepted`` of them."""
        depth = drafted if depth is None else depth
        self.target_forwards += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        grow = depth - len(self.judged_per_position)
        if grow > 0:
            self.judged_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(min(depth, accepted + 1)):  # positions the verifier looked at
            self.judged_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted / drafted draft tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward, bonus/recovered token included."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft token i accepted | every earlier draft token was accepted)."""
        return [a / j if j else 0.0 for a, j in zip(self.accepted_per_position, self.judged_per_position)]

    @property
    def decode_time_s(self) -> float:
        return self.total_time_s - self.prefill_time_s

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over wall time, prefill included."""
        return self.generated_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(alpha=self.alpha, tau=self.tau, tokens_per_s=self.tokens_per_s,
                   acceptance_by_position=self.acceptance_by_position)
        return out

    def summary(self, verbose: bool = False) -> str:
        """A few human-readable lines (``verbose``: the cost model too)."""
        choice = (self.drafter_report or {}).get("choice")
        name = f"{self.drafter} (chose {choice})" if choice else self.drafter
        lines = [
            f"drafter {name} on {self.backend}: {self.generated_tokens} tokens in {self.total_time_s:.2f} s "
            f"({self.tokens_per_s:.1f} tok/s), prompt {self.prompt_tokens} tokens "
            f"(prefill {self.prefill_time_s:.2f} s)",
            f"target forwards {self.target_forwards}, tau {self.tau:.2f} tokens/forward; "
            f"drafted {self.drafted_tokens}, accepted {self.accepted_tokens} "
            f"(alpha {self.alpha:.2f})",
            f"time: target {self.target_time_s:.2f} s, draft {self.draft_time_s:.2f} s",
        ]
        if self.judged_per_position:
            rates = " ".join(f"{r:.2f}" for r in self.acceptance_by_position)
            lines.append(f"acceptance by draft position: {rates}")
        if self.constrained:
            lines.append(f"grammar: forced {self.forced_tokens} draft tokens ({self.forced_accepted} "
                         f"accepted), cut {self.grammar_rejected_tokens} drafted tokens it forbids")
        if verbose and self.cost_model:
            lines.append(self.cost_model)
        report = self.drafter_report or {}
        if report.get("summary"):
            lines.append(f"drafter: {report['summary']}")
        for d in report.get("decisions", []):
            rates = ", ".join(f"{name} {rate:.1f}" for name, rate in d["rates"].items())
            lines.append(f"  round {d['round']}: {d['action']} ({d['reason']}); tok/s {rates or '-'}")
        return "\n".join(lines)
