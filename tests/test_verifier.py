"""The accept/resample step keeps the target distribution exactly.

1. Exact: enumerate the draft token x ~ q and compute P(output = y) from the verifier's own
   acceptance and residual functions; it must equal p for adversarial p/q pairs and warps.
2. Monte Carlo: the real ``verify`` (with its random draws) matches p by a chi-square test, and
   the same test rejects a deliberately biased sampler (so it can fail).
3. Seeded (keyed) draws: a position's draws depend on the seed and the position alone, keyed
   draws follow p, and a keyed verify emits the target's keyed draws whatever was drafted.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from speclm.drafters.base import Draft
from speclm.sampling import (
    PositionNoise,
    SamplingParams,
    keyed_choice,
    sample_token,
    warp_probs,
)
from speclm.tree import TreeMeta
from speclm.verifier import acceptance_probs, residual_probs, verify

V = 8
NEG = float("-inf")


def _logits(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# (name, target logits, draft logits)
CASES = [
    ("disjoint supports", _logits(2, 1, 0.5, NEG, NEG, NEG, NEG, NEG),
     _logits(NEG, NEG, NEG, 1, 3, 0, 2, NEG)),
    ("q much sharper than p", _logits(0.1, 0.2, 0.3, 0.1, 0.0, 0.2, 0.1, 0.3),
     _logits(0.1, 0.2, 0.3, 0.1, 0.0, 0.2, 0.1, 0.3) * 25),
    ("p with zeros", _logits(NEG, 2, NEG, 1, NEG, 0.5, NEG, 3),
     _logits(1, 1, 1, 1, 1, 1, 1, 1)),
    ("p sharp, q flat", _logits(8, 0, 0, 0, 1, 0, 0, 0), _logits(0, 0, 0, 0, 0, 0, 0, 0)),
    ("p equals q", _logits(1, 2, 3, 0, 1, 2, 0, 1), _logits(1, 2, 3, 0, 1, 2, 0, 1)),
    ("q one-hot where p is small", _logits(3, 2, 1, 0, -1, -2, -3, -4),
     _logits(NEG, NEG, NEG, NEG, NEG, NEG, NEG, 0)),
]
WARPS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=3),
    SamplingParams(temperature=1.7, top_p=0.7),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.5),
]


def exact_output_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(verifier emits y) for one drafted position, draft token x ~ q, from the verifier's
    own functions: sum_x q(x) [a(x) 1{y = x} + (1 - a(x)) residual(y)]."""
    out = torch.zeros_like(p)
    residual = residual_probs(p[None], q[None])[0]
    for x in range(p.shape[0]):
        if q[x] == 0:
            continue
        a = acceptance_probs(p[x : x + 1], q[x : x + 1])[0]
        out[x] += q[x] * a
        out += q[x] * (1 - a) * residual
    return out


