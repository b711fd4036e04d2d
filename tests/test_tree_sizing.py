"""Dynamic trees cut to the size that pays for the target's measured verify cost.

- the sizer's choice is the rate-maximising count (worked by hand), the whole budget when a
  verify is free, at least one node however weak the drafter, and fewer once the target
  accepts less than the drafter's confidence predicts;
- a sized tree is the most confident part of the full tree (still a tree);
- growth stops at the level where no child could enter the budget (the same tree, fewer drafter
  forwards), and where a drafter forward costs more than its level could return;
- the engine hands the live verify cost to adaptive rows, seeded ones included: a seeded
  request's tokens are plain seeded decoding's whatever size its trees take;
- sized trees stay lossless: greedy identity, and the exact distribution when sampling.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from speclm.cost_model import CostModel
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter
from speclm.drafters.tree_search import TreeShape, TreeSizer, grow_tree
from speclm.engine import generate_tokens
from speclm.sampling import SamplingParams
from speclm.stats import RequestStats
from speclm.tree import TreeMeta

from .conftest import backend, noisy_copy, tiny_model
from .test_lossless import assert_matches_distribution, prompts, sampling_setup

VOCAB = 96
SCORES = torch.tensor([0.9, 0.8, 0.5, 0.2, 0.05, 0.01]).log()  # path confidences, best first


def test_sizer_keeps_the_count_with_the_best_rate():
    sizer = TreeSizer()
    # each node costs half a plain step: rates 1.9/1.5, 2.7/2.0, 3.2/2.5, 3.4/3.0, ...
    assert sizer.keep(SCORES, 6, lambda n: 1.0 + 0.5 * n, 0.0) == 2
    assert sizer.keep(SCORES, 6, lambda n: 1.0, 0.0) == 6  # a free verify: the whole budget
    assert sizer.keep(SCORES, 3, lambda n: 1.0, 0.0) == 3  # never past the budget
    hopeless = torch.full((6,), math.log(1e-4))
    assert sizer.keep(hopeless, 6, lambda n: 1.0 + 0.5 * n, 0.0) == 1  # at least one node
    # time already spent drafting makes a wider verify relatively cheaper
    assert sizer.keep(SCORES, 6, lambda n: 1.0 + 0.5 * n, 10.0) == 4  # 3.4 / 13 beats 2.7 / 12


def test_sizer_calibrates_to_what_the_target_accepts():
    sizer = TreeSizer()

    def cost(n: int) -> float:
        return 1.0 + 0.15 * n

    first = sizer.keep(SCORES, 6, cost, 0.0)
    for _ in range(40):  # the drafter predicts ~2.5 accepted tokens; the target takes none
        sizer.keep(SCORES, 6, cost, 0.0)
        sizer.observe(0)
    assert sizer.calibration < 0.1
    assert sizer.keep(SCORES, 6, cost, 0.0) < first
    sizer.observe(0)
    before = sizer.calibration
    sizer.observe(3)  # a round without a kept tree (a chain, a plain step) changes nothing
    assert sizer.calibration == before


class FixedStepper:
    """Log-probs that depend on the token only: a deterministic drafter for grow_tree."""

    def __init__(self, vocab: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(3 * torch.randn(vocab, vocab, generator=gen), -1)

    def expand(self, tokens: torch.Tensor, fed: TreeMeta) -> torch.Tensor:
        return self.table[tokens]


def _paths(draft) -> set[tuple[int, ...]]:
    parents, tokens = draft.tree.parents.tolist(), draft.tokens.tolist()
    out = []
    for i in range(len(tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        out.append(tuple(reversed(path)))
    return set(out)


def test_a_sized_tree_is_the_most_confident_part_of_the_full_tree():
    stepper = FixedStepper(32, seed=1)
    root = stepper.table[5]
    shape = TreeShape(top_k=3, budget=12)
    full = grow_tree(root, stepper, 4, shape)
    sized = grow_tree(root, stepper, 4, shape, lambda n: 1.0 + 0.4 * n, TreeSizer())
    assert 1 <= sized.num_tokens < full.num_tokens == 12
    assert _paths(sized) <= _paths(full)  # a subset, and every kept node's ancestors are kept
    assert all(p < i for i, p in enumerate(sized.tree.parents.tolist()))
    unsized = grow_tree(root, stepper, 4, shape, None, TreeSizer())  # no cost known: the budget
    assert unsized.num_tokens == 12
    whole = grow_tree(root, stepper, 4, TreeShape(3, 12, fit=False), lambda n: 1.0 + 0.4 * n, TreeSizer())
    assert whole.num_tokens == 12  # fit=0: the whole budget whatever the cost


class GeometricStepper:
    """Every node's children: tokens 0, 1, 2, ... with probabilities 0.5, 0.3, 0.2 (then nothing);
    counts its expansions, and sleeps ``seconds`` in each (a slow drafter forward)."""

    ROW = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0]).log()

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.expansions = seconds, 0

    def expand(self, tokens: torch.Tensor, fed: TreeMeta) -> torch.Tensor:
        self.expansions += 1
        time.sleep(self.seconds)
        return self.ROW.expand(tokens.shape[0], -1)


def test_growth_stops_where_no_child_can_enter_the_budget():
    """Budget 3: after one expansion the kept three are 0.5, 0.3 and 0.25 (token 0 after token 0);
    every deeper node holds at most 0.25 and loses the tie to it: no second expansion."""
    stepper = GeometricStepper()
    draft = grow_tree(GeometricStepper.ROW, stepper, 6, TreeShape(top_k=3, budget=3, fit=False))
    assert stepper.expansions == 1
    assert draft.tokens.tolist() == [0, 1, 0] and draft.tree.parents.tolist() == [-1, -1, 0]
    wide = GeometricStepper()  # a budget deeper levels can enter: grown to the depth asked
    assert grow_tree(GeometricStepper.ROW, wide, 4, TreeShape(top_k=3, budget=30, fit=False)).num_tokens == 30
    assert wide.expansions == 3


def test_worth_expanding_compares_the_frontiers_confidence_with_a_forwards_worth():
    sizer = TreeSizer()
    ranked = torch.tensor([0.5, 0.3]).log()
    assert sizer.worth_expanding(ranked, torch.tensor([0.01]).log(), 4, lambda n: 1.0, 0.0)  # never timed
    sizer.timed_expansion(0.1)
    # best rate: 1.8 tokens / 1 s (both nodes); a forward is worth 0.18 tokens
    assert not sizer.worth_expanding(ranked, torch.tensor([0.1, 0.05]).log(), 4, lambda n: 1.0, 0.0)
    assert sizer.worth_expanding(ranked, torch.tensor([0.2]).log(), 4, lambda n: 1.0, 0.0)
    sizer.timed_expansion(0.2)  # a moving average: 0.11 s
    assert sizer.expand_s == pytest.approx(0.11)


def test_a_drafter_forward_that_cannot_pay_ends_the_growth():
    """A verify of 1 ms and drafter forwards of >= 20 ms: after the first (timed) expansion no
    deeper level can raise the rate (it would add at most 1 token per 20 ms, the tree so far
    gives ~2 per 21 ms); with a verify of seconds every level is grown."""
    slow = GeometricStepper(seconds=0.02)
    sizer = TreeSizer()
    for _ in range(2):
        grow_tree(GeometricStepper.ROW, slow, 6, TreeShape(top_k=3, budget=60), lambda n: 1e-3, sizer)
    assert slow.expansions == 1  # the first round's, not timed yet when it began; then none
    fast = GeometricStepper()
    grow_tree(GeometricStepper.ROW, fast, 4, TreeShape(top_k=3, budget=60), lambda n: 10.0 + n, TreeSizer())
    assert fast.expansions == 3


class Spy(DraftModelDrafter):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.costs: list[bool] = []  # whether each round was handed a verify cost
        self.sizes: list[int] = []

    def propose(self, ctx):
        self.costs.append(ctx.verify_s is not None)
        draft = super().propose(ctx)
        self.sizes.append(draft.num_tokens)
        return draft


# a verify costs ~0.15-0.3 plain steps per drafted token, as eager torch on a CPU
COST = CostModel([1, 2, 3, 4, 6, 8, 12], [1.0, 1.15, 1.3, 1.45, 1.8, 2.2, 3.2])


def _run(lm, prompt, params, drafter, config, gen=None):
    stats, out = RequestStats(), []
    for step in generate_tokens(lm, prompt, params, drafter=drafter, draft_length=config, stats=stats,
                                generator=gen, cost_model=COST):
        out += step.tokens
    return out, stats


def test_greedy_identity_with_sized_trees_and_who_gets_a_cost():
    target = tiny_model(VOCAB, seed=10, seed_layers=4)
    lm = backend(target)
    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    adaptive = DraftLengthConfig(draft_max=4, adaptive=True)
    sizes, accepted = [], 0
    for prompt in prompts(6, seed=2):
        plain, _ = _run(lm, prompt, greedy, None, None)
        spy = Spy(draft_lm, VOCAB, tree=TreeShape(top_k=3, budget=10))
        spec, stats = _run(lm, prompt, greedy, spy, adaptive)
        assert spec == plain
        assert spy.costs and all(spy.costs)
        sizes += spy.sizes
        accepted += stats.accepted_tokens
    assert accepted > 0 and len(set(sizes)) > 1 and max(sizes) <= 10

    fixed = Spy(draft_lm, VOCAB, tree=TreeShape(top_k=3, budget=10))  # --no-adaptive: the budget
    _run(lm, prompts(1)[0], greedy, fixed, DraftLengthConfig(draft_max=4))
    assert fixed.costs and not any(fixed.costs)
    seeded = Spy(draft_lm, VOCAB, tree=TreeShape(top_k=3, budget=10))  # a seed: timed like the rest
    _run(lm, prompts(1)[0], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True),
         seeded, adaptive)
    assert seeded.costs and all(seeded.costs)


def test_a_seeded_request_gets_plain_decodings_tokens_whatever_its_trees():
    """A seed fixes a sampled request's tokens, whatever its trees: sized from live timings,
    after the drafter's calibration has moved, cut to the budget or with no cost at all, the
    tokens are plain seeded decoding's."""
    target = tiny_model(VOCAB, seed=10, seed_layers=4)
    lm = backend(target)
    draft_lm = backend(noisy_copy(target, 0.02, seed=3))  # close enough to accept at T = 0.6
    seeded = SamplingParams(temperature=0.6, seed=5, max_tokens=32, ignore_eos=True)
    adaptive = DraftLengthConfig(draft_max=4, adaptive=True)
    accepted, sizes = 0, []
    for prompt in prompts(3, seed=4):
        plain, _ = _run(lm, prompt, seeded, None, None)
        drafter = Spy(draft_lm, VOCAB, tree=TreeShape(top_k=3, budget=10))
        first, stats = _run(lm, prompt, seeded, drafter, adaptive)
        accepted, sizes = accepted + stats.accepted_tokens, sizes + drafter.sizes
        drafter.sizer.calibration = 0.05  # as after many rounds of a poor drafter: smaller trees
        again, _ = _run(lm, prompt, seeded, drafter, adaptive)
        fixed, _ = _run(lm, prompt, seeded, Spy(draft_lm, VOCAB, tree=TreeShape(top_k=3, budget=10)),
                        DraftLengthConfig(draft_max=4))
        assert first == again == fixed == plain
    assert accepted > 0 and min(sizes) < 10


def test_sampling_with_sized_trees_matches_target_distribution():
    vocab, length, n = 5, 3, 1000
    target_model, lm, params, prompt, expected = sampling_setup(vocab, length)
    draft_model = noisy_copy(target_model, 0.1, seed=21)
    with torch.no_grad():
        draft_model.lm_head.weight.mul_(2.0)  # a sharp, biased draft
    drafter = Spy(backend(draft_model), vocab, tree=TreeShape(top_k=2, budget=5))
    config = DraftLengthConfig(draft_max=2, adaptive=True)
    gen = torch.Generator().manual_seed(99)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    for _ in range(n):
        seq, _ = _run(lm, prompt, params, drafter, config, gen)
        counts[(torch.tensor(seq) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
    assert any(drafter.costs) and len(set(drafter.sizes) - {0}) > 1  # trees of several sizes
    assert_matches_distribution(counts, expected)


@pytest.mark.parametrize("budget", [1, 4])
def test_sizer_respects_small_budgets(budget):
    assert TreeSizer().keep(SCORES, budget, lambda n: 1.0, 0.0) == budget
