"""A GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks on the int4 kernels (models/gguf_int4.py).

The layers must compute exactly the weights the file stores: the packed int4 layout, read back
through PyTorch's own kernel in float32, equals gguf-py's dequantization bit for bit, for
synthetic blocks of each type (rows reordered as a loader may reorder them) and for the default
model's real file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from speclm.errors import SpeclmError
from speclm.models.gguf_int4 import (
    ACTIVATIONS_ENV,
    SplitQ8Linear,
    _from_blocks,
    decode_q4,
    decode_q8,
    keep_gguf_int4,
    pack_q4,
)
from speclm.models.quantize import Int4Linear
from speclm.models.small_m import BLOCK_MAX_ROWS, MAX_ROWS, BlockLinear, block_max_rows

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _blocks(type_name: str, rows: int = 48, cols: int = 96, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw quantized rows [rows, bytes] of a random weight, and gguf-py's dequantization."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2, (rows, 1))).astype(np.float32)
    weight[3, :32] = 0.0  # a constant block: scale 0
    weight[5] += 1.5  # an offset row: Q4_1's minimum far from zero
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(weight, qtype)
    return raw, dequantize(raw, qtype).reshape(rows, cols)


def _dense(layer: torch.nn.Module) -> torch.Tensor:
    """The [N, K] weight a layer computes, read through the int4 kernel in float32."""
    if isinstance(layer, BlockLinear):  # speclm's kernel on the blocks (float32, AVX2)
        return layer.dequantized()
    if isinstance(layer, SplitQ8Linear):
        return _dense(layer.high) + _dense(layer.low)
    eye = torch.eye(layer.in_features)
    cols = torch._weight_int4pack_mm_for_cpu(eye, layer.weight_int4, layer.group_size, layer.scales_and_zeros)
    return cols.T[: layer.out_features]


@pytest.mark.parametrize("type_name", TYPES)
def test_decode_matches_gguf_py(type_name):
    raw, expected = _blocks(type_name)
    if type_name == "Q8_0":
        codes, scale = decode_q8(raw)
        got = (codes.reshape(48, -1, 32) * scale[..., None]).reshape(48, 96)
        assert codes.dtype == np.int8
    else:
        codes, scale, minimum = decode_q4(raw, type_name)
        assert codes.min() >= 0 and codes.max() <= 15
        grouped = codes.reshape(48, -1, 32).astype(np.float32)
        got = (grouped * scale[..., None] + minimum[..., None]).reshape(48, 96)
    np.testing.assert_allclose(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_packing_is_the_files_byte_order(type_name):
    """pack_q4 gives back the code bytes of the file's blocks, for NumPy codes and for tensors."""
    raw, _ = _blocks(type_name)
    codes, _, _ = decode_q4(raw, type_name)
    head = {"Q4_0": 2, "Q4_1": 4}[type_name]
    stored = raw.reshape(48, -1, head + 16)[..., head:].reshape(48, -1)  # the file's code bytes
    np.testing.assert_array_equal(pack_q4(codes), stored)
    np.testing.assert_array_equal(pack_q4(torch.from_numpy(codes)).numpy(), stored)