def warped_pair(p_logits: torch.Tensor, q_logits: torch.Tensor, params) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q [V] after the shared warp; skips the case when the warp leaves q empty."""
    p = warp_probs(p_logits[None], params)[0]
    q = warp_probs(q_logits[None], params)[0]
    if q.sum() == 0 or torch.isnan(q).any():
        pytest.skip("warp leaves q empty")
    return p, q


@pytest.mark.parametrize("name,p_logits,q_logits", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("params", WARPS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_exact_distribution(name, p_logits, q_logits, params):
    p, q = warped_pair(p_logits, q_logits, params)
    torch.testing.assert_close(exact_output_distribution(p, q), p, atol=1e-12, rtol=0)


def test_exact_distribution_deterministic_draft():
    """Prompt lookup has no q: every possible drafted token, as a one-hot q, is lossless."""
    p = warp_probs(CASES[0][1][None], SamplingParams(temperature=1.0))[0]
    for x in range(V):
        q = torch.nn.functional.one_hot(torch.tensor(x), V).to(torch.float64)
        torch.testing.assert_close(exact_output_distribution(p, q), p, atol=1e-12, rtol=0)


def _sample_first_tokens(p_logits, q_logits, params, n, seed=0, sampler=verify):
    gen = torch.Generator().manual_seed(seed)
    q = warp_probs(q_logits[None], params)  # [1, V]
    counts = torch.zeros(V)
    target_logits = torch.stack([p_logits, p_logits])  # [2, V]: drafted position + bonus
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=gen)  # [1]
        verdict = sampler(target_logits, Draft(x, q), params, gen)
        counts[int(verdict.tokens[0])] += 1
    return counts


@pytest.mark.parametrize("case", [0, 1, 2, 5], ids=lambda i: CASES[i][0])
def test_verify_samples_match_target(case):
    _, p_logits, q_logits = CASES[case]
    params = SamplingParams(temperature=0.8, top_k=6)
    p = warp_probs(p_logits[None], params)[0]
    counts = _sample_first_tokens(p_logits, q_logits, params, n=3000)
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * counts.sum()).numpy()).pvalue > 1e-3


def test_chi_square_detects_biased_sampler():
    """Always accepting the draft yields q, not p: the same test must reject it."""
    _, p_logits, q_logits = CASES[1]
    params = SamplingParams(temperature=1.0)

    def accept_all(target_logits, draft, params, gen):
        return type(verify(target_logits, draft, params, gen))(torch.tensor(1), draft.tokens, torch.arange(1))

    counts = _sample_first_tokens(p_logits, q_logits, params, n=3000, sampler=accept_all)
    p = warp_probs(p_logits[None], params)[0]
    assert chisquare(counts.numpy(), (p * counts.sum()).numpy()).pvalue < 1e-6


def test_greedy_verify_rules():
    logits = torch.full((4, V), -1.0, dtype=torch.float64)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = logits[3, 7] = 2.0  # argmax: 3, 5, 1, 7
    greedy = SamplingParams()
    gen = torch.Generator()
    v = verify(logits, Draft(torch.tensor([3, 5, 2])), greedy, gen)  # third draft wrong
    assert int(v.num_accepted) == 2 and v.tokens[:3].tolist() == [3, 5, 1]  # recovered = argmax
    v = verify(logits, Draft(torch.tensor([3, 5, 1])), greedy, gen)  # all accepted
    assert int(v.num_accepted) == 3 and v.tokens.tolist() == [3, 5, 1, 7]  # bonus token
    v = verify(logits[:1], Draft.empty(), greedy, gen)  # plain decoding
    assert int(v.num_accepted) == 0 and v.tokens.tolist() == [3]


def test_position_noise_follows_seed_and_position_alone_and_keyed_draws_follow_p():
    """A position's draws are the same in any order and any instance, differ between positions
    and seeds; keyed draws over 3,000 positions match p by chi-square; a zero-probability token
    never wins, even against a draw of exactly 0."""
    noise = PositionNoise(7, V)
    late_first = [PositionNoise(7, V).row(5), PositionNoise(7, V).rows(3, 3)[2]]
    assert all(torch.equal(row, noise.row(5)) for row in late_first)
    assert not torch.equal(noise.row(5), noise.row(6))
    assert not torch.equal(noise.row(5), PositionNoise(8, V).row(5))
    assert (noise.row(5) > 0).all() and noise.row(5).dtype == torch.float32
    params = SamplingParams(temperature=0.8, top_k=6)
    p = warp_probs(CASES[2][1][None], params)[0]  # p with zeros
    n = 3000
    chosen = keyed_choice(p.expand(n, V), PositionNoise(11, V).rows(0, n))
    counts = torch.bincount(chosen, minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support].numpy(), (p[support] * n).numpy()).pvalue > 1e-3
    zero = torch.zeros(1, V)
    assert keyed_choice(p[None], zero).item() in torch.nonzero(support).flatten().tolist()


def _keyed_draws(logits: torch.Tensor, params, noise: torch.Tensor) -> list[int]:
    return keyed_choice(warp_probs(logits, params), noise).tolist()


@pytest.mark.parametrize("params", WARPS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_a_keyed_verify_emits_the_targets_draws_whatever_was_drafted(params):
    """Chains and trees of random tokens, sampled q or none: the round emits the target's keyed
    draw at every position it commits (accepted while the draft equals it), so a seeded
    request's output does not depend on its drafts."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        k = trial % 5 + 1
        logits = torch.randn(k + 1, V, generator=gen, dtype=torch.float64) * 2
        noise = PositionNoise(trial, V).rows(0, k + 1)  # [k + 1, V]
        draws = _keyed_draws(logits, params, noise)
        lucky = torch.rand(k, generator=gen) < 0.6  # many drafts take the target's draw
        tokens = torch.where(lucky, torch.tensor(draws[:k]), torch.randint(0, V, (k,), generator=gen))
        q = warp_probs(torch.randn(k, V, generator=gen, dtype=torch.float64), params) if trial % 2 else None
        v = verify(logits, Draft(tokens, q), params, gen, noise=noise)
        n = int(v.num_accepted)
        agree = (tokens == torch.tensor(draws[:k])).long().cumprod(0).sum()
        assert n == int(agree) and v.tokens[: n + 1].tolist() == draws[: n + 1]
        # a tree: two candidates at depth 1 (nodes 0, 1), one child under each (nodes 2, 3); row 0
        # (the pending token's) predicts depth 1, row i + 1 (node i's) depth[i] + 1
        tree = TreeMeta.from_parents(torch.tensor([-1, -1, 0, 1]))
        rows = torch.randn(5, V, generator=gen, dtype=torch.float64)
        tree_noise = PositionNoise(1000 + trial, V).rows(0, 3)  # the round's positions 0, 1, 2
        row_draws = _keyed_draws(rows, params, tree_noise[torch.tensor([0, 1, 1, 2, 2])])
        first = trial % 3  # 0: neither candidate is the draw; 1: node 0 is; 2: node 1 is
        pick = [(row_draws[0] + 1) % V, (row_draws[0] + 2) % V]
        if first:
            pick[first - 1] = row_draws[0]
        under = [row_draws[first] if trial % 2 else (row_draws[first] + 1) % V] * 2  # the child's token
        v = verify(rows, Draft(torch.tensor(pick + under), None, tree), params, gen, noise=tree_noise)
        want = [row_draws[0]]
        if first:
            want.append(row_draws[first])  # the accepted node's row draws the next token
            if trial % 2:
                want.append(row_draws[first + 2])  # its child was accepted too: the child's row
        assert v.tokens[: int(v.num_accepted) + 1].tolist() == want


