"""The float32 small-M CPU kernel (models/small_m.py): correct, row-invariant, swapped in safely.

Row invariance is what makes it lossless-friendly: a row's product is bit-identical whether it
runs alone (a decode step) or among others (a verify). MKL's products are not, so the test
fails if the layers fall back to them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speclm.drafters.ngram import NgramDrafter
from speclm.engine import generate_tokens
from speclm.models import small_m
from speclm.models.attention import KERNEL_MAX_QUERIES, _kernel_applies
from speclm.models.small_m import MAX_ROWS, BlockLinear, SmallMLinear, use_small_m
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model


@pytest.fixture
def kernel(cpu_kernel):
    return cpu_kernel.small_m_mm


@pytest.mark.parametrize("k", [576, 37, 8, 3])
@pytest.mark.parametrize("n", [67, 2])  # weight rows: tiles of 3, 2 and 1 weight rows
def test_kernel_matches_the_product_and_a_row_is_the_same_alone_or_among_others(kernel, k, n):
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(MAX_ROWS, k, generator=gen)
    y = kernel(x, w)  # [MAX_ROWS, n]
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5 * k ** 0.5)
    for m in range(1, MAX_ROWS + 1):  # every row tile (4 activation rows a tile) and its remainders
        assert torch.equal(kernel(x[:m], w), y[:m])
        assert torch.equal(kernel(x[m - 1:m], w), y[m - 1:m])
    assert all(torch.equal(kernel(x, w[i:i + 1]), y[:, i:i + 1]) for i in range(min(n, 5)))  # a weight row alone
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


_MASKED = torch.finfo(torch.float32).min


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "queries", "slots", "dim"),
                         [(1, 9, 3, 1, 300, 64), (2, 9, 3, 5, 40, 64), (1, 4, 4, 3, 17, 37), (3, 8, 2, 7, 64, 128)])
def test_attention_kernel_matches_sdpa_and_a_query_is_the_same_alone_or_among_others(
        cpu_kernel, batch, heads, kv_heads, queries, slots, dim):
    gen = torch.Generator().manual_seed(slots)
    query = torch.randn(batch, queries, heads, dim, generator=gen).transpose(1, 2)  # [B, H, T, D], strided
    # key/value: the first slots of a larger buffer, as a static cache hands them over
    key = torch.randn(batch, kv_heads, slots + 9, dim, generator=gen)[:, :, :slots]
    value = torch.randn(batch, kv_heads, slots + 9, dim, generator=gen)[:, :, :slots]
    seen = torch.rand(batch, 1, queries, slots, generator=gen) < 0.6
    seen[..., 0] = True
    additive = torch.where(seen, 0.0, _MASKED)
    additive[..., 1] = torch.where(seen[..., 1], -float("inf"), additive[..., 1].new_tensor(0.5))  # -inf and a bias
    seen[..., 1] = ~seen[..., 1]
    scale = dim ** -0.5
    for mask in (additive, seen):
        want = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), scale=scale,
                                              attn_mask=mask.double() if mask.is_floating_point() else mask,
                                              enable_gqa=True).transpose(1, 2)  # [B, T, H, D]
        got = cpu_kernel.small_m_attention(query, key, value, mask, scale)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        for t in range(queries):
            alone = cpu_kernel.small_m_attention(query[:, :, t : t + 1], key, value, mask[:, :, t : t + 1], scale)
            assert torch.equal(alone[:, 0], got[:, t])
    if queries == 1:  # no mask: one query sees every slot
        want = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), scale=scale,
                                              enable_gqa=True).transpose(1, 2)
        got = cpu_kernel.small_m_attention(query, key, value, None, scale)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256), (8, 1, 64), (6, 2, 40)])
def test_attention_kernel_gives_a_head_the_same_bits_whichever_heads_share_its_pass(cpu_kernel, heads, kv_heads, dim):
    """The query heads of one key/value head run together (up to 3 a pass): each head's output is
    what it is when it runs alone or beside other heads."""
    gen = torch.Generator().manual_seed(heads * dim)
    query = torch.randn(2, heads, 5, dim, generator=gen)
    key, value = (torch.randn(2, kv_heads, 70, dim, generator=gen) for _ in range(2))
    mask = torch.where(torch.rand(2, 1, 5, 70, generator=gen) < 0.7, 0.0, _MASKED)
    got = cpu_kernel.small_m_attention(query, key, value, mask, dim ** -0.5)  # [B, T, H, D]
    group = heads // kv_heads
    for h in range(heads):
        g = h // group
        alone = cpu_kernel.small_m_attention(query[:, h : h + 1], key[:, g : g + 1], value[:, g : g + 1], mask,
                                             dim ** -0.5)
        assert torch.equal(alone[:, :, 0], got[:, :, h])


def test_a_float32_model_computes_a_verify_s_rows_bit_for_bit_as_its_steps(cpu_kernel):
    """Linear layers and attention both row-invariant: the logits of T tokens fed at once are
    the logits of the same tokens fed one at a time (the attention fallback, SDPA, is not)."""
    target = backend(tiny_model(300, seed=0).float())
    tokens = torch.randint(1, 300, (14,), generator=torch.Generator().manual_seed(2))
    target.forward(tokens[:8], 0)
    verify = target.forward(tokens[8:], 8, num_logits=6).logits  # [6, V]
    target.rollback(8)
    steps = torch.cat([target.forward(tokens[i : i + 1], i).logits for i in range(8, 14)])
    assert torch.equal(verify, steps)


def test_attention_falls_back_outside_its_case(cpu_kernel):
    module = nn.Module()
    query, key = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 2, 10)
    assert _kernel_applies(module, query, key, key, mask, 0.0, {})
    assert not _kernel_applies(module, query.double(), key.double(), key.double(), mask.double(), 0.0, {})
    assert not _kernel_applies(module, query, key, key, None, 0.0, {})  # 2 queries, causality unstated
    assert not _kernel_applies(module, query, key, key, mask, 0.1, {})
    assert not _kernel_applies(module, query, key, key, mask, 0.0, {"softcap": 30.0})
    assert not _kernel_applies(module, torch.randn(1, 4, KERNEL_MAX_QUERIES + 1, 16), key, key, None, 0.0, {})
    small_m.set_kernel_enabled(False)
    try:
        assert not _kernel_applies(module, query, key, key, mask, 0.0, {})
    finally:
        small_m.set_kernel_enabled(True)


def _q8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                  bits: int) -> torch.Tensor:
    """What small_m_blocks_q8 computes, in float64: x quantized per 32 inputs as llama.cpp does
    (q = round-half-even(x * 127 / max|x|), d = max|x| / 127 and s = d * sum(q) in half
    precision), then the exact integer dot product of every block, scaled."""
    rows, k = x.shape
    xb = x.view(rows, k // 32, 32)
    amax = xb.abs().amax(-1)  # [M, nb] float32, as the kernel computes it
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None])  # half to even
    d = (amax / 127.0).half().double()
    s = ((amax / 127.0) * q.sum(-1)).half().double()
    if bits == 4:  # byte j: input j (low nibble) and j + 16 (high)
        packed = codes.view(codes.shape[0], -1, 16).long()
        w = torch.cat([packed & 15, packed >> 4], -1)  # [N, nb, 32]
        if minimum is None:
            w = w - 8
    else:
        w = codes.view(torch.int8).view(codes.shape[0], -1, 32).long()
    dots = torch.einsum("mbi,nbi->mnb", q.long(), w).double()  # exact
    scales = (scale[None] * d.float()[:, None]).double()  # d_w * d_x, multiplied in float32
    y = (dots * scales).sum(-1)
    if minimum is not None:
        y = y + (minimum.double()[None] * s[:, None]).sum(-1)
    return y


@pytest.mark.parametrize(("bits", "with_minimum"), [(4, False), (4, True), (8, False)], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_int8_activation_blocks_compute_the_integer_dot_products_and_a_row_is_the_same_alone(
        cpu_kernel, bits, with_minimum):
    gen = torch.Generator().manual_seed(bits + with_minimum)
    n, k = 45, 96
    codes = torch.randint(0, 256, (n, k // 32 * (16 if bits == 4 else 32)), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    minimum = -torch.rand(n, k // 32, generator=gen) * 0.1 if with_minimum else None
    x = torch.randn(MAX_ROWS, k, generator=gen)
    x[1, 32:64] = 0.0  # an all-zero block
    y = cpu_kernel.small_m_blocks_q8(x, codes, scale, minimum, bits)  # [MAX_ROWS, n]
    torch.testing.assert_close(y.double(), _q8_reference(x, codes, scale, minimum, bits), rtol=1e-5, atol=1e-5)
    for m in range(1, MAX_ROWS + 1):
        assert torch.equal(cpu_kernel.small_m_blocks_q8(x[m - 1 : m], codes, scale, minimum, bits), y[m - 1 : m])
    # a registered layer (on AMX tiles where this CPU has them: up to 16 rows a tile, so 20 rows
    # take two) computes the same integer products; its rows too are the same alone or among others
    handle = cpu_kernel.register_blocks(codes, scale, minimum, bits)
    try:
        x20 = torch.cat([x, x[:4] * 3.0])
        y20 = cpu_kernel.registered_blocks(x20, handle, True)
        torch.testing.assert_close(y20.double(), _q8_reference(x20, codes, scale, minimum, bits), rtol=1e-5, atol=1e-5)
        for m in range(20):
            assert torch.equal(cpu_kernel.registered_blocks(x20[m : m + 1], handle, True), y20[m : m + 1])
        assert torch.equal(cpu_kernel.registered_blocks(x20[5:13], handle, True), y20[5:13])
    finally:
        cpu_kernel.release_blocks(handle)
    # and close to the float product with the blocks' weights (8-bit activations: ~1% of the scale)
    w = cpu_kernel.dequantize_blocks(codes, scale, minimum, bits)
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).abs().max() < 0.02 * exact.abs().max()


def test_a_block_layer_s_registration_follows_the_layer(cpu_kernel):
    """A layer's blocks are registered once (one integer for the graph): a copy, an unpickled
    layer and a moved layer compute the same with their own handles, and a freed layer's blocks
    are released."""
    import copy
    import gc
    import io

    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (40, 3 * 16), generator=gen, dtype=torch.uint8)
    scale = torch.rand(40, 3, generator=gen)
    layer = BlockLinear(codes, scale, -scale, 4, None)
    x = torch.randn(3, 96, generator=gen)
    before = set(small_m._block_rows)
    with torch.no_grad():
        y = layer(x)
        first = layer.handle
        layer.to(torch.float32)  # buffers replaced: registered anew, the old handle released
        assert layer.handle != first and first not in small_m._block_rows
        twin = copy.deepcopy(layer)
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert len({layer.handle, twin.handle, loaded.handle}) == 3
        assert all(torch.equal(m(x), y) for m in (layer, twin, loaded))
    del layer, twin, loaded
    gc.collect()
    assert set(small_m._block_rows) == before - {first}


def _block_layers(gen: torch.Generator, k: int) -> list[BlockLinear]:
    """A Q4_0, a Q4_1 and a Q8_0 layer of input size k, of different output sizes."""
    layers = []
    for n, bits, with_minimum in ((40, 4, False), (24, 4, True), (56, 8, False)):
        codes = torch.randint(0, 256, (n, k // 32 * (16 if bits == 4 else 32)), generator=gen, dtype=torch.uint8)
        scale = torch.rand(n, k // 32, generator=gen) * 0.02
        layers.append(BlockLinear(codes, scale, -scale * 7.5 if with_minimum else None, bits, None))
    return layers


def test_grouped_block_layers_give_each_layer_s_own_bits(cpu_kernel):
    """One call for layers reading the same input (models/block_groups.py) equals one call
    each, bit for bit, for every block type and row count; a layer of another input size is
    refused."""
    gen = torch.Generator().manual_seed(11)
    layers = _block_layers(gen, 96)
    handles = [layer.handle for layer in layers]
    for m in (1, 3, 4, 9, 32):
        x = torch.randn(m, 96, generator=gen)
        grouped = cpu_kernel.registered_blocks_group(x, handles)  # [m, 40 + 24 + 56]
        assert tuple(grouped.shape) == (m, sum(layer.out_features for layer in layers))
        for y, handle in zip(grouped.split([layer.out_features for layer in layers], 1), handles):
            assert torch.equal(y, cpu_kernel.registered_blocks(x, handle, True))
    other = _block_layers(gen, 64)[0]
    with pytest.raises(RuntimeError, match="input size"):
        cpu_kernel.registered_blocks_group(torch.randn(1, 96), [handles[0], other.handle])


def test_the_graph_pass_groups_calls_on_one_input_and_keeps_the_results(cpu_kernel):
    """The compiled step's pass: calls on the same input (each through its own reshape, as a
    model's projections make them) become one grouped call; a call on another input and a
    float-activation call stay as they are; the rewritten graph computes the same bits."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from speclm.models.block_groups import group_block_calls

    gen = torch.Generator().manual_seed(12)
    q, k, v = _block_layers(gen, 96)
    down = _block_layers(gen, 96)[0]  # fed another input

    def block(x, layer, q8=True):
        return torch.ops.speclm.registered_blocks(x.reshape(-1, x.shape[-1]), layer.handle, q8)

    def layer_step(x):  # [1, 2, 96]
        a, b, c = block(x, q), block(x, k), block(x, v)
        h = torch.cat([a, b, c[:, :32]], -1)  # [2, 40 + 24 + 32]: another input
        return a, b, c, block(h, down), block(x, q, q8=False)

    x = torch.randn(1, 2, 96, generator=gen)
    gm = make_fx(layer_step)(x)
    single = torch.ops.speclm.registered_blocks.default
    assert sum(n.target is single for n in gm.graph.nodes) == 5
    assert group_block_calls(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    grouped = [n for n in gm.graph.nodes if n.target is torch.ops.speclm.registered_blocks_group.default]
    assert len(grouped) == 1 and sum(n.target is single for n in gm.graph.nodes) == 2
    for got, want in zip(gm(x), layer_step(x)):
        assert torch.equal(got, want)


def test_a_compiled_step_groups_the_calls_and_computes_the_same_bits(cpu_kernel, monkeypatch):
    """Through inductor as the compiled path runs it (models/compiled_step.py hands it the pass): the
    three projections of one input become one call, and the compiled result equals eager's."""
    from speclm.models import block_groups, compiled_step

    removed = []
    group = block_groups.group_block_calls
    monkeypatch.setattr(block_groups, "group_block_calls", lambda graph: removed.append(group(graph)))

    class Projections(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = _block_layers(torch.Generator().manual_seed(13), 96)

        def forward(self, x):  # [1, T, 96]
            return torch.cat([self.q(x), self.k(x), self.v(x)], -1)

    module = Projections()
    x = torch.randn(1, 3, 96)
    options = dict(compiled_step.compile_options("inductor", None, False), fx_graph_cache=False)  # run the pass
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(module, dynamic=False, options=options)(x)
        assert torch.equal(got, module(x))
    assert removed == [2]


def test_the_compiled_wrapper_calls_every_op_through_its_c_entry_point(cpu_kernel, monkeypatch):
    """The compiled step's wrapper is C++ (models/c_shims.py): each of speclm's ops is called
    through its entry point in small_m_shims.cpp, none through Python, and the compiled result
    has the bits of the ops run one by one (optional tensors given and left out, a bool, a list)."""
    from torch._inductor.utils import run_and_get_cpp_code

    from speclm.models import c_shims, compiled_step

    monkeypatch.setattr(c_shims, "CPP_WRAPPER", True)  # the default, whatever SPECLM_CPP_WRAPPER says
    options = dict(compiled_step.compile_options("inductor", None, False), fx_graph_cache=False)
    assert options.get("cpp_wrapper") is True
    gen = torch.Generator().manual_seed(14)
    q, k, v = _block_layers(gen, 96)
    weight = torch.randn(24, 96, generator=gen)
    query, key, value = (torch.randn(1, 3, 2, 16, generator=gen), torch.randn(1, 1, 40, 16, generator=gen),
                         torch.randn(1, 1, 40, 16, generator=gen))
    mask = torch.zeros(1, 1, 2, 40)
    mask[..., 30:] = torch.finfo(torch.float32).min

    def step(x):  # [2, 96]
        ops = torch.ops.speclm
        qkv = [ops.registered_blocks(x, layer.handle, True) for layer in (q, k, v)]  # grouped by the pass
        return (*qkv, ops.registered_blocks(x, q.handle, False), ops.small_m_mm(x, weight),
                ops.small_m_blocks(x, k.codes, k.scale, k.minimum, k.bits),
                ops.small_m_blocks_q8(x, q.codes, q.scale, q.minimum, q.bits),
                ops.dequantize_blocks(v.codes, v.scale, v.minimum, v.bits) * 2,
                ops.small_m_attention(query * x[0, 0], key, value, mask, 0.25),
                ops.small_m_attention(query, key, value, None, 0.25))

    x = torch.randn(2, 96, generator=gen)
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        got, code = run_and_get_cpp_code(torch.compile(step, dynamic=False, options=options), x)
    for a, b in zip(got, step(x), strict=True):
        assert torch.equal(a, b)
    assert "PyObject_CallObject" not in code  # no op went back through Python
    for name in c_shims.DECLARATIONS:
        assert f"aoti_torch_cpu_{name}(" in code, name


def test_a_step_with_the_c_wrapper_is_kept_in_inductor_s_graph_cache(cpu_kernel, monkeypatch, tmp_path):
    """The wrapper's options pickle (inductor keys its on-disk graph cache by them), so a step
    compiled once is loaded, not compiled again, by the next compile (the next process); the
    wrapper is built in a file of its own (at -O2), the fused loops in another."""
    import pickle

    from torch._dynamo.utils import counters

    from speclm.models import c_shims, compiled_step

    monkeypatch.setattr(c_shims, "CPP_WRAPPER", True)
    monkeypatch.setattr(c_shims, "WRAPPER_OPT_LEVEL", "O2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    options = compiled_step.compile_options("inductor", None, False)
    assert options["aot_inductor.compile_wrapper_opt_level"] == "O2" and options["cpp_wrapper_build_separate"]
    table = options["aot_inductor.custom_ops_to_c_shims"]
    assert pickle.loads(pickle.dumps(table)) == table
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 96)
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
            out = torch.compile(lambda x: torch.ops.speclm.small_m_mm(x, weight) * 2, dynamic=False,
                                options=options)(x)
        runs.append((out, dict(counters["inductor"])))
    assert runs[0][1].get("fxgraph_cache_miss") == 1 and runs[1][1].get("fxgraph_cache_hit") == 1, runs
    assert len(list(tmp_path.rglob("*.main.cpp"))) == 1 and len(list(tmp_path.rglob("*.optimized.cpp"))) == 1
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][0], torch.ops.speclm.small_m_mm(x, weight) * 2)


