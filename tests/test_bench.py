"""speclm bench: method specs, the bound, the oracle drafter, outputs, and bad input."""

from __future__ import annotations

import json

import pytest
import torch

from speclm import SpeclmError
from speclm.bench import OracleDrafter, leviathan_bound, parse_method
from speclm.cli import main
from speclm.draft_length import DraftLengthConfig
from speclm.engine import generate_tokens
from speclm.sampling import SamplingParams
from speclm.stats import RequestStats

from .conftest import backend, tiny_model


def test_method_specs():
    spec = parse_method("ngram:k=8,min=1")
    assert (spec.name, spec.k, spec.options["min"], spec.options["max"]) == ("ngram", 8, 1, 3)
    assert parse_method("hf-lookup").is_peer and not parse_method("plain").is_peer
    assert parse_method("oracle:a=0.9,k=2").options["a"] == 0.9


def test_method_row_names_show_the_last_path_component(tmp_path):
    import argparse

    from speclm.bench.command import method_specs

    (tmp_path / "a" / "eagle-x").mkdir(parents=True)
    (tmp_path / "b" / "eagle-x").mkdir(parents=True)
    one, two = f"eagle:{tmp_path}/a/eagle-x", f"hf-assisted:path={tmp_path}/a/eagle-x/,k=3"
    args = argparse.Namespace(method=[one, two, "ngram:k=3"], oracle_sweep=False, temperature=0.0)
    specs = method_specs(args)
    assert [s.label for s in specs] == ["eagle:eagle-x", "hf-assisted:path=eagle-x,k=3", "ngram:k=3"]
    assert specs[0].options["path"] == f"{tmp_path}/a/eagle-x"  # the path itself is untouched
    args.method = [one, f"eagle:{tmp_path}/b/eagle-x"]  # short names would be twins: keep the full ones
    assert [s.label for s in method_specs(args)] == args.method


@pytest.mark.parametrize("text,needle", [
    ("hydra", "unknown method"), ("ngram:k", "malformed"), ("ngram:q=3", "malformed"),
    ("ngram:k=x", "must be a int"), ("draft", "needs path"), ("oracle:a=1.5", "a must be"),
    ("ngram:k=0", "k must be"), ("ngram:min=3,max=2", "min <= max"),
])
def test_bad_method_specs(text, needle):
    with pytest.raises(SpeclmError, match=needle):
        parse_method(text)


def test_leviathan_bound():
    assert leviathan_bound(0.0, 4, 0.0) == pytest.approx(1.0)
    assert leviathan_bound(1.0, 4, 0.0) == pytest.approx(5.0)
    assert leviathan_bound(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)


def test_oracle_controls_acceptance_and_stays_lossless():
    model = tiny_model(64, seed=3)
    lm = backend(model)
    greedy = SamplingParams(max_tokens=300, ignore_eos=True)
    prompt = torch.tensor([1, 2, 3])
    plain = [t for s in generate_tokens(lm, prompt, greedy) for t in s.tokens]
    for a in (0.5, 0.9):
        oracle = OracleDrafter(a, 64, seed=1)
        oracle.set_continuation(3, plain)
        stats = RequestStats()
        out = [t for s in generate_tokens(lm, prompt, greedy, drafter=oracle,
                                          draft_length=DraftLengthConfig(4), stats=stats) for t in s.tokens]
        assert out == plain
        alpha_iid = sum(stats.accepted_per_position) / sum(stats.judged_per_position)
        assert abs(alpha_iid - a) < 0.08  # hundreds of judged tokens