def test_warp_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    assert (warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0, :3] == 0).all()
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)[0]
    # smallest set reaching 0.7: {4} has 0.64 < 0.7, {4, 3} reaches it
    assert (probs[0, :3] == 0).all() and probs[0, 3] > 0
    torch.testing.assert_close(probs[0, 3:], full[3:] / full[3:].sum())
    assert torch.equal(warp_probs(logits, SamplingParams()), torch.tensor([[0.0, 0, 0, 0, 1]], dtype=torch.float64))


def _nucleus_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference top-p: sort each row, keep the prefix whose mass before it is under top_p."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    drop_sorted = torch.cumsum(sorted_p, dim=-1) - sorted_p >= top_p
    return ~torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # kept mask


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_a_full_sort(top_p):
    """The nucleus found from each row's sorted values (numpy's sort on a CPU) is the one a
    full sort with indices gives: peaked and flat rows in one batch, small and large nuclei."""
    gen = torch.Generator().manual_seed(3)
    V = 20_000
    scales = torch.tensor([[8.0], [3.0], [0.05], [0.0]])  # peaked .. uniform rows
    logits = torch.randn(4, V, generator=gen, dtype=torch.float64) * scales
    logits[3] += torch.rand(V, generator=gen, dtype=torch.float64) * 1e-6  # uniform, no exact ties
    probs = torch.softmax(logits, -1)
    warped = warp_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    want = _nucleus_by_sort(probs, top_p)
    assert torch.equal(warped > 0, want)
    torch.testing.assert_close(warped, torch.where(want, probs, 0.0) / torch.where(want, probs, 0.0).sum(-1, keepdim=True))
    if top_p >= 0.5:
        assert int(want[3].sum()) > 1024 and int(want[0].sum()) < 100  # large and small nuclei


