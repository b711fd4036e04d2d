"""The compiled fast path (models/compiled.py) against the eager reference backend.

On tiny random Llama models: chain and tree logits match HFCausalLM's, rollback and compaction
behave like the eager cache, greedy generation (plain, prompt lookup, a draft model) is token-
identical to eager plain decoding, and int8/int4 weight-only quantization stays close to the float
model and lossless with respect to its own plain decoding. Most checks compile with torch.compile's
``aot_eager`` backend (the same tracing, padding and static cache, compiled in a second); the
greedy identity checks also run under inductor, the backend used for real.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from speclm.drafters.draft_model import DraftModelDrafter
from speclm.drafters.ngram import NgramDrafter
from speclm.engine import generate_tokens
from speclm.errors import CacheContractError, SpeclmError
from speclm.models.compiled import CompiledCausalLM, fast_dtype, make_compiled
from speclm.models.quantize import Int4Linear, Int8Linear, quantize_weights
from speclm.sampling import SamplingParams
from speclm.tree import TreeMeta

from .conftest import backend, noisy_copy, tiny_model

pytestmark = pytest.mark.compiled
VOCAB = 300
EOS = frozenset({0})


@pytest.fixture(scope="module")
def target64():
    return tiny_model(VOCAB, seed=0)


@pytest.fixture(scope="module")
def quick(target64) -> CompiledCausalLM:
    """aot_eager, small cache buckets so that requests cross capacities."""
    return make_compiled(target64, EOS, buckets=(1, 2, 4, 8), capacities=(32, 64, 264),
                         compile_backend="aot_eager")


@pytest.fixture(scope="module")
def inductor(target64) -> CompiledCausalLM:
    model = make_compiled(target64, EOS, buckets=(1, 8), capacities=(264,))
    model.warmup()
    return model


@pytest.fixture(scope="module")
def target32():
    return tiny_model(VOCAB, seed=0).float()


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _same(a, b, tol=1e-9):
    torch.testing.assert_close(a.logits.double(), b.logits.double(), rtol=tol, atol=tol)


def _greedy(model, prompt, drafter=None, max_tokens=40) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [t for step in generate_tokens(model, prompt, params, drafter=drafter) for t in step.tokens]


def _repetitive_prompt() -> torch.Tensor:
    return torch.cat([_ids(12, 1), _ids(12, 1), _ids(5, 2)])  # prompt lookup finds matches


@pytest.mark.parametrize("which", ["quick", "inductor"])
def test_chain_logits_match_eager(request, target64, which):
    fast, ref = request.getfixturevalue(which), backend(target64)
    tol = 1e-9 if which == "quick" else 1e-5  # inductor reorders float64 sums (and rounds via RMSNorm's float32)
    fast.reset()
    ids = _ids(80)
    _same(fast.forward(ids[:20], 0, num_logits=20), ref.forward(ids[:20], 0, num_logits=20), tol)  # eager prefill
    pos = 20
    for t in (1, 3, 2, 8, 5, 1, 7, 4, 6):  # crosses the 32- and 64-slot capacities (quick)
        _same(fast.forward(ids[pos : pos + t], pos, num_logits=t), ref.forward(ids[pos : pos + t], pos, num_logits=t), tol)
        pos += t
    assert fast.cache_length == ref.cache_length == pos


def test_tree_logits_match_eager(quick, target64):
    ref = backend(target64)
    for m in (quick, ref):
        m.reset()
        m.forward(_ids(30), 0)
    tree = TreeMeta.from_parents([-1, -1, 0, 0, 1])
    fed = _ids(6, 3)  # [pending, 5 nodes]
    _same(quick.forward(fed, 30, num_logits=6, tree=tree), ref.forward(fed, 30, num_logits=6, tree=tree))
    for m in (quick, ref):  # keep the path pending -> n1 -> n4
        m.compact(31, [1, 4])
    nxt = _ids(2, 4)
    _same(quick.forward(nxt, 33, num_logits=2), ref.forward(nxt, 33, num_logits=2))
    # a tree fed level by level: the last rows of [pending, nodes], earlier ones cached
    for m in (quick, ref):
        m.rollback(30)
    first = TreeMeta.from_parents([-1, -1])
    _same(quick.forward(fed[:3], 30, num_logits=3, tree=first), ref.forward(fed[:3], 30, num_logits=3, tree=first))
    _same(quick.forward(fed[3:], 33, num_logits=3, tree=tree), ref.forward(fed[3:], 33, num_logits=3, tree=tree))


def test_rollback_compact_and_contract(quick, target64):
    ref = backend(target64)
    ids = _ids(60)
    for m in (quick, ref):
        m.reset()
        m.forward(ids[:25], 0)
        m.forward(ids[25:29], 25, num_logits=4)
        m.rollback(27)
        m.compact(24, [0, 2])  # drops position 25
        assert m.cache_length == 26
    _same(quick.forward(ids[40:43], 26, num_logits=3), ref.forward(ids[40:43], 26, num_logits=3))
    with pytest.raises(CacheContractError):
        quick.forward(ids[:1], 5)
    with pytest.raises(CacheContractError):
        quick.rollback(100)
    with pytest.raises(CacheContractError):
        quick.compact(20, [0, 50])
    quick.reset()
    assert quick.cache_length == 0


@pytest.mark.parametrize("fed", [10, 3])  # 10 tokens: past the largest bucket, eager; 3: compiled
def test_hidden_states_of_selected_layers(quick, target64, fed):
    """A drafter's feature layers come back from the compiled step (a graph per layer set) as
    from the eager one: equal to the reference, indexed by layer, None where not asked."""
    ref = backend(target64)
    for m in (quick, ref):
        m.reset()
        m.forward(_ids(5, 3), 0)
    graphs = set(quick._step.seen_hidden)
    a = quick.forward(_ids(fed), 5, num_logits=2, return_hidden=[0, -1])
    b = ref.forward(_ids(fed), 5, num_logits=2, return_hidden=[0, -1])
    _same(a, b)
    for layer in (0, -1):
        torch.testing.assert_close(a.hidden_states[layer], b.hidden_states[layer], rtol=0, atol=1e-10)
        assert a.hidden_states[layer].shape == (fed, target64.config.hidden_size)
    assert a.hidden_states[1] is None and quick.cache_length == 5 + fed
    if fed == 3:
        assert ((4,), (0, target64.config.num_hidden_layers)) in quick._step.seen_hidden
    else:
        assert quick._step.seen_hidden == graphs


def test_the_first_graph_with_hidden_states_is_one_graph():
    """transformers installs its hidden-state hooks on the first forward that asks for hidden
    states; traced inside the step, that broke the first such graph in two (two graphs a call,
    ~1.8x a plain step). The step installs them eagerly first: no graph break."""
    from torch._dynamo.utils import counters

    fresh = make_compiled(tiny_model(VOCAB, seed=4), EOS, buckets=(1, 4), capacities=(32,),
                          compile_backend="aot_eager")
    fresh.forward(_ids(5, 3), 0)
    before = sum(counters["graph_break"].values())
    out = fresh.forward(_ids(1), 5, return_hidden=[0, -1])
    assert out.hidden_states[-1].shape[0] == 1
    assert sum(counters["graph_break"].values()) == before


def test_fork_shares_weights_and_step(quick, target64):
    other = quick.fork()
    assert other.model is quick.model and other._step is quick._step
    ids = _ids(12)
    quick.reset()
    quick.forward(ids[:9], 0)
    other.reset()
    out = other.forward(ids[:4], 0, num_logits=4)
    assert other.cache_length == 4 and quick.cache_length == 9
    _same(out, backend(target64).forward(ids[:4], 0, num_logits=4))


@pytest.mark.parametrize("which", ["quick", "inductor"])
def test_greedy_identity(request, target64, which):
    fast = request.getfixturevalue(which)
    prompt = _repetitive_prompt()
    expected = _greedy(backend(target64), prompt)
    assert _greedy(fast, prompt) == expected
    assert _greedy(fast, prompt, NgramDrafter(2, 3)) == expected
    draft = make_compiled(noisy_copy(target64, 0.05, seed=1), EOS, buckets=fast.buckets,
                          capacities=fast.capacities, compile_backend=fast.compile_backend)
    assert _greedy(fast, prompt, DraftModelDrafter(draft, VOCAB)) == expected
    assert fast._step.direct_calls > 0  # proven graphs ran without dynamo (models/direct_call.py)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_close_and_lossless(target32, scheme):
    q = make_compiled(target32, EOS, quantize=scheme, buckets=(1, 2, 4, 8), capacities=(264,),
                      compile_backend="aot_eager")
    assert q.model is not target32 and q.backend_name == f"torch-compiled+{scheme}"
    kinds = {type(m) for m in q.model.modules()}
    assert (Int8Linear if scheme == "int8" else Int4Linear) in kinds and torch.nn.Linear not in kinds
    ids = _ids(20)
    a = q.forward(ids, 0, num_logits=20).logits
    b = backend(target32).forward(ids, 0, num_logits=20).logits
    err = (a - b).norm() / b.norm()
    assert err < (0.05 if scheme == "int8" else 0.6), float(err)  # errors compound through the layers
    prompt = _repetitive_prompt()
    assert _greedy(q, prompt, NgramDrafter(2, 3)) == _greedy(q, prompt)


def test_bfloat16_int8_inductor(target32):
    """bf16 activations, int8 weights: compiled for real, against the traced reference."""
    ids = _ids(3)
    outs = []
    for how in ("inductor", "aot_eager"):
        fast = make_compiled(target32, EOS, dtype=torch.bfloat16, quantize="int8", buckets=(4,),
                             capacities=(264,), compile_backend=how)
        assert fast.model.get_output_embeddings().scales.dtype == torch.bfloat16 and fast.vocab_size == VOCAB
        outs.append(fast.forward(ids, 0, num_logits=3).logits)
    assert outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=0.02, atol=0.05)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_layers(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 300, dtype=dtype)  # 300 outputs: int4 pads to whole tiles
    x = torch.randn(5, 256, dtype=dtype)
    with torch.no_grad():
        ref = linear(x).float()
        for make, tol in ((Int8Linear, 0.01), (Int4Linear.from_linear, 0.08)):  # int4: ~range / 15
            out = make(linear)(x)
            assert out.dtype == dtype and out.shape == (5, 300)
            assert float((out.float() - ref).norm() / ref.norm()) < tol, make


def test_rounded_layers_multiply_bfloat16_on_cpu():
    """PyTorch's CPU weight-only kernels loop scalar over float32 activations (10-50x slower):
    a float32 model's rounded layers multiply in bfloat16 there and hand back float32 rows."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48)
    x = torch.randn(3, 128)
    with torch.no_grad():
        for layer in (Int8Linear(linear), Int4Linear.from_linear(linear)):
            stored = layer.scales if isinstance(layer, Int8Linear) else layer.scales_and_zeros
            assert stored.dtype == torch.bfloat16, type(layer)
            out = layer(x)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, layer(x.bfloat16()).float(), rtol=0, atol=0)


