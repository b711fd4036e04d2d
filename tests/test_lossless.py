"""End-to-end losslessness of every drafter on tiny float64 models.

- greedy: speculative output == plain greedy output, token for token, over many prompts and K,
  for every drafter (prompt lookup, draft models, layer skipping, early exit, token recycling,
  suffix matching, automatic choice);
- seeded sampling: speculative output == plain seeded output, token for token, for every
  drafter, K and draft-length mode (the verifier's keyed draws);
- a draft model equal to the target accepts every token (tau == K + 1);
- sampling: the distribution of short generated sequences matches the target's exact one
  (chi-square against the enumerated distribution), for drafters that produce q (draft models,
  layer skipping) and deterministic ones (prompt lookup, recycling, suffix matching, auto),
  unseeded; seeded, each drafter's requests equal plain seeded decoding's on the same adversarial
  setup, whose own distribution is tested once.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter, NgramDrafter
from speclm.drafters.tree_search import TreeShape
from speclm.drafters.auto import AutoDrafter
from speclm.drafters.layer_skip import LayerSkipDrafter, early_exit_drafter
from speclm.drafters.recycle import RecycleDrafter
from speclm.drafters.suffix import SuffixDrafter
from speclm.engine import generate_tokens
from speclm.sampling import SamplingParams, warp_probs
from speclm.stats import RequestStats

from .conftest import backend, noisy_copy, tiny_model

VOCAB = 96
SEEDED_REQUESTS = 300  # per drafter in the sampling test: each must equal plain seeded decoding


@pytest.fixture(scope="module")
def target():
    return tiny_model(VOCAB, seed=10, seed_layers=4)


def run(lm, prompt, params, drafter=None, config=None, gen=None, cost_model=None):
    stats = RequestStats()
    tokens = []
    for step in generate_tokens(lm, prompt, params, drafter=drafter, draft_length=config,
                                stats=stats, generator=gen, cost_model=cost_model):
        tokens += step.tokens
    return tokens, stats


def prompts(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(1, VOCAB, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen)
        out.append(base.repeat(1 + i % 3))  # repeats give prompt lookup something to find
    return out


def drafters(target_model, lm):
    """Every drafter kind, with settings that give partial acceptance. Layer skipping runs on
    ``lm`` itself (the target's own cache); learners (recycling, suffix) are made once and keep
    learning over the requests of a test, as they do in a session."""
    draft_lm = backend(noisy_copy(target_model, 0.08, seed=3))
    unrelated = backend(tiny_model(VOCAB, seed=11))
    recycle, suffix = RecycleDrafter(VOCAB, 4), SuffixDrafter(capacity=256)
    # no "none" candidate: auto's choice is timing-based, and on a slow machine it may rightly pick
    # plain decoding, which would leave nothing accepted to check (choosing "none" is in test_auto)
    auto = AutoDrafter({"ngram": (NgramDrafter(1, 3), 6),
                        "recycle": (RecycleDrafter(VOCAB, 4), 4),
                        "layerskip": (LayerSkipDrafter(lm, [2]), 3)}, probe_rounds=2, reprobe_every=12)
    return {
        "ngram[1..3]": lambda: NgramDrafter(1, 3),
        "ngram[2..4]": lambda: NgramDrafter(2, 4),
        "draft-model": lambda: DraftModelDrafter(draft_lm, VOCAB),
        "draft-model-p_min": lambda: DraftModelDrafter(draft_lm, VOCAB, p_min=0.3),
        "unrelated-draft": lambda: DraftModelDrafter(unrelated, VOCAB),
        "draft-model-tree": lambda: DraftModelDrafter(draft_lm, VOCAB, tree=TreeShape(top_k=3, budget=10)),
        "unrelated-tree": lambda: DraftModelDrafter(unrelated, VOCAB, tree=TreeShape(top_k=2, budget=5)),
        "layerskip": lambda: LayerSkipDrafter(lm, [1, 2]),
        "layerskip-p_min": lambda: LayerSkipDrafter(lm, [2], p_min=0.3),
        "early-exit": lambda: early_exit_drafter(lm, 2),
        "skip-first-layer": lambda: LayerSkipDrafter(lm, [0]),
        "recycle": lambda: recycle,
        "suffix": lambda: suffix,
        "auto": lambda: auto,
    }


DRAFTERS = ["ngram[1..3]", "ngram[2..4]", "draft-model", "draft-model-p_min", "unrelated-draft",
            "layerskip", "layerskip-p_min", "early-exit", "skip-first-layer", "recycle", "suffix", "auto",
            "draft-model-tree", "unrelated-tree"]


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identity(target, name, k):
    lm = backend(target)
    make = drafters(target, lm)[name]
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    total_accepted = 0
    for i, prompt in enumerate(prompts(12, seed=k)):
        plain, _ = run(lm, prompt, greedy)
        config = DraftLengthConfig(draft_max=k, draft_min=min(i % 4, k), adaptive=i % 3 == 0)
        spec, stats = run(lm, prompt, greedy, make(), config)
        assert spec == plain, f"prompt {i}: speculative output diverged from plain greedy"
        assert stats.generated_tokens == len(plain) == 40
        total_accepted += stats.accepted_tokens
    if name not in ("unrelated-draft", "unrelated-tree", "skip-first-layer"):
        assert total_accepted > 0  # the comparison exercised accept paths, not only rejections


@pytest.mark.parametrize("name", DRAFTERS)
def test_seeded_sampling_identity(target, name):
    """A seed gives the same tokens with any drafter, any K, fixed or adaptive, as plain seeded
    decoding: the target's keyed draw at each position decides it, a draft only how many
    positions one forward settles."""
    lm = backend(target)
    make = drafters(target, lm)[name]
    total_accepted = 0
    for i, prompt in enumerate(prompts(8, seed=21)):
        params = SamplingParams(temperature=(0.2, 0.5)[i % 2], top_p=(1.0, 0.9)[i % 2 if i % 4 else 0],
                                top_k=(0, 20)[i % 3 == 1], seed=300 + i, max_tokens=48, ignore_eos=True)
        plain, _ = run(lm, prompt, params)
        config = DraftLengthConfig(draft_max=1 + i % 6, adaptive=i % 3 == 0)
        spec, stats = run(lm, prompt, params, make(), config)
        assert spec == plain, f"prompt {i}: seeded speculative output diverged from plain seeded decoding"
        total_accepted += stats.accepted_tokens
    if name not in ("unrelated-draft", "unrelated-tree", "skip-first-layer"):
        assert total_accepted > 0  # the comparison exercised accept paths, not only rejections


# top_k=1: a one-branch tree, which still runs the tree mask, verifier and compaction paths
@pytest.mark.parametrize("tree", [None, TreeShape(top_k=1, budget=64)], ids=["chain", "tree"])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_draft_equal_to_target_accepts_everything(target, k, tree):
    lm = backend(target)
    drafter = DraftModelDrafter(lm.fork(), VOCAB, tree=tree)
    for params in (SamplingParams(max_tokens=(k + 1) * 5, ignore_eos=True),
                   SamplingParams(temperature=0.9, top_p=0.9, max_tokens=(k + 1) * 5,
                                  ignore_eos=True, seed=1)):
        if tree is not None and not params.greedy:
            continue  # a sampled token need not be one of the top-k children: only greedy is sure
        _, stats = run(lm, prompts(1)[0], params, drafter, DraftLengthConfig(draft_max=k))
        assert stats.tau == k + 1
        assert stats.acceptance_by_position == [1.0] * k
        if tree is None:
            assert stats.alpha == 1.0


def exact_sequence_distribution(model, prompt, length, params):
    """P(x_1..x_length | prompt) for every sequence, by enumeration: [V ** length]."""
    lm = backend(model)
    vocab = model.config.vocab_size
    probs = torch.zeros([vocab] * length, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=length):
        ids = torch.cat([prompt, torch.tensor(seq[:-1], dtype=torch.long)])
        lm.reset()
        logits = lm.forward(ids, 0, num_logits=length).logits  # [length, V]
        p = warp_probs(logits, params)
        probs[seq] = torch.prod(p[torch.arange(length), torch.tensor(seq)])
    return probs.flatten()


def sampling_setup(vocab: int = 5, length: int = 3):
    """A tiny target, temperature/top-k params for ``length`` tokens, a prompt that repeats
    the model's own greedy continuation (so prompt lookup drafts tokens the target likes, and
    is sometimes wrong about), and the exact distribution of the ``length`` generated tokens."""
    target_model = tiny_model(vocab, seed=20)
    lm = backend(target_model)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=length, ignore_eos=True)
    seed_ids = torch.tensor([1, 2])
    greedy, _ = run(lm, seed_ids, SamplingParams(max_tokens=5, ignore_eos=True))
    prompt = torch.cat([seed_ids, torch.tensor(greedy), seed_ids])
    return target_model, lm, params, prompt, exact_sequence_distribution(target_model, prompt, length, params)


def assert_matches_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square of observed sequence counts against the exact distribution."""
    total = counts.sum()
    assert counts[expected == 0].sum() == 0
    keep = expected * total >= 5  # pool rare cells, the usual chi-square validity condition
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().view(1)]) * total
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("kind", ["draft-model", "draft-model-p_min", "ngram", "layerskip",
                                  "recycle", "suffix", "auto", "draft-model-tree"])
