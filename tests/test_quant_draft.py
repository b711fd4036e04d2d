"""The quantized self-draft (drafters/quant.py): the target's own weights at fewer bits draft.

On tiny float64 Llama models: the int8/int4 copy really is quantized (its logits differ from the
target's) and shares the target's unquantized tensors, yet greedy output is token-identical to
plain decoding (chains, trees, eager and compiled targets, through the API) and sampled output
follows the target's exact distribution (chi-square); rows of a server share one loaded copy;
bad options fail in one line. The GGUF requantization cache is tested with a stand-in for
llama.cpp's quantizer, and on the real default model with llama.cpp itself (``real_model``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from speclm import LLM, SamplingParams, SpeclmError
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter
from speclm.drafters.quant import quant_draft
from speclm.drafters.registry import parse_drafter
from speclm.drafters.tree_search import TreeShape
from speclm.models.quantize import Int4Linear, Int8Linear, quantized_copy
from speclm.models.small_m import BlockLinear

from .conftest import backend, tiny_model
from .test_lossless import assert_matches_distribution, prompts, run, sampling_setup

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_model(VOCAB, seed=10, seed_layers=4)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_copy_is_quantized_and_shares_the_rest(scheme):
    model = tiny_model(VOCAB, seed=10, seed_layers=4).float()
    copy = quantized_copy(model, scheme)
    from speclm.models.small_m import kernel_available

    kind = BlockLinear if kernel_available() else Int8Linear if scheme == "int8" else Int4Linear
    assert {type(m) for m in copy.modules()} >= {kind} and torch.nn.Linear not in {type(m) for m in copy.modules()}
    assert any(isinstance(m, torch.nn.Linear) for m in model.modules())  # the target is untouched
    assert copy.model.embed_tokens.weight is model.model.embed_tokens.weight  # shared, not copied
    assert copy.model.norm.weight is model.model.norm.weight
    ids = prompts(1)[0]
    a = backend(model).forward(ids, 0, num_logits=ids.shape[0]).logits
    b = backend(copy).forward(ids, 0, num_logits=ids.shape[0]).logits
    err = float((a - b).norm() / a.norm())
    assert 1e-4 < err < (0.05 if scheme == "int8" else 0.6), err  # really quantized, still close


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float32_copy_is_llama_cpp_blocks_on_the_kernel(cpu_kernel, scheme):
    """int8: Q8_0 (scale = absmax / 127 per 32 inputs); int4: Q4_1 (scale = range / 15 and the
    minimum per 32 inputs); either rounds each weight to the nearest code."""
    model = tiny_model(VOCAB, seed=10, seed_layers=2).float()
    copy = quantized_copy(model, scheme)
    pairs = [(name, m) for name, m in copy.named_modules() if isinstance(m, BlockLinear)]
    assert pairs and not any(isinstance(m, (Int8Linear, Int4Linear)) for m in copy.modules())
    for name, layer in pairs:
        w = model.get_submodule(name).weight.detach()  # [N, K]
        blocks = w.view(w.shape[0], -1, 32)
        if scheme == "int8":
            scale = blocks.abs().amax(dim=2) / 127
            assert layer.bits == 8 and layer.minimum is None
        else:
            scale = (blocks.amax(dim=2) - blocks.amin(dim=2)) / 15
            assert layer.bits == 4 and torch.allclose(layer.minimum, blocks.amin(dim=2))
        assert torch.allclose(layer.scale, scale, rtol=1e-5)
        err = (layer.dequantized() - w).abs().view_as(blocks)
        assert bool((err <= scale[..., None] / 2 * (1 + 1e-4) + 1e-7).all())  # round to nearest
        assert float(err.max()) > 0  # really rounded
    ids = torch.arange(0, VOCAB, 2)
    head = quantized_copy(model, scheme, vocab=ids).get_output_embeddings().layer  # rows built outside no_grad
    assert isinstance(head, BlockLinear)
    assert not any(t.requires_grad for t in (head.codes, head.scale, head.minimum) if t is not None)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tree", [None, TreeShape(top_k=2, budget=6)], ids=["chain", "tree"])
def test_greedy_identity_eager(target, bits, tree):
    lm = backend(target)
    key, make = quant_draft(lm, bits)
    draft = make()
    assert draft.model is not target and draft.dtype == torch.float32  # float64 is copied in float32
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    accepted = rejected = 0
    for i, prompt in enumerate(prompts(6, seed=bits)):
        plain, _ = run(lm, prompt, greedy)
        k = (1, 3, 6)[i % 3]
        spec, stats = run(lm, prompt, greedy, DraftModelDrafter(draft, VOCAB, tree=tree),
                          DraftLengthConfig(draft_max=k, adaptive=i % 2 == 0))
        assert spec == plain, f"prompt {i}: quant-drafted output diverged from plain greedy"
        accepted += stats.accepted_tokens
        rejected += stats.drafted_tokens - stats.accepted_tokens
    assert accepted > 0 and (rejected > 0 or tree is not None)  # partial acceptance: not the target


def test_greedy_identity_compiled_target(target):
    from speclm.models.compiled import make_compiled

    fast = make_compiled(target, frozenset({0}), buckets=(1, 4, 8), capacities=(264,),
                         compile_backend="aot_eager")
    _, make = quant_draft(fast, 4)
    draft = make()
    assert draft.backend_name == "torch-compiled+int4" and draft.buckets == fast.buckets
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    accepted = 0
    for prompt in prompts(3, seed=5):
        plain, _ = run(backend(target), prompt, greedy)
        spec, stats = run(fast, prompt, greedy, DraftModelDrafter(draft, VOCAB), DraftLengthConfig(4, adaptive=False))
        assert spec == plain
        accepted += stats.accepted_tokens
    assert accepted > 0


def test_compiled_draft_compiles_nothing_when_the_cache_grows(target):
    """A long request grows the draft's cache with the target's: the draft's graphs, compiled
    when it is built, serve the larger cache sizes too (none compiled mid-request)."""
    from torch._dynamo.utils import counters

    from speclm.models.compiled import make_compiled

    fast = make_compiled(target, frozenset({0}), buckets=(1, 4), capacities=(64, 128, 256),
                         compile_backend="aot_eager")
    draft = quant_draft(fast, 4)[1]()
    graphs, seen = counters["stats"]["unique_graphs"], set(draft._step.seen)
    assert seen == {(1,), (4,)}
    draft.forward(torch.randint(1, VOCAB, (100,)), 0)  # a long prompt: eager, into the 128-slot buffers
    for pos in range(100, 140):  # then steps over them, and over the 256-slot ones
        draft.forward(torch.tensor([7]), pos)
    assert draft._cache.capacity == 256
    assert draft._step.seen == seen and counters["stats"]["unique_graphs"] == graphs


def test_compiled_draft_runs_a_long_catch_up_eagerly(target):
    """The draft compiles the token buckets its warmup covers and no others: a feed longer than
    those (a row's first catch-up on its prompt) runs eagerly, not through a graph compiled in
    the middle of a request, and computes the same logits."""
    from speclm.models.compiled import make_compiled

    fast = make_compiled(target, frozenset({0}), buckets=(1, 4, 16, 32), capacities=(64, 128),
                         compile_backend="aot_eager")
    draft = quant_draft(fast, 4)[1]()
    assert draft._step.seen == {(1,), (4,), (16,)} and draft.buckets == (1, 4, 16)
    ids = torch.randint(1, VOCAB, (30,), generator=torch.Generator().manual_seed(4))
    whole = draft.forward(ids[:20], 0, num_logits=20).logits  # 20 tokens: past the 16 bucket
    assert draft._step.seen == {(1,), (4,), (16,)}
    draft.reset()
    draft.forward(ids[:10], 0)
    parts = draft.forward(ids[10:20], 10, num_logits=10).logits  # the 16 graph
    torch.testing.assert_close(parts, whole[-10:], atol=1e-4, rtol=1e-4)


def test_api_greedy_identity_and_rows_share_one_copy(model_dirs):
    llm = LLM(str(model_dirs["target"]), "quant:bits=8", 4, dtype="float64", adaptive_draft=False)
    assert llm.speculation.name == "quant[8-bit]"
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for text in ("the quick brown fox", "def add(a, b):"):
        spec = llm.generate(text, params)[0]
        plain = llm.generate(text, params, speculative=False)[0]
        assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0
    rows = llm.row_drafters("quant:bits=4,tree=2,budget=6")
    first, second = rows.factory(None), rows.factory(None)
    assert first.model is not second.model  # a cache per row ...
    assert first.model.model is second.model.model  # ... over one quantized copy
    assert first.tree is not None


@pytest.mark.parametrize("narrow", [False, True], ids=["every-token", "likeliest-left-out"])
def test_sampling_matches_target_distribution(narrow):
    """Also with ``vocab=``: q_draft 0 on two of five tokens, the target's likeliest first token
    among them (models/vocab_subset.py), so the verifier's residual must put their mass back."""
    vocab, length, n = 5, 3, 1500
    target_model, lm, params, prompt, expected = sampling_setup(vocab, length)
    ids = None
    if narrow:
        first = int(torch.argmax(lm.forward(prompt, 0).logits[-1]))
        lm.reset()
        ids = torch.tensor([i for i in range(vocab) if i not in (first, (first + 1) % vocab)])
    _, make = quant_draft(lm, 4, vocab=ids)
    drafter = DraftModelDrafter(make(), vocab)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    accepted = rejected = 0
    for _ in range(n):
        seq, stats = run(lm, prompt, params, drafter, DraftLengthConfig(draft_max=2), gen)
        counts[(torch.tensor(seq) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
        accepted += stats.accepted_tokens
        rejected += stats.drafted_tokens - stats.accepted_tokens
    assert accepted > n // (20 if narrow else 10) and rejected > 0  # q really differs from p
    assert_matches_distribution(counts, expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_rows_draft_on_the_targets_cache(bits):
    """On eager torch's batched rows (a server), the copy's chains run on the target's own
    cache: every row's member is in one group over one copy, the copy never sees a prompt (each
    of its forwards feeds one token per row: no draft prefill, no catch-up), the drafts are the
    copy's (it really runs), and greedy and seeded sampled rows give plain decoding's tokens."""
    from speclm.drafters.quant import shared_cache_member
    from speclm.drafters.shared_cache import SharedCacheMember
    from speclm.engine import Engine
    from speclm.models.rows import make_rows

    from .test_batch import drive

    lm = backend(tiny_model(VOCAB, seed=10, seed_layers=4).float())
    key, make = quant_draft(lm, bits)
    built = []
    members = []

    def factory(handle):
        member = shared_cache_member(handle, key, lambda: built.append(1) or make(), 0.0)
        members.append(member)
        return member

    reqs = prompts(5, seed=21)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=20, seed=60 + i, ignore_eos=True)
              if i % 2 else SamplingParams(max_tokens=20, ignore_eos=True) for i in range(len(reqs))]
    solo = [run(lm, p, sp, gen=sp.make_generator())[0] for p, sp in zip(reqs, params)]
    engine = Engine(make_rows(lm, 4), drafter_factory=factory, draft_length=DraftLengthConfig(3, 0, adaptive=False))
    engine.add("warm", reqs[0], params[0])  # the group (and its copy) exists once a row has joined
    engine.step()
    group = members[0].batch_group
    widths = []
    hook = group.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    engine.abort("warm")
    out = drive(engine, {0: [(str(i), p, sp) for i, (p, sp) in enumerate(zip(reqs, params))]})
    hook.remove()
    assert [out[str(i)][0] for i in range(len(reqs))] == solo
    assert built == [1] and all(isinstance(m, SharedCacheMember) and m.batch_group is group for m in members)
    assert widths and set(widths) == {1}  # one token per row per forward: the prompts are the target's
    assert any(isinstance(m, (BlockLinear, Int8Linear if bits == 8 else Int4Linear)) for m in group.model.modules())
    drafted = sum(out[str(i)][2].drafted_tokens for i in range(len(reqs)))
    accepted = sum(out[str(i)][2].accepted_tokens for i in range(len(reqs)))
    assert drafted > 0 and accepted > 0


def test_batched_rows_on_the_targets_cache_match_the_target_distribution():
    """Sampled chains of the copy on the target's cache, verified in batches of 24 ragged rows
    (seeded and unseeded): each kind of row follows the target's exact distribution."""
    from speclm.drafters.quant import shared_cache_member
    from speclm.engine import Engine
    from speclm.models.rows import make_rows

    from .test_batch import assert_ragged_rows_match
    from .test_lossless import exact_sequence_distribution

    vocab, length, n = 5, 3, 1500
    target_model, _, params, prompt, _ = sampling_setup(vocab, length)
    target_model = target_model.float()
    lm = backend(target_model)
    expected = exact_sequence_distribution(target_model, prompt, length, params).double()
    expected /= expected.sum()  # computed in float32
    key, make = quant_draft(lm, 4)
    engine = Engine(make_rows(lm, 24), drafter_factory=lambda h: shared_cache_member(h, key, make, 0.0),
                    draft_length=DraftLengthConfig(2, 0, adaptive=False))
    assert_ragged_rows_match(engine, params, prompt, n, vocab, expected)


def test_no_shared_cache_where_the_draft_cannot_share_it(target):
    """A single-row target, a float64 target (its copy computes in float32) and ``fast=1`` (a
    compiled draft on its own cache) keep a draft cache of their own."""
    from speclm.drafters.quant import shared_cache_member
    from speclm.models.rows import make_rows

    lm = backend(target)
    key, make = quant_draft(lm, 8)
    assert shared_cache_member(lm, key, make, 0.0) is None
    assert shared_cache_member(make_rows(lm, 2).handle(0), key, make, 0.0) is None
    lm32 = backend(tiny_model(VOCAB, seed=10, seed_layers=4).float())
    view = make_rows(lm32, 2).handle(0)
    assert shared_cache_member(view, key + ":fast", make, 0.0) is None
    assert shared_cache_member(view, key, lambda: quant_draft(lm32, 8)[1](), 0.0) is not None


def test_bad_options_fail_in_one_line(target, model_dirs):
    with pytest.raises(SpeclmError, match="bits=5 is not offered.*torch.*4/8.*llama.cpp.*2/3/4/8"):
        parse_drafter("quant:bits=5")
    with pytest.raises(SpeclmError, match="p_min applies to chains"):
        parse_drafter("quant:tree=2,p_min=0.3")
    with pytest.raises(SpeclmError, match="not offered on the torch backends; use bits=4/8"):
        quant_draft(backend(target), 2)
    from speclm.models.compiled import make_compiled

    int4 = make_compiled(target.float(), frozenset({0}), quantize="int4", compile_backend="aot_eager")
    with pytest.raises(SpeclmError, match="already int4-quantized"):
        quant_draft(int4, 8)
    llm = LLM(str(model_dirs["target"]), dtype="float64")
    with pytest.raises(SpeclmError, match="bits=3 is not offered on the torch backends"):
        llm.make_speculation("quant:bits=3")


class _FakeLlamaCpp:
    """Stands in for llama_cpp's quantizer: writes a file and counts calls."""

    LLAMA_FTYPE_MOSTLY_Q4_0 = 2

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def llama_backend_init(self):
        pass

    def llama_model_quantize_default_params(self):
        from types import SimpleNamespace

        return SimpleNamespace(ftype=0, allow_requantize=False, nthread=0)

    def llama_model_quantize(self, src, dst, params_ref):
        params = params_ref._obj
        self.calls.append((src, dst, params.ftype, params.allow_requantize))
        Path(dst.decode()).write_bytes(b"GGUF requantized")
        return 1 if self.fail else 0


def test_requantize_cache_made_once_atomically(tmp_path, monkeypatch, capsys):
    import ctypes

    from speclm.models import requantize

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ctypes, "byref", lambda obj: type("Ref", (), {"_obj": obj})())
    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"GGUF source")
    broken = _FakeLlamaCpp(fail=True)
    monkeypatch.setattr(requantize, "import_llama_cpp", lambda: broken)
    with pytest.raises(SpeclmError, match="could not requantize model.Q4_1.gguf to Q4_0"):
        requantize.requantize_gguf(source, "q4_0")
    assert not any((tmp_path / "cache" / "requantized").iterdir())  # no half-written file left
    fake = _FakeLlamaCpp()
    monkeypatch.setattr(requantize, "import_llama_cpp", lambda: fake)
    out = requantize.requantize_gguf(source, "q4_0")
    assert "requantizing model.Q4_1.gguf to Q4_0" in capsys.readouterr().err
    assert out.read_bytes() == b"GGUF requantized" and out.parent == tmp_path / "cache" / "requantized"
    assert fake.calls[0][2:] == (2, True)  # Q4_0, allow_requantize
    assert requantize.requantize_gguf(source, "q4_0") == out and len(fake.calls) == 1  # reused
    assert capsys.readouterr().err == ""
    os.utime(source, ns=(1, 1))  # another file at the same path: a new copy
    assert requantize.requantize_gguf(source, "q4_0", progress=False) != out and len(fake.calls) == 2
    with pytest.raises(SpeclmError, match="unknown GGUF type 'q1'"):
        requantize.requantize_gguf(source, "q1")


