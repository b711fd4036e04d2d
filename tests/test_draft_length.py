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


def _realised(parallel: int, alpha: float, t_round: float, rounds: int = 600) -> tuple[float, int]:
    """Tokens per second (second half) and the longest K asked, for a drafter whose every round
    costs ``t_round`` whatever its length and a verify costing 1 + 0.05 K plain steps; a parallel
    drafter cannot propose more than ``parallel`` tokens."""
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=6, adaptive=True), parallel=parallel)
    rng = random.Random(0)
    tokens, seconds, longest = 0, 0.0, 0
    for i in range(rounds):
        k = policy.next_k()
        drafted = min(k, 4)  # the head proposes at most four tokens per forward
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        draft_s, verify_s = (t_round if k else 0.0), 1.0 + 0.05 * drafted
        policy.update(drafted, accepted, draft_s, verify_s)
        if i >= rounds // 2:
            tokens, seconds, longest = tokens + accepted + 1, seconds + draft_s + verify_s, max(longest, k)
    return tokens / seconds, longest


def test_a_parallel_drafter_is_charged_per_round_and_asked_for_at_most_its_width():
    """A head that drafts N tokens in one forward costs the same for a short round as for a long
    one: charged per token, a short round looks dear per token and K drifts down; charged per
    round, the policy keeps drafting what pays, and never asks for more than N."""
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=6, adaptive=True), parallel=4)
    policy.update(2, 1, 0.3, 1.1)
    assert policy.draft_s(1) == policy.draft_s(4) == 0.3
    for alpha in (0.6, 0.7):
        per_round, longest = _realised(4, alpha, 0.15)
        per_token, _ = _realised(0, alpha, 0.15)
        assert longest <= 4 and per_round > 1.02 * per_token


def test_the_engine_gives_the_policy_the_drafters_width(tiny_tokenizer):
    """Through the engine: a drafter with ``parallel_tokens`` = 2 is never asked for more than 2
    tokens, though the draft cap is 6 (a sequential drafter is asked for up to 6)."""
    import torch

    from speclm.drafters.base import Draft
    from speclm.engine import generate_tokens
    from speclm.models.hf import HFCausalLM
    from speclm.sampling import SamplingParams

    from .conftest import tiny_model

    class Echo:  # proposes the last token again: often wrong, always valid
        def __init__(self, width: int) -> None:
            self.parallel_tokens, self.asked = width, []

        def reset(self, prompt_ids):
            pass

        def propose(self, ctx):
            self.asked.append(ctx.max_tokens)
            return Draft(ctx.token_ids[-1:].repeat(min(ctx.max_tokens, self.parallel_tokens or 6)))

        def on_verified(self, num_accepted, emitted):
            pass

    lm = HFCausalLM(tiny_model(len(tiny_tokenizer), seed=0), frozenset())
    for width, most in ((2, 2), (0, 6)):
        drafter = Echo(width)
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        for _ in generate_tokens(lm, torch.tensor([5, 6, 7]), params, drafter=drafter,
                                 draft_length=DraftLengthConfig(draft_max=6, adaptive=True)):
            pass
        assert max(drafter.asked) == most


def test_a_seeded_request_stops_drafting_where_it_cannot_pay_and_keeps_its_tokens(tiny_tokenizer):
    """Through the engine: a seeded sampled request whose drafts are always rejected, over a cost
    model where a verify costs, runs mostly plain rounds, as an unseeded one does, and returns
    plain seeded decoding's tokens, run after run."""
    import torch

    from speclm.cost_model import CostModel
    from speclm.drafters.base import Draft
    from speclm.engine import generate_tokens
    from speclm.models.hf import HFCausalLM
    from speclm.sampling import SamplingParams

    from .conftest import tiny_model

    class Wrong:  # proposes token 0 again and again: rarely what the target samples
        def __init__(self) -> None:
            self.asked = []

        def reset(self, prompt_ids):
            pass

        def propose(self, ctx):
            self.asked.append(ctx.max_tokens)
            return Draft(torch.zeros(ctx.max_tokens, dtype=torch.long))

        def on_verified(self, num_accepted, emitted):
            pass

    lm = HFCausalLM(tiny_model(len(tiny_tokenizer), seed=0), frozenset())
    params = SamplingParams(temperature=0.8, top_k=5, seed=11, max_tokens=60, ignore_eos=True)
    config = DraftLengthConfig(draft_max=4, adaptive=True)
    prior = CostModel([1, 2, 4, 8], [1.0, 1.3, 1.9, 3.1])
    plain = [t for out in generate_tokens(lm, torch.tensor([5, 6, 7]), params) for t in out.tokens]
    for _ in range(2):
        drafter = Wrong()
        tokens = [t for out in generate_tokens(lm, torch.tensor([5, 6, 7]), params, drafter=drafter,
                                              draft_length=config, cost_model=prior) for t in out.tokens]
        assert tokens == plain and len(tokens) == 60
        assert 0 < len(drafter.asked) < 15  # the first rounds draft, then a probe every 8 plain rounds


def test_a_first_round_drafts_what_keeps_the_first_token_from_waiting():
    """A row's first round may delay its first token by at most half a plain step of drafting,
    where the drafting time is known from the engine's earlier rows; unknown, or in fixed mode,
    K stands. The acceptance measured elsewhere starts the row's estimate."""
    config = DraftLengthConfig(draft_max=8, adaptive=True)
    fresh = DraftLengthPolicy(config)
    fresh.update(0, 0, 0.0, 0.1)  # a plain step: 0.1 s
    assert fresh.first_round(6) == 6  # the drafter's cost is not known yet
    costly, cheap = DraftLengthPolicy(config), DraftLengthPolicy(config)
    for policy in (costly, cheap):
        policy.update(0, 0, 0.0, 0.1)
    costly.start_from(0.9, t_draft=0.02)  # 20 ms a token: 2 tokens fit in 50 ms
    cheap.start_from(0.9, t_draft=0.0001)  # prompt lookup
    assert costly.alpha == cheap.alpha == 0.9
    assert (costly.first_round(6), cheap.first_round(6)) == (2, 6)
    too_slow = DraftLengthPolicy(config)
    too_slow.update(0, 0, 0.0, 0.1)
    too_slow.start_from(0.9, t_draft=0.08)
    assert too_slow.first_round(6) == 0
    parallel = DraftLengthPolicy(config, parallel=4)
    parallel.update(0, 0, 0.0, 0.1)
    parallel.start_from(0.9, t_draft=0.04)  # one head forward per round
    assert parallel.first_round(4) == 4
    fixed = DraftLengthPolicy(DraftLengthConfig(draft_max=8, adaptive=False))
    fixed.update(0, 0, 0.0, 0.1)
    fixed.start_from(0.9, t_draft=0.08)
    assert fixed.first_round(8) == 8  # fixed mode drafts draft_max every round
