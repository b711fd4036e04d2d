"""Drafter unit behaviour: what prompt lookup proposes, and what the model interface returns."""

from __future__ import annotations

import torch

from speclm.drafters import DraftContext, NgramDrafter
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model


def propose(drafter, ids, k):
    ctx = DraftContext(torch.tensor(ids), k, SamplingParams(), torch.Generator())
    return drafter.propose(ctx).tokens.tolist()


def test_ngram_docstring_example():
    # [4, 2, 3] never occurred before; [2, 3] did at index 1, followed by 4, 2, 3
    assert propose(NgramDrafter(2, 3), [1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]


def test_ngram_prefers_longest_match_then_latest_occurrence():
    ids = [5, 1, 2, 7, 9, 1, 2, 8, 3, 1, 2]
    # 2-gram [1, 2] occurs at 1 and 5: the latest (5) wins, continuation [8, 3, 1]
    assert propose(NgramDrafter(1, 2), ids, 3) == [8, 3, 1]
    # a 3-gram [9, 1, 2] match beats the later 2-gram match
    assert propose(NgramDrafter(1, 3), [9, 1, 2, 4, 4, 1, 2, 6, 9, 1, 2], 2) == [4, 4]


def test_ngram_no_match_budget_and_tail():
    assert propose(NgramDrafter(2, 3), [1, 2, 3, 4], 5) == []  # nothing repeats
    assert propose(NgramDrafter(1, 1), [1, 2, 3, 1], 0) == []  # K = 0: no draft
    assert propose(NgramDrafter(1, 1), [7, 3, 7], 5) == [3, 7]  # continuation runs to the end


def test_forward_returns_hidden_states_when_asked():
    model = tiny_model(64, seed=0)
    lm = backend(model)
    out = lm.forward(torch.tensor([1, 2, 3]), 0, num_logits=2, return_hidden=True)
    assert out.logits.shape == (2, 64)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (3, 32) for h in out.hidden_states)
    assert lm.forward(torch.tensor([4]), 3).hidden_states is None
