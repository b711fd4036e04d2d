"""The llama.cpp backend on the real default model's GGUF file (SmolLM2-135M-Instruct, Q4_1).

llama.cpp runs the quantized weights directly, so its logits are compared with themselves (a
rollback reproduces them, a tree node equals the chain it stands for) and with the torch
backend's dequantized model only loosely. Greedy speculative output must equal the llama.cpp
backend's own plain greedy output; the bench peers (llama.cpp's own plain loop and
llama-cpp-python's prompt lookup) must run and match it too. Skipped without llama-cpp-python.
"""

from __future__ import annotations

import shutil
import subprocess
import types

import pytest
import torch

from speclm import LLM, SamplingParams
from speclm.errors import CacheContractError, SpeclmError
from speclm.models.llamacpp import amx_kernels_built, import_llama_cpp, llama_cpp_available
from speclm.tree import TreeMeta

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python not installed")]

PROMPTS = [
    "List the planets of the solar system in order, one per line, with one fact about each.",
    "Translate to French: 'The cat sleeps on the warm stone wall while the children play.'",
    "Write a Python function that returns the n-th Fibonacci number, then explain it.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("default", "ngram", 10, backend="llamacpp", adaptive_draft=False)  # fixed K


@pytest.fixture(scope="module")
def ids(llm):
    return torch.tensor(llm.encode([{"role": "user", "content": PROMPTS[0]}]))


def test_auto_picks_llamacpp_for_gguf_and_torch_when_needed(llm):
    assert llm.backend_name == "llamacpp"
    assert LLM("default").backend_name == "llamacpp"  # auto: a GGUF file on the CPU
    assert LLM("default", dtype="float32").backend_name == "torch"  # a torch-only option


def test_amx_kernels_are_detected(tmp_path):
    """A llama-cpp-python built with ggml's AMX kernels (pip's own -march=native build on an AMX
    CPU, where they crash in llama_decode) is recognised, so the backend keeps its weights out of
    them; the build the tests run on (scripts/build-llama-cpp.sh) has none."""
    assert not amx_kernels_built(import_llama_cpp())
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build a stand-in library")
    lib = tmp_path / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (tmp_path / "amx.cpp").write_text("void *ggml_backend_amx_buffer_type() { return nullptr; }\n")
    subprocess.run(["g++", "-shared", "-fPIC", str(tmp_path / "amx.cpp"), "-o", str(lib / "libggml-cpu.so")],
                   check=True)
    fake = types.ModuleType("llama_cpp")
    fake.__file__ = str(tmp_path / "llama_cpp" / "__init__.py")
    assert amx_kernels_built(fake)


def test_logits_close_to_torch_backend(llm, ids):
    torch_llm = LLM("default", backend="torch")
    torch_llm.target.reset()
    reference = torch_llm.target.forward(ids, 0, num_logits=ids.shape[0]).logits
    llm.target.reset()
    logits = llm.target.forward(ids, 0, num_logits=ids.shape[0]).logits  # [T, V]
    assert logits.shape == reference.shape and logits.dtype == torch.float32
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree > 0.9  # the same weights; llama.cpp also quantizes activations for Q4_1


def test_rollback_reproduces_logits_and_keeps_contract(llm, ids):
    target = llm.target
    target.reset()
    target.forward(ids[:-4], 0)
    first = target.forward(ids[-4:], ids.shape[0] - 4, num_logits=4).logits
    target.rollback(ids.shape[0] - 4)
    target.forward(torch.tensor([5, 6, 7]), ids.shape[0] - 4)  # something else, then back
    target.rollback(ids.shape[0] - 4)
    again = target.forward(ids[-4:], ids.shape[0] - 4, num_logits=4).logits
    assert torch.equal(first, again)
    with pytest.raises(CacheContractError, match="roll back"):
        target.forward(ids[:1], 3)


def test_tree_rows_equal_their_chains(llm, ids):
    """Each node's logits equal a chain forward of its root-to-node path; compacting the
    accepted path leaves the cache as if the path had been fed as a chain."""
    target, n = llm.target, ids.shape[0]
    pending = ids[-1:]
    tree = TreeMeta.from_parents([-1, -1, 0, 0, 1, 2])
    nodes = torch.tensor([300, 400, 301, 302, 401, 303])
    target.reset()
    target.forward(ids[:-1], 0)
    got = target.forward(torch.cat([pending, nodes]), n - 1, num_logits=7, tree=tree).logits  # [7, V]
    paths = {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [1, 4], 5: [0, 2, 5]}
    for node, path in paths.items():
        target.reset()
        target.forward(ids[:-1], 0)
        chain = target.forward(torch.cat([pending, nodes[path]]), n - 1, num_logits=len(path) + 1).logits
        assert torch.allclose(got[node + 1], chain[-1], atol=1e-3), node
    # keep node 0 -> 2 -> 5 after the tree, then continue: as if fed as a chain
    target.reset()
    target.forward(ids[:-1], 0)
    target.forward(torch.cat([pending, nodes]), n - 1, num_logits=7, tree=tree)
    target.compact(n, [0, 2, 5])
    assert target.cache_length == n + 3
    after_tree = target.forward(torch.tensor([9]), n + 3).logits
    target.reset()
    target.forward(torch.cat([ids, nodes[[0, 2, 5]]]), 0)
    after_chain = target.forward(torch.tensor([9]), n + 3).logits
    assert torch.allclose(after_tree, after_chain, atol=1e-3)


@pytest.mark.parametrize("max_parked", [None, 6])
def test_rounds_of_trees_match_recomputation(llm, ids, max_parked):
    """Random trees, random accepted paths, several rounds: the pending row of every round equals
    a forward of the committed tokens from scratch. Catches llama.cpp cache layouts that give wrong
    attention (holes refilled by a batch, cells of other sequences); max_parked=6 forces the
    re-prefill that bounds parked cells."""
    import random

    target, reference = llm.target.fork(), llm.target.fork()
    if max_parked is not None:
        target.max_parked = max_parked
    rng = random.Random(0)
    for _ in range(3):
        target.reset()
        target.forward(ids[:-1], 0)
        committed = ids.tolist()
        for _ in range(4):
            k = rng.randint(2, 8)
            parents = [-1] + [rng.randrange(-1, i) for i in range(1, k)]
            nodes = torch.tensor([rng.randrange(300, 3000) for _ in range(k)])
            n = len(committed)
            got = target.forward(torch.cat([torch.tensor(committed[-1:]), nodes]), n - 1, num_logits=k + 1,
                                 tree=TreeMeta.from_parents(parents)).logits[0]
            reference.reset()
            want = reference.forward(torch.tensor(committed), 0).logits[-1]
            assert torch.allclose(got, want, atol=1e-3)
            x, path = rng.randrange(k), []
            while x >= 0:
                path.append(x)
                x = parents[x]
            path = path[::-1][: rng.randint(0, len(path))]
            target.compact(n, path)
            assert target.cache_length == n + len(path)
            committed += nodes[path].tolist() + [rng.randrange(300, 3000)]


@pytest.fixture(scope="module")
def plain_48(llm):
    """Plain greedy answers to PROMPTS, 48 tokens each, decoded once for the module."""
    params = SamplingParams(max_tokens=48)
    return [llm.chat([{"role": "user", "content": text}], params, speculative=False).token_ids
            for text in PROMPTS]


@pytest.mark.parametrize("spec", ["ngram", "suffix", "recycle", "draft:path=default,tree=3,budget=8"])
def test_greedy_identity_with_llamacpp_plain(llm, plain_48, spec):
    setup = llm.make_speculation(spec, 4 if spec.startswith("draft") else None, adaptive_draft=False)
    params = SamplingParams(max_tokens=48)
    accepted = 0
    for text, plain in zip(PROMPTS, plain_48):
        out = llm.chat([{"role": "user", "content": text}], params, speculative=setup)
        assert out.token_ids == plain, (spec, text)
        assert out.stats.backend == "llamacpp"
        accepted += out.stats.accepted_tokens
    assert accepted > 0


def test_self_draft_on_llamacpp_accepts_nearly_everything(llm):
    """The target as its own draft (a second context on the same weights)."""
    setup = llm.make_speculation("default", 4, adaptive_draft=False)  # fixed K: every round drafts
    out = llm.chat([{"role": "user", "content": PROMPTS[2]}], SamplingParams(max_tokens=32), speculative=setup)
    assert out.stats.alpha > 0.9


def test_sampling_runs_and_is_reproducible(llm):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
    a = llm.generate("Once upon a time", params)[0].token_ids
    b = llm.generate("Once upon a time", params)[0].token_ids
    assert a == b and len(a) > 0


def test_torch_only_drafters_and_options_say_so(llm, tmp_path):
    with pytest.raises(SpeclmError, match="--backend torch"):
        llm.make_speculation("early-exit")
    with pytest.raises(SpeclmError, match="torch backend"):
        LLM("default", backend="llamacpp", dtype="bfloat16")
    folder = LLM("default", backend="torch").model_path  # the dequantized HF folder
    with pytest.raises(SpeclmError, match="GGUF"):
        LLM(str(folder), backend="llamacpp")


def test_missing_package_says_how_to_install(monkeypatch):
    import speclm.models.llamacpp as lcp

    monkeypatch.setattr(lcp, "llama_cpp_available", lambda: False)
    with pytest.raises(SpeclmError, match=r"speclm\[llamacpp\]"):
        LLM("default", backend="llamacpp")
    assert LLM("default").backend_name == "torch"  # auto falls back


def test_bench_peers_match_llamacpp_plain(llm):
    from speclm.bench.methods import parse_method
    from speclm.bench.runner import EnginePool, run_bench

    pool = EnginePool("default", "cpu", ("llamacpp", 0, None, None))
    specs = [parse_method(m) for m in ["plain", "ngram:adaptive=0", "llamacpp", "llamacpp-lookup",
                                       "plain:backend=torch"]]
    prompts = [dict(id=1, category="qa", turns=[PROMPTS[1]])]
    rows = run_bench(pool, specs, prompts, SamplingParams(max_tokens=24), progress=False, baseline="llamacpp")
    by = {r["method"]: r for r in rows}
    assert not any(r.get("error") for r in rows), rows
    assert by["llamacpp"]["identical"] and by["ngram:adaptive=0"]["identical"]
    assert by["llamacpp-lookup"]["tokens"] > 0 and by["ngram:adaptive=0"]["vs_baseline"] > 0
    assert by["plain:backend=torch"]["reference"] == "plain:backend=torch"  # its own engine


def test_llamacpp_logs_are_silent_unless_verbose(capfd):
    from speclm.models.llamacpp import LlamaCppLM, LlamaCppModel, set_native_logging
    from speclm.models.loading import find_gguf

    gguf = find_gguf("default")
    set_native_logging(False)  # what a command without --verbose sets (an earlier test may not have)
    capfd.readouterr()
    LlamaCppLM(LlamaCppModel(gguf), frozenset()).forward(torch.tensor([1, 2, 3]), 0)
    assert capfd.readouterr().err == ""  # the loader and context logs are dropped
    set_native_logging(True)
    try:
        LlamaCppLM(LlamaCppModel(gguf), frozenset())
    finally:
        set_native_logging(False)
    assert "llama" in capfd.readouterr().err  # --verbose shows them
