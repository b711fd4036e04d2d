"""Token trees: metadata, the tree forward and cache compaction, and lossless tree verification.

Verification is checked three ways, like the chain verifier: the multi-draft rule's output
distribution computed exactly by enumeration from the verifier's own functions equals p; the real
``verify`` on a two-level tree matches the target's joint distribution by chi-square; and greedy
tree verification picks exactly the argmax path.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from speclm.drafters.base import Draft
from speclm.sampling import SamplingParams, warp_probs
from speclm.tree import TreeMeta, tree_from_paths
from speclm.verifier import acceptance_probs, residual_probs, verify

from .conftest import backend, tiny_model
from .test_verifier import CASES, WARPS, warped_pair

V = 8


def test_tree_meta_of_the_docstring_example():
    tree = TreeMeta.from_parents([-1, -1, 0, 0, 1])
    assert tree.depth.tolist() == [1, 1, 2, 2, 2]
    assert tree.ancestors[3].tolist() == [True, False, False, True, False]
    assert tree.num_children.tolist() == [2, 2, 1, 0, 0, 0]
    assert tree.children.tolist() == [[0, 1], [2, 3], [4, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 12]
    assert tree.max_depth == 2 and not tree.is_chain and TreeMeta.chain(4).is_chain
    bias = tree.attention_bias(past=3, dtype=torch.float64, device=torch.device("cpu"))[0, 0]
    allowed = (bias == 0).int()
    assert allowed[:, :3].all()  # the past is visible to every row
    assert allowed[0, 3:].tolist() == [1, 0, 0, 0, 0, 0]  # pending sees itself only
    assert allowed[4, 3:].tolist() == [1, 1, 0, 0, 1, 0]  # node 3: pending, node 0, itself


def test_tree_meta_of_random_trees_matches_walking_the_parents():
    """The host metadata (built with numpy) against a walk up each node's parents, on random
    trees of 0-40 nodes; the mask in each dtype a model runs, its blocked entries the dtype's
    minimum; a chain built by parents is the chain built directly."""
    gen = torch.Generator().manual_seed(3)
    for k in [0, 1, 2, 5, 16, 23, 40]:
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(k)]
        tree = TreeMeta.from_parents(torch.tensor(parents, dtype=torch.long))
        assert tree.parents.tolist() == parents
        assert {t.dtype for t in (tree.parents, tree.depth, tree.children)} == {torch.long}
        assert tree.ancestors.dtype == torch.bool and tree.ancestors.shape == (k, k)
        for i in range(k):
            line, node = {i}, parents[i]
            while node >= 0:
                line.add(node)
                node = parents[node]
            assert tree.depth[i] == len(line)
            assert {j for j in range(k) if tree.ancestors[i, j]} == line
        assert tree.max_depth == (max(tree.depth.tolist()) if k else 0)
        for row in range(-1, k):  # each row's children: its nodes in order, then -1s
            kids = [i for i in range(k) if parents[i] == row]
            assert [c for c in tree.children[row + 1].tolist() if c >= 0] == kids
            assert tree.children[row + 1, len(kids):].eq(-1).all()
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            bias = tree.attention_bias(past=2, dtype=dtype, device=torch.device("cpu"), rows=min(3, k + 1))
            assert bias.dtype == dtype and bias.shape == (1, 1, min(3, k + 1), 2 + k + 1)
            assert set(bias.unique().tolist()) <= {0.0, torch.finfo(dtype).min}
            seen = torch.cat([torch.ones(k + 1, 3, dtype=torch.bool),
                              torch.cat([torch.zeros(1, k, dtype=torch.bool), tree.ancestors])], 1)
            assert torch.equal(bias[0, 0] == 0, seen[-min(3, k + 1):])
    chain = TreeMeta.from_parents(list(range(-1, 11)))
    direct = TreeMeta.chain(12)
    assert chain.is_chain and all(torch.equal(getattr(chain, f), getattr(direct, f))
                                  for f in ("parents", "depth", "ancestors", "children"))


def test_deep_chain_ancestors():
    tree = TreeMeta.chain(37)
    assert tree.depth.tolist() == list(range(1, 38))
    assert torch.equal(tree.ancestors, torch.ones(37, 37, dtype=torch.bool).tril())


def test_bad_parents():
    with pytest.raises(ValueError):
        TreeMeta.from_parents([-1, 1])  # a node cannot be its own parent
    with pytest.raises(ValueError):
        TreeMeta.from_parents([0])


def test_tree_from_paths():
    parents, paths = tree_from_paths([[0, 0, 1], [1], [0, 1]])
    assert paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 1)]
    assert parents == [-1, -1, 0, 0, 2]


# -- the multi-draft rule, exactly ---------------------------------------------------------------

def exact_multi_draft(p: torch.Tensor, children: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """P(first emitted token = y) when ``children`` (token, q row) are tried in order with the
    verifier's own acceptance and residual functions."""
    out = torch.zeros_like(p)
    reach, p_cur = 1.0, p.clone()
    for token, q in children:
        a = acceptance_probs(p_cur[token : token + 1], q[token : token + 1])[0]
        out[token] += reach * a
        reach = reach * (1 - a)
        p_cur = residual_probs(p_cur[None], q[None])[0]
    return out + reach * p_cur


