"""What the engine's step returns: the tokens each request committed, and a report for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from .stats import RequestStats


@dataclass
class Step:
    """Tokens committed by one round (EOS included when it ends the request)."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens or context) or None


@dataclass
class SeqOutput:
    """What one step committed for one request."""

    request_id: str
    step: Step
    stats: RequestStats  # live; complete once step.finish_reason is set


@dataclass
class StepReport:
    """What one engine step did, for metrics."""

    batch_size: int = 0  # rows in the decode forward (0: no decode this step)
    fed_per_row: int = 0  # T = 1 + the longest draft verified
    draft_cap: int = 0  # K of the widest row after the batch cap (0: a plain step)
    longest_draft: int = 0  # the longest draft proposed before the batch cap
    policy_plain: bool = False  # the batch policy made the step plain (drafts cut, or not asked for)
    drafted: int = 0  # draft tokens verified, all rows
    accepted: int = 0
    committed: int = 0  # tokens committed, all rows
    decode_s: float = 0.0  # target forward + verification
    draft_s: float = 0.0
    catch_up_s: float = 0.0  # of draft_s: batched draft rows catching up on rounds they missed
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    judged_per_position: list[int] = field(default_factory=list)  # [K] rows judged at position i
    accepted_per_position: list[int] = field(default_factory=list)  # [K] rows accepted there