@pytest.mark.real_model
def test_llamacpp_requantized_draft_on_the_default_model(tmp_path, monkeypatch, capfd):
    """A Q2_K copy of the default model's GGUF (made once, reused) drafts on llama.cpp; greedy
    output equals llama.cpp's own plain decoding."""
    from speclm.models import requantize
    from speclm.models.llamacpp import llama_cpp_available

    if not llama_cpp_available():
        pytest.skip("llama-cpp-python not installed")
    monkeypatch.setattr(requantize, "cache_dir", lambda: tmp_path)
    llm = LLM("default", "quant:bits=2", 4, backend="llamacpp", adaptive_draft=False)
    assert "requantizing" in capfd.readouterr().err
    made = list((tmp_path / "requantized").glob("*-q2_k-*.gguf"))
    assert len(made) == 1 and made[0].stat().st_size < llm.target.weights.path.stat().st_size
    assert llm.drafter.model.weights.path == made[0]
    params = SamplingParams(max_tokens=48)
    accepted = 0
    for text in ("List the planets of the solar system in order, one per line, with one fact about each.",
                 "Write a Python function that returns the n-th Fibonacci number, then explain it."):
        messages = [{"role": "user", "content": text}]
        out = llm.chat(messages, params)
        assert out.token_ids == llm.chat(messages, params, speculative=False).token_ids
        accepted += out.stats.accepted_tokens
    assert accepted > 0
    again = llm.make_speculation("quant:bits=2")  # cached: no second requantization
    assert "requantizing" not in capfd.readouterr().err and again.drafter.model.weights.path == made[0]


