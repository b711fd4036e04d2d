"""Training data for drafters at scale: batched answers equal solo greedy decoding, every stage
resumes after an interruption without duplicating anything, self-written prompts are filtered and
deduplicated, feature shards respect their bounds, and the held-out split stays put as the store
grows."""

from __future__ import annotations

import json

import pytest
import torch

from speclm.engine import generate_tokens
from speclm.errors import SpeclmError
from speclm.learned import self_prompts
from speclm.learned.answers import Answer, AnswerStore, answer_prompts, text_key
from speclm.learned.features import FeatureShards, batch_features, record_features
from speclm.learned.self_prompts import degenerate, normalise, user_turn_opener, write_prompts
from speclm.models.hf import HFCausalLM
from speclm.prompts import encode_user_turn
from speclm.sampling import SamplingParams

from .conftest import tiny_model

PROMPTS = [f"the quick brown fox number {i}" + " and more" * (i % 4) for i in range(10)]


@pytest.fixture(scope="module")
def lm(tiny_tokenizer):
    return HFCausalLM(tiny_model(len(tiny_tokenizer), seed=0), frozenset({0}))


def _solo(lm, tokenizer, text, max_tokens):
    prompt = encode_user_turn(tokenizer, text, 384)
    out = []
    for step in generate_tokens(lm, torch.tensor(prompt), SamplingParams(max_tokens=max_tokens)):
        out += step.tokens
    return prompt + out


def test_batched_answers_equal_solo_greedy_decoding(lm, tiny_tokenizer, tmp_path):
    store = AnswerStore(tmp_path)
    report = answer_prompts(lm, tiny_tokenizer, PROMPTS, store, max_new_tokens=12, rows=4, progress=False)
    assert report.requests == len(PROMPTS) and not report.stopped_early
    answers = store.answers([text_key(p) for p in PROMPTS])
    assert [a.key for a in answers] == [text_key(p) for p in PROMPTS]
    for text, answer in zip(PROMPTS, answers):
        assert answer.ids == _solo(lm, tiny_tokenizer, text, 12)
        assert answer.answer_len == 12 or answer.finish == "stop"