def test_bfloat16_step_keeps_float32_logits(target32):
    fast = make_compiled(target32, EOS, dtype=torch.bfloat16, buckets=(1, 4), capacities=(264,),
                         compile_backend="aot_eager")
    assert fast.dtype == torch.bfloat16 and next(target32.parameters()).dtype == torch.float32
    out = fast.forward(_ids(3), 0, num_logits=2)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, VOCAB)
    ref = backend(copy.deepcopy(target32).to(torch.bfloat16))  # the same rounding, eagerly
    expected = ref.forward(_ids(3), 0, num_logits=2).logits.float()
    assert float((out.logits - expected).norm() / expected.norm()) < 0.02
    assert fast_dtype("cpu") in (torch.bfloat16, torch.float32)


def test_auto_dtype_runs_a_ggufs_blocks_in_float32_where_the_block_kernel_runs(monkeypatch):
    """dtype="auto" with quantize="gguf" keeps float32 where speclm's block kernel runs (bfloat16
    would put the file's blocks on int4 kernels, not llama.cpp's arithmetic), else the fast dtype."""
    from speclm.models import small_m
    from speclm.models.compiled import auto_dtype

    cpu = torch.device("cpu")
    monkeypatch.setattr(small_m, "kernel_available", lambda: True)
    assert auto_dtype(cpu, "gguf") == torch.float32
    assert auto_dtype(cpu, "int4") == auto_dtype(cpu, None) == fast_dtype(cpu)
    monkeypatch.setattr(small_m, "kernel_available", lambda: False)
    assert auto_dtype(cpu, "gguf") == fast_dtype(cpu)


