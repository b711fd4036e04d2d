"""The CLI: streaming output, stats, --compare, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from speclm.cli import main


def cli(capsys, *argv, stdin=None, monkeypatch=None):
    """Run the CLI in-process; argparse's own errors arrive as SystemExit."""
    if stdin is not None:
        import io
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_compare_greedy_identical(capsys, model_dirs):
    code, out, err = cli(capsys, "generate", "the quick brown fox", "--model", str(model_dirs["target"]),
                         "--dtype", "float64", "-n", "20", "--compare")
    assert code == 0
    assert "speedup:" in err and "outputs identical" in err and "tau" in err


def test_generate_compare_seeded_sampling_identical(capsys, model_dirs):
    code, _, err = cli(capsys, "generate", "the quick brown fox", "--model", str(model_dirs["target"]),
                         "--dtype", "float64", "-n", "20", "--temperature", "0.8", "--seed", "4",
                         "--draft-model", str(model_dirs["draft"]), "--compare")
    assert code == 0 and "outputs identical" in err


def test_generate_json_from_stdin_with_draft_model(capsys, model_dirs, monkeypatch):
    code, out, _ = cli(capsys, "generate", "--model", str(model_dirs["target"]), "--dtype", "float64",
                       "--draft-model", str(model_dirs["draft"]), "--draft-max", "3", "-n", "12",
                       "--json", "--compare", stdin="héllo wörld", monkeypatch=monkeypatch)
    assert code == 0
    result = json.loads(out)
    assert result["compare"]["identical"] is True
    assert result["stats"]["generated_tokens"] == len(result["token_ids"])


def test_generate_from_file_raw(capsys, model_dirs, tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("def add(a, b):")
    code, out, _ = cli(capsys, "generate", "-f", str(prompt), "--raw", "--model",
                       str(model_dirs["target"]), "--dtype", "float64", "-n", "5", "-q")
    assert code == 0 and out.endswith("\n")


@pytest.mark.parametrize("argv,needle", [
    (["--draft-max", "0"], "draft max"),
    (["--draft-max", "x"], "not a valid int"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-p", "0"], "top_p"),
    (["--temperature", "-0.5"], "temperature"),
    (["--draft-min", "9", "--draft-max", "3"], "draft min"),
    (["--device", "tpu"], "device"),
    (["--dtype", "int3"], "dtype"),
    (["--ngram-min", "3", "--ngram-max", "2"], "n-gram"),
    (["--draft-p-min", "1.5", "--draft-model", "SAME"], "p-min"),
    (["--ngram", "--draft-model", "x"], "not allowed with"),
])
def test_bad_flags_exit_2_with_one_line(capsys, model_dirs, argv, needle):
    argv = [str(model_dirs["target"]) if a == "SAME" else a for a in argv]
    code, _, err = cli(capsys, "generate", "hello", "--model", str(model_dirs["target"]),
                       "--dtype", "float64", *argv)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("case", ["empty", "too_long", "missing_model", "not_a_model",
                                  "missing_file", "chat_no_template"])
def test_bad_inputs_exit_2(capsys, model_dirs, tmp_path, monkeypatch, case):
    short = ["--model", str(model_dirs["short"]), "--dtype", "float64"]
    argv, stdin = {
        "empty": (["generate", "   ", *short], None),
        "too_long": (["generate", "the quick brown fox " * 30, "--raw", *short], None),
        "missing_model": (["generate", "hi", "--model", str(tmp_path / "nope")], None),
        "not_a_model": (["generate", "hi", "--model", __file__], None),
        "missing_file": (["generate", "-f", str(tmp_path / "none.txt"), *short], None),
        "chat_no_template": (["chat", "--model", str(model_dirs["no_template"])], "hi\n"),
    }[case]
    code, _, err = cli(capsys, *argv, stdin=stdin, monkeypatch=monkeypatch)
    assert code == 2
    assert err.startswith("speclm: error:") and len(err.strip().splitlines()) == 1


def test_chat_multi_turn(capsys, model_dirs, monkeypatch):
    code, out, err = cli(capsys, "chat", "--model", str(model_dirs["target"]), "--dtype", "float64",
                         "-n", "6", "--stats", stdin="hello\n/stats\nsecond turn\n/reset\n/exit\n",
                         monkeypatch=monkeypatch)
    assert code == 0
    assert err.count("target forwards") == 3  # two answers with --stats, plus /stats


def test_help_runs_as_module():
    out = subprocess.run([sys.executable, "-m", "speclm", "generate", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--draft-max" in out.stdout and "--compare" in out.stdout


def test_non_utf8_prompt_file(capsys, model_dirs, tmp_path):
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("café".encode("latin-1"))
    code, _, err = cli(capsys, "generate", "-f", str(prompt), "--model", str(model_dirs["target"]))
    assert code == 2 and "not UTF-8" in err


def test_chat_survives_a_turn_that_outgrows_the_context(capsys, model_dirs, monkeypatch):
    long_turn = "the quick brown fox jumps over the lazy dog " * 10
    code, out, err = cli(capsys, "chat", "--model", str(model_dirs["short"]), "--dtype", "float64",
                         "-n", "4", stdin=f"{long_turn}\nhi\n/exit\n", monkeypatch=monkeypatch)
    assert code == 0
    assert "context" in err and "Traceback" not in err
    assert out.strip()  # the second, short turn was answered


def test_ngram_flag_runs_prompt_lookup(capsys, model_dirs):
    assert main(["generate", "the quick brown fox", "--model", str(model_dirs["target"]), "--ngram",
                 "--raw", "-n", "6"]) == 0
    assert capsys.readouterr().err.startswith("drafter ngram[2..3] on torch")
