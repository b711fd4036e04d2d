"""Medusa heads and the EAGLE head: lossless drafting (greedy identity, sampling distribution),
training that matches drafting, checkpoints that refuse the wrong target, and the CLI."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from speclm.draft_length import DraftLengthConfig
from speclm.drafters.eagle import EagleDrafter
from speclm.drafters.lookup_branch import LookupBranch
from speclm.drafters.ngram import NgramDrafter
from speclm.drafters.medusa import MedusaDrafter, best_static_tree
from speclm.drafters.tree_search import TreeShape
from speclm.engine import generate_tokens
from speclm.errors import SpeclmError
from speclm.learned.answers import Answer
from speclm.learned.checkpoint import DrafterConfig, TargetIdentity, save_weights
from speclm.learned.features import batch_features
from speclm.learned.loader import load_learned_drafter
from speclm.learned.modules import EagleHead, MedusaHeads
from speclm.learned.train import EagleTrainer, MedusaTrainer, Sequence, _pad
from speclm.sampling import SamplingParams, warp_probs
from speclm.stats import RequestStats

from .conftest import backend, tiny_model

V = 96
LAYERS = [1, 2]
REDUCED = torch.randperm(V, generator=torch.Generator().manual_seed(7))[:64]  # a draft vocabulary


@pytest.fixture(scope="module")
def target():
    return tiny_model(V, seed=10)


def run(lm, prompt, params, drafter=None, k=3, gen=None):
    stats, tokens = RequestStats(), []
    for step in generate_tokens(lm, prompt, params, drafter=drafter, draft_length=DraftLengthConfig(k),
                                stats=stats, generator=gen):
        tokens += step.tokens
    return tokens, stats


def drafters(target):
    """Each learned drafter, untrained but perturbed so that it proposes varied, often wrong
    tokens (correctness must not depend on the drafter being good)."""
    gen = torch.Generator().manual_seed(0)
    heads = MedusaHeads.create(target, 3, torch.arange(V)).double()
    shared = MedusaHeads.create(target, 3, None).double()  # the target's own LM head
    eagle = EagleHead.create(target, LAYERS, torch.arange(V)).double()
    parallel = EagleHead.create(target, LAYERS, torch.arange(V), parallel=3).double()
    reduced = EagleHead.create(target, LAYERS, REDUCED).double()  # drafts 64 of the 96 tokens
    with torch.no_grad():
        for p in (list(heads.blocks.parameters()) + list(shared.parameters()) + list(eagle.parameters())
                  + list(parallel.parameters()) + list(reduced.parameters())):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    paths = best_static_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]], 10)
    embed = target.get_input_embeddings()
    return {
        "medusa": lambda: MedusaDrafter(heads, paths),
        "medusa-shared-head": lambda: MedusaDrafter(shared, paths),
        "eagle-chain": lambda: EagleDrafter(eagle, embed, LAYERS, V, None),
        "eagle-tree": lambda: EagleDrafter(eagle, embed, LAYERS, V, TreeShape(3, 10)),
        "eagle-tree-reduced": lambda: EagleDrafter(reduced, embed, LAYERS, V, TreeShape(3, 10)),
        "eagle-parallel": lambda: EagleDrafter(parallel, embed, LAYERS, V, None),
        "eagle-tree-lookup": lambda: LookupBranch(EagleDrafter(eagle, embed, LAYERS, V, TreeShape(3, 10)),
                                                  NgramDrafter(1, 3), 4),
    }


@pytest.mark.parametrize("name", ["medusa", "medusa-shared-head", "eagle-chain", "eagle-tree", "eagle-parallel",
                                  "eagle-tree-lookup", "eagle-tree-reduced"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identity(target, name, k):
    lm = backend(target)
    make = drafters(target)[name]
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    accepted = 0
    for i in range(8):
        prompt = torch.randint(1, V, (3 + i,), generator=torch.Generator().manual_seed(i))
        plain, _ = run(lm, prompt, greedy)
        spec, stats = run(lm, prompt, greedy, make(), k)
        assert spec == plain, f"prompt {i} diverged"
        accepted += stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("name", ["medusa", "eagle-chain", "eagle-tree", "eagle-parallel", "eagle-tree-lookup",
                                  "eagle-tree-reduced"])
def test_seeded_sampling_identity(target, name):
    """A seeded sampled request: the learned drafters' chains and trees give plain seeded
    decoding's tokens (the verifier's keyed draws)."""
    lm = backend(target)
    make = drafters(target)[name]
    accepted = 0
    for i in range(6):
        params = SamplingParams(temperature=0.5, top_k=(0, 8)[i % 2], seed=40 + i, max_tokens=30,
                                ignore_eos=True)
        prompt = torch.randint(1, V, (3 + i,), generator=torch.Generator().manual_seed(i))
        plain, _ = run(lm, prompt, params)
        spec, stats = run(lm, prompt, params, make(), 1 + i % 4)
        assert spec == plain, f"prompt {i} diverged"
        accepted += stats.accepted_tokens
    assert accepted > 0


def test_a_tree_over_a_reduced_draft_vocabulary_proposes_its_target_ids(target):
    """The tree grows over the head's 64 draft columns; each node is the target's id of its column."""
    drafter = drafters(target)["eagle-tree-reduced"]()
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda ctx: proposed.append(propose(ctx)) or proposed[-1]
    run(backend(target), torch.tensor([3, 5, 7]), SamplingParams(max_tokens=30, ignore_eos=True), drafter, 4)
    tokens = torch.cat([d.tokens for d in proposed])
    assert tokens.numel() > 20 and bool(torch.isin(tokens, REDUCED).all())


@pytest.mark.compiled
@pytest.mark.parametrize("name", ["medusa", "eagle-tree", "eagle-tree-lookup"])  # layer -1; two middle layers
def test_learned_drafters_read_features_from_the_compiled_step(target, name):
    """On the compiled path the verify step itself returns the drafter's feature layers (no
    eager forward per round): each request gets plain decoding's tokens and the same
    acceptance as on the eager backend, alone and as rows of one batch."""
    from speclm.engine import Engine
    from speclm.models.compiled import make_compiled
    from speclm.models.rows import make_rows

    fast = make_compiled(target, frozenset({0}), buckets=(4, 16), capacities=(64,),
                         compile_backend="aot_eager")  # few buckets: few graphs to trace
    lm, make = backend(target), drafters(target)[name]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [torch.randint(1, V, (4 + 3 * i,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    solo = []
    for prompt in prompts:
        want, want_stats = run(lm, prompt, greedy, make())
        got, stats = run(fast, prompt, greedy, make())
        assert got == want == run(lm, prompt, greedy)[0]
        assert (stats.accepted_tokens, stats.drafted_tokens) == (want_stats.accepted_tokens, want_stats.drafted_tokens)
        solo.append(got)
    assert fast._step.seen_hidden  # the verifies ran compiled, features included
    engine = Engine(make_rows(fast, 2), drafter_factory=lambda handle: make(), draft_length=DraftLengthConfig(3))
    for i, prompt in enumerate(prompts):
        engine.add(str(i), prompt, greedy)
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step()[0]:
            out[o.request_id] += o.step.tokens
    assert [out[str(i)] for i in range(len(prompts))] == solo
    assert any(len(key) == 2 for key, _ in fast._step.seen_hidden)  # (rows, tokens) graphs


@pytest.mark.parametrize("name", ["eagle-chain", "eagle-tree", "eagle-parallel", "medusa", "eagle-tree-lookup",
                                  "eagle-tree-reduced"])
def test_sampling_matches_target_distribution(name):
    from itertools import product

    vocab, length, n = 6, 3, 1500
    model = tiny_model(vocab, seed=20)
    lm = backend(model)
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=length, ignore_eos=True)
    prompt = torch.tensor([1, 2, 3, 4])
    expected = torch.zeros([vocab] * length, dtype=torch.float64)
    for seq in product(range(vocab), repeat=length):
        ref = backend(model)
        logits = ref.forward(torch.cat([prompt, torch.tensor(seq[:-1])]), 0, num_logits=length).logits
        expected[seq] = torch.prod(warp_probs(logits, params)[torch.arange(length), torch.tensor(seq)])
    expected = expected.flatten()
    ids = torch.arange(vocab)
    if name == "medusa":
        drafter = MedusaDrafter(MedusaHeads.create(model, 2, ids).double(), [[0], [1], [0, 0], [1, 0]])
    else:
        # reduced: the head drafts tokens 0, 2, 3 and 5 only; 1 and 4 come from the target alone
        columns = torch.tensor([0, 2, 3, 5]) if name.endswith("reduced") else ids
        head = EagleHead.create(model, LAYERS, columns, parallel=3 if name.endswith("parallel") else 0).double()
        if name.endswith("parallel"):  # a mask pair far from the start: drafts that often miss
            with torch.no_grad():
                head.mask_feature.normal_(generator=torch.Generator().manual_seed(3))
        drafter = EagleDrafter(head, model.get_input_embeddings(), LAYERS, vocab,
                               TreeShape(2, 4) if "tree" in name else None)
        if name.endswith("lookup"):  # prompt lookup's chain merged into the head's tree
            drafter = LookupBranch(drafter, NgramDrafter(1, 2), 2)
    gen = torch.Generator().manual_seed(5)
    counts = torch.zeros(vocab**length, dtype=torch.float64)
    accepted = branch = 0
    for _ in range(n):
        seq, stats = run(lm, prompt, params, drafter, 2, gen)
        counts[(torch.tensor(seq) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
        accepted += stats.accepted_tokens
        branch += (stats.drafter_report or {}).get("lookup_branch_accepted", 0)
    assert accepted > n // 10
    assert branch > 0 or not name.endswith("lookup")  # the lookup's own tokens were accepted
    assert counts[expected == 0].sum() == 0
    keep = expected * n >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().view(1)]) * n
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3


def _sequences(target, count=6, length=24, layers=LAYERS):
    lm = backend(target)
    out = []
    for i in range(count):
        prompt = torch.randint(1, V, (4 + i % 3,), generator=torch.Generator().manual_seed(100 + i))
        answer, _ = run(lm, prompt, SamplingParams(max_tokens=length, ignore_eos=True))
        ids = torch.cat([prompt, torch.tensor(answer)])
        seq = batch_features(target, [Answer("k", ids.tolist(), prompt.shape[0], "length")], layers, torch.float64)[0]
        features, target_next = seq.features, seq.target_next
        assert torch.equal(target_next[prompt.shape[0] - 1 : -1], ids[prompt.shape[0]:].int())  # greedy
        out.append(Sequence(ids, prompt.shape[0], features.double(), target_next))
    return out


def _trained_steps_and_drafter(target, head, t: int):
    """A sequence, the trainer's unrolled steps on it [(logits [1, T', N], labels)] and a chain
    drafter over ``head`` that has committed tokens 0..t and features for 0..t-1."""
    seq = _sequences(target, count=1)[0]
    trainer = EagleTrainer(head, target.get_input_embeddings(), [seq], [seq], vocab_size=V, epochs=1,
                           batch_size=1, lr=1e-3, device="cpu", max_seconds=None, unroll=2, progress=False)
    with torch.no_grad():
        steps = trainer.predictions(_pad([seq], trainer.table, "cpu", torch.float64), everywhere=False)
    drafter = EagleDrafter(head, target.get_input_embeddings(), LAYERS, V, None)
    drafter.reset(seq.ids[: t + 1])
    drafter.on_target_features(seq.features[:t].to(torch.float64))
    return seq, steps, drafter


def test_unrolled_training_steps_equal_drafting(target):
    """Step s of the EAGLE trainer computes, at every position, the head's output of a depth-s
    draft from there: check against the drafter itself run on a prefix."""
    head = EagleHead.create(target, LAYERS, torch.arange(V)).double()
    t = 9  # the drafter has committed tokens 0..t (pending t) and features for 0..t-1
    seq, steps, drafter = _trained_steps_and_drafter(target, head, t)
    from speclm.drafters.base import DraftContext

    logits_seen = []
    original = drafter._full_logits

    def spy(hidden):
        out = original(hidden)
        logits_seen.append(out)
        return out

    drafter._full_logits = spy
    greedy = SamplingParams()
    drafter.propose(DraftContext(seq.ids[: t + 1], 3, greedy, torch.Generator()))
    # the draft is argmax-driven: compare where the trainer used the true tokens too
    root, depth1 = logits_seen[0][0], logits_seen[1][0]
    torch.testing.assert_close(root, steps[0][0][0, t - 1], atol=1e-9, rtol=0)  # pair t-1 predicts t+1
    if int(root.argmax()) == int(seq.ids[t + 1]):  # the depth-1 input is then the true token
        torch.testing.assert_close(depth1, steps[1][0][0, t - 1], atol=1e-9, rtol=0)


def test_parallel_training_steps_equal_one_drafting_forward(target):
    """A head that drafts in parallel: trainer step s at position t is the output of the s-th
    mask pair the drafter runs after the pairs up to t (exactly, whatever it drafts), and one
    head forward per round proposes all the chain's tokens."""
    from speclm.drafters.base import DraftContext

    torch.manual_seed(1)
    head = EagleHead.create(target, LAYERS, torch.arange(V), parallel=3).double()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, dtype=p.dtype) * 0.02)
    t = 9
    seq, steps, drafter = _trained_steps_and_drafter(target, head, t)
    logits_seen, calls = [], []
    original = drafter._full_logits
    drafter._full_logits = lambda hidden: logits_seen.append(original(hidden)) or logits_seen[-1]
    head.register_forward_hook(lambda *_: calls.append(1))
    draft = drafter.propose(DraftContext(seq.ids[: t + 1], 3, SamplingParams(), torch.Generator()))
    assert len(calls) == 1 and draft.tokens.shape[0] == 3  # one forward, three tokens
    rows = logits_seen[0]  # [3, V]: the root, then the two mask pairs
    torch.testing.assert_close(rows[0], steps[0][0][0, t - 1], atol=1e-9, rtol=0)
    for s in (1, 2):  # step s's row for position t - 1 + s sits at index t - 1 of its output
        torch.testing.assert_close(rows[s], steps[s][0][0, t - 1], atol=1e-9, rtol=0)
    assert torch.equal(draft.tokens, rows.argmax(-1))
    drafter.on_verified(0, [])
    assert drafter.cache.get_seq_length() == drafter.processed == t  # the mask pairs are dropped


