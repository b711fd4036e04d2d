"""On the real default model (SmolLM2-135M-Instruct, float32): greedy speculative output is
identical to plain greedy output for prompt lookup and for a self-draft.

Marked ``real_model``; run with ``pytest -m real_model``. Reads Spec-Bench prompts from
``--spec-bench`` or ``../shared/data/spec_bench/question.jsonl``, else the shipped prompt set.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from speclm import LLM, SamplingParams
from speclm.prompts import load_prompts, spread

pytestmark = pytest.mark.real_model
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prompts(request):
    path = request.config.getoption("--spec-bench") or REPO.parent / "shared/data/spec_bench/question.jsonl"
    rows = load_prompts(path) if Path(path).is_file() else load_prompts()
    return spread(rows, 6)


@pytest.fixture(scope="module")
def llm():
    return LLM("default", "ngram", 10, backend="torch", adaptive_draft=False)  # fixed K: every round drafts


def test_default_model_loads_with_chat_template(llm):
    assert llm.tokenizer.chat_template and llm.target.vocab_size == 49152
    assert llm.model_path.joinpath("model.safetensors").is_file()  # the dequantized cache


PLAIN_TOKENS = 48  # the longest greedy output any test here compares


@pytest.fixture(scope="module")
def plain(llm):
    """Plain decoding of a prompt's first turn, once per prompt and sampling setting for the whole
    module: greedy output with N tokens is the first N of the output with more, so every greedy
    test compares against a prefix of one ``PLAIN_TOKENS``-token run."""
    done: dict[tuple, list[int]] = {}

    def first(p: dict, params: SamplingParams) -> list[int]:
        greedy = params.temperature == 0
        assert not greedy or params.max_tokens <= PLAIN_TOKENS
        key = (p["id"], None if greedy else repr(params))
        if key not in done:
            messages = [{"role": "user", "content": p["turns"][0]}]
            run = SamplingParams(max_tokens=PLAIN_TOKENS) if greedy else params
            done[key] = llm.chat(messages, run, speculative=False).token_ids
        return done[key][:params.max_tokens]

    return first


def assert_identical_to_plain(llm, plain, prompts, spec, max_tokens: int,
                              params: SamplingParams | None = None) -> list:
    """Chat each prompt's first turn with ``spec`` (None: the LLM's default speculation); greedy
    (or seeded: ``params``), the output must match plain decoding's (``plain``, the module's
    cached runs) token for token. Returns the speculative outputs."""
    params = params or SamplingParams(max_tokens=max_tokens)
    outs = []
    for p in prompts:
        messages = [{"role": "user", "content": p["turns"][0]}]
        out = llm.chat(messages, params) if spec is None else llm.chat(messages, params, speculative=spec)
        assert out.token_ids == plain(p, params), f"question {p['id']} ({p['category']}) differs"
        outs.append(out)
    return outs


def test_ngram_greedy_identity(llm, prompts, plain):
    outs = assert_identical_to_plain(llm, plain, prompts, None, PLAIN_TOKENS)
    assert sum(out.stats.accepted_tokens for out in outs) > 0


def test_seeded_sampling_identity(llm, prompts, plain):
    """T = 0.7 with a seed on the real model: prompt lookup and the shipped EAGLE tree give plain
    seeded decoding's tokens. Fixed K (no cost model), so every round drafts on any machine."""
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=5, max_tokens=40)
    for spec in (None, llm.make_speculation("eagle", 4, adaptive_draft=False)):
        outs = assert_identical_to_plain(llm, plain, prompts[:3], spec, 40, params)
        assert sum(out.stats.drafted_tokens for out in outs) > 0, spec
        assert sum(out.stats.accepted_tokens for out in outs) > 0, spec


def test_self_draft_greedy_identity(llm, prompts, plain):
    selfdraft = llm.make_speculation("default", 4, adaptive_draft=False)  # fixed K: every round drafts
    assert selfdraft.drafter.model.model is llm.target.model  # no second copy of the weights
    for out in assert_identical_to_plain(llm, plain, prompts[:4], selfdraft, 24):
        assert out.stats.alpha > 0.9  # float32 rounding may flip a rare near-tie in the draft


