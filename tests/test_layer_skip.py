"""Self-speculation: the layer subset's logits and cache handling, bad layer sets, and the
automatic search with its per-model cache."""

from __future__ import annotations

import json

import pytest
import torch

from speclm import SpeclmError
from speclm.drafters import DraftContext
from speclm.drafters.layer_search import cache_file, choose_skip, load_choice
from speclm.drafters.layer_skip import LayerSkipDrafter, early_exit_skip
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
            LayerSkipDrafter.early_exit(lm, layers)
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
    for drafter in (LayerSkipDrafter(lm, [1]), LayerSkipDrafter.early_exit(lm, 1)):
        out = [t for s in generate_tokens(lm, prompt, greedy, drafter=drafter,
                                          draft_length=DraftLengthConfig(4)) for t in s.tokens]
        assert out == plain


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
