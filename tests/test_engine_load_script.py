"""benchmarks/engine_load.py end to end on a tiny random model (its figures mean nothing here:
the benchmark is run on real models, not in the tests): both engines run their phases and the
summary lines come out; bad settings are refused in one line."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import load_benchmark

TINY = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
            max_position_embeddings=512, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engine_load():
    return load_benchmark("engine_load")


@pytest.fixture
def files(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Repeat after me: {w} {w} {w} {w}"]}) + "\n"
                               for w in ("red", "green", "blue")))
    return config, prompts


def _main(engine_load, monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["engine_load.py", *argv])
    engine_load.main()


@pytest.mark.real_model  # the default model's tokenizer and chat template
def test_both_engines_run_and_report(engine_load, files, monkeypatch, capsys):
    config, prompts = files
    _main(engine_load, monkeypatch, "--model", f"random:{config}", "--backend", "torch", "--prompts", str(prompts),
          "--clients", "2", "--requests", "3", "--rounds", "1", "--max-tokens", "4", "--chat")
    out = capsys.readouterr().out
    assert "warm-up off" in out and "round 1 spec" in out and "spec / off per round" in out
    assert "identical outputs:" in out and "/3" in out


def test_bad_settings_are_refused_in_one_line(engine_load, files, monkeypatch, tmp_path):
    config, prompts = files
    with pytest.raises(SystemExit, match="must be >= 1"):
        _main(engine_load, monkeypatch, "--prompts", str(prompts), "--clients", "0")
    with pytest.raises(SystemExit, match="not a readable JSON-lines prompts file"):
        _main(engine_load, monkeypatch, "--prompts", str(tmp_path / "missing.jsonl"))
    with pytest.raises(SystemExit, match="not a preset"):
        _main(engine_load, monkeypatch, "--model", "random:nothing-here", "--prompts", str(prompts))
