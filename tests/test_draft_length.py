"""The adaptive draft length: K chosen from measured acceptance and measured costs."""

from __future__ import annotations

import random

from speclm.draft_length import DraftLengthConfig, DraftLengthPolicy


def drive(policy: DraftLengthPolicy, alpha: float, cost, rounds: int, seed: int = 0) -> list[int]:
    """Run ``policy`` for ``rounds`` rounds with i.i.d. acceptance ``alpha`` and a verify of K
    drafted tokens costing ``cost(K)``; return the K it chose each round."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        k = policy.next_k()
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.update(k, accepted, 0.0, cost(k))
        chosen.append(k)
    return chosen


def simulate(alpha: float, t_plain: float, t_token: float, rounds: int = 400, seed: int = 0) -> list[int]:
    """Drive the policy with verify costs t_plain + K * t_token; return the K it chose in the
    second half (after it has learned)."""
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=8, adaptive=True, probe_every=8))
    return drive(policy, alpha, lambda k: t_plain + k * t_token, rounds, seed)[rounds // 2:]


def test_cheap_wide_verifies_draft_long():  # a GPU: a verify costs what a plain step does
    chosen = simulate(alpha=0.8, t_plain=1.0, t_token=0.0)
    assert sorted(chosen)[len(chosen) // 2] == 8


def test_costly_verifies_draft_short_or_not_at_all():
    """A CPU whose verify grows ~0.3 plain steps per token (llama.cpp's Q4 kernels): with weak
    acceptance, drafting loses, so the policy runs plain steps (probing now and then)."""
    chosen = simulate(alpha=0.3, t_plain=1.0, t_token=0.3)
    assert sum(k == 0 for k in chosen) > 0.8 * len(chosen)
    good = simulate(alpha=0.8, t_plain=1.0, t_token=0.3)
    assert 1 <= sorted(good)[len(good) // 2] <= 4  # strong acceptance: short drafts pay
