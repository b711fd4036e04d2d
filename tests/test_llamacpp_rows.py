"""Batched llama.cpp rows (one context, a sequence per row) on the real default model's GGUF.

llama.cpp computes a forward of several tokens with other kernels than a forward of one, so a
row's logits in a batch equal its logits alone only closely (near-ties can flip greedy tokens:
docs/benchmarks.md). What must hold exactly: rows never see each other (a row's logits do not
change when its neighbours' tokens do), cutting a row back and feeding it again reproduces its
logits, renaming slots (move, swap) keeps each row's cache, and a batch of requests through the
engine matches each request decoded alone wherever the two agree on the argmax by a margin.
"""

from __future__ import annotations

import pytest
import torch

from speclm import LLM, SamplingParams
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import NgramDrafter
from speclm.engine import Engine
from speclm.errors import CacheContractError, SpeclmError
from speclm.models.llamacpp import llama_cpp_available
from speclm.models.rows import SlotRows, make_rows
from speclm.tree import TreeMeta

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not llama_cpp_available(), reason="llama-cpp-python not installed")]

QUESTIONS = [
    "List the planets of the solar system in order, one per line.",
    "Write a Python function that reverses a string, then explain it.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM("default", backend="llamacpp")


@pytest.fixture(scope="module")
def prompts(llm):
    return [torch.tensor(llm.encode([{"role": "user", "content": q}])) for q in QUESTIONS]


def feed(rows, slots, chunks, logits=True):
    """One forward of ``chunks[b]`` into ``slots[b]`` (contiguous slots), then keep all of it."""
    width = max(c.shape[0] for c in chunks)
    ids = torch.zeros(len(chunks), width, dtype=torch.long)
    for b, c in enumerate(chunks):
        ids[b, : c.shape[0]] = c
    out = rows.forward(range(slots[0], slots[0] + len(slots)), ids, [c.shape[0] for c in chunks], logits=logits)
    for b, slot in enumerate(slots):
        rows.keep(slot, rows.length(slot), [])
    return out


def test_make_rows_batches_llamacpp_chains_only(llm):
    from speclm.models.llamacpp_rows import LlamaCppRows

    assert isinstance(make_rows(llm.target, 4), LlamaCppRows)
    assert isinstance(make_rows(llm.target, 4, needs_trees=True), SlotRows)
    assert isinstance(make_rows(llm.target, 1), SlotRows)  # a batch of one: the plain backend


def test_rows_are_isolated_and_close_to_alone(llm, prompts):
    rows = llm.target.batched_rows(3)
    a, b, c = prompts
    out = feed(rows, [0, 1, 2], [a, b, c])
    assert out.logits.shape[:2] == (3, max(p.shape[0] for p in prompts))
    # a neighbour's different tokens (same shapes) leave row 0 bit for bit unchanged
    rows.clear()
    other = feed(rows, [0, 1, 2], [a, torch.flip(b, [0]), c.roll(3)])
    n = a.shape[0]
    assert torch.equal(out.logits[0, :n], other.logits[0, :n])
    # and close to the row alone on the single-row backend
    llm.target.reset()
    alone = llm.target.forward(a, 0, num_logits=n).logits  # [n, V]
    agree = (alone.argmax(-1) == out.logits[0, :n].argmax(-1)).float().mean().item()
    assert agree > 0.9
    # clearing drops the cells and leaves the old keys and values in the buffers (zeroing them
    # cost 0.36 s a request): nothing reads them, the same forward gives the same bits
    rows.clear()
    again = feed(rows, [0, 1, 2], [a, b, c]).logits
    assert all(torch.equal(again[i, : p.shape[0]], out.logits[i, : p.shape[0]]) for i, p in enumerate(prompts))
    llm.target.reset()
    assert torch.equal(llm.target.forward(a, 0, num_logits=n).logits, alone)
    llm.target.reset()


def test_keep_then_refeed_reproduces_logits(llm, prompts):
    rows = llm.target.batched_rows(2)
    a, b = prompts[0], prompts[1]
    feed(rows, [0, 1], [a[:-3], b[:-2]], logits=False)
    first = rows.forward(range(0, 2), torch.stack([a[-3:], torch.cat([b[-2:], b[:1]])]), [3, 3])
    rows.keep(0, a.shape[0] - 3, [])  # reject everything in row 0, keep two of row 1
    rows.keep(1, b.shape[0] - 2, [0, 1])
    assert (rows.length(0), rows.length(1)) == (a.shape[0] - 3, b.shape[0])
    rows.keep(1, b.shape[0] - 2, [])
    again = rows.forward(range(0, 2), torch.stack([a[-3:], torch.cat([b[-2:], b[:1]])]), [3, 3])
    assert torch.equal(first.logits, again.logits)
    with pytest.raises(CacheContractError):
        rows.keep(0, 0, [1])  # a chain keeps a prefix
    with pytest.raises(SpeclmError, match="trees"):
        rows.forward(range(0, 1), torch.zeros(1, 2, dtype=torch.long), [2],
                     trees=[TreeMeta.from_parents([-1])])


def test_swap_and_move_keep_each_rows_cache(llm, prompts):
    rows = llm.target.batched_rows(3)
    a, b = prompts[0], prompts[1]
    feed(rows, [0, 1], [a[:-1], b[:-1]], logits=False)
    want = rows.forward(range(0, 2), torch.stack([a[-1:], b[-1:]]), [1, 1]).logits
    rows.keep(0, a.shape[0] - 1, [])
    rows.keep(1, b.shape[0] - 1, [])
    rows.swap(0, 1)
    got = rows.forward(range(0, 2), torch.stack([b[-1:], a[-1:]]), [1, 1]).logits
    assert torch.equal(got[0], want[1]) and torch.equal(got[1], want[0])
    rows.keep(0, b.shape[0] - 1, [])
    rows.keep(1, a.shape[0] - 1, [])
    rows.move(1, 2)  # row a now lives in slot 2, slot 1 is free
    assert rows.length(1) == 0 and rows.length(2) == a.shape[0] - 1
    rows.release(0)
    alone = rows.forward(range(2, 3), a[-1:].view(1, 1), [1]).logits
    assert (alone[0, 0].argmax() == want[0, 0].argmax()).item()


def test_engine_batch_matches_solo_up_to_near_ties(llm, prompts):
    """Three greedy requests, prompt lookup, batched in one llama.cpp context: each equals its
    solo plain output up to the first near-tie (the solo run's top-2 gap there is small)."""
    params = SamplingParams(max_tokens=48)
    engine = Engine(make_rows(llm.target, 3), drafter_factory=lambda _: NgramDrafter(2, 3),
                    draft_length=DraftLengthConfig(6, 0, adaptive=False))
    for i, p in enumerate(prompts):
        engine.add(str(i), p, params)
    got = {str(i): [] for i in range(3)}
    while engine.has_work:
        outputs, _ = engine.step()
        for o in outputs:
            got[o.request_id] += o.step.tokens
    for i, p in enumerate(prompts):
        target = llm.target
        target.reset()
        tokens, logits = [], target.forward(p, 0).logits[-1]
        for _ in range(len(got[str(i)])):
            tok = int(logits.argmax())
            tokens.append(tok)
            if tok in target.eos_token_ids:
                break
            logits = target.forward(torch.tensor([tok]), p.shape[0] + len(tokens) - 1).logits[-1]
        target.reset()
        mine = got[str(i)]
        same = next((j for j, (x, y) in enumerate(zip(mine, tokens)) if x != y), None)
        if same is None:
            assert mine == tokens[: len(mine)]
            continue
        # a difference must sit on a near-tie of the solo run: replay it and read the gap
        target.forward(torch.cat([p, torch.tensor(tokens[:same], dtype=torch.long)])[:-1], 0)
        last = target.forward(torch.tensor([tokens[same - 1] if same else int(p[-1])]),
                              p.shape[0] + same - 1).logits[-1]
        target.reset()
        top2 = last.topk(2).values
        assert float(top2[0] - top2[1]) < 1.0, f"request {i} differs at {same} with a clear argmax"