def test_attention_kernel_keeps_a_nan_score_nan(cpu_kernel):
    """A NaN key makes every query row that sees it NaN, as in SDPA (the vectorized exponential
    must not turn it into a zero weight)."""
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 1, 40, 16, generator=gen),
                         torch.randn(1, 1, 40, 16, generator=gen))
    key[0, 0, 7, 3] = float("nan")
    assert torch.isnan(cpu_kernel.small_m_attention(query, key, value, None, 0.25)).all()
    assert torch.isnan(F.scaled_dot_product_attention(query, key.expand(1, 2, 40, 16), value.expand(1, 2, 40, 16),
                                                      scale=0.25)).all()


def test_an_unknown_isa_request_is_named_and_ignored(monkeypatch, caplog):
    """SPECLM_CPU_ISA picks a lower build to compare; a value it does not know is said, not dropped
    silently, and the build follows the CPU."""
    monkeypatch.delenv(small_m.ISA_ENV, raising=False)
    found = small_m.isa()
    monkeypatch.setenv(small_m.ISA_ENV, "avx9000")
    with caplog.at_level("WARNING", logger=small_m.__name__):
        assert small_m.isa() == found
    assert "avx9000" in caplog.text and "avx2" in caplog.text
    caplog.clear()
    monkeypatch.setenv(small_m.ISA_ENV, "avx2")
    with caplog.at_level("WARNING", logger=small_m.__name__):
        assert small_m.isa() == "avx2"
    assert caplog.text == ""