def test_answers_resume_after_an_interruption_without_duplicates(lm, tiny_tokenizer, tmp_path, monkeypatch):
    clean = AnswerStore(tmp_path / "clean")
    answer_prompts(lm, tiny_tokenizer, PROMPTS, clean, max_new_tokens=8, rows=3, progress=False)

    store = AnswerStore(tmp_path / "run")
    real_add, calls = AnswerStore.add, []

    def failing_add(self, answer):
        calls.append(answer.key)
        if len(calls) == 4:
            raise KeyboardInterrupt
        real_add(self, answer)

    monkeypatch.setattr(AnswerStore, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        answer_prompts(lm, tiny_tokenizer, PROMPTS, store, max_new_tokens=8, rows=3, progress=False)
    monkeypatch.setattr(AnswerStore, "add", real_add)
    with (tmp_path / "run" / "answers.jsonl").open("a") as f:
        f.write('{"key": "torn')  # a write cut off by the crash
    again = AnswerStore(tmp_path / "run")
    assert len(again.rows) == 3
    report = answer_prompts(lm, tiny_tokenizer, PROMPTS, again, max_new_tokens=8, rows=3, progress=False)
    assert report.requests == len(PROMPTS) - 3
    lines = (tmp_path / "run" / "answers.jsonl").read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == len(PROMPTS)
    by_key = {a.key: a.ids for a in clean.answers()}
    assert {a.key: a.ids for a in AnswerStore(tmp_path / "run").answers()} == by_key
    # nothing left: a third run answers nothing; a past deadline stops before any step
    assert answer_prompts(lm, tiny_tokenizer, PROMPTS, again, max_new_tokens=8, progress=False).requests == 0
    late = answer_prompts(lm, tiny_tokenizer, ["a new prompt"], again, max_new_tokens=8, deadline=0.0,
                          progress=False)
    assert late.stopped_early and late.requests == 0


def test_degenerate_prompts_are_named():
    assert degenerate("What is the capital of France?") is None
    assert degenerate("hi there") == "length"
    assert degenerate("<|im_start|> hello there my friend") == "template text"
    assert degenerate("1234 5678 9999 0000 1111 2222") == "not prose"
    assert degenerate("the cat sat " * 10) == "repetitive"
    assert normalise("What's  the TIME?") == normalise("what s the time")


def test_user_turn_opener_ends_where_the_user_text_starts(tiny_tokenizer, model_dirs):
    from transformers import AutoTokenizer

    assert tiny_tokenizer.decode(user_turn_opener(tiny_tokenizer)) == "<|im_start|>user\n"
    no_template = AutoTokenizer.from_pretrained(model_dirs["no_template"])
    assert user_turn_opener(no_template) == []  # no BOS either: write_prompts refuses it


def test_self_written_prompts_are_deduplicated_and_resume(tiny_tokenizer, tmp_path, monkeypatch):
    model = tiny_model(len(tiny_tokenizer), seed=0)
    lm = HFCausalLM(model, frozenset(range(0, len(tiny_tokenizer), 3)))  # a third of tokens end a turn
    monkeypatch.setattr(self_prompts, "degenerate", lambda text: None if text else "length")
    known = ["already known"]
    kept, report = write_prompts(lm, tiny_tokenizer, 4, tmp_path, seed=1, known=known, rows=3, max_tokens=6,
                                 starts=("",), progress=False)
    assert 0 < len(kept) <= 4 and report.requests >= len(kept)
    assert len({normalise(t) for t in kept}) == len(kept) and normalise(known[0]) not in map(normalise, kept)
    store = tmp_path / "self-prompts-seed1.jsonl"
    first_attempts = [json.loads(line)["attempt"] for line in store.read_text().splitlines()]
    more, report2 = write_prompts(lm, tiny_tokenizer, 6, tmp_path, seed=1, known=known, rows=3, max_tokens=6,
                                  starts=("",), progress=False)
    assert more[: len(kept)] == kept  # earlier prompts kept, in order
    attempts = [json.loads(line)["attempt"] for line in store.read_text().splitlines()]
    assert attempts[: len(first_attempts)] == first_attempts and len(set(attempts)) == len(attempts)
    # each attempt samples with its own seed: a fresh folder, another batch size, the same text
    write_prompts(lm, tiny_tokenizer, 4, tmp_path / "fresh", seed=1, known=known, rows=1, max_tokens=6,
                  starts=("",), progress=False)
    ours = {r["attempt"]: r["text"] for r in map(json.loads, store.read_text().splitlines())}
    theirs = {r["attempt"]: r["text"] for r in
              map(json.loads, (tmp_path / "fresh" / "self-prompts-seed1.jsonl").read_text().splitlines())}
    common = set(ours) & set(theirs)
    assert common and all(ours[i] == theirs[i] for i in common)


def test_self_written_prompts_begin_with_their_attempts_start(tiny_tokenizer, tmp_path, monkeypatch):
    model = tiny_model(len(tiny_tokenizer), seed=0)
    lm = HFCausalLM(model, frozenset(range(0, len(tiny_tokenizer), 3)))
    monkeypatch.setattr(self_prompts, "degenerate", lambda text: None if text else "length")
    fed = []
    real = self_prompts.run_requests

    def spy(target, requests, **kwargs):
        def recorded():
            for rid, prompt, params in requests:
                fed.append((int(rid), prompt))
                yield rid, prompt, params
        return real(target, recorded(), **kwargs)

    monkeypatch.setattr(self_prompts, "run_requests", spy)
    starts = ("", "Translate this:")
    write_prompts(lm, tiny_tokenizer, 6, tmp_path, seed=2, rows=3, max_tokens=6, starts=starts, progress=False)
    opener = user_turn_opener(tiny_tokenizer)
    start_ids = tiny_tokenizer("Translate this:", add_special_tokens=False)["input_ids"]
    assert fed and all(prompt == opener + (start_ids if i % 2 else []) for i, prompt in fed)
    (store,) = tmp_path.glob("self-prompts-seed2-*.jsonl")  # its own store: another set of starts
    kept = [row for row in map(json.loads, store.read_text().splitlines()) if row["text"] is not None]
    assert {row["attempt"] % 2 for row in kept} == {0, 1}
    assert all(row["text"].startswith("Translate this:") == (row["attempt"] % 2 == 1) for row in kept)
    assert not (tmp_path / "self-prompts-seed2.jsonl").exists()


def test_write_prompts_needs_a_way_to_open_a_turn(lm, model_dirs, tmp_path):
    from transformers import AutoTokenizer

    with pytest.raises(SpeclmError, match="neither a chat template nor a BOS"):
        write_prompts(lm, AutoTokenizer.from_pretrained(model_dirs["no_template"]), 2, tmp_path, progress=False)


def _answers(lm, tokenizer, tmp_path) -> list[Answer]:
    store = AnswerStore(tmp_path / "answers")
    answer_prompts(lm, tokenizer, PROMPTS, store, max_new_tokens=10, rows=5, progress=False)
    return store.answers()


def test_feature_shards_resume_and_match_one_answer_forwards(lm, tiny_tokenizer, tmp_path, monkeypatch):
    from speclm.learned import features as features_module

    answers = _answers(lm, tiny_tokenizer, tmp_path)
    layers = [1, -1]
    meta = dict(target="tiny", layers=layers)
    shards = FeatureShards(tmp_path / "features", meta)
    real, calls = features_module.batch_features, []

    def failing(model, batch, layers, dtype=torch.bfloat16):
        calls.append(len(batch))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, batch, layers, dtype)

    monkeypatch.setattr(features_module, "batch_features", failing)
    with pytest.raises(KeyboardInterrupt):
        record_features(lm.model, answers, shards, layers, batch_tokens=60, shard_tokens=40, progress=False)
    monkeypatch.setattr(features_module, "batch_features", real)
    resumed = FeatureShards(tmp_path / "features", meta)
    before = len(resumed.keys)
    assert 0 < before < len(answers)  # the shards written before the interruption
    done = record_features(lm.model, answers, resumed, layers, batch_tokens=60, shard_tokens=40, progress=False)
    assert done == len(answers) - before and len(resumed.keys) == len(answers)
    loaded = FeatureShards(tmp_path / "features", meta).load()
    assert len(loaded) == len(answers) and len(resumed.shards) >= 3
    by_ids = {tuple(s.ids.tolist()): s for s in loaded}
    for a in answers:
        seq = by_ids[tuple(a.ids)]
        alone = batch_features(lm.model, [a], layers, torch.float64)[0]
        assert seq.features.dtype == torch.bfloat16 and seq.features.shape == alone.features.shape
        assert torch.allclose(seq.features.double(), alone.features, rtol=1e-2, atol=1e-2)
        assert torch.equal(seq.target_next, alone.target_next)
    with pytest.raises(SpeclmError, match="another target or layer set"):
        FeatureShards(tmp_path / "features", dict(target="tiny", layers=[2]))


