"""transformers' RMSNorm layers on speclm's one-call kernel (models/fast_norm.py).

A swapped layer computes what its own forward computes, to float32 rounding, with each row's
bits independent of the rows beside it; layers that are not an RMS norm keep their forward; a
compiled graph, autograd and other dtypes run the layer's own forward; and speculative decoding
on a float32 model with swapped norms stays token-identical to its plain decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM

from speclm import SamplingParams
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter
from speclm.models.fast_norm import use_fast_norms

from .conftest import backend, tiny_config
from .test_lossless import prompts, run

VOCAB = 96  # the prompts of test_lossless


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(VOCAB)).eval()  # float32


def _gemma3() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                              initializer_range=0.3)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # trained-looking scales: Gemma's norms compute x * (1 + w)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return model


def _norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("make, per_layer", [(_llama, 2), (_gemma3, 6)])
def test_every_norm_runs_the_kernel_and_computes_its_own_forward(cpu_kernel, make, per_layer, monkeypatch):
    model = make()
    norms = _norms(model)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(3, 5, m.weight.shape[0], generator=gen) * 4 for m in norms]
    with torch.no_grad():
        expected = [m(x) for m, x in zip(norms, inputs)]
        assert use_fast_norms(model) == len(norms) == per_layer * model.config.num_hidden_layers + 1
        assert use_fast_norms(model) == 0  # swapped once

        def own_forward(self, x):
            raise AssertionError("the layer ran its own forward, not the kernel")

        monkeypatch.setattr(type(norms[0]), "_speclm_own_forward", own_forward)
        for m, x, want in zip(norms, inputs, expected):
            got = m(x)
            torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
            assert torch.equal(m(x[1:2, 2:3]), got[1:2, 2:3])  # a row's bits alone = in a batch


def test_layers_that_are_not_rms_norms_keep_their_forward(cpu_kernel):
    class Scaled(nn.Module):  # an eps and a weight, but not an RMS norm
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

        def forward(self, x):
            return x * self.weight * 2

    class OtherEps(nn.Module):  # an RMS norm whose forward does not use its eps attribute
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight

    class Gated(nn.Module):  # an RMS norm at gate=None, but called with a gate
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.ones(16)), 1e-6

        def forward(self, x, gate=None):
            x = x if gate is None else x * torch.sigmoid(gate)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight

    class Ignores(nn.Module):  # all ones, its weight unused: the probe's random weight tells
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    model = nn.Sequential(nn.LayerNorm(16, bias=False), Scaled(), OtherEps(), Gated(), Ignores(), nn.Linear(16, 16))
    kinds = [type(m) for m in model]
    assert use_fast_norms(model) == 0
    assert [type(m) for m in model] == kinds
    assert use_fast_norms(_llama().to(torch.float64)) == 0  # float32 only


def test_compiled_graphs_and_autograd_run_the_layers_own_forward(cpu_kernel):
    model = _llama()
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        want = model(ids).logits
    use_fast_norms(model)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=recording)  # traced: no graph break
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, want, rtol=1e-5, atol=1e-5)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert targets and not any("rms_norm" in t for t in targets)  # transformers' norm, fused by inductor
    norm = _norms(model)[0]
    x = torch.randn(4, 32, requires_grad=True)
    norm(x).sum().backward()  # the kernel has no backward: autograd runs transformers' forward
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("make", [_llama, _gemma3])
def test_speculation_on_fast_norms_is_token_identical(cpu_kernel, make):
    target = backend(make())
    assert any(hasattr(type(m), "_speclm_own_forward") for m in target.model.modules())
    draft_model = make()
    with torch.no_grad():
        for p in draft_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in prompts(3):
        plain, _ = run(target, prompt, greedy)
        spec, stats = run(target, prompt, greedy, DraftModelDrafter(backend(draft_model), VOCAB),
                          DraftLengthConfig(4, adaptive=False))
        assert spec == plain and stats.accepted_tokens > 0


def test_the_switches_turn_the_kernel_off_and_a_swapped_layer_pickles(cpu_kernel, monkeypatch):
    import pickle

    from speclm.models import fast_norm, small_m

    model = _llama()
    use_fast_norms(model)
    norm = _norms(model)[0]
    calls = []
    monkeypatch.setattr(fast_norm, "_rms_norm", lambda *a: calls.append(1) or torch.zeros(1))
    x = torch.randn(2, 32)
    with torch.no_grad():
        norm(x)
        assert calls == [1]
        fast_norm.set_enabled(False)
        try:
            norm(x)
        finally:
            fast_norm.set_enabled(True)
        small_m.set_kernel_enabled(False)
        try:
            norm(x)
        finally:
            small_m.set_kernel_enabled(True)
        assert calls == [1]  # both switches: the layer's own forward
    monkeypatch.undo()
    again = pickle.loads(pickle.dumps(norm))
    assert type(again) is type(norm) and torch.equal(again.weight, norm.weight)
    with torch.no_grad():
        assert torch.equal(again(x), norm(x))
