"""The CPU attention speclm swaps in for transformers' SDPA: same results, no per-layer copy of
the cache for multi-token masked forwards (verifies, batched rows, token trees)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from speclm.models.attention import NAME, use_gqa_sdpa
from speclm.models.hf import HFCausalLM
from speclm.tree import TreeMeta

from .conftest import tiny_model


def _no_repeat(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("repeat_kv copied the cache")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", refuse)


def test_masked_multi_token_forward_matches_transformers_sdpa_without_copying(monkeypatch):
    stock = tiny_model(64, seed=3)
    assert stock.config._attn_implementation == "sdpa" and stock.config.num_key_value_heads < 4
    ours = copy.deepcopy(stock)
    use_gqa_sdpa(ours)
    assert ours.config._attn_implementation == NAME
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded row: the model builds a 4D mask
    with torch.inference_mode():
        expected = stock(ids, attention_mask=mask).logits
        _no_repeat(monkeypatch)
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_the_eager_backend_uses_it_for_chains_and_trees(monkeypatch):
    model = tiny_model(64, seed=5)
    reference = HFCausalLM(copy.deepcopy(model), frozenset({0}))
    reference.model.config._attn_implementation = "sdpa"  # transformers' own, for comparison
    lm = HFCausalLM(model, frozenset({0}))
    assert model.config._attn_implementation == NAME and lm.supports_trees
    prompt = torch.randint(1, 64, (20,), generator=torch.Generator().manual_seed(1))
    tree = TreeMeta.from_parents([-1, 0, 0, 1])  # 4 nodes after the pending token
    for backend in (reference, lm):
        backend.forward(prompt[:-1], 0, num_logits=1)
    expected_chain = reference.forward(prompt[-1:].repeat(5), 19, num_logits=5).logits
    reference.rollback(19)
    expected_tree = reference.forward(prompt[-1:].repeat(5), 19, num_logits=5, tree=tree).logits
    _no_repeat(monkeypatch)
    chain = lm.forward(prompt[-1:].repeat(5), 19, num_logits=5).logits
    lm.rollback(19)
    tree_logits = lm.forward(prompt[-1:].repeat(5), 19, num_logits=5, tree=tree).logits
    torch.testing.assert_close(chain, expected_chain, rtol=0, atol=1e-12)
    torch.testing.assert_close(tree_logits, expected_tree, rtol=0, atol=1e-12)


@pytest.mark.parametrize("implementation", ["eager"])
def test_other_attention_implementations_are_left_alone(implementation):
    model = tiny_model(64, seed=7)
    model.config._attn_implementation = implementation
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == implementation