def test_feature_recording_stops_at_the_disk_bound(lm, tiny_tokenizer, tmp_path, capsys):
    answers = _answers(lm, tiny_tokenizer, tmp_path)
    shards = FeatureShards(tmp_path / "bounded", {"layers": [1]})
    per_token = 2 * lm.model.config.hidden_size + 12
    bound = per_token * (len(answers[0].ids) + len(answers[1].ids) + 1)
    done = record_features(lm.model, answers, shards, [1], batch_tokens=1, max_bytes=bound, progress=False)
    assert 1 <= done < len(answers)
    assert "disk bound" in capsys.readouterr().err


def test_features_recorded_while_answering_equal_a_teacher_forced_pass(lm, tiny_tokenizer, tmp_path):
    """The engine hands a FeatureRecorder the target's hidden states of every position it feeds:
    the same features and greedy choices a second, teacher-forced forward computes, without
    that forward."""
    layers = [1, -1]
    shards = FeatureShards(tmp_path / "features", {"layers": layers})
    store = AnswerStore(tmp_path / "answers")
    answer_prompts(lm, tiny_tokenizer, PROMPTS, store, max_new_tokens=9, rows=4, features=shards,
                   feature_layers=layers, shard_tokens=50, progress=False)
    answers = store.answers()
    assert shards.keys == {a.key for a in answers} and len(shards.shards) >= 2
    recorded = {tuple(s.ids.tolist()): s for s in FeatureShards(tmp_path / "features", {"layers": layers}).load()}
    for a in answers:
        seq = recorded[tuple(a.ids)]
        forced = batch_features(lm.model, [a], layers, torch.float64)[0]
        assert seq.prompt_len == a.prompt_len
        assert seq.features.shape == forced.features.shape
        # the target's choice after every position: its LM head on the prompt, the answer after
        assert torch.equal(seq.target_next[:-1], forced.target_next[:-1])
        assert torch.allclose(seq.features[:-1].double(), forced.features[:-1], rtol=1e-2, atol=1e-2)
        assert not seq.features[-1].any()  # the last token is never fed
    # a disk bound already reached records nothing more in the same pass
    full = FeatureShards(tmp_path / "full", {"layers": layers})
    answer_prompts(lm, tiny_tokenizer, ["one more prompt"], AnswerStore(tmp_path / "more"), max_new_tokens=4,
                   features=full, feature_layers=layers, max_feature_bytes=0, progress=False)
    assert not full.keys


def test_the_held_out_split_is_drawn_per_answer_and_stable_as_the_store_grows():
    """A head measured on held-out answers, then trained further on a grown store, must not
    train on what it was measured on: an answer's side depends on its key and the seed only."""
    from speclm.learned.command import split_held_out
    from speclm.learned.train import Sequence

    def store(n: int) -> list[Sequence]:
        return [Sequence(torch.tensor([i]), 0, torch.zeros(1, 1), None, text_key(f"prompt {i}")) for i in range(n)]

    small_held, small_train = split_held_out(store(300), 0.1, seed=0)
    big_held, big_train = split_held_out(store(3000), 0.1, seed=0)
    keys = lambda seqs: {s.key for s in seqs}  # noqa: E731
    assert keys(small_held) <= keys(big_held) and keys(small_train) <= keys(big_train)
    assert not keys(big_held) & keys(big_train) and len(big_held) + len(big_train) == 3000
    assert 240 <= len(big_held) <= 360  # about a tenth
    assert keys(split_held_out(store(3000), 0.1, seed=1)[0]) != keys(big_held)  # the seed draws anew
    tiny_held, tiny_train = split_held_out(store(2), 0.1, seed=0)
    assert len(tiny_held) == 1 and len(tiny_train) == 1  # at least one of each
