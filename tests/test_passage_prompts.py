"""Prompts built on the target's own answers: filtered, reproducible, distinct, and answered in
the same data stage as the prompts they come from (a rerun answers nothing twice)."""

from __future__ import annotations

import pytest
import torch

from speclm.learned import passage_prompts as pp
from speclm.learned.answers import Answer, AnswerStore, answers_folder, text_key
from speclm.learned.data import build_dataset
from speclm.models.hf import HFCausalLM

from .conftest import tiny_model

WORDS = "the river carries water from the hills down to the sea where ships wait".split()


def _answer(i: int, words: int, finish: str = "stop", digits: bool = False) -> tuple[str, Answer]:
    text = " ".join(("12345" if digits and j % 2 else WORDS[(i + j) % len(WORDS)]) for j in range(words))
    ids = [0, 1, 2] + [ord(c) for c in f"{i}:{text}"]  # decode() below maps ids back to this text
    return f"question {i}?", Answer(text_key(f"question {i}?"), ids, 3, finish)


def _decode(ids: list[int]) -> str:
    return "".join(map(chr, ids)).split(":", 1)[1]


def test_only_finished_prose_of_a_sensible_length_becomes_a_passage():
    answered = [_answer(0, 60), _answer(1, 10), _answer(2, 60, finish="length"), _answer(3, 60, digits=True),
                _answer(4, 400), _answer(5, 80)]
    kept = pp.passages([a for _, a in answered], _decode)
    assert [i for i, _ in kept] == [0, 5]
    assert kept[0][1] == _decode(answered[0][1].ids[3:])


def test_a_long_answer_is_cut_after_its_last_whole_sentence():
    sentence = "The river carries water from the hills down to the sea. "  # 11 words
    text = sentence * 20
    answer = Answer("k", [0, 1] + [ord(c) for c in f"0:{text}"], 2, "stop")
    [(_, cut)] = pp.passages([answer], _decode, min_words=20, max_words=50)
    assert cut == (sentence * 4).strip() and cut.endswith("sea.")


def test_passage_prompts_are_reproducible_distinct_new_and_cycle_through_the_tasks():
    answered = [_answer(i, 50 + i) for i in range(12)]
    made = pp.passage_prompts(answered, _decode, 25, seed=3)
    assert len(made) == 25 and len(set(made)) == 25
    assert made == pp.passage_prompts(answered, _decode, 25, seed=3)
    assert made[:10] == pp.passage_prompts(answered, _decode, 10, seed=3)  # asking for more keeps the first
    assert made != pp.passage_prompts(answered, _decode, 25, seed=4)
    texts = {p for p, _ in answered}
    assert not texts & set(made)
    heads = [t.split("{")[0] for t in pp.PASSAGE_TASKS]
    for i, prompt in enumerate(made[: len(pp.PASSAGE_TASKS)]):
        assert prompt.startswith(heads[i])
    passages = {_decode(a.ids[3:]) for _, a in answered}
    for prompt in made:
        assert any(p in prompt for p in passages)
        if "Question: " in prompt:  # a question asked after the passage that answers it
            question = prompt.rsplit("Question: ", 1)[1]
            answer = dict(answered)[question]
            assert _decode(answer.ids[3:]) in prompt


def test_too_few_passages_make_no_prompts():
    assert pp.passage_prompts([_answer(0, 60)], _decode, 5) == []
    assert pp.passage_prompts([_answer(i, 3) for i in range(5)], _decode, 5) == []


def test_build_dataset_answers_the_passage_prompts_and_a_rerun_answers_nothing(tiny_tokenizer, tmp_path, monkeypatch):
    """The tiny model's answers are not prose: every answer is let through as a passage."""
    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pp, "passages", lambda answers, decode: [(i, f"passage {i}") for i in range(len(answers))])
    lm = HFCausalLM(tiny_model(len(tiny_tokenizer), seed=0), frozenset({0}))
    prompts = [f"tell me about item {i}" for i in range(6)]
    kwargs = dict(target_name="tiny", fingerprint=1.0, feature_layers=[1], max_new_tokens=5,
                  folder=tmp_path / "drafter", rows=4, passages=4, seed=0, progress=False)
    sequences = build_dataset(lm, tiny_tokenizer, prompts, **kwargs)
    store = AnswerStore(answers_folder(tmp_path / "cache", "tiny", 1.0, "torch", 5))
    assert len(store.rows) == 10 and len(sequences) == 10  # 6 prompts + 4 built on their answers
    made = [a for a in store.answers() if a.key not in {text_key(p) for p in prompts}]
    assert len(made) == 4
    rows_before = len(store.rows)
    again = build_dataset(lm, tiny_tokenizer, prompts, **kwargs)
    assert len(AnswerStore(store.path.parent).rows) == rows_before  # nothing answered twice
    assert sorted(s.ids.tolist() for s in again) == sorted(s.ids.tolist() for s in sequences)
    assert all(torch.is_tensor(s.features) for s in again)


@pytest.mark.parametrize("task", pp.PASSAGE_TASKS)
def test_every_task_takes_passages_and_an_optional_question(task):
    text = task.format("first passage", "second passage", question="what?")
    assert "first passage" in text and "{" not in text