def test_bench_end_to_end_writes_outputs(capsys, model_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "echo", "turns": ["the quick brown fox", "again please"]}\n'
                       '{"category": "code", "prompt": "def add(a, b):"}\n')
    target = str(model_dirs["target"])
    code = main(["bench", "--model", target, "--dtype", "float64", "--prompts", str(prompts),
                 "--max-new-tokens", "10", "--method", "ngram:k=4", "--method", f"draft:path={target},k=3",
                 "--method", "oracle:a=0.8,k=3", "--method", "hf", "--method", "hf-lookup",
                 "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "| ngram:k=4 | all | 3 |" in out and "MISMATCH" not in out
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"environment", "meta", "summary", "rows"} <= set(result)
    assert len(result["rows"]) == 3 * 6  # two turns + one prompt, six methods (plain added)
    assert all(r["identical"] for r in result["rows"])  # greedy: every method equals plain
    selfdraft = result["summary"]["draft:path=target,k=3"]["all"]  # rows name a path by its last part
    assert selfdraft["alpha"] == 1.0 and selfdraft["bound"] == pytest.approx(4 / (1 + 3 * selfdraft["c"]))
    for name in ("results.md", "speedup_by_category.png", "acceptance_by_position.png", "measured_vs_bound.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0


@pytest.mark.parametrize("argv,needle", [
    (["--prompts", "/nonexistent.jsonl"], "cannot read prompts"),
    (["--method", "hydra"], "unknown method"),
    (["--categories", "poetry"], "no prompts in category poetry"),
    (["--method", "oracle:a=0.5", "--temperature", "0.7"], "greedy"),
])
def test_bench_bad_input_fails_before_loading_a_model(capsys, argv, needle):
    # the model path does not exist: reaching the model loader would give another error
    code = main(["bench", "--model", "/no/such/model", *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_bound_with_verify_cost():
    assert leviathan_bound(0.8, 4, 0.05, v=2.0) == pytest.approx((1 - 0.8**5) / 0.2 / 2.2)


def test_oracle_sweep_expands_the_grid_and_reports_it(capsys, model_dirs):
    code = main(["bench", "--model", str(model_dirs["target"]), "--dtype", "float64",
                 "--per-category", "1", "--categories", "qa", "--max-new-tokens", "12", "--no-warmup",
                 "--oracle-sweep", "--oracle-a", "0.5,1", "--oracle-k", "2,3"])
    out = capsys.readouterr().out
    assert code == 0
    sweep = out.split("Oracle sweep")[1]
    for a, k in (("0.5", 2), ("0.5", 3), ("1", 2), ("1", 3)):
        assert f"| {a} | {k} |" in sweep
    # a = 1: every drafted token accepted, tau = K + 1 until the budget clips the last round
    assert "| oracle:a=1,k=3 | all |" in out and "MISMATCH" not in out


@pytest.mark.parametrize("argv,needle", [
    (["--oracle-sweep", "--oracle-a", "x"], "--oracle-a takes"),
    (["--oracle-sweep", "--oracle-k", ","], "--oracle-k is empty"),
])
def test_bad_sweep_flags(capsys, argv, needle):
    assert main(["bench", "--model", "/no/such/model", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_random_model_from_a_config_file(tmp_path, model_dirs):
    from speclm.models import load_model

    loaded = load_model(f"random:{model_dirs['target'] / 'config.json'}", dtype="float64")
    lm = loaded.backend
    assert lm.eos_token_ids == frozenset()  # random weights run to the token budget
    assert lm.forward(torch.tensor([1, 2, 3]), 0).logits.shape == (1, lm.vocab_size)
    again = load_model(f"random:{model_dirs['target'] / 'config.json'}", dtype="float64").backend
    assert torch.equal(next(lm.model.parameters()), next(again.model.parameters()))  # seeded
    with pytest.raises(SpeclmError, match="not a preset"):
        load_model("random:no-such-preset")


def test_mismatch_diagnosis_tells_a_bug_from_a_tie(model_dirs):
    from speclm import LLM
    from speclm.bench.runner import diagnose_mismatch

    llm = LLM(str(model_dirs["target"]), dtype="float64")
    messages = [{"role": "user", "content": "the quick brown fox"}]
    plain = llm.chat(messages, SamplingParams(max_tokens=6, ignore_eos=True), speculative=False).token_ids
    wrong = plain[:3] + [(plain[3] + 1) % llm.target.vocab_size] + plain[4:]
    found = diagnose_mismatch(llm, messages, plain, wrong)
    assert found["position"] == 3 and found["margin"] > 0 and found["verdict"].startswith("BUG")
    twin = wrong[3]
    with torch.no_grad():  # give the other token the same LM-head row: an exact tie everywhere
        head = llm.target.model.get_output_embeddings().weight
        head[twin] = head[plain[3]]
    tie = diagnose_mismatch(llm, messages, plain, wrong)
    assert tie["margin"] == 0 and tie["verdict"].startswith("numerical near-tie")
    short = diagnose_mismatch(llm, messages, plain, plain[:4])
    assert short["position"] == 4 and "lengths differ" in short["verdict"]
    memo: dict = {}  # methods of one turn that part from plain at the same token share one diagnosis
    first = diagnose_mismatch(llm, messages, plain, wrong, memo)
    llm.target.forward = None  # a second diagnosis of the same divergence computes nothing
    assert diagnose_mismatch(llm, messages, plain, wrong[:5], memo) is first


def test_seeded_sampled_methods_are_checked_against_plain_and_a_mismatch_is_diagnosed(capsys, model_dirs,
                                                                                     tmp_path):
    """At a temperature the bench's seed keys every method's draws: speculative outputs are
    checked token by token against plain sampling (peers are not); a differing draw is a bug
    unless some way of computing its position makes the other token win the seeded race."""
    from speclm import LLM
    from speclm.bench.runner import diagnose_mismatch

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "echo", "turns": ["the quick brown fox"]}\n')
    target = str(model_dirs["target"])
    code = main(["bench", "--model", target, "--dtype", "float64", "--prompts", str(prompts), "--no-warmup",
                 "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--method", "ngram:k=4",
                 "--method", f"draft:path={target},k=3", "--method", "hf", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "MISMATCH" not in out and "temperature 0.8, top-p 0.9" in out
    rows = {r["method"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["rows"]}
    assert rows["ngram:k=4"]["identical"] and rows["draft:path=target,k=3"]["identical"]
    assert rows["hf"]["identical"] is None  # another engine's sampler: not comparable
    selfdraft = rows["draft:path=target,k=3"]
    assert selfdraft["accepted"] == selfdraft["drafted"] > 0  # q = p, drawn with the same noise

    llm = LLM(target, dtype="float64")
    messages = [{"role": "user", "content": "the quick brown fox"}]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    plain = llm.chat(messages, params, speculative=False).token_ids
    wrong = plain[:2] + [(plain[2] + 1) % llm.target.vocab_size] + plain[3:]
    found = diagnose_mismatch(llm, messages, plain, wrong, params=params)
    assert found["position"] == 2 and found["margin"] > 0 and found["verdict"].startswith("BUG")


def test_near_ties_are_measured_where_kernels_round_rows_differently(model_dirs):
    """llama.cpp rounds one row and several rows differently: a mismatch is a near-tie when the
    several-row computation of the position prefers the other token, or the gap is within how
    far the two computations disagree there; no tolerance is set by hand."""
    from speclm import LLM
    from speclm.bench.runner import diagnose_mismatch

    llm = LLM(str(model_dirs["target"]), dtype="float64")
    messages = [{"role": "user", "content": "the quick brown fox"}]
    plain = llm.chat(messages, SamplingParams(max_tokens=6, ignore_eos=True), speculative=False).token_ids
    llm.target.reset()
    logits = llm.target.forward(torch.tensor(llm.encode(messages) + plain[:3]), 0).logits[-1]
    llm.target.reset()
    other = int(logits.topk(2).indices[1])  # the runner-up at position 3
    gap = float(logits[plain[3]] - logits[other])
    wrong = plain[:3] + [other] + plain[4:]
    forward = llm.target.forward

    def several_rows_round_differently(token_ids, start_pos, *args, **kwargs):
        out = forward(token_ids, start_pos, *args, **kwargs)
        if token_ids.shape[0] > 1:  # a verify's kernels: the runner-up comes out ahead
            out.logits = out.logits.clone()
            out.logits[..., other] += shift
        return out

    llm.target.forward = several_rows_round_differently
    shift = 1.5 * gap
    tie = diagnose_mismatch(llm, messages, plain, wrong)
    assert tie["margin"] == pytest.approx(gap) and tie["verdict"].startswith("numerical near-tie")
    shift = 0.0  # every way of computing the position agrees: the other token is a bug
    assert diagnose_mismatch(llm, messages, plain, wrong)["verdict"].startswith("BUG")


def test_a_methods_own_engine_options_decide_its_backend(monkeypatch):
    """torch options of a method's own make it torch even where the command's --backend auto
    chose llama.cpp for a GGUF file; backend=llamacpp of its own drops the command's torch
    options. Nothing is loaded."""
    import speclm.models.llamacpp as lcp
    from speclm.bench.runner import EnginePool

    monkeypatch.setattr(lcp, "llama_cpp_available", lambda: True)
    pool = EnginePool("default", "cpu", ("auto", 0, None, "auto"))
    assert pool.defaults == ("llamacpp", 0, None, None)
    engine = {m: pool.engine_of(parse_method(m)) for m in
              ["ngram", "ngram:compile=1", "plain:quantize=int4", "ngram:dtype=bfloat16", "hf", "llamacpp"]}
    assert engine["ngram"] == ("llamacpp", 0, None, None)
    assert engine["ngram:compile=1"] == ("torch", 1, None, None)
    assert engine["plain:quantize=int4"] == ("torch", 0, "int4", None)
    assert engine["ngram:dtype=bfloat16"] == ("torch", 0, None, "bfloat16")
    assert engine["hf"][0] == "torch" and engine["llamacpp"][0] == "llamacpp"
    compiled = EnginePool("default", "cpu", ("auto", 1, None, "auto"))
    assert compiled.defaults == ("torch", 1, None, None)
    assert compiled.engine_of(parse_method("ngram:backend=llamacpp")) == ("llamacpp", 0, None, None)


def test_each_engine_gets_its_own_plain_reference(model_dirs):
    """A method on an engine without plain decoding gets that plain run added (and announced);
    its speedup and identity are against it, never against another engine's plain."""
    from speclm import LLM
    from speclm.bench.runner import run_bench

    llm = LLM(str(model_dirs["target"]), dtype="float32")
    specs = [parse_method(m) for m in ["plain", "ngram:k=3", "ngram:k=3,dtype=float64"]]
    prompts = [dict(id=1, category="echo", turns=["the quick brown fox jumps over the quick brown fox"])]
    said = []
    rows = run_bench(llm, specs, prompts, SamplingParams(max_tokens=8), progress=False, log=said.append)
    by = {r["method"]: r for r in rows}
    added = "plain:backend=torch,dtype=float64"
    assert added in by and any(added in line and "ngram:k=3,dtype=float64" in line for line in said)
    assert by["ngram:k=3,dtype=float64"]["reference"] == added
    assert by["ngram:k=3"]["reference"] == "plain" and by["ngram:k=3,dtype=float64"]["identical"]
    assert by["ngram:k=3,dtype=float64"]["vs_baseline"] > 0  # the baseline stays the given plain


def test_guard_flags_a_method_slower_than_plain_in_a_category():
    from speclm.bench.report import markdown, slower_than_plain

    fig = dict(requests=3, errors=0, tok_s=10.0, identical=3, checked=3)
    summary = {"plain": {"qa": dict(fig, speedup=1.0)},
               "ngram": {"qa": dict(fig, speedup=0.80), "code": dict(fig, speedup=1.30)},
               "suffix": {"qa": dict(fig, speedup=0.95)}}
    lines = slower_than_plain(summary)
    assert lines == ["SLOWER THAN PLAIN: ngram on qa: median speedup 0.80x < 0.95x"]
    table = markdown(summary, "header", [parse_method("ngram"), parse_method("suffix")])
    rows = {line.split(" | ")[0] + line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| ")}
    assert rows["| ngramqa"].endswith("| SLOW |") and not rows["| ngramcode"].endswith("| SLOW |")
    assert not rows["| suffixqa"].endswith("| SLOW |") and lines[0] in table


def test_a_base_model_without_a_chat_template_is_benchmarked_on_plain_text(model_dirs):
    """Gemma-3-270M is a base model: the bench sends it the conversation as plain text instead
    of stopping at the missing chat template; greedy identity still holds."""
    from speclm import LLM
    from speclm.bench.runner import bench_prompt, run_bench

    llm = LLM(str(model_dirs["no_template"]), dtype="float64")
    messages = [{"role": "user", "content": "the quick brown fox"}]
    assert bench_prompt(llm, messages) == "User: the quick brown fox\nAssistant:"
    prompts = [dict(id=1, category="echo", turns=["the quick brown fox jumps", "and again"])]
    rows = run_bench(llm, [parse_method("plain"), parse_method("ngram:k=3")], prompts,
                     SamplingParams(max_tokens=8, ignore_eos=True), progress=False, log=lambda *_: None)
    spec = [r for r in rows if r["method"] == "ngram:k=3"]
    assert len(spec) == 2 and all(r["identical"] for r in spec)


def test_a_compile_inside_a_timed_request_is_flagged(model_dirs):
    """A request during which the fast path compiled a graph carries the count, and the report
    flags its method and category: its time includes the compile."""
    from speclm.api import LLM
    from speclm.bench.report import markdown
    from speclm.bench.runner import _run_one

    llm = LLM(str(model_dirs["target"]), None, dtype="float64")
    target = llm.target
    target.compiled_graphs = 0
    forward = target.forward

    def compiling(*args, **kwargs):  # the first decode step compiles a graph
        if target.cache_length > 0 and target.compiled_graphs == 0:
            target.compiled_graphs = 1
        return forward(*args, **kwargs)

    target.forward = compiling
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    first = _run_one(llm, False, [{"role": "user", "content": "hi"}], params)
    again = _run_one(llm, False, [{"role": "user", "content": "hi"}], params)
    assert first["compiled"] == 1 and "compiled" not in again
    fig = dict(requests=2, errors=0, tok_s=10.0, identical=2, checked=2, speedup=1.0)
    table = markdown({"plain": {"qa": dict(fig, compiled=1), "code": dict(fig, compiled=0)}}, "header")
    assert "| COMPILED 1 |" in table and "COMPILED WHILE TIMED: plain on qa: 1 request(s)" in table
    assert "plain on code" not in table
