"""Token recycling and suffix matching: their tables and indexes, their bounds, and the engine's
top-k feedback (sent only to drafters that ask for it)."""

from __future__ import annotations

import pytest
import torch

from speclm import SpeclmError
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftContext, NgramDrafter
from speclm.drafters.recycle import UNSEEN, RecycleDrafter, RecycleTable
from speclm.drafters.suffix import SuffixDrafter, SuffixIndex
from speclm.engine import generate_tokens
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model


def ctx(ids, k):
    return DraftContext(torch.tensor(ids), k, SamplingParams(), torch.Generator())


# -- token recycling ---------------------------------------------------------------------------
def test_recycle_table_keeps_the_latest_candidates_and_follows_the_best():
    table = RecycleTable(10, 2)
    assert table.best_chain(3, 4) == [] and table.filled == 0
    table.update(torch.tensor([3, 5]), torch.tensor([[5, 1, 9], [7, 2, 9]]))  # top-3 given, 2 kept
    assert table.children(3).tolist() == [5, 1] and table.children(4).tolist() == [UNSEEN, UNSEEN]
    assert table.best_chain(3, 4) == [5, 7]  # stops where the table knows nothing
    table.update(torch.tensor([7]), torch.tensor([[3, 0]]))
    assert table.best_chain(3, 5) == [5, 7, 3, 5, 7]  # loops are fine: the budget ends them
    table.update(torch.tensor([3]), torch.tensor([[8, 6]]))  # newer evidence replaces older
    assert table.best_chain(3, 1) == [8] and table.filled == 3
    with pytest.raises(SpeclmError, match="topk"):
        RecycleTable(10, 0)


class Spy:
    """Records the engine's calls; asks for ``t`` target candidates per position."""

    def __init__(self, t):
        if t:
            self.wants_target_topk = t
        self.feedback = []

    def reset(self, prompt_ids):
        pass

    def propose(self, ctx):
        return NgramDrafter(1, 2).propose(ctx)

    def on_verified(self, num_accepted, emitted):
        pass

    def on_target_topk(self, fed, topk_ids):
        self.feedback.append((fed.clone(), topk_ids.clone()))


def test_engine_sends_topk_every_round_only_when_asked():
    model = tiny_model(48, seed=7)
    lm = backend(model)
    prompt = torch.tensor([4, 5, 6, 4, 5, 6, 4])
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    quiet = Spy(0)
    plain_out = [t for s in generate_tokens(lm, prompt, params) for t in s.tokens]
    out = [t for s in generate_tokens(lm, prompt, params, drafter=quiet,
                                      draft_length=DraftLengthConfig(3)) for t in s.tokens]
    assert out == plain_out and quiet.feedback == []
    spy = Spy(3)
    rounds = list(generate_tokens(lm, prompt, params, drafter=spy, draft_length=DraftLengthConfig(3)))
    assert len(spy.feedback) == len(rounds)
    committed = prompt.tolist()
    for (fed, topk), step in zip(spy.feedback, rounds):
        assert topk.shape == (fed.shape[0], 3) and fed[0] == committed[-1]  # the pending token first
        lm.reset()
        logits = lm.forward(torch.cat([torch.tensor(committed[:-1]), fed]), 0, num_logits=fed.shape[0]).logits
        assert torch.equal(topk, logits.topk(3, dim=-1).indices)  # the target's own candidates
        committed += step.tokens


def test_recycle_learns_from_the_target_and_drafts_its_table():
    from speclm.stats import RequestStats

    model = tiny_model(48, seed=7)
    lm = backend(model)
    drafter = RecycleDrafter(48, 4)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = torch.tensor([4, 5, 6])
    plain = [t for s in generate_tokens(lm, prompt, params) for t in s.tokens]
    stats = RequestStats()
    for _ in range(2):  # the table is kept from request to request
        out = [t for s in generate_tokens(lm, prompt, params, drafter=drafter, stats=stats,
                                          draft_length=DraftLengthConfig(4)) for t in s.tokens]
        assert out == plain
    assert stats.accepted_tokens > 0 and "table holds" in stats.drafter_report["summary"]
    last = plain[-1]
    assert drafter.propose(ctx(prompt.tolist() + plain, 3)).tokens.tolist() == drafter.table.best_chain(last, 3)


