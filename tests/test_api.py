"""The Python API on tiny model folders: generate, stream, chat, stops, errors."""

from __future__ import annotations

import pytest

from speclm import LLM, SamplingParams, SpeclmError
from speclm.detokenize import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["target"]), "ngram", 4, dtype="float64")


def test_generate_matches_plain_and_reports_stats(llm):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    spec = llm.generate(["the quick brown fox", "héllo wörld"], params)
    plain = llm.generate(["the quick brown fox", "héllo wörld"], params, speculative=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.text for o in spec] == [o.text for o in plain]
    s = spec[0].stats
    assert s.generated_tokens == 30 and spec[0].finish_reason == "length"
    assert sum(o.stats.accepted_tokens for o in spec) > 0  # speculation happened
    assert s.tau == pytest.approx(30 / s.target_forwards)
    assert plain[0].stats.drafted_tokens == 0 and plain[0].stats.tau == 1.0


def test_stream_deltas_join_to_final_text(llm):
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    chunks = list(llm.stream("naïve café", params))
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == llm.tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_truncates_text_and_tokens(llm):
    free = llm.generate("the quick brown fox", SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = free.text[8:11]
    assert stop, "the tiny model produced too little text for this test"
    out = llm.generate("the quick brown fox", SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.index(stop)]
    assert stop not in out.text and len(out.token_ids) < 30
    assert out.stats.generated_tokens == len(out.token_ids)
    streamed = "".join(c.text for c in llm.stream("the quick brown fox", SamplingParams(
        max_tokens=30, stop=[stop], ignore_eos=True)))
    assert streamed == out.text


@pytest.mark.parametrize("speculative", [False, True])
def test_eos_ends_generation(model_dirs, speculative):
    path = str(model_dirs["target"])
    llm = LLM(path, path, 3, dtype="float64")  # self-draft: rounds of 4 tokens
    free = llm.generate("the quick", SamplingParams(max_tokens=20, ignore_eos=True))[0]
    eos = free.token_ids[5]  # pretend the 6th generated token (mid-round) is end-of-sequence
    llm.target.eos_token_ids = frozenset({eos})
    out = llm.generate("the quick", SamplingParams(max_tokens=20), speculative=speculative)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert out.stats.generated_tokens == len(out.token_ids)


def test_chat_uses_template_and_sampling_is_seeded(llm):
    messages = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=15, seed=7, ignore_eos=True)
    a, b = llm.chat(messages, params), llm.chat(messages, params)
    assert a.token_ids == b.token_ids  # same seed, same draws
    assert llm.encode(messages)[:1] == llm.tokenizer.convert_tokens_to_ids(["<|im_start|>"])


def test_self_draft_and_draft_model(model_dirs):
    path = str(model_dirs["target"])
    selfdraft = LLM(path, path, 3, dtype="float64", adaptive_draft=False)  # fixed K: tau = K + 1
    assert selfdraft.drafter.model.model is selfdraft.target.model  # weights shared, not reloaded
    out = selfdraft.generate("the quick", SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out.stats.alpha == 1.0 and out.stats.tau == 4.0
    drafted = LLM(path, str(model_dirs["draft"]), 3, dtype="float64")
    plain = drafted.generate("the quick", SamplingParams(max_tokens=16, ignore_eos=True), speculative=False)
    spec = drafted.generate("the quick", SamplingParams(max_tokens=16, ignore_eos=True))
    assert spec[0].token_ids == plain[0].token_ids


@pytest.mark.parametrize("kind,match", [
    ("missing", "does not exist"),
    ("not_a_model", "not a GGUF file or a model folder"),
    ("empty_dir", "not a model folder"),
    ("broken_config", "cannot load"),
])
def test_bad_model_paths(tmp_path, kind, match):
    path = tmp_path / kind
    if kind == "not_a_model":
        path.write_text("hello")
    elif kind == "empty_dir":
        path.mkdir()
    elif kind == "broken_config":
        path.mkdir()
        (path / "config.json").write_text("{not json")
    with pytest.raises(SpeclmError, match=match):
        LLM(str(path))


def test_vocab_mismatch_is_a_clear_error(model_dirs):
    with pytest.raises(SpeclmError, match="vocabulary"):
        LLM(str(model_dirs["target"]), str(model_dirs["other_vocab"]), dtype="float64")


def test_chat_without_template_is_a_clear_error(model_dirs):
    llm = LLM(str(model_dirs["no_template"]), dtype="float64")
    with pytest.raises(SpeclmError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(SpeclmError, match=match):
        SamplingParams(**kwargs)


def test_bad_draft_settings_and_prompts(model_dirs):
    path = str(model_dirs["short"])
    with pytest.raises(SpeclmError, match="draft max"):
        LLM(path, "ngram", 0, dtype="float64")
    with pytest.raises(SpeclmError, match="draft min"):
        LLM(path, "ngram", 3, draft_min=4, dtype="float64")
    llm = LLM(path, "ngram", dtype="float64")
    with pytest.raises(SpeclmError, match="empty"):
        llm.generate("")
    with pytest.raises(SpeclmError, match="context"):
        llm.generate("the quick brown fox jumps over the lazy dog. " * 10)


def test_generation_stops_at_context_end(model_dirs):
    llm = LLM(str(model_dirs["short"]), "ngram", 5, dtype="float64")
    out = llm.generate("the quick brown fox", SamplingParams(max_tokens=200, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(llm.encode("the quick brown fox")) + len(out.token_ids) == 48


def test_detokenizer_holds_back_partial_characters_and_stop_prefixes(tiny_tokenizer):
    text = "naïve café 日本語 🙂 end"
    ids = tiny_tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    # a request that ends in the middle of a character still returns all of its text
    cut = next(i for i in range(1, len(ids)) if tiny_tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tiny_tokenizer)
    partial = detok.add(ids[:cut])
    assert partial + detok.flush() == tiny_tokenizer.decode(ids[:cut])
    detok = IncrementalDetokenizer(tiny_tokenizer, stop=["🙂 e"])
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == "naïve café 日本語 " and detok.stopped


def test_acceptance_by_position_with_mixed_draft_lengths():
    from speclm.stats import RequestStats

    stats = RequestStats()
    for drafted, accepted in [(1, 1), (2, 0), (2, 2), (3, 1)]:
        stats.record_round(drafted, accepted)
    # position 0 judged 4 times, accepted 3; position 1 judged in rounds 3 and 4, accepted once;
    # position 2 reached only in round 4 but never judged (position 1 was rejected)
    assert stats.acceptance_by_position == [0.75, 0.5, 0.0]
    assert stats.judged_per_position == [4, 2, 0]