@pytest.mark.parametrize("name,p_logits,q_logits", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("params", WARPS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_iid_sampled_children_are_exact(name, p_logits, q_logits, params):
    """Three children drawn i.i.d. from q: averaging over every draw gives exactly p."""
    p, q = warped_pair(p_logits, q_logits, params)
    total = torch.zeros_like(p)
    for draws in itertools.product(range(V), repeat=3):
        weight = torch.prod(q[list(draws)])
        if weight > 0:
            total += weight * exact_multi_draft(p, [(x, q) for x in draws])
    torch.testing.assert_close(total, p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name,p_logits,q_logits", CASES, ids=[c[0] for c in CASES])
def test_deterministic_children_are_exact(name, p_logits, q_logits):
    """Any set of distinct deterministic children (one-hot q), in any order, gives exactly p."""
    p = warp_probs(p_logits[None], SamplingParams(temperature=0.8))[0]
    for children in [(0,), (7, 3), (1, 2, 3, 4, 5, 6, 7, 0), (5, 0, 2)]:
        rows = [(c, torch.nn.functional.one_hot(torch.tensor(c), V).to(p.dtype)) for c in children]
        torch.testing.assert_close(exact_multi_draft(p, rows), p, atol=1e-12, rtol=0)


# -- the real verify on trees --------------------------------------------------------------------

def _two_level_case():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, V, generator=gen, dtype=torch.float64) * 1.5  # rows: pending + 7 nodes
    # root children: tokens 2, 5, 6 (nodes 0-2); node 0's children 1, 4; node 1's child 3
    tree = TreeMeta.from_parents([-1, -1, -1, 0, 0, 1, 3])
    tokens = torch.tensor([2, 5, 6, 1, 4, 3, 0])
    return logits, tree, tokens


def _joint_target(logits, tree, tokens, params):
    """P(first two emitted tokens) under the target: x1 ~ p_root; if x1 is a root child's token,
    x2 ~ p at that child, else the round ends (x2 = STOP = V)."""
    p = warp_probs(logits, params)
    expected = torch.zeros(V, V + 1, dtype=torch.float64)
    children = {int(tokens[i]): i for i in range(tree.num_nodes) if tree.parents[i] == -1}
    for x1 in range(V):
        if x1 in children:
            expected[x1, :V] = p[0, x1] * p[children[x1] + 1]
        else:
            expected[x1, V] = p[0, x1]
    return expected


def _chi_square_ok(observed: torch.Tensor, p: torch.Tensor) -> bool:
    """Counts against probabilities, rare cells pooled; True when they are consistent."""
    assert observed[p == 0].sum() == 0
    expected = p / p.sum() * observed.sum()
    keep = expected >= 5
    obs, exp = observed[keep], expected[keep]
    if expected[~keep].sum() > 0:  # pool the rare cells into one
        obs = torch.cat([obs, observed[~keep].sum().view(1)])
        exp = torch.cat([exp, expected[~keep].sum().view(1)])
    return chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3


@pytest.mark.parametrize("sampled", [False, True], ids=["deterministic", "iid-sampled"])
def test_tree_verify_matches_target(sampled):
    """First emitted token ~ p at the pending token; given the first accepted node, the next
    emitted token ~ p at that node; with fixed tokens the joint of both is checked too."""
    logits, tree, tokens = _two_level_case()
    params = SamplingParams(temperature=1.0, top_k=6)
    p = warp_probs(logits, params)
    gen = torch.Generator().manual_seed(0)
    q = None
    if sampled:  # each node drawn from its parent's q; siblings i.i.d., repeats allowed
        q_rows = warp_probs(torch.randn(tree.num_nodes + 1, V, generator=gen, dtype=torch.float64), params)
        q = q_rows[tree.parents + 1]  # [k, V]
    n = 4000
    first = torch.zeros(V, dtype=torch.float64)
    second_given_node = torch.zeros(tree.num_nodes, V, dtype=torch.float64)
    joint = torch.zeros(V, V + 1, dtype=torch.float64)
    for _ in range(n):
        if sampled:  # fresh draws each time: the test averages over drafts as well
            tokens = torch.multinomial(q, 1, generator=gen).flatten()
        verdict = verify(logits, Draft(tokens, q, tree), params, gen)
        a = int(verdict.num_accepted)
        out = verdict.tokens[: a + 1].tolist()
        path = verdict.path[:a].tolist()
        for i, node in enumerate(path):  # the path is a real root-to-node path
            assert int(tokens[node]) == out[i] and int(tree.depth[node]) == i + 1
        first[out[0]] += 1
        if a >= 1:
            second_given_node[path[0], out[1]] += 1
        joint[out[0], out[1] if a >= 1 else V] += 1
    assert _chi_square_ok(first, p[0])
    for node in range(tree.num_nodes):
        if tree.parents[node] == -1 and second_given_node[node].sum() >= 300:
            assert _chi_square_ok(second_given_node[node], p[node + 1])
    if not sampled:
        assert _chi_square_ok(joint.flatten(), _joint_target(logits, tree, tokens, params).flatten())


def test_greedy_tree_verify_follows_the_argmax_path():
    logits, tree, tokens = _two_level_case()
    argmax = logits.argmax(-1)
    tokens = tokens.clone()
    tokens[1] = argmax[0]  # node 1 is the root's argmax, node 5 (its child) the next argmax
    tokens[0] = (argmax[0] + 1) % V
    tokens[2] = (argmax[0] + 2) % V
    tokens[5] = argmax[2]
    verdict = verify(logits, Draft(tokens, None, tree), SamplingParams(), torch.Generator())
    assert int(verdict.num_accepted) == 2
    assert verdict.path[:2].tolist() == [1, 5]
    assert verdict.tokens[:3].tolist() == [int(argmax[0]), int(argmax[2]), int(argmax[6])]  # bonus at node 5
    tokens[1] = (argmax[0] + 3) % V  # nothing matches at the root: recovered = argmax of row 0
    verdict = verify(logits, Draft(tokens, None, tree), SamplingParams(), torch.Generator())
    assert int(verdict.num_accepted) == 0 and int(verdict.tokens[0]) == int(argmax[0])


# -- the tree forward and compaction on a real (tiny) model ---------------------------------------

def test_tree_forward_equals_each_path_run_alone():
    model = tiny_model(64, seed=4)
    lm = backend(model)
    prompt = torch.tensor([5, 9, 11, 3, 7])
    tree = TreeMeta.from_parents([-1, -1, 0, 0, 1, 2])
    nodes = torch.tensor([8, 12, 30, 31, 40, 41])
    lm.forward(prompt[:-1], 0)
    out = lm.forward(torch.cat([prompt[-1:], nodes]), 4, num_logits=7, tree=tree).logits  # [7, V]
    for i in range(tree.num_nodes):
        path = [j for j in range(tree.num_nodes) if tree.ancestors[i, j]]
        ref = backend(model)
        alone = ref.forward(torch.cat([prompt, nodes[path]]), 0).logits[-1]
        torch.testing.assert_close(out[i + 1], alone, atol=1e-10, rtol=0)
    # keep the path 0 -> 2 -> 5 and check the cache against recomputation
    lm.compact(5, [0, 2, 5])
    assert lm.cache_length == 8
    nxt = lm.forward(torch.tensor([17]), 8).logits[-1]
    ref = backend(model).forward(torch.cat([prompt, nodes[[0, 2, 5]], torch.tensor([17])]), 0).logits[-1]
    torch.testing.assert_close(nxt, ref, atol=1e-10, rtol=0)


def test_sliding_window_models_refuse_trees():
    from transformers import MistralConfig, MistralForCausalLM

    from speclm.errors import SpeclmError

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    lm = backend(MistralForCausalLM(config).eval())
    with pytest.raises(SpeclmError, match="full attention"):
        lm.forward(torch.tensor([1, 2, 3]), 0, num_logits=1, tree=TreeMeta.from_parents([-1, -1]))


def test_growing_a_tree_level_by_level_equals_one_forward():
    """A drafter feeds each new level as the last rows of the tree; logits match a full forward."""
    model = tiny_model(64, seed=6)
    prompt = torch.tensor([5, 9, 11, 3, 7])
    parents = [-1, -1, 0, 0, 1, 2, 2]
    nodes = torch.tensor([8, 12, 30, 31, 40, 41, 42])
    full = backend(model)
    full.forward(prompt[:-1], 0)
    whole = full.forward(torch.cat([prompt[-1:], nodes]), 4, num_logits=8,
                         tree=TreeMeta.from_parents(parents)).logits
    grown = backend(model)
    grown.forward(prompt, 0)  # the pending token already cached, as a draft model keeps it
    for upto in (2, 4, 5, 7):  # levels: nodes 0-1, 2-3, 4, 5-6
        fed = upto - grown.cache_length + len(prompt)
        out = grown.forward(nodes[upto - fed : upto], grown.cache_length, num_logits=fed,
                            tree=TreeMeta.from_parents(parents[:upto])).logits
        torch.testing.assert_close(out, whole[upto - fed + 1 : upto + 1], atol=1e-10, rtol=0)


@pytest.mark.parametrize("k", [0, 1, 2, 7])
def test_chain_built_directly_equals_the_general_construction(k):
    direct, general = TreeMeta.chain(k), TreeMeta.from_parents(torch.arange(-1, k - 1))
    for name in ("parents", "depth", "ancestors", "children"):
        assert torch.equal(getattr(direct, name), getattr(general, name)), name
    assert direct.max_depth == general.max_depth
