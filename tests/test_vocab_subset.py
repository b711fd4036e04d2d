"""A draft's output layer over part of the vocabulary (models/vocab_subset.py, ``quant:vocab=N``).

The ranking (single characters first, then BPE merge order), the head (the full head's logits on
its tokens, -inf elsewhere, N rows read), and losslessness: a draft that can never propose some
of the target's tokens still gives plain decoding's greedy tokens (chains, trees, a compiled
target, a server's rows on the target's cache, the API); the chi-square test of its sampled
output, with the target's likeliest tokens left out of the draft's vocabulary on purpose, is
tests/test_quant_draft.py's test_sampling_matches_target_distribution.
"""

from __future__ import annotations

import pytest
import torch

from speclm import LLM, SamplingParams, SpeclmError
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import DraftModelDrafter
from speclm.drafters.quant import quant_draft
from speclm.drafters.registry import parse_drafter
from speclm.drafters.tree_search import TreeShape
from speclm.models.quantize import Int4Linear, Int8Linear, quantized_copy
from speclm.models.small_m import BlockLinear
from speclm.models.vocab_subset import SubsetHead, draft_vocabulary, ranked_vocabulary

from .conftest import backend, tiny_model
from .test_lossless import prompts, run

VOCAB = 96


class _Pieces:
    """A tokenizer that names its pieces: SentencePiece-style, single characters last."""

    def __init__(self, pieces):
        self.pieces = pieces

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


def test_ranking_puts_single_characters_first_then_merge_order():
    tok = _Pieces(["<eos>", "\u2581the", "\u2581and", "ing", "\u2581a", "x", ",", "\u0120b"])
    # ids 8, 9: padded rows the tokenizer does not name
    assert ranked_vocabulary(tok, 10).tolist() == [4, 5, 6, 7, 0, 1, 2, 3, 8, 9]
    assert ranked_vocabulary(object(), 5).tolist() == [0, 1, 2, 3, 4]  # no pieces: by id
    ids = draft_vocabulary(ranked_vocabulary(tok, 10), 5, always=[3])
    assert ids.tolist() == [3, 4, 5, 6, 7]  # ascending; the end-of-sequence id kept
    with pytest.raises(SpeclmError, match="takes 1 to 9 of the target's 10 tokens"):
        draft_vocabulary(torch.arange(10), 10)


def test_the_targets_prior_ranks_what_it_predicts_first_and_is_cached(tmp_path, monkeypatch, tiny_tokenizer):
    """The ranking puts first the tokens the target gives mass to on speclm's prompts; computed
    once per model file (the cache file is named for it), then read back."""
    from speclm.drafters import quant
    from speclm.drafters.quant import narrowed_vocabulary
    from speclm.models import vocab_subset

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))
    vocab = len(tiny_tokenizer)
    model = tiny_model(vocab, seed=3)
    with torch.no_grad():  # a target that predicts tokens 9 and 7 everywhere, 9 the most
        model.lm_head.weight.mul_(0.01)
        unit = model.model.norm.weight / model.model.norm.weight.norm()
        model.lm_head.weight[9] += 40 * unit
        model.lm_head.weight[7] += 30 * unit
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"stands for the weights")
    calls = []
    real = vocab_subset.target_prior
    monkeypatch.setattr(vocab_subset, "target_prior", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(vocab_subset, "_RANKINGS", {})
    monkeypatch.setattr(quant, "_NARROWED", {})
    lm = backend(model)
    ids = narrowed_vocabulary(lm, tiny_tokenizer, folder, 3)
    assert set(ids.tolist()) >= {7, 9} and ids.numel() == 3
    assert narrowed_vocabulary(lm, tiny_tokenizer, folder, 3) is ids  # the next request in this process
    assert narrowed_vocabulary(lm, tiny_tokenizer, folder, 4).numel() == 4  # another size: its own answer
    monkeypatch.setattr(vocab_subset, "_RANKINGS", {})  # another process: from the file
    monkeypatch.setattr(quant, "_NARROWED", {})
    assert torch.equal(narrowed_vocabulary(lm, tiny_tokenizer, folder, 3), ids)
    assert calls == [1] and len(list((tmp_path / "cache" / "vocab").glob("*.pt"))) == 1
    ranking = vocab_subset.prior_ranking(model, tiny_tokenizer, vocab, max_tokens=64)
    assert calls == [1, 1]  # not cached without a file
    assert ranking[:2].tolist() == [9, 7] and sorted(ranking.tolist()) == list(range(vocab))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_subset_head_gives_the_full_heads_logits_on_its_tokens(scheme):
    model = tiny_model(VOCAB, seed=10, seed_layers=4).float()
    ids = torch.arange(0, VOCAB, 3)  # 32 of 96
    full = quantized_copy(model, scheme)
    part = quantized_copy(model, scheme, vocab=ids)
    head = part.get_output_embeddings()
    assert isinstance(head, SubsetHead) and head.out_features == VOCAB
    assert isinstance(head.layer, (BlockLinear, Int8Linear if scheme == "int8" else Int4Linear))
    assert head.layer.out_features == ids.numel()  # it reads 32 rows, not 96
    assert part.model.embed_tokens.weight is model.model.embed_tokens.weight  # still shared
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)  # the target is untouched
    prompt = prompts(1)[0]
    a = backend(full).forward(prompt, 0, num_logits=prompt.shape[0]).logits
    b = backend(part).forward(prompt, 0, num_logits=prompt.shape[0]).logits  # [T, V]
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(b[:, outside]).all()
    torch.testing.assert_close(b[:, ids], a[:, ids], rtol=1e-2, atol=1e-2)  # the same rows, rounded alike


