"""Self-speculation: the layer subset's logits and cache handling, bad layer sets, and the
automatic search with its per-model cache."""

from __future__ import annotations

import json

import pytest
import torch

from speclm import SpeclmError
from speclm.drafters import DraftContext
from speclm.drafters.layer_search import cache_file, choose_skip, load_choice
from speclm.drafters.layer_skip import LayerSkipDrafter, early_exit_drafter, early_exit_skip
from speclm.errors import CacheContractError
from speclm.models.layer_subset import LayerSubset, check_skip, skipping
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model

VOCAB = 64


@pytest.fixture()
def lm():
    return backend(tiny_model(VOCAB, seed=4, seed_layers=5))


def test_early_exit_logits_equal_a_truncated_model_on_a_shared_cache(lm):
    """The first N layers' keys and values are the target's: drafting on the target's cache
    gives exactly what the N-layer model computes from scratch."""
    ids = torch.tensor([3, 9, 4, 17, 22, 5, 8])
    lm.forward(ids[:5], 0)  # the target has seen five tokens
    subset = LayerSubset(lm, early_exit_skip(5, 2))
    drafted = torch.cat([subset.forward(ids[5:6], 5), subset.forward(ids[6:7], 6)])  # [2, V]
    with skipping(lm.model, range(2, 5)):
        reference = lm.model(input_ids=ids.view(1, -1), use_cache=False).logits[0, 5:]  # [2, V]
    torch.testing.assert_close(drafted, reference)
    subset.discard()
    assert lm.cache_length == 5 and all(layer.get_seq_length() == 5 for layer in lm.hf_cache.layers)


@pytest.mark.parametrize("skip", [[1, 3], [0], [4], [1, 2, 3]])
def test_discard_leaves_the_target_as_if_nothing_happened(skip):
    model = tiny_model(VOCAB, seed=4, seed_layers=5)
    lm, fresh = backend(model), backend(model).fork()
    ids = torch.tensor([3, 9, 4, 17, 22, 5, 8, 30])
    lm.forward(ids[:4], 0)
    subset = LayerSubset(lm, skip)
    subset.forward(ids[4:5], 4)
    subset.forward(torch.tensor([11, 12]), 5, num_logits=2)
    subset.discard()
    after = lm.forward(ids[4:], 4, num_logits=4).logits
    expected = fresh.forward(ids, 0, num_logits=4).logits
    torch.testing.assert_close(after, expected, rtol=0, atol=0)


def test_cache_contract_is_enforced(lm):
    lm.forward(torch.tensor([1, 2, 3]), 0)
    subset = LayerSubset(lm, [2])
    with pytest.raises(CacheContractError):
        subset.forward(torch.tensor([4]), 2)  # the target holds 3 positions
    subset.forward(torch.tensor([4]), 3)
    lm.rollback(2)  # the target moved while the draft held positions
    with pytest.raises(CacheContractError):
        subset.forward(torch.tensor([5]), 3)


@pytest.mark.parametrize("skip,needle", [
    ([], "at least one"), ([0, 1, 2, 3, 4], "keep at least one"), ([5], "does not exist"),
    ([-1], "does not exist"),
])
def test_bad_layer_sets(skip, needle):
    with pytest.raises(SpeclmError, match=needle):
        check_skip(skip, 5)


def test_bad_early_exit_and_p_min(lm):
    for layers in (0, 5, 9):
        with pytest.raises(SpeclmError, match="early exit"):
            early_exit_drafter(lm, layers)
    with pytest.raises(SpeclmError, match="p_min"):
        LayerSkipDrafter(lm, [1], p_min=1.5)


def test_drafter_proposes_from_the_pending_token_and_restores_the_cache(lm):
    ids = torch.tensor([3, 9, 4, 17, 22])
    lm.forward(ids[:-1], 0)  # the engine's invariant: all but the pending token
    drafter = LayerSkipDrafter(lm, [2, 3])
    draft = drafter.propose(DraftContext(ids, 4, SamplingParams(), torch.Generator()))
    assert draft.num_tokens == 4 and draft.q_draft is None and lm.cache_length == 4
    sampled = drafter.propose(DraftContext(ids, 3, SamplingParams(temperature=1.0), torch.Generator()))
    assert sampled.q_draft.shape == (3, VOCAB)
    assert torch.allclose(sampled.q_draft.sum(-1), torch.ones(3, dtype=sampled.q_draft.dtype))
    assert drafter.report()["skip"] == [2, 3] and "3 of 5 layers" in drafter.report()["summary"]


def test_sliding_window_model_drafts_past_its_window():
    from transformers import MistralConfig, MistralForCausalLM

    from speclm.draft_length import DraftLengthConfig
    from speclm.engine import generate_tokens

    torch.manual_seed(5)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           max_position_embeddings=256, initializer_range=0.3)
    lm = backend(MistralForCausalLM(config).to(torch.float64).eval())
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])
    plain = [t for s in generate_tokens(lm, prompt, greedy) for t in s.tokens]
    for drafter in (LayerSkipDrafter(lm, [1]), early_exit_drafter(lm, 1)):
        out = [t for s in generate_tokens(lm, prompt, greedy, drafter=drafter,
                                          draft_length=DraftLengthConfig(4)) for t in s.tokens]
        assert out == plain


def _prefilled_rows(lm, prompts):
    from speclm.models.rows import RaggedRows

    rows = RaggedRows(lm, len(prompts))
    for slot, ids in enumerate(prompts):  # each holds all but its pending token
        rows.forward(range(slot, slot + 1), ids[None, :-1], [len(ids) - 1], logits=False)
        rows.keep(slot, len(ids) - 1, [])
    return rows