@pytest.mark.parametrize("type_name", TYPES)
def test_layer_computes_the_files_weights_exactly(type_name):
    raw, dequantized = _blocks(type_name, seed=1)
    order = np.random.default_rng(2).permutation(48)  # the loader reordered the rows
    weight = torch.from_numpy(dequantized[order].copy())
    bias = torch.randn(48)
    layer = _from_blocks(raw, type_name, weight, bias)
    assert isinstance(layer, (BlockLinear, SplitQ8Linear if type_name == "Q8_0" else Int4Linear))
    assert layer.in_features == 96 and layer.out_features == 48
    assert torch.equal(_dense(layer), weight)  # bit for bit, after the row reordering
    x = torch.randn(3, 96)
    exact = x @ weight.T + bias
    if isinstance(layer, BlockLinear) and layer.activations == "q8":  # 8-bit activations: ~1% of the scale
        torch.testing.assert_close(layer(x), exact, rtol=0, atol=0.02 * exact.abs().max().item())
    else:
        torch.testing.assert_close(layer(x), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", ["q8", "float"])
@pytest.mark.parametrize("type_name", TYPES)
def test_the_cpu_kernel_runs_the_files_blocks_exactly(cpu_kernel, type_name, activations, monkeypatch):
    """float32 on an AVX2 CPU: few-row products run speclm's kernel on the file's own blocks.
    Read back with one-hot rows its weights are gguf-py's values bit for bit; a row's output is
    the same alone or among others, at any number of rows on the tile layout (8-bit
    activations); with float activations long inputs run the BLAS on the decoded blocks."""
    raw, dequantized = _blocks(type_name, seed=4)
    order = np.random.default_rng(5).permutation(48)
    weight = torch.from_numpy(dequantized[order].copy())
    bias = torch.randn(48)
    monkeypatch.setenv(ACTIVATIONS_ENV, activations)
    layer = _from_blocks(raw, type_name, weight, bias)
    assert isinstance(layer, BlockLinear) and layer.activations == activations
    eye = torch.eye(96)
    read = torch.cat([cpu_kernel.small_m_blocks(eye[i:i + 8], layer.codes, layer.scale, layer.minimum,
                                                layer.bits) for i in range(0, 96, 8)])  # [K, N]
    assert torch.equal(read.T, weight) and torch.equal(layer.dequantized(), weight)
    x = torch.randn(MAX_ROWS, 96)
    with torch.no_grad():
        y = layer(x)
        exact = (x.double() @ weight.double().T + bias.double()).float()
        if activations == "q8":  # the integer products, checked exactly in tests/test_small_m.py
            torch.testing.assert_close(y, exact, rtol=0, atol=0.02 * exact.abs().max().item())
        else:  # float32 sums of 96 products (one in 768 outputs was 1.05e-5 from MKL's at 1e-5)
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=5e-5)
        assert all(torch.equal(layer(x[i:i + 1]), y[i:i + 1]) for i in range(MAX_ROWS))
        long = torch.randn(2, BLOCK_MAX_ROWS // 2 + 1, 96)  # [2, 17, 96]: more rows than the AVX2 loop takes
        if activations == "q8" and block_max_rows() is None:  # the tile layout: the kernel, each row's own bits
            got = layer(long)
            assert all(torch.equal(got[b, t], layer(long[b, t:t + 1])[0]) for b in range(2) for t in range(17))
            torch.testing.assert_close(got, long @ weight.T + bias, rtol=0, atol=0.02 * got.abs().max().item())
        else:  # the BLAS on the decoded blocks
            torch.testing.assert_close(layer(long), long @ weight.T + bias, rtol=1e-5, atol=1e-5)


def test_foreign_weights_are_refused():
    raw, dequantized = _blocks("Q4_1", seed=3)
    weight = torch.from_numpy(dequantized.copy())
    weight[7, 11] += 1e-3  # one value that the file does not hold
    assert _from_blocks(raw, "Q4_1", weight, None) is None
    assert _from_blocks(raw, "Q4_1", weight[:, :64].contiguous(), None) is None  # wrong shape


def _assert_like_the_float_model(got: torch.Tensor, want: torch.Tensor, model: torch.nn.Module) -> None:
    """Logits of the file's blocks against the float32 model dequantized from the same file: the
    float-activation kernel differs only in summation order; 8-bit activations (llama.cpp's
    arithmetic) move the default model's logits by up to ~1.5 (mean ~0.2) on an 8-token prompt,
    about as far as llama.cpp's own logits sit from the float model (1.2, mean 0.17)."""
    if any(isinstance(m, BlockLinear) and m.activations == "q8" for m in model.modules()):
        diff = (got - want).abs()
        assert diff.max() < 2.5 and diff.mean() < 0.35, (diff.max(), diff.mean())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.real_model
def test_default_model_runs_its_own_blocks():
    from speclm.models import load_model
    from speclm.models.loading import find_gguf

    loaded = load_model("default", backend="torch")  # float32, dequantized from the file
    model = loaded.backend.model
    reference = {n: m.weight.detach().clone() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)}
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30, 198]])
    with torch.inference_mode():
        before = model(ids).logits[0]
    kept = keep_gguf_int4(model, find_gguf("default"))
    assert len(kept.int4) == len(reference) and not kept.dense  # Q4_1 layers, the Q8_0 head
    assert kept.int4["lm_head"] == "Q8_0" and set(kept.int4.values()) == {"Q4_1", "Q8_0"}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                 "model.layers.29.mlp.down_proj"):  # q and k are the rows transformers reorders
        assert torch.equal(_dense(model.get_submodule(name)), reference[name]), name
    with torch.inference_mode():
        after = model(ids).logits[0]
    _assert_like_the_float_model(after, before, model)


def test_clear_errors(tmp_path):
    from speclm.models.compiled import make_compiled

    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    with pytest.raises(SpeclmError, match="not loaded from a GGUF"):
        make_compiled(model, frozenset(), quantize="gguf")
    with pytest.raises(SpeclmError, match="unknown quantization"):
        make_compiled(model, frozenset(), quantize="int3")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(SpeclmError, match="cannot read GGUF"):
        keep_gguf_int4(model, bad)


@pytest.mark.real_model
def test_quantized_self_draft_uses_the_files_blocks():
    """quant:bits=4 on a target loaded from a 4-bit GGUF drafts with the file's own blocks: the
    draft computes the target's weights, so it agrees with the target (float32: closely)."""
    from speclm.drafters.quant import quant_draft
    from speclm.models import load_model

    target = load_model("default", backend="torch").backend
    assert target.source_gguf is not None and target.fork().source_gguf == target.source_gguf
    key, build = quant_draft(target, 4, progress=False)
    assert key == "quant:gguf"
    draft = build()
    assert draft.model is not target.model
    assert any(isinstance(m, (Int4Linear, BlockLinear)) for m in draft.model.modules())
    assert not any(isinstance(m, (Int4Linear, BlockLinear)) for m in target.model.modules())  # untouched
    ids = torch.tensor([1, 504, 3458, 314, 260, 1345, 30, 198])
    a = draft.forward(ids, 0, num_logits=8).logits
    b = target.forward(ids, 0, num_logits=8).logits
    _assert_like_the_float_model(a, b, draft.model)


@pytest.mark.real_model
def test_quantized_self_draft_is_lossless_through_the_api():
    """Greedy speculation with the file's-blocks draft returns plain decoding's tokens, and a
    server's row view hands the drafter the same source file."""
    from speclm import LLM, SamplingParams
    from speclm.models.rows import SlotRows, TargetView

    # K fixed: the adaptive draft length follows the measured cost model, which a loaded machine
    # can tip to plain steps; a chat turn, since the bare text's greedy answer is EOS at once
    llm = LLM("default", backend="torch", speculative_model="quant:bits=4", num_speculative_tokens=4,
              adaptive_draft=False)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    turn = [{"role": "user", "content": "Name the planets of the solar system in order."}]
    plain = llm.chat(turn, params, speculative=False)
    spec = llm.chat(turn, params)
    assert len(plain.token_ids) == 16
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted_tokens > 0
    assert spec.stats.accepted_tokens / spec.stats.drafted_tokens > 0.8  # the target's own weights
    for view in (TargetView(llm.target), SlotRows(llm.target, 1)):
        assert view.source_gguf == llm.target.source_gguf
