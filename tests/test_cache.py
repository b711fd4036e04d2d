"""KV cache rollback: after any accept/reject history the cache gives the logits that a
recomputation from scratch gives, and misuse of the cache contract fails loudly."""

from __future__ import annotations

import random

import pytest
import torch

from speclm.errors import CacheContractError

from .conftest import backend, tiny_model


@pytest.mark.parametrize("seed", range(6))
def test_rollback_equals_recompute(seed):
    rng = random.Random(seed)
    model = tiny_model(64, seed=seed)
    cached, fresh = backend(model), backend(model)
    sequence: list[int] = []
    for _ in range(25):
        # extend by a "draft" of 1..6 tokens, then keep a random accepted prefix of it
        new = [rng.randrange(64) for _ in range(rng.randint(1, 6))]
        if not sequence and len(new) < 2:
            new.append(rng.randrange(64))
        out = cached.forward(torch.tensor(new), len(sequence), num_logits=len(new))
        sequence += new
        fresh.reset()
        ref = fresh.forward(torch.tensor(sequence), 0, num_logits=len(new))
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-10, rtol=0)
        keep = rng.randint(max(0, len(sequence) - len(new) - 1), len(sequence))
        cached.rollback(keep)
        del sequence[keep:]
        assert cached.cache_length == len(sequence)


def test_cache_contract_fails_loudly():
    lm = backend(tiny_model(64, seed=0))
    lm.forward(torch.tensor([1, 2, 3]), 0)
    with pytest.raises(CacheContractError):
        lm.forward(torch.tensor([4]), 5)  # a gap
    with pytest.raises(CacheContractError):
        lm.forward(torch.tensor([4]), 1)  # overwriting without an explicit rollback
    with pytest.raises(CacheContractError):
        lm.rollback(4)  # cannot roll forward
    lm.rollback(1)
    assert lm.cache_length == 1


def test_fork_shares_weights_not_cache():
    lm = backend(tiny_model(64, seed=0))
    twin = lm.fork()
    lm.forward(torch.tensor([1, 2, 3]), 0)
    assert twin.cache_length == 0 and twin.model is lm.model