# -- suffix matching ---------------------------------------------------------------------------
def test_suffix_index_finds_the_longest_match_and_stops_at_boundaries():
    index = SuffixIndex(capacity=64, anchors=(2,), max_candidates=8)
    index.start_sequence()
    index.extend([1, 2, 3, 4, 5, 6])
    index.start_sequence()
    index.extend([9, 3, 4, 7, 8])
    p, length = index.longest_match([0, 9, 3, 4])  # [9, 3, 4] matches 3 tokens, [2, 3, 4] two
    assert length == 3 and index.continuation(p, 5) == [7, 8]
    p, length = index.longest_match([2, 3, 4])
    assert length == 3 and index.continuation(p, 3) == [5, 6]  # ends at the sequence boundary
    p, length = index.longest_match([0, 3, 4])  # two candidates of length 2: the newest wins
    assert length == 2 and index.continuation(p, 1) == [7]
    assert index.longest_match([7, 8]) == (-1, 0)  # the end has no continuation yet
    assert index.longest_match([5, 5]) == (-1, 0)


def test_suffix_index_memory_is_bounded():
    index = SuffixIndex(capacity=32, anchors=(2, 4))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        index.start_sequence()
        index.extend(torch.randint(0, 6, (25,), generator=gen).tolist())
    assert index.end - index.oldest == 32
    assert len(index.tokens) == 32 and all(len(prev) == 32 for prev in index.prev.values())
    for heads in index.head.values():
        assert len(heads) <= 32 and all(p >= index.oldest for p in heads.values())
    # every match it reports is real and inside the ring
    for q in range(index.oldest + 4, index.end):
        context = [index._at(i) for i in range(q - 3, q + 1)]
        p, length = index.longest_match(context)
        if length:
            assert p >= index.oldest and [index._at(i) for i in range(p - length + 1, p + 1)] == context[-length:]


def test_suffix_drafter_drafts_across_requests_with_its_cap():
    drafter = SuffixDrafter(capacity=1024, factor=1.0)
    drafter.reset(torch.tensor([1, 2, 3]))
    drafter.on_verified(0, [10, 11, 12, 13, 14, 15])  # request 1's output
    drafter.reset(torch.tensor([7, 12, 13]))  # request 2 ends the way request 1 went on
    draft = drafter.propose(ctx([7, 12, 13], 10)).tokens.tolist()
    assert draft == [14, 15]  # a 2-token match earns factor x 2 tokens
    uncapped = SuffixDrafter(capacity=1024, factor=0)
    uncapped.reset(torch.tensor([1, 2, 3, 4, 5, 6, 7]))
    uncapped.reset(torch.tensor([2, 3]))
    assert uncapped.propose(ctx([2, 3], 3)).tokens.tolist() == [4, 5, 6]
    # rounds it did not draft (propose not called) are caught up from the context
    assert uncapped.propose(ctx([2, 3, 4, 5, 9, 2, 3], 2)).tokens.tolist() == [4, 5]
    assert uncapped.report()["hits"] == 2


def test_suffix_observe_indexes_rounds_it_sat_out():
    drafter = SuffixDrafter(capacity=256, factor=0)
    drafter.reset(torch.tensor([1, 2]))
    drafter.observe(torch.tensor([1, 2, 30, 31, 32]))
    drafter.reset(torch.tensor([5, 30]))
    assert drafter.propose(ctx([5, 30, 31], 4)).tokens.tolist() == [32]


def test_bad_suffix_settings():
    with pytest.raises(SpeclmError, match="capacity"):
        SuffixDrafter(capacity=4)
    with pytest.raises(SpeclmError, match="factor"):
        SuffixDrafter(factor=-1)
