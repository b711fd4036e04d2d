"""Speculative speculative decoding: lossless, threads that start, stop and fail cleanly, and the
outcome cache doing its job."""

from __future__ import annotations

import threading

import pytest
import torch
from scipy.stats import chisquare

from speclm.draft_length import DraftLengthConfig
from speclm.drafters.ssd import AsyncDraftModelDrafter
from speclm.engine import generate_tokens
from speclm.sampling import SamplingParams, warp_probs
from speclm.stats import RequestStats

from .conftest import backend, noisy_copy, tiny_model

V = 96


@pytest.fixture(scope="module")
def target():
    return tiny_model(V, seed=10)


def run(lm, prompt, params, drafter=None, config=None, gen=None):
    stats, tokens = RequestStats(), []
    for step in generate_tokens(lm, prompt, params, drafter=drafter,
                                draft_length=config or DraftLengthConfig(4), stats=stats, generator=gen):
        tokens += step.tokens
    return tokens, stats


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("speclm-ssd")]


@pytest.mark.parametrize("fanout", [1, 4, 16])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identity(target, fanout, k):
    lm = backend(target)
    drafter = AsyncDraftModelDrafter(backend(noisy_copy(target, 0.05, seed=3)), V, fanout=fanout)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    hits = 0
    for i in range(8):
        prompt = torch.randint(1, V, (3 + i,), generator=torch.Generator().manual_seed(i))
        plain, _ = run(lm, prompt, greedy)
        # adaptive K and draft_min make some rounds skip drafting: the outcome cache goes stale
        config = DraftLengthConfig(draft_max=k, draft_min=min(i % 3, k), adaptive=i % 2 == 1)
        spec, stats = run(lm, prompt, greedy, drafter, config)
        assert spec == plain, f"prompt {i} diverged"
        hits += stats.drafter_report["hits"]
        assert not _workers()  # no worker outlives its request
    assert hits > 0


@pytest.mark.parametrize("fanout", [1, 4])
def test_seeded_sampling_identity(target, fanout):
    """Seeded sampling with asynchronous drafting: plain seeded decoding's tokens, whatever the
    worker guessed about each verdict."""
    lm = backend(target)
    drafter = AsyncDraftModelDrafter(backend(noisy_copy(target, 0.05, seed=3)), V, fanout=fanout)
    accepted = 0
    for i in range(6):
        params = SamplingParams(temperature=0.6, seed=70 + i, max_tokens=40, ignore_eos=True)
        prompt = torch.randint(1, V, (3 + i,), generator=torch.Generator().manual_seed(i))
        plain, _ = run(lm, prompt, params)
        spec, stats = run(lm, prompt, params, drafter, DraftLengthConfig(draft_max=3, adaptive=i % 2 == 1))
        assert spec == plain, f"prompt {i} diverged"
        accepted += stats.accepted_tokens
        assert not _workers()
    assert accepted > 0


def test_draft_equal_to_target_accepts_everything_and_predicts_the_bonus(target):
    lm = backend(target)
    drafter = AsyncDraftModelDrafter(lm.fork(), V, fanout=2, alpha_prior=0.99)  # bonus outcomes first
    _, stats = run(lm, torch.tensor([5, 6, 7]), SamplingParams(max_tokens=25, ignore_eos=True),
                   drafter, DraftLengthConfig(4))
    assert stats.alpha == 1.0 and stats.tau == 5
    report = stats.drafter_report
    assert report["hits"] == report["rounds"] == 5  # every outcome is (K, the draft's top bonus)


def test_sampling_matches_target_distribution():
    from itertools import product

    vocab, length, n = 5, 3, 1500
    model = tiny_model(vocab, seed=20)
    lm = backend(model)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=length, ignore_eos=True)
    prompt = torch.tensor([1, 2, 3])
    expected = torch.zeros([vocab] * length, dtype=torch.float64)
    for seq in product(range(vocab), repeat=length):
        logits = backend(model).forward(torch.cat([prompt, torch.tensor(seq[:-1])]), 0, num_logits=length).logits
        expected[seq] = torch.prod(warp_probs(logits, params)[torch.arange(length), torch.tensor(seq)])
    expected = expected.flatten()
    draft_model = noisy_copy(model, 0.1, seed=21)
    drafter = AsyncDraftModelDrafter(backend(draft_model), vocab, fanout=6)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    hits = 0
    for _ in range(n):
        seq, stats = run(lm, prompt, params, drafter, DraftLengthConfig(1), gen)  # K=1: several rounds
        counts[(torch.tensor(seq) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
        hits += stats.drafter_report["hits"]
    assert hits > n // 4  # sampled branch drafts were really used
    assert counts[expected == 0].sum() == 0
    keep = expected * n >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().view(1)]) * n
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3


def test_worker_errors_surface_and_threads_stop(target, monkeypatch):
    lm = backend(target)
    drafter = AsyncDraftModelDrafter(backend(noisy_copy(target, 0.05, seed=3)), V)

    def boom(*args, **kwargs):
        raise RuntimeError("draft worker failed")

    monkeypatch.setattr(drafter, "_speculate_here", boom)
    with pytest.raises(RuntimeError, match="draft worker failed"):
        run(lm, torch.tensor([1, 2, 3]), SamplingParams(max_tokens=20, ignore_eos=True), drafter)
    assert not _workers()


def test_cpu_threads_are_split_for_the_request_and_restored(target):
    """Target and worker share the cores (no oversubscription); the caller's budget comes back."""
    lm = backend(target)
    drafter = AsyncDraftModelDrafter(backend(noisy_copy(target, 0.05, seed=3)), V, threads=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        steps = generate_tokens(lm, torch.tensor([1, 2, 3]), SamplingParams(max_tokens=30, ignore_eos=True),
                                drafter=drafter, draft_length=DraftLengthConfig(4))
        next(steps)
        assert torch.get_num_threads() == 2  # 3 - the worker's 1, while the request runs
        list(steps)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_closing_the_stream_early_stops_the_worker(target):
    lm = backend(target)
    drafter = AsyncDraftModelDrafter(backend(noisy_copy(target, 0.05, seed=3)), V)
    steps = generate_tokens(lm, torch.tensor([1, 2, 3]), SamplingParams(max_tokens=50, ignore_eos=True),
                            drafter=drafter, draft_length=DraftLengthConfig(4))
    next(steps)
    assert _workers()  # speculating for the next round right now, or idle in its pool
    steps.close()
    assert not _workers()


def test_api_and_cli(model_dirs, capsys):
    from speclm import LLM
    from speclm.cli import main

    llm = LLM(str(model_dirs["target"]), str(model_dirs["draft"]), 3, dtype="float64", async_draft=True,
              async_fanout=4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = llm.generate("the quick brown fox", params)[0]
    assert out.token_ids == llm.generate("the quick brown fox", params, speculative=False)[0].token_ids
    assert "hit rate" in out.stats.drafter_report["summary"]
    code = main(["generate", "x", "--model", str(model_dirs["target"]), "--async", "--ngram"])
    assert code == 2 and "--async needs a draft model" in capsys.readouterr().err