def test_held_out_accuracy_counts_tokens_outside_the_draft_vocabulary_as_misses(target):
    """A drafter never proposes a token its draft vocabulary lacks, so the held-out figure must
    count those answer tokens as misses (the acceptance a drafted token can expect at inference):
    checked against a direct count over every answer position, for the first draft depth."""
    data = _sequences(target)
    draft_to_target = torch.arange(0, V, 2)  # half the vocabulary
    head = EagleHead.create(target, LAYERS, draft_to_target).double()
    trainer = EagleTrainer(head, target.get_input_embeddings(), [], data, vocab_size=V, epochs=1,
                           batch_size=4, lr=1e-3, device="cpu", max_seconds=None, progress=False)
    hits, total, outside = torch.zeros(4), 0, 0
    with torch.no_grad():
        for seq in data:
            logits = trainer.predictions(_pad([seq], trainer.table, "cpu", torch.float64), everywhere=False)[0][0]
            guesses = draft_to_target[logits[0].topk(4, dim=-1).indices]  # [T - 2, 4] entry i guesses token i + 2
            answer = torch.arange(2, seq.ids.shape[0]) >= seq.prompt_len
            truth = seq.ids[2:]
            hits += (guesses == truth[:, None])[answer].sum(0).double()
            total += int(answer.sum())
            outside += int((truth[answer] % 2 == 1).sum())
    got = trainer.evaluate(top=4)[0]
    assert outside > 0 and hits.sum() > 0  # both kinds of position occur, so the count matters
    torch.testing.assert_close(torch.tensor(got), (hits / total).float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle-parallel"])
def test_training_lowers_loss_and_checkpoints_roundtrip(target, tmp_path, kind):
    torch.manual_seed(0)
    data = _sequences(target, layers=[-1] if kind == "medusa" else LAYERS)
    ids = torch.arange(V)
    if kind == "medusa":
        module = MedusaHeads.create(target, 2, ids).double()
        trainer = MedusaTrainer(module, data, data[:2], vocab_size=V, epochs=60, batch_size=3, lr=1e-2,
                                device="cpu", max_seconds=None, progress=False)
    else:
        parallel = 3 if kind == "eagle-parallel" else 0
        module = EagleHead.create(target, LAYERS, ids, parallel=parallel).double()
        trainer = EagleTrainer(module, target.get_input_embeddings(), data, data[:2], vocab_size=V,
                               epochs=40, batch_size=3, lr=3e-3, device="cpu", max_seconds=None, progress=False)
        kind = "eagle"
    before = trainer.evaluate()
    state = trainer.run()
    after = trainer.evaluate()
    assert state.history[-1]["loss"] < state.history[0]["loss"]
    assert after[0][0] > before[0][0]  # memorising the data raises top-1 accuracy
    identity = TargetIdentity.of(target, "tiny")
    DrafterConfig(kind, identity, V, LAYERS if kind == "eagle" else [-1], num_heads=2,
                  parallel=getattr(module, "parallel", 0), training=dict(tree=[[0], [0, 0], [1]])).save(tmp_path)
    save_weights(module, tmp_path)
    lm = backend(target)
    drafter = load_learned_drafter(tmp_path, lm, kind)
    prompt = data[0].ids[: data[0].prompt_len]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    plain, _ = run(lm, prompt, greedy)
    spec, stats = run(lm, prompt, greedy, drafter, 2)
    assert spec == plain and stats.tau > 1.2  # it learnt these very answers
    if getattr(module, "parallel", 0):  # a parallel head drafts its chain in one forward
        assert drafter.head.parallel == 3 and drafter.tree is None and drafter.parallel_tokens == 3
    else:
        assert getattr(drafter, "parallel_tokens", 0) == 0


def test_bfloat16_training_runs_the_products_in_bfloat16_and_keeps_float32_state(target):
    torch.manual_seed(0)
    data = _sequences(target, layers=LAYERS)
    module = EagleHead.create(target, LAYERS, torch.arange(V))  # float32
    trainer = EagleTrainer(module, target.get_input_embeddings(), data, data[:2], vocab_size=V, epochs=30,
                           batch_size=3, lr=3e-3, device="cpu", max_seconds=None, progress=False,
                           compute_dtype=torch.bfloat16)
    seen = set()
    module.lm_head.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    state = trainer.run()
    assert seen == {torch.bfloat16}  # every draft logit, in training and held-out scoring
    assert state.history[-1]["loss"] < 0.5 * state.history[0]["loss"]
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(v.dtype == torch.float32 for st in trainer.optimizer.state.values() for k, v in st.items()
               if k != "step")


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_batches_padded_to_a_multiple_give_the_same_loss(target, kind):
    from speclm.learned.train import _pad

    data = _sequences(target, layers=[-1] if kind == "medusa" else LAYERS)[:3]
    if kind == "medusa":
        module = MedusaHeads.create(target, 2, torch.arange(V)).double()
        trainer = MedusaTrainer(module, data, data, vocab_size=V, epochs=1, batch_size=3, lr=1e-2,
                                device="cpu", max_seconds=None, progress=False)
    else:
        module = EagleHead.create(target, LAYERS, torch.arange(V)).double()
        trainer = EagleTrainer(module, target.get_input_embeddings(), data, data, vocab_size=V, epochs=1,
                               batch_size=3, lr=3e-3, device="cpu", max_seconds=None, progress=False)
    exact = _pad(data, trainer.table, "cpu", torch.float64)
    padded = _pad(data, trainer.table, "cpu", torch.float64, multiple=64)
    assert padded[0].shape[1] % 64 == 0 and padded[0].shape[1] > exact[0].shape[1]
    torch.testing.assert_close(trainer.loss(padded)[0], trainer.loss(exact)[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(trainer.accuracy(padded, 2), trainer.accuracy(exact, 2), atol=0, rtol=0)


@pytest.mark.parametrize("stop", [5, 6])  # mid-epoch, and after an epoch's last batch
def test_batches_group_lengths_and_an_interrupted_run_resumes_exactly(target, stop):
    import copy
    import random

    from speclm.learned.train import _batches

    data = _sequences(target, layers=LAYERS)
    batches = _batches(data, 2, random.Random("0:0"), group=len(data))
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in data)  # each once
    widths = sorted(s.ids.shape[0] for s in data)
    pads = sum(max(s.ids.shape[0] for s in b) * len(b) for b in batches)
    assert pads == sum(max(widths[j : j + 2]) * len(widths[j : j + 2]) for j in range(0, len(widths), 2))

    def trainer():
        torch.manual_seed(0)
        module = EagleHead.create(target, LAYERS, torch.arange(V)).double()
        return EagleTrainer(module, target.get_input_embeddings(), data, data[:2], vocab_size=V, epochs=3,
                            batch_size=2, lr=3e-3, device="cpu", max_seconds=None, progress=False)

    whole = trainer()
    whole.run()
    saved = []

    def checkpoint():
        saved.append(copy.deepcopy(cut.state_dict()))
        if cut.state.step == stop:  # the process dies here
            raise KeyboardInterrupt

    cut = trainer()
    with pytest.raises(KeyboardInterrupt):
        cut.run(on_checkpoint=checkpoint, checkpoint_s=0.0)
    resumed = trainer()
    resumed.load_state_dict(saved[-1])
    resumed.run()
    assert resumed.state.step == whole.state.step
    for a, b in zip(whole.module.state_dict().values(), resumed.module.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_loading_for_another_target_is_a_clear_error(target, tmp_path):
    other = tiny_model(V + 8, seed=1)
    DrafterConfig("eagle", TargetIdentity.of(other, "other"), V, LAYERS).save(tmp_path)
    with pytest.raises(SpeclmError, match="vocab_size"):
        load_learned_drafter(tmp_path, backend(target), "eagle")
    with pytest.raises(SpeclmError, match="holds a eagle drafter"):
        load_learned_drafter(tmp_path, backend(target), "medusa")
    with pytest.raises(SpeclmError, match="does not exist"):
        load_learned_drafter(tmp_path / "nothing", backend(target), "eagle")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeclmError, match="not a speclm drafter folder"):
        load_learned_drafter(tmp_path / "empty", backend(target), "eagle")


def test_a_quantized_target_keeps_its_identity(cpu_kernel):
    """--quantize swaps the LM head for a layer with no float weight: the target's identity then
    comes from the embeddings the head is tied to, or from the weights its GGUF blocks describe,
    so a drafter made on the float model is recognised on its quantized copy."""
    import copy

    from transformers import LlamaForCausalLM

    from speclm.models.quantize import quantize_weights
    from speclm.models.small_m import BlockLinear

    from .conftest import tiny_config

    config = tiny_config(V)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    tied = LlamaForCausalLM(config).float().eval()
    quantized = copy.deepcopy(tied)
    quantize_weights(quantized, "int8")
    assert not hasattr(quantized.get_output_embeddings(), "weight")
    assert TargetIdentity.of(quantized, "q").same_as(TargetIdentity.of(tied, "f"))

    untied = tiny_model(V, seed=4).float()
    codes = torch.randint(0, 256, (V, untied.config.hidden_size // 2), dtype=torch.uint8)
    scale = torch.rand(V, untied.config.hidden_size // 32) * 0.1
    untied.lm_head = BlockLinear(codes, scale, -8 * scale, 4, None)  # Q4_1 blocks
    identity = TargetIdentity.of(untied, "blocks")
    assert identity.vocab_size == V
    assert identity.fingerprint == round(float(untied.lm_head.dequantized()[:64, :64].double().sum()), 4)

    int8 = tiny_model(V, seed=4).float()
    quantize_weights(int8, "int8")
    with pytest.raises(SpeclmError, match="output head is quantized"):
        TargetIdentity.of(int8, "int8")


def test_an_exported_drafter_ships_for_its_own_target_only(target, tmp_path):
    from safetensors.torch import load_file

    from speclm.learned.checkpoint import export_drafter
    from speclm.learned.shipped import shipped_folder

    trained = tmp_path / "trained"
    trained.mkdir()
    module = EagleHead.create(target, LAYERS, torch.arange(V))
    DrafterConfig("eagle", TargetIdentity.of(target, "tiny"), V, LAYERS).save(trained)
    save_weights(module, trained)
    root = tmp_path / "shipped"
    size = export_drafter(trained, root / "tiny-eagle")
    weights = load_file(str(root / "tiny-eagle" / "drafter.safetensors"))
    assert size < (trained / "drafter.safetensors").stat().st_size * 0.6
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.bfloat16}
    assert shipped_folder(target, "eagle", root) == root / "tiny-eagle"
    drafter = load_learned_drafter(root / "tiny-eagle", backend(target), "eagle")  # float32 again
    assert next(drafter.head.parameters()).dtype == torch.float64
    half = tiny_model(V, seed=10).to(torch.bfloat16)  # a 16-bit target gets a 16-bit head
    drafter = load_learned_drafter(root / "tiny-eagle", backend(half), "eagle")
    assert {p.dtype for p in drafter.head.parameters()} == {torch.bfloat16}
    _, stats = run(backend(half), torch.tensor([3, 5, 7]), SamplingParams(max_tokens=12, ignore_eos=True),
                   drafter, 3)
    assert stats.drafted_tokens > 0
    for other in (tiny_model(V + 8, seed=1), tiny_model(V, seed=2)):  # other shapes; other weights
        with pytest.raises(SpeclmError, match="ships no eagle drafter for this target .it ships one for tiny") as err:
            shipped_folder(other, "eagle", root)
        assert "\n" not in str(err.value)
    with pytest.raises(SpeclmError, match="ships no medusa drafter for this target .it ships none"):
        shipped_folder(target, "medusa", root)
    with pytest.raises(SpeclmError, match="ships no eagle drafter for this target .it ships one for SmolLM2"):
        shipped_folder(target, "eagle")  # the drafter in the package is for the default model only


def test_a_float32_head_on_a_cpu_without_native_bfloat16_runs_in_8_bit_blocks(target, tmp_path, cpu_kernel,
                                                                              monkeypatch):
    """Where bfloat16 is not native (an AVX2 CPU), a float32 target's head is float32, and its
    linear layers go to Q8_0 blocks on speclm's kernel (a quarter of the bytes a forward reads);
    ``bits=0`` keeps them float32 on the target's few-row kernels. Either way it drafts, and the
    output is plain decoding's; an unknown ``bits`` is refused in one line."""
    from speclm.drafters.registry import parse_drafter
    from speclm.models.small_m import BlockLinear, SmallMLinear

    monkeypatch.setattr("speclm.learned.loader.fast_dtype", lambda device: torch.float32)
    trained = tmp_path / "head"
    trained.mkdir()
    DrafterConfig("eagle", TargetIdentity.of(target, "tiny"), len(REDUCED), LAYERS).save(trained)
    save_weights(EagleHead.create(target, LAYERS, REDUCED), trained)
    single = tiny_model(V, seed=10).float()
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = torch.tensor([3, 5, 7, 11])
    plain, _ = run(backend(single), prompt, greedy)
    blocks = load_learned_drafter(trained, backend(single), "eagle").head  # bits: the default
    floats = load_learned_drafter(trained, backend(single), "eagle", bits=0).head
    assert blocks is not floats  # loaded once per choice, each kept for the drafters that share it
    linears = ("fuse", "fc_in", "layer.self_attn.k_proj", "layer.mlp.down_proj", "lm_head")
    for name in linears:
        layer = blocks.get_submodule(name)
        assert type(layer) is BlockLinear and layer.bits == 8
        assert type(floats.get_submodule(name)) is SmallMLinear
        weight = floats.get_submodule(name).weight
        # Q8_0: each block of 32 inputs within half a step of its scale (max |w| / 127)
        step = weight.abs().view(weight.shape[0], -1, 32).amax(-1, keepdim=True) / 127
        assert ((layer.dequantized() - weight).view(step.shape[0], -1, 32).abs() <= step * 0.5001 + 1e-7).all()
    assert hasattr(type(blocks.norm), "_speclm_own_forward")  # the one-call norm (models/fast_norm.py)
    for bits in (None, 0):
        drafter = load_learned_drafter(trained, backend(single), "eagle", bits=bits)
        spec, stats = run(backend(single), prompt, greedy, drafter, 4)
        assert spec == plain and stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    with pytest.raises(SpeclmError, match="eagle's bits must be one of 0, 8") as err:
        parse_drafter("eagle:bits=4")
    assert "\n" not in str(err.value)


def test_best_static_tree_is_a_tree_in_order_of_estimated_acceptance():
    paths = best_static_tree([[0.6, 0.3], [0.5, 0.2], [0.4, 0.1]], 6)
    assert paths[0] == [0] and len(paths) == 6
    for p in paths:  # every prefix is in the tree
        assert all(p[:d] in paths for d in range(1, len(p)))


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_train_drafter_command_end_to_end(method, model_dirs, tmp_path, capsys, monkeypatch):
    from speclm import LLM
    from speclm.cli import main

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))  # the answers cache

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["the quick brown fox number {i}"]}}\n' for i in range(12)))
    out = tmp_path / method
    argv = ["train-drafter", "--method", method, "--target", str(model_dirs["target"]), "--out", str(out),
            "--prompts", str(prompts), "--no-default-prompts", "--max-new-tokens", "12", "--epochs", "2",
            "--batch-size", "4", "--heads", "2", "--rows", "5", "--self-prompts", "2"] + (
                ["--draft-vocab", "128"] if method == "eagle" else [])
    assert main(argv) == 0
    assert "prompts written by the target" in capsys.readouterr().err
    assert list((out / "features").glob("shard-*.pt"))
    assert (out / "drafter.json").is_file() and (out / "drafter.safetensors").is_file()
    config = DrafterConfig.load(out)
    assert config.kind == method and config.training["epochs"] == 2
    assert (config.draft_vocab_size == 0) == (method == "medusa")  # medusa shares the target's head
    assert len(config.training["held_out_accuracy"]) >= 1
    capsys.readouterr()
    assert main(argv) == 0  # a second run finds the cached data and the finished state
    assert "using cached training data" in capsys.readouterr().err
    llm = LLM(str(model_dirs["target"]), f"{method}:path={out}", 3, dtype="float64")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = llm.generate("the quick brown fox", params)[0]
    plain = llm.generate("the quick brown fox", params, speculative=False)[0]
    assert spec.token_ids == plain.token_ids