def test_top_p_keeps_tied_tokens_together():
    """Tokens of equal probability at the cut are kept or dropped together."""
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=torch.float64))
    kept = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.5)) > 0
    assert kept.tolist() == [[True, True, True, True]]  # 0.4 < 0.5, so every 0.2 is kept
    kept = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.4)) > 0
    assert kept.tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-20, 1e-6, 1e-5, 1e-3, 0.7, 2.0])
def test_no_temperature_or_logit_scale_gives_nan(dtype, temperature):
    """1/T overflowed in float32 (1e-40 sampled token 0 every time): temperatures below 1e-5 are
    greedy, and no positive temperature or logit magnitude may produce NaN probabilities."""
    params = SamplingParams(temperature=temperature)
    assert params.greedy == (temperature < 1e-5)
    logits = torch.tensor([[1e30, -1e30, 0.0, 5.0, 1e30 - 1e24],
                           [-1e30, -1e30, -1e30, -1e30, -2e30],
                           [3.0, 1.0, 2.0, NEG, 0.5],
                           [float("inf"), 1.0, float("inf"), 0.0, -1.0]], dtype=dtype)
    probs = warp_probs(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4, dtype=probs.dtype))
    draws = sample_token(probs.repeat(50, 1), torch.Generator().manual_seed(0)).view(50, 4)
    assert (probs.repeat(50, 1).view(50, 4, -1).gather(-1, draws.unsqueeze(-1)) > 0).all()
    if temperature <= 1e-3:  # the argmax wins every draw (ties: one of the tied tokens)
        assert set(draws[:, 0].tolist()) == {0} and set(draws[:, 2].tolist()) == {0}
        assert set(draws[:, 3].tolist()) <= {0, 2}


def test_tiny_temperature_generates_the_greedy_text(model_dirs):
    from speclm.api import LLM

    llm = LLM(str(model_dirs["target"]), "ngram", 4, dtype="float64")
    greedy = llm.generate("the quick brown fox", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    for t in (1e-40, 1e-300):
        out = llm.generate("the quick brown fox", SamplingParams(temperature=t, max_tokens=12,
                                                                 ignore_eos=True, seed=3))[0]
        assert out.token_ids == greedy.token_ids and out.text


def test_argmax_last_gives_torchs_indices_ties_nans_and_views_included():
    from speclm.sampling import argmax_last

    gen = torch.Generator().manual_seed(0)
    cases = [
        torch.randn(49152, generator=gen),
        torch.randn(8, 49152, generator=gen),
        torch.randn(2, 3, 17, generator=gen, dtype=torch.float64),
        torch.randn(6, 40, generator=gen)[:, ::3],  # a strided view
        torch.tensor([[1.0, 3.0, 3.0, float("nan"), float("nan")],  # the first NaN wins
                      [float("-inf")] * 5,  # all -inf: index 0
                      [2.0, 2.0, 1.0, 0.0, 2.0],  # ties: the first
                      [float("inf"), 1.0, float("inf"), 0.0, -1.0]]),
        torch.randn(3, 11, generator=gen).to(torch.bfloat16),  # not numpy's: torch's own argmax
    ]
    for x in cases:
        got = argmax_last(x)
        assert got.dtype == torch.long and torch.equal(got, x.argmax(-1))