_REGISTERED_PRODUCTS = """
import sys, torch
from speclm.models import small_m
assert small_m.kernel_available() and small_m.isa() == sys.argv[2], small_m.isa()
gen = torch.Generator().manual_seed(11)
out = {}
for bits, with_minimum in ((4, False), (4, True), (8, False)):
    n, k = 37, 128  # 37 weight rows: a last group of 5 (one half-empty 8-lane half on AVX2)
    codes = torch.randint(0, 256, (n, k // 32 * (16 if bits == 4 else 32)), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) * 0.02
    minimum = -torch.rand(n, k // 32, generator=gen) * 0.1 if with_minimum else None
    x = torch.randn(21, k, generator=gen)
    handle = torch.ops.speclm.register_blocks(codes, scale, minimum, bits)
    out[f"{bits}-{with_minimum}"] = torch.ops.speclm.registered_blocks(x, handle, True)
torch.save(out, sys.argv[1])
"""


def test_every_build_s_tile_products_have_the_same_bits(cpu_kernel, tmp_path):
    """The AVX2 build's products on the tile layout (small_m_tiles_avx2.cpp) and the AVX-512
    VNNI / AMX ones compute the same exact integer dots and then the same float operations, so
    a registered layer's output is the same bits on either build. Runs where the CPU has more
    than AVX2 (the AVX2 build in a child process, SPECLM_CPU_ISA=avx2, about a minute to build
    once); on an AVX2-only CPU the products are checked against the exact reference above."""
    import os
    import subprocess
    import sys

    if small_m.isa() == "avx2":
        pytest.skip("an AVX2-only CPU: no second build to compare with")
    outputs = {}
    for isa in ("avx2", small_m.isa()):
        env = {**os.environ, small_m.ISA_ENV: isa, "OMP_NUM_THREADS": "1"}
        path = tmp_path / f"{isa}.pt"
        subprocess.run([sys.executable, "-c", _REGISTERED_PRODUCTS, str(path), isa], env=env, check=True, timeout=600)
        outputs[isa] = torch.load(path)
    avx2, other = outputs["avx2"], outputs[small_m.isa()]
    assert avx2.keys() == other.keys()
    for key in avx2:
        assert torch.equal(avx2[key], other[key]), key