@pytest.mark.parametrize("text", ["layerskip:skip=12-15", "early-exit:layers=20", "recycle", "suffix"])
def test_training_free_drafters_greedy_identity(llm, prompts, plain, text):
    spec = llm.make_speculation(text, adaptive_draft=False)
    if hasattr(spec.drafter, "subset"):
        assert spec.drafter.subset.target is llm.target  # self-speculation: no second model
    outs = assert_identical_to_plain(llm, plain, prompts[:3], spec, 24)
    assert sum(out.stats.accepted_tokens for out in outs) > 0


def _learned_drafters(llm):
    """Untrained (warm-started) learned drafters: they exercise the real shapes and feature
    plumbing; acceptance does not matter for identity."""
    import torch

    from speclm.drafters.eagle import EagleDrafter
    from speclm.drafters.medusa import MedusaDrafter
    from speclm.drafters.tree_search import TreeShape
    from speclm.learned.modules import EagleHead, MedusaHeads

    model = llm.target.model
    ids = torch.arange(4096)
    eagle = EagleHead.create(model, [2, 15, 29], ids)
    return {
        "medusa": MedusaDrafter(MedusaHeads.create(model, 3, None), [[0], [1], [0, 0], [0, 0, 0]]),
        "eagle-tree": EagleDrafter(eagle, model.get_input_embeddings(), [2, 15, 29], llm.target.vocab_size,
                                   TreeShape(4, 12)),
    }


@pytest.mark.parametrize("text", ["draft:path=default,tree=3,budget=10", "async-self-draft",
                                  "medusa", "eagle-tree"])
def test_trees_learned_and_async_drafters_greedy_identity(llm, prompts, plain, text):
    """Token trees through the real model's 4D mask, learned drafters on its features, and
    asynchronous drafting with a worker thread: all token-identical to plain decoding."""
    if text == "async-self-draft":
        spec = llm.make_speculation("default", 3, async_draft=True, async_fanout=4, adaptive_draft=False)
    elif text in ("medusa", "eagle-tree"):
        spec = llm.make_speculation(_learned_drafters(llm)[text], 3, adaptive_draft=False)
    else:
        spec = llm.make_speculation(text, 3, adaptive_draft=False)
    assert_identical_to_plain(llm, plain, prompts[:2], spec, 20)


def test_the_shipped_eagle_drafter(llm, prompts, plain):
    """``eagle`` with no path: the drafter shipped for the default model names it, loads on it
    and keeps greedy output identical to plain decoding."""
    from speclm.learned.checkpoint import DrafterConfig
    from speclm.learned.shipped import shipped_folder
    from speclm.models.loading import DEFAULT_MODEL_NAME

    config = DrafterConfig.load(shipped_folder(llm.target.model, "eagle"))
    assert config.kind == "eagle" and config.target.name == DEFAULT_MODEL_NAME
    spec = llm.make_speculation("eagle", 4, adaptive_draft=False)
    outs = assert_identical_to_plain(llm, plain, prompts[:3], spec, 32)
    assert sum(out.stats.accepted_tokens for out in outs) > 0


def test_batched_greedy_identity(llm, prompts, plain):
    """The server's batched engine (prompt lookup, adaptive K) on six Spec-Bench questions at
    once, prompts of very different lengths: each output equals its solo plain output."""
    from speclm.draft_length import DraftLengthConfig
    from speclm.drafters import NgramDrafter
    from speclm.engine import Engine
    from speclm.models.rows import make_rows

    params = SamplingParams(max_tokens=24)
    engine = Engine(make_rows(llm.target, 6), drafter_factory=lambda _: NgramDrafter(2, 3),
                    draft_length=DraftLengthConfig(10, 0, True))
    expected, outputs = {}, {}
    for p in prompts:
        messages = [{"role": "user", "content": p["turns"][0]}]
        expected[p["id"]] = plain(p, params)
        engine.add(p["id"], llm.encode(messages), params)
        outputs[p["id"]] = []
    while engine.has_work:
        for out in engine.step()[0]:
            outputs[out.request_id] += out.step.tokens
    assert outputs == expected