def test_train_drafter_data_only_makes_the_data_and_stops(model_dirs, tmp_path, capsys, monkeypatch):
    from speclm.cli import main

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["a slow grey cat number {i}"]}}\n' for i in range(6)))
    out = tmp_path / "eagle"
    argv = ["train-drafter", "--method", "eagle", "--target", str(model_dirs["target"]), "--out", str(out),
            "--prompts", str(prompts), "--no-default-prompts", "--max-new-tokens", "8", "--rows", "3"]
    assert main(argv + ["--data-only"]) == 0
    assert "without --data-only" in capsys.readouterr().err
    assert list((out / "features").glob("shard-*.pt")) and not (out / "drafter.json").exists()
    assert main(argv + ["--epochs", "1", "--draft-vocab", "64"]) == 0  # trains on the data kept
    assert "using cached training data" in capsys.readouterr().err
    assert (out / "drafter.json").is_file()


def test_train_drafter_parallel_head_started_from_another(model_dirs, tmp_path, capsys, monkeypatch):
    from speclm import LLM
    from speclm.cli import main

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["a slow grey cat number {i}"]}}\n' for i in range(6)))

    def argv(out):
        return ["train-drafter", "--method", "eagle", "--target", str(model_dirs["target"]), "--out",
                str(tmp_path / out), "--prompts", str(prompts), "--no-default-prompts", "--max-new-tokens", "8",
                "--rows", "3", "--epochs", "1"]

    assert main(argv("chain") + ["--draft-vocab", "64"]) == 0
    capsys.readouterr()
    assert main(argv("parallel") + ["--draft-vocab", "64", "--parallel-draft", "3", "--init",
                                    str(tmp_path / "chain")]) == 0
    assert "starting from the drafter" in capsys.readouterr().err
    config = DrafterConfig.load(tmp_path / "parallel")
    assert config.parallel == 3 and len(config.training["held_out_accuracy"]) == 3  # three positions trained
    llm = LLM(str(model_dirs["target"]), f"eagle:path={tmp_path / 'parallel'}", 3, dtype="float64")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = llm.generate("a slow grey cat", params)[0]
    assert spec.token_ids == llm.generate("a slow grey cat", params, speculative=False)[0].token_ids
    capsys.readouterr()  # a start that does not fit is a one-line error
    assert main(argv("other") + ["--draft-vocab", "32", "--init", str(tmp_path / "chain")]) == 2
    assert "--init" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--parallel-draft", "1"], "--parallel-draft is for"),
    (["--init", "/no/such/drafter"], "not a speclm drafter folder"),
    (["--held-out", "0.9"], "--held-out"),
    (["--no-default-prompts"], "needs --prompts"),
    (["--feature-layers", "x"], "--feature-layers"),
    (["--epochs", "0"], "--epochs must be > 0"),
    (["--max-minutes", "-1"], "--max-minutes must be > 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--heads", "0"], "--heads must be > 0"),
    (["--rows", "0"], "--rows must be > 0"),
    (["--data-minutes", "0"], "--data-minutes must be > 0"),
    (["--max-feature-gb", "-2"], "--max-feature-gb must be > 0"),
    (["--self-prompts", "-1"], "--passage-prompts must be >= 0, got 2, 0, -1 and 0"),
    (["--passage-prompts", "-3"], "--passage-prompts must be >= 0, got 2, 0, 0 and -3"),
    (["--self-prompts", "4", "--self-prompt-starts", "/no/such/file.txt"], "--self-prompt-starts: not tasks"),
])
def test_train_drafter_bad_input(argv, needle, model_dirs, tmp_path, capsys):
    from speclm.cli import main

    code = main(["train-drafter", "--method", "eagle", "--target", str(model_dirs["target"]),
                 "--out", str(tmp_path / "d"), *argv])
    assert code == 2 and needle in capsys.readouterr().err


def test_eagle_head_for_a_target_with_rope_per_layer_type(capsys):
    """Gemma-3 keeps one rope setting per attention kind: the head takes its last layer's, and
    starts from random weights where the target's layer is not Llama-shaped (one line says so)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from speclm.learned.modules import _layer_config

    config = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                              max_position_embeddings=128, layer_types=["sliding_attention", "full_attention"])
    assert _layer_config(config).rope_parameters == config.rope_parameters["full_attention"]
    head = EagleHead.create(Gemma3ForCausalLM(config), [1, -1], torch.arange(64))
    assert "starts from random weights" in capsys.readouterr().err
    out = head(torch.zeros(1, 3, 32), torch.zeros(1, 3, 32), torch.arange(3).view(1, 3))
    assert out.shape == (1, 3, 32) and torch.isfinite(out).all()
