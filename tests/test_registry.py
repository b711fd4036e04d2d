"""Drafters by name: the option-string parser, the registry, ``LLM(speculative_model=...)``,
``--drafter`` and bench methods, with one-line errors for bad specs."""

from __future__ import annotations

import json

import pytest

from speclm import LLM, SamplingParams, SpeclmError
from speclm.bench import parse_method
from speclm.cli import main
from speclm.drafters.registry import KINDS, grows_trees, is_drafter_spec, parse_drafter
from speclm.specs import REQUIRED, IntList, NameList, parse_options


def test_option_lists_ranges_and_defaults():
    schema = {"x": {"skip": (IntList(), None), "k": (int, 3), "names": (NameList(), ()), "p": (str, REQUIRED)}}
    spec = parse_options("x:p=a,skip=3,5,9-11,k=4,names=ngram,suffix,ngram", schema)
    assert spec.options == {"skip": (3, 5, 9, 10, 11), "k": 4, "names": ("ngram", "suffix"), "p": "a"}
    assert parse_options("x:p=b", schema).options["skip"] is None
    for text, needle in [("x:k=1", "needs p"), ("x:p=a,5", "not key=value"), ("x:p=a,skip=3-1", "list of integers"),
                         ("x:p=a,skip=q", "list of integers"), ("y", "unknown method")]:
        with pytest.raises(SpeclmError, match=needle):
            parse_options(text, schema)


def test_registry_names_and_checks():
    assert {"ngram", "suffix", "recycle", "layerskip", "early-exit", "draft", "distilled", "auto"} <= set(KINDS)
    assert is_drafter_spec("layerskip:skip=1") and not is_drafter_spec("./models/draft")
    assert parse_drafter("ngram", {"min": 1}).options == {"min": 1, "max": 3}
    assert parse_drafter("ngram:min=2", {"min": 1}).options["min"] == 2  # given beats default
    for text, needle in [("ngram:min=4,max=2", "min <= max"), ("layerskip:p_min=2", "p_min"),
                         ("draft", "needs path"), ("draft:path=/no/such", "does not exist"),
                         ("medusa", "needs path"), ("eagle:path=/no/such", "does not exist"),
                         ("hydra", "unknown drafter"), ("quant:tree=2,fit=2", "fit 0 or 1")]:
        with pytest.raises(SpeclmError, match=needle):
            parse_drafter(text)


def test_tree_fit_option_reaches_the_shape():
    from speclm.drafters.registry import _tree_shape

    assert _tree_shape(parse_drafter("quant:tree=3,budget=9").options).fit
    shape = _tree_shape(parse_drafter("quant:tree=3,budget=9,fit=0").options)
    assert (shape.top_k, shape.budget, shape.fit) == (3, 9, False)


def test_which_specs_grow_token_trees(tmp_path):
    """The server batches llama.cpp rows only for drafters that never propose a tree."""
    grows = {text: grows_trees(parse_drafter(text)) for text in [
        "ngram", f"draft:path={tmp_path}", f"draft:path={tmp_path},tree=3", f"eagle:path={tmp_path}",
        f"eagle:path={tmp_path},tree=0", f"medusa:path={tmp_path}", "auto", "auto:candidates=none,ngram,suffix"]}
    assert [text for text, yes in grows.items() if yes] == [
        f"draft:path={tmp_path},tree=3", f"eagle:path={tmp_path}", f"medusa:path={tmp_path}"]


def test_bench_methods_come_from_the_registry():
    spec = parse_method("layerskip:skip=1,3,k=2")
    assert spec.k == 2 and spec.drafter.options == {"skip": (1, 3), "refresh": 0, "p_min": 0.0}
    assert parse_method("recycle").k == KINDS["recycle"].default_k
    assert parse_method("hf").drafter is None and parse_method("oracle:a=0.5").drafter is None
    with pytest.raises(SpeclmError, match="method spec"):
        parse_method("suffix:capacity=x")


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["target"]), dtype="float64")


@pytest.mark.parametrize("text,label,k", [
    ("ngram", "ngram[2..3]", 10), ("suffix:factor=2", "suffix:factor=2", 10), ("recycle", "recycle", 2),
    ("layerskip:skip=1", "layerskip:skip=1", 3), ("early-exit:layers=1", "early-exit:layers=1", 3),
])
def test_api_builds_each_drafter_and_stays_lossless(llm, text, label, k):
    spec = llm.make_speculation(text)
    assert spec.name == label and spec.draft_length.draft_max == k
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for prompt in ("the quick brown fox", "def add(a, b):"):
        out = llm.generate(prompt, params, speculative=spec)[0]
        assert out.token_ids == llm.generate(prompt, params, speculative=False)[0].token_ids
        assert out.stats.drafter == label


def test_cli_drafter_flag(capsys, model_dirs):
    code = main(["generate", "the quick brown fox", "--model", str(model_dirs["target"]), "--dtype", "float64",
                 "-n", "12", "--drafter", "early-exit:layers=1", "--compare", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["compare"]["identical"]
    assert "1 of 2 layers" in result["stats"]["drafter_report"]["summary"]
    code = main(["generate", "x", "--model", "/no/such/model", "--drafter", "layerskip:skip=a"])
    err = capsys.readouterr().err
    assert code == 2 and "list of integers" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):  # argparse: --drafter and --draft-model exclude each other
        main(["generate", "x", "--drafter", "suffix", "--draft-model", "default"])


def test_bench_runs_the_new_drafters(capsys, model_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "echo", "turns": ["the quick brown fox", "again please"]}\n')
    code = main(["bench", "--model", str(model_dirs["target"]), "--dtype", "float64", "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--method", "suffix", "--method", "recycle:k=3",
                 "--method", "early-exit:layers=1", "--method", "auto:candidates=none,ngram,recycle,probe=2",
                 "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0 and "MISMATCH" not in out and "| recycle:k=3 | all | 2 |" in out
    assert "Drafters' own reports" in out and "auto:candidates=none,ngram,recycle,probe=2: choice at the end" in out
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert all(r["identical"] for r in rows)


def test_a_bare_first_option_is_the_path(tmp_path):
    assert parse_drafter(f"eagle:{tmp_path}").options["path"] == str(tmp_path)
    assert parse_drafter(f"draft:{tmp_path},p_min=0.2").options == {
        **parse_drafter(f"draft:path={tmp_path}").options, "p_min": 0.2}
    with pytest.raises(SpeclmError, match="malformed"):
        parse_drafter("ngram:3")  # no path option: still an error
