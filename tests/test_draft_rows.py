"""DraftRows' slots and refusals (its drafts are checked against a one-row draft model in
tests/test_engine.py)."""

from __future__ import annotations

import pytest
import torch

from speclm.drafters.base import DraftContext
from speclm.drafters.draft_rows import DraftRows
from speclm.errors import SpeclmError
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model

VOCAB = 64


@pytest.fixture(scope="module")
def draft():
    return backend(tiny_model(VOCAB, seed=4))


def ctx(tokens, k=3):
    return DraftContext(torch.tensor(tokens), k, SamplingParams(), torch.Generator())


def test_members_take_free_slots_and_give_them_back(draft):
    group = DraftRows(draft, VOCAB, 2)
    a, b, c = group.member(), group.member(), group.member()
    a.reset(torch.tensor([1, 2, 3]))
    b.reset(torch.tensor([4, 5]))
    with pytest.raises(SpeclmError, match="all 2 draft rows are in use"):
        c.reset(torch.tensor([6]))
    a.finish()
    c.reset(torch.tensor([6, 7]))
    assert {b.slot, c.slot} == {0, 1} and a.slot is None
    drafts = group.propose_rows([c, b], [ctx([6, 7]), ctx([4, 5])])  # c moves to slot 0
    assert (c.slot, b.slot) == (0, 1) and [d.num_tokens for d in drafts] == [3, 3]
    del c  # a member dropped without finish(): its slot is free again
    a.reset(torch.tensor([1]))
    assert a.slot == 0
    assert group.rows.cache._keys[0] is not None
    a.finish()
    b.finish()
    assert group.rows.cache._keys[0] is None  # no request left: the cache's memory is given back


def test_refusals(draft):
    group = DraftRows(draft, VOCAB, 2)
    m = group.member()
    with pytest.raises(SpeclmError, match="reset"):
        m.propose(ctx([1, 2]))
    m.reset(torch.tensor([1, 2]))
    with pytest.raises(SpeclmError, match="distinct"):
        group.propose_rows([m, m], [ctx([1, 2]), ctx([1, 2])])
    with pytest.raises(SpeclmError, match="p_min"):
        DraftRows(draft, VOCAB, 2, p_min=1.0)


def test_a_catch_up_on_missed_rounds_is_reported_apart(draft):
    """Rows in step feed at most their last accepted token before the pending one: nothing to
    report. A row that was not prefilled, or sat out rounds, feeds what it missed first: the
    group reports the tokens and the seconds, which the engine keeps out of drafting's cost
    per token."""
    group = DraftRows(draft, VOCAB, 2)
    fresh, steady = group.member(), group.member()
    fresh.reset(torch.tensor([1, 2, 3, 4, 5]))  # its prompt never fed: it catches up when asked
    steady.reset(torch.tensor([6, 7, 8]))
    steady.on_prefill(torch.tensor([6, 7]))
    group.propose_rows([steady], [ctx([6, 7, 8], k=2)])
    assert (group.catch_up_s, group.caught_up) == (0.0, 0)
    steady.on_verified(0, [9])  # nothing accepted, 9 recovered
    drafted = group.propose_rows([fresh, steady], [ctx([1, 2, 3, 4, 5, 6], k=2), ctx([6, 7, 8, 9], k=2)])
    assert group.caught_up == 5 and group.catch_up_s > 0  # fresh fed 1..5 before its pending 6
    fresh.on_verified(2, [int(t) for t in drafted[0].tokens] + [9])  # all accepted, plus the bonus
    group.propose_rows([fresh], [ctx([1, 2, 3, 4, 5, 6, *drafted[0].tokens.tolist(), 9], k=2)])
    assert (group.catch_up_s, group.caught_up) == (0.0, 0)  # in step: the last draft token only


def test_a_row_past_the_drafts_context_drafts_nothing(draft):
    group = DraftRows(draft, VOCAB, 2)
    near, far = group.member(), group.member()
    group.max_context = 6  # positions up to total + K - 2 must fit
    near.reset(torch.tensor([1, 2]))
    far.reset(torch.tensor([1, 2, 3, 4, 5]))
    drafts = group.propose_rows([near, far], [ctx([1, 2], k=4), ctx([1, 2, 3, 4, 5, 6, 7], k=4)])
    assert drafts[0].num_tokens == 4 and drafts[1].num_tokens == 0


def test_compiled_draft_rows_draft_what_one_row_drafts():
    """A draft on the compiled path drafts its rows in one compiled forward per depth: the
    one-token graph of every rows bucket is compiled when the group is built (none inside a
    request), a row the engine did not prefill catches up eagerly, and every row drafts what a
    one-row compiled draft drafts for the same tokens."""
    from speclm.drafters import DraftModelDrafter
    from speclm.models.compiled import make_compiled

    fast = make_compiled(tiny_model(VOCAB, seed=4), frozenset({0}), buckets=(1, 4), capacities=(64, 128),
                         compile_backend="aot_eager")
    group = DraftRows(fast, VOCAB, 3)
    seen = set(group.rows._step.seen)
    assert {(1, 1), (2, 1), (3, 1)} <= seen
    gen = torch.Generator().manual_seed(5)
    texts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (9, 30, 14)]
    members = [group.member() for _ in texts]
    for m, t in zip(members, texts):
        m.reset(t)
    members[0].on_prefill(texts[0][:-1])  # the others catch up when asked
    contexts = [DraftContext(t, 3, SamplingParams(), torch.Generator()) for t in texts]
    for rows in (members, members[:2]):  # three rows, then two (the row bucket of 2)
        drafts = group.propose_rows(rows, contexts[: len(rows)])
        for t, c, d in zip(texts, contexts, drafts):
            one = DraftModelDrafter(fast.fork(), VOCAB)
            one.reset(t)
            assert d.num_tokens == 3 and d.tokens.tolist() == one.propose(c).tokens.tolist()
        for m in rows:
            m.on_verified(1, [])  # keep one drafted token, as if one was accepted
        texts = [torch.cat([t, d.tokens[:1], torch.tensor([7])]) for t, d in zip(texts, drafts)] + texts[len(rows):]
        contexts = [DraftContext(t, 3, SamplingParams(), torch.Generator()) for t in texts]
    assert {key for key in group.rows._step.seen if len(key) == 2} == seen  # (the one-row draft's are (tokens,))
