"""A prompt-lookup branch merged into a tree drafter's tree: the trie merge, whose tokens each
drafter is credited with, the verify cost the wrapped drafter prices, and the registry option.
(Greedy identity, seeded identity and the sampling distribution through the engine:
tests/test_learned.py, ``eagle-tree-lookup``.)"""

from __future__ import annotations

import pytest
import torch

from speclm.drafters.base import Draft, DraftContext
from speclm.drafters.lookup_branch import LookupBranch, merge_chain, shared_path
from speclm.drafters.registry import parse_drafter
from speclm.errors import SpeclmError
from speclm.sampling import SamplingParams
from speclm.tree import TreeMeta

#   pending ─┬─ 5 (n0) ─┬─ 7 (n2)
#            │          └─ 8 (n3)
#            └─ 6 (n1) ─── 9 (n4)
TREE = Draft(torch.tensor([5, 6, 7, 8, 9]), None, TreeMeta.from_parents([-1, -1, 0, 0, 1]))


def tokens_and_parents(draft: Draft) -> tuple[list[int], list[int]]:
    return draft.tokens.tolist(), draft.tree.parents.tolist()


@pytest.mark.parametrize("chain, tokens, parents", [
    ([5, 8, 3, 4], [5, 6, 7, 8, 9, 3, 4], [-1, -1, 0, 0, 1, 3, 5]),  # shares 5, 8; the rest below n3
    ([2, 3], [5, 6, 7, 8, 9, 2, 3], [-1, -1, 0, 0, 1, -1, 5]),  # shares nothing: a new first token
    ([6, 7], [5, 6, 7, 8, 9, 7], [-1, -1, 0, 0, 1, 1]),  # 7 under n1 is not n2 (7 under n0)
])
def test_the_chain_shares_the_nodes_it_agrees_with_and_hangs_the_rest_below(chain, tokens, parents):
    merged = merge_chain(TREE, torch.tensor(chain))
    assert tokens_and_parents(merged) == (tokens, parents)
    assert merged.q_draft is None and merged.depth == max(2, len(chain))


def test_a_chain_the_tree_already_holds_leaves_the_draft_as_it_was():
    assert merge_chain(TREE, torch.tensor([6, 9])) is TREE


def test_two_chains_become_a_two_branch_tree():
    merged = merge_chain(Draft(torch.tensor([1, 2, 3])), torch.tensor([1, 4]))
    assert tokens_and_parents(merged) == ([1, 2, 3, 4], [-1, 0, 1, 0])


def test_shared_path_is_the_deepest_agreeing_node():
    assert shared_path(TREE, torch.tensor([5, 8, 1])) == (2, 3)
    assert shared_path(TREE, torch.tensor([6])) == (1, 1)
    assert shared_path(TREE, torch.tensor([7])) == (0, -1)
    assert shared_path(TREE, torch.tensor([], dtype=torch.long)) == (0, -1)


class Fixed:
    """A drafter that proposes a given draft and records what it is told."""

    def __init__(self, draft: Draft) -> None:
        self.draft, self.asked, self.verified = draft, [], []

    def reset(self, prompt_ids):
        pass

    def propose(self, ctx: DraftContext) -> Draft:
        self.asked.append(ctx)
        return self.draft

    def on_verified(self, num_accepted, emitted):
        self.verified.append(num_accepted)


def context(verify_s=None) -> DraftContext:
    return DraftContext(torch.tensor([1, 2, 3]), 4, SamplingParams(), torch.Generator(), verify_s=verify_s)


def test_each_drafter_is_credited_with_its_own_accepted_tokens_and_prices_after_the_branch():
    inner, lookup = Fixed(TREE), Fixed(Draft(torch.tensor([5, 8, 3, 4])))
    wrapper = LookupBranch(inner, lookup, 3)
    merged = wrapper.propose(context(verify_s=lambda n: 10.0 * n))
    assert lookup.asked[0].max_tokens == 3  # the branch's own cap
    assert inner.asked[0].verify_s(2) == 60.0  # its nodes priced after the branch's 4
    assert merged.num_tokens == 7 and wrapper.max_draft_tokens == 3  # (Fixed has no budget)
    wrapper.on_verified(3, [5, 8, 3, 11])  # the path 5, 8 (the tree's), then 3 (the branch's)
    assert (inner.verified, lookup.verified) == ([2], [3])
    assert wrapper.report()["lookup_branch_accepted"] == 1


def test_a_sampled_draft_is_verified_alone():
    sampled = Draft(torch.tensor([5, 7]), torch.full((2, 10), 0.1))
    inner = Fixed(sampled)
    wrapper = LookupBranch(inner, Fixed(Draft(torch.tensor([2, 3]))), 3)
    assert wrapper.propose(context()) is sampled
    wrapper.on_verified(1, [5, 4])
    assert inner.verified == [1] and wrapper.report()["lookup_branch_accepted"] == 0


def test_the_wrapped_drafters_optional_members_stay_visible():
    inner = Fixed(TREE)
    inner.feature_layers = (1, 2)
    assert LookupBranch(inner, Fixed(Draft.empty()), 2).feature_layers == (1, 2)


@pytest.mark.parametrize("text, needle", [
    ("eagle:tree=0,lookup=4", "give tree=N"),
    ("eagle:lookup=-1", "lookup must be >= 0"),
    ("quant:lookup=3", "give tree=N"),
])
def test_bad_lookup_options_are_one_line_errors(text, needle):
    with pytest.raises(SpeclmError, match=needle):
        parse_drafter(text)


def test_lookup_is_an_option_of_tree_drafters():
    assert parse_drafter("eagle:lookup=6").options["lookup"] == 6
    assert parse_drafter("quant:tree=4,lookup=5").options["lookup"] == 5
    assert parse_drafter("eagle:tree=0").options["lookup"] is None  # a chain: no branch by default


@pytest.mark.parametrize("text, branch", [("eagle:path=.", 5), ("eagle:path=.,lookup=0", 0),
                                          ("eagle:path=.,tree=0", 0), ("eagle:path=.,lookup=3", 3)])
def test_the_eagle_head_drafts_with_a_lookup_branch_unless_told_otherwise(text, branch, monkeypatch):
    import speclm.learned.loader as loader
    from speclm.drafters.registry import BuildContext, build_drafter

    from .conftest import backend, tiny_model

    head = Fixed(TREE)  # the head itself is tested elsewhere
    monkeypatch.setattr(loader, "load_learned_drafter", lambda path, target, kind, **options: head)
    ctx = BuildContext(backend(tiny_model(32, seed=1)), None, None, load_draft=None)
    drafter = build_drafter(parse_drafter(text), ctx)
    assert (drafter.max_tokens, drafter.drafter) == (branch, head) if branch else drafter is head


def test_the_bench_sums_a_drafters_counts_over_its_requests():
    from speclm.bench.report import drafter_notes

    rows = [{"method": "eagle:lookup=5", "drafter_report": {"lookup_branch_accepted": n, "summary": f"{n} tokens"}}
            for n in (3, 4)]
    assert drafter_notes(rows) == ["- eagle:lookup=5: 4 tokens (last request); over all 2 requests: "
                                   "lookup_branch_accepted 7"]
