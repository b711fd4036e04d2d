"""The float32 small-M CPU kernel (models/small_m.py): correct, row-invariant, swapped in safely.

Row invariance is what makes it lossless-friendly: a row's product is bit-identical whether it
runs alone (a decode step) or among others (a verify). MKL's products are not, so the test
fails if the layers fall back to them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speclm.drafters.ngram import NgramDrafter
from speclm.engine import generate_tokens
from speclm.models import small_m
from speclm.models.small_m import MAX_ROWS, SmallMLinear, use_small_m
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model


@pytest.fixture
def kernel(cpu_kernel):
    return cpu_kernel.small_m_mm


@pytest.mark.parametrize("k", [576, 37, 8, 3])
def test_kernel_matches_the_product_and_a_row_is_the_same_alone_or_among_others(kernel, k):
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(67, k, generator=gen)  # an odd number of output rows
    x = torch.randn(MAX_ROWS, k, generator=gen)
    y = kernel(x, w)  # [MAX_ROWS, 67]
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5 * k ** 0.5)
    for m in range(1, MAX_ROWS + 1):
        assert torch.equal(kernel(x[:m], w), y[:m])
        assert torch.equal(kernel(x[m - 1:m], w), y[m - 1:m])
    strided = x.t().contiguous().t()  # the same values in another memory layout
    assert torch.equal(kernel(strided, w), y)


def test_swapped_layers_share_parameters_and_fall_back_outside_their_case(kernel):
    model = tiny_model(300, seed=0).float()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    keys = list(model.state_dict())
    ids = torch.randint(1, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    n = use_small_m(model)
    assert n == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    assert model.lm_head.weight is model.model.embed_tokens.weight and list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)
    layer = model.lm_head
    assert isinstance(layer, SmallMLinear)
    x = torch.randn(2, 3, 32, requires_grad=True)  # autograd on: F.linear, gradients flow
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():  # [B, T, K] within MAX_ROWS rows, and a prefill beyond it
        for rows in ((2, 3), (1, MAX_ROWS + 5)):
            x = torch.randn(*rows, 32)
            torch.testing.assert_close(layer(x), x @ layer.weight.t(), rtol=1e-5, atol=1e-5)
    assert use_small_m(tiny_model(300, seed=0)) == 0  # float64: left alone


def test_greedy_speculation_on_the_kernel_matches_plain_decoding(kernel):
    target = backend(tiny_model(300, seed=0).float())
    assert any(isinstance(m, SmallMLinear) for m in target.model.modules())
    prompt = torch.randint(1, 300, (12,), generator=torch.Generator().manual_seed(1)).repeat(2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(drafter=None):
        return [t for s in generate_tokens(target, prompt, params, drafter=drafter) for t in s.tokens]

    assert run(NgramDrafter(2, 3)) == run()


def test_the_compiled_path_calls_the_kernel(kernel):
    layer = nn.Linear(40, 24, bias=True).eval()
    layer.__class__ = SmallMLinear
    x = torch.randn(4, 40)
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, backend="inductor", fullgraph=True)(x)
    assert torch.equal(compiled, eager)


def test_turned_off_it_runs_torch_s_product(kernel, monkeypatch):
    layer = nn.Linear(40, 24, bias=False)
    layer.__class__ = SmallMLinear
    calls = []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or a[0] @ a[1].t())
    small_m.set_kernel_enabled(False)
    try:
        with torch.no_grad():
            layer(torch.randn(2, 40))
    finally:
        small_m.set_kernel_enabled(True)
    assert calls
