"""``speclm distill`` on a tiny target: the student's initialisation, training that lowers the
loss, an ordinary transformers folder that speclm and transformers' assisted generation load, and
bad input refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from speclm import LLM, SamplingParams, SpeclmError
from speclm.cli import main
from speclm.distill import default_distill_dir, find_distilled
from speclm.distill.student import build_student, pick_layers
from speclm.distill.train import DistillConfig, distill

from .conftest import tiny_model


def test_pick_layers_spreads_over_the_depth():
    assert pick_layers(30, 4) == [0, 10, 19, 29]
    assert pick_layers(5, 1) == [0] and pick_layers(5, 2) == [0, 4]
    for bad in (0, 5, 7):
        with pytest.raises(SpeclmError, match="--layers"):
            pick_layers(5, bad)


def test_student_copies_the_chosen_layers():
    target = tiny_model(64, seed=3, seed_layers=4)
    student = build_student(target, [0, 3])
    assert student.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    t, s = target.state_dict(), student.state_dict()
    assert torch.equal(s["model.layers.1.mlp.up_proj.weight"], t["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(s["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(s["lm_head.weight"], t["lm_head.weight"])
    s["model.norm.weight"].add_(1.0)  # a copy, not a view of the target's weights
    assert not torch.equal(s["model.norm.weight"], t["model.norm.weight"])


def test_distill_trains_and_saves_a_folder_both_libraries_load(model_dirs, tiny_tokenizer, tmp_path):
    target_dir = model_dirs["target"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    out = tmp_path / "draft"
    config = DistillConfig(layers=1, max_minutes=2, max_steps=25, max_new_tokens=12, num_prompts=16,
                           batch_tokens=256, lr=3e-3, holdout=0.25)
    figures = distill(target, tiny_tokenizer, [0], out, config, progress=False)
    assert figures["steps"] == 25 and figures["loss_last"] < figures["loss_first"]
    assert 0.0 <= figures["holdout_agreement_after"] <= 1.0 and figures["size_bytes"] > 0
    saved = json.loads((out / "speclm_distill.json").read_text())
    assert saved["student_layers"] == [0] and saved["parameters"] == figures["parameters"]
    draft = AutoModelForCausalLM.from_pretrained(out)
    assert draft.config.num_hidden_layers == 1 and (out / "tokenizer.json").is_file()
    # transformers' own assisted generation accepts it and stays greedy-identical
    ids = torch.tensor([tiny_tokenizer("the quick brown fox")["input_ids"]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assisted = target.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False)
    assert torch.equal(plain, assisted)
    # and so does speclm, as a draft model
    llm = LLM(str(target_dir), str(out), 3, dtype="float64")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert llm.generate("héllo wörld", params)[0].token_ids == \
        llm.generate("héllo wörld", params, speculative=False)[0].token_ids


def test_distilled_is_found_in_the_cache(capsys, model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path))
    target_dir = model_dirs["target"]
    llm = LLM(str(target_dir), dtype="float64")
    with pytest.raises(SpeclmError, match="speclm distill"):
        llm.make_speculation("distilled")
    code = main(["distill", "--target", str(target_dir), "--layers", "1", "--max-steps", "2",
                 "--num-prompts", "4", "--max-new-tokens", "4"])
    assert code == 0
    folder = default_distill_dir(target_dir, 1)
    assert folder.is_relative_to(tmp_path) and find_distilled(target_dir) == folder
    spec = llm.make_speculation("distilled")
    assert spec.name == "distilled" and spec.drafter.model.num_layers == 1
    capsys.readouterr()
    assert main(["distill", "--target", str(target_dir), "--layers", "1", "--max-steps", "1",
                 "--num-prompts", "4", "--max-new-tokens", "4", "--lr", "1e-4"]) == 0
    assert "reusing the target's answers" in capsys.readouterr().err  # the data is cached


@pytest.mark.parametrize("argv,needle", [
    (["--layers", "0"], "--layers"),
    (["--layers", "2", "--loss", "mse"], "invalid choice"),
    (["--layers", "1", "--max-minutes", "0"], "--max-minutes"),
    (["--layers", "1", "--prompts", "/no/such.jsonl"], "cannot read prompts"),
    (["--layers", "9"], "--layers must be in"),
])
def test_distill_bad_input(capsys, model_dirs, argv, needle):
    try:
        code = main(["distill", "--target", str(model_dirs["target"]), *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_distill_refuses_to_overwrite_a_foreign_folder(capsys, model_dirs, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    code = main(["distill", "--target", str(model_dirs["target"]), "--layers", "1", "--out", str(tmp_path)])
    assert code == 2 and "not an earlier" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"