def test_clear_errors(target64, target32):
    with pytest.raises(SpeclmError, match="unknown quantization"):
        make_compiled(target32, EOS, quantize="int3")
    with pytest.raises(SpeclmError, match="float32, bfloat16 or float16"):
        make_compiled(target64, EOS, quantize="int8")
    torch.manual_seed(0)
    odd = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96,
                                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(SpeclmError, match="divisible by 32"):
        quantize_weights(odd, "int4")
    assert not any(isinstance(m, Int4Linear) for m in odd.modules())  # left untouched
    with pytest.raises(SpeclmError, match="buckets"):
        make_compiled(target64, EOS, buckets=(0, 4))


@pytest.mark.real_model
def test_real_model_greedy_identity():
    from speclm.models import load_model
    from speclm.prompts import encode_user_turn

    loaded = load_model("default", backend="torch")
    eager = loaded.backend
    # one bucket: the decode step pads its token to 8, so one graph (minutes to compile from a cold
    # cache on 2 cores) serves both the plain and the speculative rounds
    fast = make_compiled(eager.model, eager.eos_token_ids, buckets=(8,))
    fast.warmup()
    prompt = torch.tensor(encode_user_turn(loaded.tokenizer, "List three facts about the Moon."))
    expected = _greedy(eager, prompt, max_tokens=32)
    assert _greedy(fast, prompt, max_tokens=32) == expected
    assert _greedy(fast, prompt, NgramDrafter(1, 3), max_tokens=32) == expected