def test_sampling_matches_target_distribution(kind):
    """Three tokens per request with K = 2, so one round can accept both drafts plus a bonus:
    1,500 unseeded requests (rejection sampling) match the exact distribution by chi-square;
    then 300 seeded ones (keyed draws, request i has seed i) each give plain seeded decoding's
    tokens, so they follow plain seeded decoding's distribution, which
    test_seeded_plain_sampling_matches_target_distribution checks. Learners (recycling, suffix,
    auto) keep their state from request to request: each draft is a function of what came
    before, which is all losslessness asks."""
    vocab, length, n = 5, 3, 1500
    target_model, lm, params, prompt, expected = sampling_setup(vocab, length)
    config = DraftLengthConfig(draft_max=2)
    if kind.startswith("draft-model"):  # a sharp, biased draft: adversarial q
        draft_model = noisy_copy(target_model, 0.1, seed=21)
        with torch.no_grad():
            draft_model.lm_head.weight.mul_(2.0)
        # with p_min the draft's length depends on its own draws; draft_min must not then
        # drop short drafts (that would bias which tokens get verified)
        p_min = 0.6 if kind.endswith("p_min") else 0.0
        tree = TreeShape(top_k=2, budget=5) if kind.endswith("tree") else None
        drafter = DraftModelDrafter(backend(draft_model), vocab, p_min=p_min, tree=tree)
        config = DraftLengthConfig(draft_max=2, draft_min=2 if p_min else 0)
    elif kind == "layerskip":  # layer 0, the norm and the LM head: q from a shallower model
        drafter = LayerSkipDrafter(lm, [1])
    elif kind == "recycle":
        drafter = RecycleDrafter(vocab, 2)
    elif kind == "suffix":
        drafter = SuffixDrafter(capacity=64, factor=0)
    elif kind == "auto":
        # no plain-decoding candidate: on a tiny model it wins on time and nothing is drafted
        drafter = AutoDrafter({"ngram": (NgramDrafter(1, 2), 2),
                               "recycle": (RecycleDrafter(vocab, 2), 2),
                               "layerskip": (LayerSkipDrafter(lm, [1]), 2)}, probe_rounds=2, reprobe_every=8)
    else:
        drafter = NgramDrafter(1, 2)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    accepted = 0
    for _ in range(n):
        seq, stats = run(lm, prompt, params, drafter, config, gen)
        counts[(torch.tensor(seq) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
        accepted += stats.accepted_tokens
    assert accepted > n // 10  # speculation really happened
    assert_matches_distribution(counts, expected)
    accepted = 0
    for i in range(SEEDED_REQUESTS):
        request = replace(params, seed=i)
        seq, stats = run(lm, prompt, request, drafter, config)
        assert seq == run(lm, prompt, request)[0], f"seed {i}"
        accepted += stats.accepted_tokens
    assert accepted > SEEDED_REQUESTS // 10


def test_seeded_plain_sampling_matches_target_distribution():
    """Plain seeded decoding over seeds 0..1,499 follows the exact distribution: with the seeded
    identity of every drafter above, so does seeded speculation."""
    vocab, length, n = 5, 3, 1500
    _, lm, params, prompt, expected = sampling_setup(vocab, length)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    for i in range(n):
        seq, _ = run(lm, prompt, replace(params, seed=i))
        counts[(torch.tensor(seq) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
    assert_matches_distribution(counts, expected)


def test_sliding_window_model_rolls_back_past_the_window():
    """Mistral-style sliding-window attention: caches must roll back after the window fills."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(5)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=8, max_position_embeddings=256, initializer_range=0.3)
    model = MistralForCausalLM(config).to(torch.float64).eval()
    lm = backend(model)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in prompts(4, seed=9):
        plain, _ = run(lm, prompt, greedy)
        for drafter in (NgramDrafter(1, 3), DraftModelDrafter(backend(noisy_copy(model, 0.05, 4)), VOCAB)):
            spec, stats = run(lm, prompt, greedy, drafter, DraftLengthConfig(draft_max=4))
            assert spec == plain


def test_drafter_reused_across_requests_with_no_draft_rounds(target):
    """A request whose rounds never call propose (budget 0) must not trip the draft's cache."""
    lm = backend(target)
    drafter = DraftModelDrafter(backend(noisy_copy(target, 0.08, seed=3)), VOCAB)
    config = DraftLengthConfig(draft_max=4)
    first, second = prompts(2, seed=4)
    run(lm, first, SamplingParams(max_tokens=20, ignore_eos=True), drafter, config)
    one, stats = run(lm, second, SamplingParams(max_tokens=1, ignore_eos=True), drafter, config)
    assert stats.drafted_tokens == 0 and len(one) == 1
    plain, _ = run(lm, first, SamplingParams(max_tokens=20, ignore_eos=True))
    again, _ = run(lm, first, SamplingParams(max_tokens=20, ignore_eos=True), drafter, config)
    assert again == plain