def test_batched_rows_draft_as_each_row_alone_in_one_forward_per_depth(lm):
    """Three of four ragged rows draft together (one is skipped over inside the span): every
    row's chain equals the single-row drafter's on its own cache, greedy and seeded sampled;
    one skipping forward per depth for all rows; the cache is left as it was."""
    from speclm.drafters.layer_skip import layer_skip_drafter
    from speclm.drafters.shared_cache import SharedCacheMember

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (5, 9, 7, 12)]
    rows = _prefilled_rows(lm, prompts)
    members = [layer_skip_drafter(rows.handle(slot), [2, 3]) for slot in range(4)]
    assert all(isinstance(m, SharedCacheMember) for m in members)
    assert len({id(m.batch_group) for m in members}) == 1  # one group per cache and layer set
    asked, limits = [0, 1, 3], [4, 2, 3]
    calls = []
    hook = lm.model.model.register_forward_hook(lambda *a: calls.append(1))
    for params, seed in ((SamplingParams(), 0), (SamplingParams(temperature=0.9, top_k=12), 7)):
        ctxs = [DraftContext(prompts[s], k, params, torch.Generator().manual_seed(seed + s), slot=s)
                for s, k in zip(asked, limits)]
        calls.clear()
        drafts = members[0].batch_group.propose_rows([members[s] for s in asked], ctxs)
        assert len(calls) == max(limits)  # the pending tokens, then a depth at a time
        assert [rows.length(s) for s in range(4)] == [len(p) - 1 for p in prompts]
        for s, k, draft in zip(asked, limits, drafts):
            alone = lm.fork()
            alone.forward(prompts[s][:-1], 0)
            expected = LayerSkipDrafter(alone, [2, 3]).propose(
                DraftContext(prompts[s], k, params, torch.Generator().manual_seed(seed + s)))
            assert draft.tokens.tolist() == expected.tokens.tolist() and draft.num_tokens == k
            if not params.greedy:
                torch.testing.assert_close(draft.q_draft, expected.q_draft)
    hook.remove()
    for slot, ids in enumerate(prompts):  # every row, asked or not, verifies as if nothing happened
        out = rows.forward(range(slot, slot + 1), ids[None, -1:], [1]).logits[0, 0]
        reference = lm.fork().forward(ids, 0).logits[-1]
        torch.testing.assert_close(out, reference)
    with pytest.raises(CacheContractError, match="slot 1"):
        members[1].propose(DraftContext(prompts[1][:-2], 2, SamplingParams(), torch.Generator(), slot=1))
    import gc
    import weakref

    gone = weakref.ref(rows)
    del rows, members, out, drafts
    gc.collect()
    assert gone() is None  # the group cache does not keep a server's rows (and cache) alive


def test_batched_layer_skip_on_a_sliding_window_model_equals_plain_decoding():
    """Rows of a sliding-window model (Mistral-style, window 8) drafting with skipped layers
    and early exit on the batched cache, past the window: each equals its plain decoding."""
    from transformers import MistralConfig, MistralForCausalLM

    from speclm.draft_length import DraftLengthConfig
    from speclm.drafters.layer_skip import layer_skip_drafter
    from speclm.engine import Engine, generate_tokens
    from speclm.models.rows import RaggedRows, make_rows

    from .test_batch import drive

    torch.manual_seed(5)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           max_position_embeddings=256, initializer_range=0.3)
    lm = backend(MistralForCausalLM(config).to(torch.float64).eval())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (4, 11, 6)]
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = [[t for s in generate_tokens(lm, p, greedy) for t in s.tokens] for p in prompts]
    for factory in (lambda h: layer_skip_drafter(h, [1]), lambda h: early_exit_drafter(h, 1)):
        rows = make_rows(lm, 3)
        assert isinstance(rows, RaggedRows)
        engine = Engine(rows, drafter_factory=factory, draft_length=DraftLengthConfig(4, 0, adaptive=False))
        out = drive(engine, {0: [(str(i), p, greedy) for i, p in enumerate(prompts)]})
        assert [out[str(i)][0] for i in range(3)] == plain
        assert sum(out[str(i)][2].drafted_tokens for i in range(3)) > 0


def test_search_chooses_measures_and_caches_per_model(model_dirs, tiny_tokenizer, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = tiny_model(len(tiny_tokenizer), seed=6, seed_layers=5)
    folder = tmp_path / "five-layers"
    model.save_pretrained(folder)
    lm = backend(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64))
    fast = dict(num_prompts=2, max_tokens=8, num_candidates=2, progress=False)
    choice, origin = choose_skip(lm, tiny_tokenizer, folder, **fast)
    assert origin == "searched" and choice.num_layers == 5
    check_skip(choice.skip, 5)
    assert choice.candidates and all(c["identical"] for c in choice.candidates)  # greedy: lossless
    assert all(c["speedup"] > 0 for c in choice.candidates)  # measured, not assumed
    assert choice.speedup == max(c["speedup"] for c in choice.candidates)
    assert sorted(choice.order) == sorted(set(choice.order)) and len(choice.influence) == 5
    path = cache_file(folder, lm)
    assert path.is_relative_to(tmp_path) and load_choice(path).skip == choice.skip
    again, origin = choose_skip(lm, tiny_tokenizer, folder, **fast)
    assert origin == "cached" and again.skip == choice.skip
    path.write_text(json.dumps(dict(json.loads(path.read_text()), version=0)))  # an older search
    assert load_choice(path) is None
    _, origin = choose_skip(lm, tiny_tokenizer, folder, refresh=True, **fast)
    assert origin == "searched" and load_choice(path) is not None