def test_api_and_cli_select_the_fast_path(model_dirs, capsys):
    """LLM(compile=True) / --compile run the compiled backend (stats say so) and give plain
    eager decoding's greedy tokens in float64; layer drafters refuse it in one line. K = 1:
    the warm-up compiles the 1- and 2-token graphs only (each ~25 s from a cold cache), which
    the CLI's run with --draft-max 1 then finds in the cache."""
    from speclm import LLM, SamplingParams
    from speclm.cli import main

    eager = LLM(str(model_dirs["target"]), "ngram", 1, dtype="float64", backend="torch")
    fast = LLM(str(model_dirs["target"]), "ngram", 1, dtype="float64", compile=True)
    assert fast.backend_name == "torch-compiled" and eager.backend_name == "torch"
    params = SamplingParams(max_tokens=24)
    want = eager.generate("the quick brown fox", params, speculative=False)[0].token_ids
    got = fast.generate("the quick brown fox", params)[0]
    assert got.token_ids == want and got.stats.backend == "torch-compiled"
    with pytest.raises(SpeclmError, match="--backend torch"):
        fast.make_speculation("early-exit")
    assert main(["generate", "--model", str(model_dirs["target"]), "--compile", "--dtype", "float64",
                 "--draft-max", "1", "-n", "8", "--raw", "the quick"]) == 0
    assert "on torch-compiled" in capsys.readouterr().err