def test_cli_generate_and_bench(capsys, model_dirs, tmp_path):
    import json

    from speclm.cli import main

    code = main(["generate", "the quick brown fox", "--model", str(model_dirs["target"]), "--dtype", "float64",
                 "-n", "12", "--drafter", "quant:bits=8", "--compare", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["compare"]["identical"] and result["stats"]["drafter"] == "quant[8-bit]"
    code = main(["generate", "x", "--model", str(model_dirs["target"]), "--drafter", "quant:bits=6"])
    err = capsys.readouterr().err
    assert code == 2 and "bits=6 is not offered" in err and len(err.strip().splitlines()) == 1
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"category": "echo", "turns": ["the quick brown fox", "again please"]}\n')
    code = main(["bench", "--model", str(model_dirs["target"]), "--dtype", "float64", "--prompts", str(prompts_file),
                 "--max-new-tokens", "8", "--method", "quant:bits=4,k=3", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "MISMATCH" not in out and "| quant:bits=4,k=3 | all | 2 |" in out
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert all(r["identical"] for r in rows)


def test_server_rows_draft_with_one_quantized_copy(model_dirs):
    """speclm serve --drafter quant:bits=8: concurrent requests (one batched target forward on
    eager torch), each row drafting on its own cache over the one copy, answers equal plain."""
    import threading

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from speclm.serve.launch import ServeOptions, build_app

    opts = ServeOptions(model=str(model_dirs["target"]), dtype="float64", max_batch=3, max_queue=3,
                        served_model_name="tiny", draft_max=4)
    opts.drafter = "quant:bits=8"
    texts = ["the quick brown fox", "def add(a, b):", "the lazy dog. the lazy dog."]
    solo = LLM(str(model_dirs["target"]), None, dtype="float64")
    with TestClient(build_app(opts), base_url="http://localhost") as http:
        answers: dict[int, dict] = {}

        def ask(i: int) -> None:
            answers[i] = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": texts[i]}], "max_tokens": 16,
                "temperature": 0, "ignore_eos": True}).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        for i, text in enumerate(texts):
            expected = solo.chat([{"role": "user", "content": text}], params, speculative=False).text
            assert answers[i]["choices"][0]["message"]["content"] == expected, f"request {i}"
            assert answers[i]["speclm"]["drafter"] == "quant[8-bit]"
        assert sum(a["speclm"]["drafted_tokens"] for a in answers.values()) > 0


def test_the_files_header_is_read_once_per_version(tmp_path, monkeypatch):
    """A server builds a row's drafter at every request it admits, and quant asks whether the
    target's GGUF stores 4-bit blocks: the header (seconds to parse for the default model; the
    server ran at a fifth of its speed) is read once per version of the file, not per request."""
    import types

    import gguf

    from speclm.models.gguf_int4 import stores_4bit

    reads = []

    def reader(path):
        reads.append(path)
        kind = "Q4_1" if b"q4" in Path(path).read_bytes() else "Q8_0"
        return types.SimpleNamespace(tensors=[types.SimpleNamespace(tensor_type=types.SimpleNamespace(name=kind))])

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF q4")
    assert all(stores_4bit(path) for _ in range(5)) and len(reads) == 1
    path.write_bytes(b"GGUF q8 -- another file")  # a new version: read again
    assert not stores_4bit(path) and len(reads) == 2
    assert not stores_4bit(tmp_path / "missing.gguf") and len(reads) == 2