def _likeliest_left_out(lm, prompt, size):
    """``size`` ids that leave out the target's greedy tokens after ``prompt``: the draft cannot
    propose the token the target wants most at those positions."""
    greedy, _ = run(lm, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    keep = [i for i in range(lm.vocab_size) if i not in set(greedy[:4])]
    return torch.tensor(keep[:size])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tree", [None, TreeShape(top_k=2, budget=6)], ids=["chain", "tree"])
def test_greedy_identity_with_a_narrow_draft_vocabulary(bits, tree):
    lm = backend(tiny_model(VOCAB, seed=10, seed_layers=4))
    greedy = SamplingParams(max_tokens=32, ignore_eos=True)
    accepted = 0
    for i, prompt in enumerate(prompts(4, seed=bits)):
        _, make = quant_draft(lm, bits, vocab=_likeliest_left_out(lm, prompt, 64))
        plain, _ = run(lm, prompt, greedy)
        spec, stats = run(lm, prompt, greedy, DraftModelDrafter(make(), VOCAB, tree=tree),
                          DraftLengthConfig(draft_max=(2, 5)[i % 2], adaptive=False))
        assert spec == plain, f"prompt {i}: output diverged from plain greedy"
        accepted += stats.accepted_tokens
    assert accepted > 0


def test_greedy_identity_compiled_target_with_a_narrow_draft_vocabulary():
    from speclm.models.compiled import make_compiled

    model = tiny_model(VOCAB, seed=10, seed_layers=4)
    fast = make_compiled(model, frozenset({0}), buckets=(1, 4, 8), capacities=(264,), compile_backend="aot_eager")
    _, make = quant_draft(fast, 8, vocab=torch.arange(48))
    draft = make()
    assert isinstance(draft.model.get_output_embeddings(), SubsetHead) and draft.vocab_size == VOCAB
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in prompts(2, seed=3):
        plain, _ = run(fast, prompt, greedy)
        spec, _ = run(fast, prompt, greedy, DraftModelDrafter(draft, VOCAB), DraftLengthConfig(draft_max=4, adaptive=False))
        assert spec == plain


def test_server_rows_on_the_targets_cache_with_a_narrow_draft_vocabulary():
    """A server's eager rows: the narrowed copy drafts on the target's own cache, and greedy and
    seeded rows joining a 3-row batch give plain decoding's tokens."""
    from speclm.drafters.quant import shared_cache_member
    from speclm.engine import Engine
    from speclm.models.rows import make_rows

    from .test_batch import drive

    lm = backend(tiny_model(VOCAB, seed=10, seed_layers=4).float())
    key, make = quant_draft(lm, 8, vocab=torch.arange(0, VOCAB, 2))
    assert key.endswith(":vocab48")
    reqs = prompts(4, seed=5)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=7 + i, ignore_eos=True)
              if i % 2 else SamplingParams(max_tokens=16, ignore_eos=True) for i in range(len(reqs))]
    solo = [run(lm, p, sp, gen=sp.make_generator())[0] for p, sp in zip(reqs, params)]
    engine = Engine(make_rows(lm, 3), drafter_factory=lambda h: shared_cache_member(h, key, make, 0.0),
                    draft_length=DraftLengthConfig(3, 0, adaptive=False))
    out = drive(engine, {0: [(str(i), p, sp) for i, (p, sp) in enumerate(zip(reqs, params))]})
    assert [out[str(i)][0] for i in range(len(reqs))] == solo
    assert sum(out[str(i)][2].accepted_tokens for i in range(len(reqs))) > 0


def test_api_and_bad_options(model_dirs):
    llm = LLM(str(model_dirs["target"]), "quant:bits=8,vocab=200", 4, dtype="float32", adaptive_draft=False)
    row = llm.row_drafters("quant:bits=8,vocab=200").factory(None)
    assert isinstance(row.model.model.get_output_embeddings(), SubsetHead)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for text in ("the quick brown fox", "def add(a, b):"):
        spec = llm.generate(text, params)[0]
        plain = llm.generate(text, params, speculative=False)[0]
        assert spec.token_ids == plain.token_ids and spec.stats.drafted_tokens > 0
    with pytest.raises(SpeclmError, match="vocab= is the number of tokens"):
        parse_drafter("quant:vocab=-1")
    with pytest.raises(SpeclmError, match="takes 1 to .* of the target's .* tokens"):
        llm.make_speculation("quant:bits=8,vocab=100000")

    class LlamaCppTarget:
        backend_name = "llamacpp"

    from speclm.drafters.quant import narrowed_vocabulary

    with pytest.raises(SpeclmError, match="vocab= narrows a torch draft's output layer; llama.cpp"):
        narrowed_vocabulary(LlamaCppTarget(), None, None, 8)