def test_bfloat16_cast_keeps_rotary_frequencies_float32(target32):
    """Casting a float32 model to bfloat16 must not round RoPE's inv_freq (it garbles long
    prompts): the fast path keeps it float32, as transformers does when loading in bfloat16."""
    fast = make_compiled(target32, frozenset({0}), dtype=torch.bfloat16, compile_backend="aot_eager")
    rotary = {n: b for n, b in fast.model.named_buffers() if "inv_freq" in n}
    assert rotary and all(b.dtype == torch.float32 for b in rotary.values())
    assert torch.equal(rotary["model.rotary_emb.inv_freq"],
                       dict(target32.named_buffers())["model.rotary_emb.inv_freq"])
    assert next(fast.model.parameters()).dtype == torch.bfloat16


def test_warmup_shows_its_progress_graph_by_graph(target64, capsys):
    """Compiling is minutes of silence on a slow CPU: the warm-up counts its graphs on stderr, and
    a second warm-up for the same shapes compiles and prints nothing."""
    fast = make_compiled(target64, EOS, buckets=(1, 2, 4), capacities=(32, 64), compile_backend="aot_eager")
    fast.warmup()
    err = capsys.readouterr().err
    assert "3 token counts" in err and "3/3" in err
    assert fast.warmup() == 0.0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["aot_eager", "inductor"])
def test_one_graph_per_token_count_serves_every_cache_size(target64, how):
    """The cache's capacity is a dynamic dimension of the graphs: a request that grows the cache
    past the sizes seen at warm-up runs the graphs already compiled (no compile in the middle of
    a request, 30-70 s a graph on 2 cores), with the eager backend's logits."""
    from torch._dynamo.utils import counters

    fast = make_compiled(target64, EOS, buckets=(1, 4), capacities=(32, 64, 264), compile_backend=how)
    ref = backend(target64)
    fast.warmup()
    compiled = counters["stats"]["unique_graphs"]
    prompt = _ids(20, 5)
    tol = 1e-9 if how == "aot_eager" else 1e-5
    for m in (fast, ref):
        m.reset()
        m.forward(prompt, 0)
    pos, sizes = 20, set()
    while pos < 90:  # one token, then four, across the 32-, 64- and 264-slot buffers
        fed = _ids(1 if pos % 2 else 4, pos)
        _same(fast.forward(fed, pos, num_logits=len(fed)), ref.forward(fed, pos, num_logits=len(fed)), tol)
        pos += len(fed)
        sizes.add(fast._cache.capacity)
    assert sizes == {32, 64, 264}
    assert counters["stats"]["unique_graphs"] == compiled and fast._step.seen == {(1,), (4,)}


def test_warmup_compiles_up_to_a_trees_node_budget(target64):
    """A token tree verifies up to its node budget, more than the draft cap K: warming up for
    an EAGLE tree compiles the feature steps up to 1 + budget tokens, so that no graph is
    compiled inside a request (a bench's or a server's)."""
    from speclm.api import LLM, Speculation
    from speclm.draft_length import DraftLengthConfig
    from speclm.drafters.eagle import EagleDrafter
    from speclm.drafters.tree_search import TreeShape
    from speclm.learned.modules import EagleHead

    fast = make_compiled(target64, EOS, buckets=(1, 2, 4, 8, 16, 32), capacities=(64,),
                         compile_backend="aot_eager")
    head = EagleHead.create(target64, [1, 2], torch.arange(VOCAB)).double()
    embed = target64.get_input_embeddings()
    llm = LLM.__new__(LLM)
    llm.target = fast
    for shape, top in ((None, 4), (TreeShape(top_k=3, budget=10), 16)):  # K = 3: 4 tokens; 11
        drafter = EagleDrafter(head, embed, [1, 2], VOCAB, shape)
        llm.warmup(Speculation(drafter, DraftLengthConfig(3, 0, True), "eagle"))
        assert {key[0][0] for key in fast._step.seen_hidden} == {b for b in (1, 2, 4, 8, 16) if b <= top}
