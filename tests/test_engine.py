"""The one engine with several rows: every drafter, on both row kinds, stays lossless.

- greedy: each row of a batch equals its solo plain greedy output, for every drafter (chains,
  trees, sampled drafts, self-drafting on the row's own cache, learners), with requests joining
  mid-way, on the batched eager-torch rows and on one-handle-per-slot rows;
- mixed batches: greedy rows next to seeded sampled rows; a seeded row draws what it draws alone;
- sampling: rows drafted by a draft model (sampled q) in a batch follow the target's exact
  sequence distribution (chi-square);
- chunked prefill: a long prompt joins in chunks while a running row keeps getting tokens.
"""

from __future__ import annotations


import pytest
import torch

from speclm.cost_model import CostModel
from speclm.draft_length import DraftLengthConfig, DraftLengthPolicy
from speclm.drafters import DraftModelDrafter, NgramDrafter
from speclm.drafters.recycle import RecycleDrafter
from speclm.drafters.suffix import SuffixDrafter
from speclm.drafters.auto import AutoDrafter, NoDrafter
from speclm.drafters.layer_skip import LayerSkipDrafter, early_exit_drafter, layer_skip_drafter
from speclm.drafters.eagle import EagleDrafter
from speclm.drafters.medusa import MedusaDrafter, best_static_tree
from speclm.drafters.draft_rows import DraftRows
from speclm.drafters.tree_search import TreeShape
from speclm.learned.modules import EagleHead, MedusaHeads
from speclm.engine import Engine
from speclm.models.rows import RaggedRows, SlotRows, make_rows
from speclm.sampling import SamplingParams

from .conftest import backend, noisy_copy, tiny_model
from .test_batch import assert_ragged_rows_match, drive
from .test_lossless import prompts, run, sampling_setup

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_model(VOCAB, seed=10, seed_layers=4)


def row_drafters(target_model):
    """Per-row drafter factories: ``factory(handle)`` gets the row's own target handle. The
    learned drafters' modules are shared by every row, as the server shares them."""
    draft_lm = backend(noisy_copy(target_model, 0.08, seed=3))
    learned = learned_drafters(target_model)
    return {**learned,
        "ngram": lambda h: NgramDrafter(1, 3),
        "suffix": lambda h: SuffixDrafter(capacity=256),
        "recycle": lambda h: RecycleDrafter(VOCAB, 4),
        "draft-model": lambda h: DraftModelDrafter(draft_lm.fork(), VOCAB),
        "draft-model-p_min": lambda h: DraftModelDrafter(draft_lm.fork(), VOCAB, p_min=0.05),
        "draft-model-tree": lambda h: DraftModelDrafter(draft_lm.fork(), VOCAB, tree=TreeShape(top_k=3, budget=10)),
        # one draft forward per depth for all rows (8 slots: more than any test's batch)
        "draft-rows": lambda h, g=DraftRows(draft_lm, VOCAB, 8): g.member(),
        "draft-rows-p_min": lambda h, g=DraftRows(draft_lm, VOCAB, 8, p_min=0.05): g.member(),
        # on ragged rows: one skipping forward per depth for every row, on the target's cache
        "layerskip": lambda h: layer_skip_drafter(h, [1, 2]),
        "layerskip-p_min": lambda h: layer_skip_drafter(h, [2], p_min=0.3),
        "early-exit": lambda h: early_exit_drafter(h, 2),
        "auto": lambda h: AutoDrafter({"none": (NoDrafter(), 1), "ngram": (NgramDrafter(1, 3), 6),
                                       "layerskip": (layer_skip_drafter(h, [2]), 3)},
                                      probe_rounds=2, reprobe_every=12),
    }


def learned_drafters(target_model):
    """EAGLE (chain and tree) and Medusa heads, untrained but perturbed: varied, often wrong."""
    gen = torch.Generator().manual_seed(0)
    eagle = EagleHead.create(target_model, [1, 2], torch.arange(VOCAB)).double()
    heads = MedusaHeads.create(target_model, 3, torch.arange(VOCAB)).double()
    with torch.no_grad():
        for p in list(eagle.parameters()) + list(heads.blocks.parameters()):
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
    paths = best_static_tree([[0.5, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]], 10)
    embed = target_model.get_input_embeddings()
    return {
        "eagle-chain": lambda h: EagleDrafter(eagle, embed, [1, 2], VOCAB, None),
        "eagle-tree": lambda h: EagleDrafter(eagle, embed, [1, 2], VOCAB, TreeShape(3, 10)),
        "medusa": lambda h: MedusaDrafter(heads, paths),
    }


def rows_for(lm, kind: str, max_batch: int):
    """Eager rows: the ragged cache make_rows picks, or one handle per slot."""
    if kind == "slots":
        return SlotRows(lm, max_batch)
    rows = make_rows(lm, max_batch)
    assert isinstance(rows, RaggedRows)
    return rows


@pytest.fixture(scope="module")
def workload(target):
    lm = backend(target)
    reqs = prompts(9, seed=5)
    lengths = [12 + 5 * (i % 4) for i in range(len(reqs))]
    solo = [run(lm, p, SamplingParams(max_tokens=m, ignore_eos=True))[0] for p, m in zip(reqs, lengths)]
    return reqs, lengths, solo


@pytest.mark.parametrize("kind", ["ragged", "slots"])
@pytest.mark.parametrize("name", list(row_drafters(tiny_model(VOCAB, seed=10, seed_layers=4))))
def test_every_drafter_in_a_batch_equals_solo_greedy(target, workload, kind, name):
    reqs, lengths, solo = workload
    factory = row_drafters(target)[name]
    lm = backend(target)
    engine = Engine(rows_for(lm, kind, 4), drafter_factory=factory,
                    draft_length=DraftLengthConfig(4, 0, adaptive=False))
    arrivals = {0: [], 2: []}
    for i, (p, m) in enumerate(zip(reqs, lengths)):  # more than 4 at once: some queue
        arrivals[(0, 2)[i % 2]].append((str(i), p, SamplingParams(max_tokens=m, ignore_eos=True)))
    out = drive(engine, arrivals)
    accepted = 0
    for i in range(len(reqs)):
        tokens, finish, stats = out[str(i)]
        assert tokens == solo[i], f"{name} on {kind} rows: request {i} diverged from its solo output"
        assert finish == "length"
        accepted += stats.accepted_tokens
    assert accepted > 0
    assert not engine.running


@pytest.mark.parametrize("priced", [False, True])
@pytest.mark.parametrize("drafts", ["per-row", "batched"])
@pytest.mark.parametrize("kind", ["ragged", "slots"])
def test_seeded_sampled_rows_next_to_greedy_rows_equal_solo(target, kind, drafts, priced):
    """A draft model's sampled drafts, drafted row by row or in one batched draft forward per
    depth: a seeded row's tokens do not depend on its neighbours, on the draft cap, or on draft
    lengths chosen from a cost model and live timings; they are plain seeded decoding's."""
    prior = CostModel([1, 2, 4], [1.0, 1.4, 2.2]) if priced else None
    lm = backend(target)
    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    group = DraftRows(draft_lm.fork(), VOCAB, 6)
    reqs = prompts(6, seed=13)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=50 + i, ignore_eos=True)
              if i % 2 else SamplingParams(max_tokens=24, ignore_eos=True) for i in range(len(reqs))]
    config = DraftLengthConfig(3, 0, adaptive=True)
    solo = [run(lm, p, sp, DraftModelDrafter(draft_lm.fork(), VOCAB), config,
                sp.make_generator(), prior)[0] for p, sp in zip(reqs, params)]
    rows = rows_for(lm, kind, 6)
    factory = (lambda h: group.member()) if drafts == "batched" else (lambda h: DraftModelDrafter(draft_lm.fork(), VOCAB))
    engine = Engine(rows, drafter_factory=factory, draft_length=config, cost_prior=prior)
    out = drive(engine, {0: [(str(i), p, sp) for i, (p, sp) in enumerate(zip(reqs, params))]})
    assert [out[str(i)][0] for i in range(len(reqs))] == solo
    assert solo == [run(lm, p, sp)[0] for p, sp in zip(reqs, params)]  # plain decoding's tokens


@pytest.mark.parametrize("drafts", ["per-row", "batched", "layerskip"])
def test_draft_model_rows_in_a_batch_match_the_target_distribution(drafts):
    """Sampled drafts (q from the draft model, drafted row by row or all rows in one draft
    forward per depth; or from the target minus a layer, all rows in one forward per depth on
    the target's own cache) verified in batches of 24 rows, two prompts of different lengths so
    the rows are ragged, seeded rows (keyed draws) beside unseeded ones (rejection sampling):
    the sequences of each follow the target exactly."""
    vocab, length, n = 5, 3, 2000
    target_model, lm, params, prompt, expected = sampling_setup(vocab, length)
    draft_lm = backend(noisy_copy(target_model, 0.3, seed=4))
    group = DraftRows(draft_lm, vocab, 24)
    factory = {"batched": lambda h: group.member(), "layerskip": lambda h: layer_skip_drafter(h, [1]),
               "per-row": lambda h: DraftModelDrafter(draft_lm.fork(), vocab)}[drafts]
    engine = Engine(make_rows(lm, 24), drafter_factory=factory,
                    draft_length=DraftLengthConfig(2, 0, adaptive=False))
    assert_ragged_rows_match(engine, params, prompt, n, vocab, expected)


def test_chunked_prefill_feeds_a_draft_model_in_the_same_chunks(target):
    """A draft model's batched rows take a 150-token prompt that joins a running request in the
    target's 16-token chunks (no draft forward wider than a chunk, however long the prompt), and
    both outputs equal their solo outputs."""
    lm = backend(target)
    group = DraftRows(backend(noisy_copy(target, 0.08, seed=3)), VOCAB, 2)
    widths = []
    forward = group.rows.forward
    group.rows.forward = lambda rows, ids, *a, **kw: widths.append(ids.shape[1]) or forward(rows, ids, *a, **kw)
    gen = torch.Generator().manual_seed(1)
    short, long = prompts(1, seed=3)[0], torch.randint(1, VOCAB, (150,), generator=gen)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    solo = [run(lm, p, params)[0] for p in (short, long)]
    config = DraftLengthConfig(3, 0, adaptive=False)
    engine = Engine(make_rows(lm, 2), prefill_chunk=16, drafter_factory=lambda h: group.member(), draft_length=config)
    out = drive(engine, {0: [("short", short, params)], 2: [("long", long, params)]})
    assert [out["short"][0], out["long"][0]] == solo
    assert out["long"][2].drafted_tokens > 0 and max(widths) <= 16
    # the chunks built the draft's cache right: alone and unchunked, the same drafts are accepted
    alone = DraftRows(backend(noisy_copy(target, 0.08, seed=3)), VOCAB, 2)
    engine = Engine(make_rows(lm, 2), drafter_factory=lambda h: alone.member(), draft_length=config)
    stats = drive(engine, {0: [("long", long, params)]})["long"][2]
    assert (stats.drafted_tokens, stats.accepted_tokens) == (out["long"][2].drafted_tokens, out["long"][2].accepted_tokens)


@pytest.mark.parametrize("drafts", ["per-row", "batched"])
def test_a_row_joining_a_plain_batch_prefills_its_draft_when_first_asked(target, drafts):
    """A request with a draft model joins two running rows while the batch policy finds that no
    draft pays at that size: the engine skips its draft's prefill, and the draft catches up on
    the whole prompt when first asked. Its output equals its solo output, and its drafts are
    accepted exactly as when the draft took the prompt with the target's chunks."""
    lm = backend(target)
    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    reqs = prompts(3, seed=21)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    solo = run(lm, reqs[2], params)[0]
    config = DraftLengthConfig(3, 0, adaptive=False)

    def setup(plain_rows: int):
        """An engine whose first ``plain_rows`` requests never draft, and a count of the draft
        prefills it runs (chunks fed by the engine)."""
        fed = [0]
        group = DraftRows(draft_lm, VOCAB, 3) if drafts == "batched" else None

        def draft():
            if group is not None:
                member = group.member()
                member.on_prefill = lambda held, m=member: fed.__setitem__(0, fed[0] + 1) or group.prefill(m, held)
                return member
            drafter = DraftModelDrafter(draft_lm.fork(), VOCAB)
            on_prefill = drafter.on_prefill
            drafter.on_prefill = lambda held: fed.__setitem__(0, fed[0] + 1) or on_prefill(held)
            return drafter

        made = iter(range(10))
        factory = lambda h: NoDrafter() if next(made) < plain_rows else draft()
        return Engine(make_rows(lm, 3), drafter_factory=factory, draft_length=config), fed

    engine, fed = setup(0)
    alone = drive(engine, {0: [("c", reqs[2], params)]})["c"]
    assert alone[0] == solo and alone[2].drafted_tokens > 0 and fed[0] > 0
    engine, fed = setup(2)
    engine._drafters_sit_out = lambda: len(engine.running) >= 3  # a busy batch sits out
    out = drive(engine, {0: [("a", reqs[0], params), ("b", reqs[1], params)], 2: [("c", reqs[2], params)]})
    assert out["c"][0] == solo and fed[0] == 0
    assert (out["c"][2].drafted_tokens, out["c"][2].accepted_tokens) == (alone[2].drafted_tokens,
                                                                         alone[2].accepted_tokens)


def test_a_joining_row_starts_from_the_acceptance_the_engine_has_seen(target):
    """A request whose drafter the factory makes starts its draft-length policy from the
    acceptance measured on the engine's earlier rows (the batch policy reads it before the row
    has drafted once); a request that brings its own drafter starts from the blind prior."""
    lm = backend(target)
    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    reqs = prompts(3, seed=23)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    config = DraftLengthConfig(3, 0, adaptive=False)
    engine = Engine(make_rows(lm, 2), drafter_factory=lambda h: DraftModelDrafter(draft_lm.fork(), VOCAB),
                    draft_length=config)
    assert engine.seen_alpha is None
    first = engine.add("a", reqs[0], params)
    while engine.has_work:
        engine.step()
    prior = DraftLengthPolicy(config).alpha
    assert first.stats.drafted_tokens > first.stats.accepted_tokens > 0
    assert engine.seen_alpha is not None and engine.seen_alpha != pytest.approx(prior)
    joining = engine.add("b", reqs[1], params)
    own = engine.add("c", reqs[2], params, drafter=DraftModelDrafter(draft_lm.fork(), VOCAB))
    engine._admit()  # both join (before either drafts)
    assert joining.policy.alpha == joining.alpha == engine.seen_alpha
    assert joining.policy.t_draft == engine.seen_t_draft == first.policy.t_draft > 0
    assert own.policy.alpha == prior


@pytest.mark.parametrize("per_token_s", [0.01, 0.0])
def test_a_joining_rows_first_round_waits_only_for_a_cheap_draft(target, per_token_s):
    """With the step costs known (the server's cost model), a request joining after rows whose
    drafter took 10 ms a token (a millisecond step: the first token may wait 1 ms) starts with a
    plain step; after a drafter that costs nothing it drafts from its first step."""
    import time

    from .test_batch import oracle_factory

    lm = backend(target)
    reqs = prompts(2, seed=29)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    continuations = {tuple(p.tolist()): run(lm, p, params)[0] for p in reqs}
    make = oracle_factory(1.0, continuations)  # drafts the target's own tokens: always worth asking
    asked = []  # (request's prompt length, committed tokens) at each propose

    def factory(handle):
        drafter = make()
        propose = drafter.propose

        def timed(ctx):
            asked.append((drafter._prompt_len, ctx.token_ids.shape[0]))
            time.sleep(per_token_s * ctx.max_tokens)
            return propose(ctx)

        drafter.propose = timed
        return drafter

    prior = CostModel([1, 2, 4], [0.002, 0.0022, 0.0025])  # about the tiny model's steps
    engine = Engine(make_rows(lm, 2), drafter_factory=factory, cost_prior=prior,
                    draft_length=DraftLengthConfig(3, 0, adaptive=True))
    first = drive(engine, {0: [("a", reqs[0], params)]})
    assert first["a"][0] == continuations[tuple(reqs[0].tolist())]
    assert (len(reqs[0]), len(reqs[0])) in asked  # nothing known yet: the first round drafts
    asked.clear()
    second = drive(engine, {0: [("b", reqs[1], params)]})
    assert second["b"][0] == continuations[tuple(reqs[1].tolist())]
    assert asked and ((len(reqs[1]), len(reqs[1])) in asked) == (per_token_s == 0.0)


def test_seeded_sampled_layer_skip_rows_equal_solo(target):
    """Layer skipping on the batched cache: greedy and seeded sampled rows together give each
    row the tokens its single-row drafter gives it alone."""
    lm = backend(target)
    reqs = prompts(6, seed=13)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=50 + i, ignore_eos=True)
              if i % 2 else SamplingParams(max_tokens=24, ignore_eos=True) for i in range(len(reqs))]
    config = DraftLengthConfig(3, 0, adaptive=True)
    solo = [run(lm, p, sp, LayerSkipDrafter(lm, [1, 2]), config, sp.make_generator())[0]
            for p, sp in zip(reqs, params)]
    engine = Engine(make_rows(lm, 6), drafter_factory=lambda h: layer_skip_drafter(h, [1, 2]), draft_length=config)
    out = drive(engine, {0: [(str(i), p, sp) for i, (p, sp) in enumerate(zip(reqs, params))]})
    assert [out[str(i)][0] for i in range(len(reqs))] == solo


@pytest.mark.parametrize("kind", ["ragged", "slots"])
def test_chunked_prefill_keeps_a_running_row_going(target, kind):
    """A 150-token prompt joins a running request with a 16-token chunk budget: it is fed over
    ten steps, the running row commits tokens at every one of them, and both outputs equal
    their solo outputs."""
    lm = backend(target)
    gen = torch.Generator().manual_seed(1)
    short, long = prompts(1, seed=3)[0], torch.randint(1, VOCAB, (150,), generator=gen)
    params = [SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=20, ignore_eos=True)]
    solo = [run(lm, p, sp)[0] for p, sp in zip((short, long), params)]
    engine = Engine(rows_for(lm, kind, 2), prefill_chunk=16,
                    drafter_factory=lambda h: NgramDrafter(1, 3), draft_length=DraftLengthConfig(3))
    engine.add("short", short, params[0])
    outputs = {"short": [], "long": []}
    steps = []
    while engine.has_work:
        if len(steps) == 2:
            engine.add("long", long, params[1])
        outs, report = engine.step()
        for o in outs:
            outputs[o.request_id] += o.step.tokens
        steps.append((report.prefill_tokens, {o.request_id for o in outs}))
    assert outputs["short"] == solo[0] and outputs["long"] == solo[1]
    feeding = [(tokens, ids) for tokens, ids in steps[2:] if tokens]
    assert len(feeding) == 10 and all(tokens <= 16 for tokens, _ in feeding)
    assert all("short" in ids for _, ids in feeding)  # the running row never waits a whole prompt
    assert all("long" not in ids for _, ids in feeding[:-1]) and "long" in feeding[-1][1]


def test_one_token_prompt_joining_between_prefilling_rows(target):
    """A row still being fed, then a one-token prompt (nothing to feed: it decodes at once) and
    a long prompt joining together: the rows being fed are not adjacent, and each is fed in its
    own slot; every output equals its solo output."""
    lm = backend(target)
    gen = torch.Generator().manual_seed(2)
    long_a, long_b = (torch.randint(1, VOCAB, (n,), generator=gen) for n in (150, 60))
    reqs = {"a": long_a, "one": torch.tensor([5]), "b": long_b, "short": prompts(1, seed=6)[0]}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = {k: run(lm, p, params)[0] for k, p in reqs.items()}
    engine = Engine(make_rows(lm, 4), prefill_chunk=100, drafter_factory=lambda h: NgramDrafter(1, 3),
                    draft_length=DraftLengthConfig(3))
    out = drive(engine, {0: [("short", reqs["short"], params), ("a", long_a, params)],
                         1: [("one", reqs["one"], params), ("b", long_b, params)]})
    assert {k: v[0] for k, v in out.items()} == solo


def test_gemma3_style_sliding_window_model_in_a_batch():
    """A tiny Gemma-3 text model (sliding-window and full layers, window 4) serves several rows
    in one batched forward (the ragged cache with a sliding mask per local layer), with prompts
    longer than the window; each row's greedy output equals its solo output."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(7)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=256, initializer_range=0.3)
    lm = backend(Gemma3ForCausalLM(config).to(torch.float64).eval())
    reqs = [p.repeat(2) for p in prompts(4, seed=21)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    solo = [run(lm, p, params)[0] for p in reqs]
    rows = make_rows(lm, 3)
    assert isinstance(rows, RaggedRows)
    engine = Engine(rows, drafter_factory=lambda h: NgramDrafter(1, 3), draft_length=DraftLengthConfig(3),
                    prefill_chunk=8)
    out = drive(engine, {0: [(str(i), p, params) for i, p in enumerate(reqs)]})
    assert [out[str(i)][0] for i in range(len(reqs))] == solo


def test_draft_rows_catch_up_does_not_pad_rows_to_a_long_one(target):
    """Two rows of a draft's batched rows are in step, a third never took its 60-token prompt
    (the engine skipped it while the drafters sat out): the long catch-up runs as its own
    one-row forward, not padded onto the other rows, and all three draft what a one-row draft
    model drafts for the same tokens."""
    from speclm.drafters.base import DraftContext

    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    gen = torch.Generator().manual_seed(7)
    texts = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (12, 14, 60)]
    group = DraftRows(draft_lm, VOCAB, 3)
    calls = []
    forward = group.rows.forward
    group.rows.forward = lambda rows, ids, *a, **kw: calls.append((len(rows), ids.shape[1])) or forward(rows, ids, *a, **kw)
    members = [group.member() for _ in texts]
    for m, t in zip(members, texts):
        m.reset(t)
    for m, t in zip(members[:2], texts[:2]):
        m.on_prefill(t[:-1])
    calls.clear()
    params = SamplingParams()
    ctxs = [DraftContext(t, 3, params, torch.Generator()) for t in texts]
    drafts = group.propose_rows(members, ctxs)
    assert (1, 59) in calls and all(width == 1 for rows, width in calls if rows > 1)
    for t, ctx, draft in zip(texts, ctxs, drafts):
        one = DraftModelDrafter(draft_lm.fork(), VOCAB)
        one.reset(t)
        assert draft.tokens.tolist() == one.propose(ctx).tokens.tolist()


def test_batched_draft_rows_draft_what_one_row_drafts(target, workload):
    """A draft model drafting all rows in one forward per depth proposes, at every round of
    every request, exactly the tokens a one-row draft model proposes there (so its per-row
    cache, catch-up and rollback are right: greedy verification alone would hide a wrong draft),
    and makes at most 2 + K draft forwards per step however many rows draft."""
    reqs, lengths, solo = workload
    draft_lm = backend(noisy_copy(target, 0.08, seed=3))
    seen: dict[str, dict[tuple, list[int]]] = {"rows": {}, "one": {}}
    calls = []

    class Recording(DraftRows):
        def _forward(self, count, fed, logits):
            calls[-1][1] += 1
            return super()._forward(count, fed, logits)

        def propose_rows(self, members, ctxs):
            calls.append([len(members), 0])
            drafts = super().propose_rows(members, ctxs)
            for ctx, d in zip(ctxs, drafts):
                seen["rows"][tuple(ctx.token_ids.tolist())] = d.tokens.tolist()
            return drafts

    class OneRow(DraftModelDrafter):
        def propose(self, ctx):
            draft = super().propose(ctx)
            seen["one"][tuple(ctx.token_ids.tolist())] = draft.tokens.tolist()
            return draft

    group = Recording(draft_lm, VOCAB, 4)
    config = DraftLengthConfig(4, 0, adaptive=False)  # no timing: both runs draft the same rounds
    for name, factory in (("rows", lambda h: group.member()), ("one", lambda h: OneRow(draft_lm.fork(), VOCAB))):
        engine = Engine(make_rows(backend(target), 4), drafter_factory=factory, draft_length=config)
        arrivals = {0: [(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
                        for i, (p, m) in enumerate(zip(reqs, lengths))]}
        out = drive(engine, arrivals)
        assert [out[str(i)][0] for i in range(len(reqs))] == solo
    assert seen["rows"] == seen["one"] and len(seen["rows"]) > 20
    assert max(rows for rows, _ in calls) == 4
    assert all(forwards <= 2 + 4 for _, forwards in calls)
    assert group._owners == [None] * 4  # every request gave its slot back


def test_batched_rows_are_asked_for_the_planned_depth(target, monkeypatch):
    """With several rows the batch policy plans the depth every row is asked for (a draft
    model then drafts no depth the verify would cut; 0 asks nobody), and each row's own policy
    learns its acceptance from the batched rounds but not the batch's time, which is not the
    row's: a row alone later still times its own drafting."""
    from .test_batch import oracle_factory

    lm = backend(target)
    reqs = prompts(3, seed=31)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    continuations = {tuple(p.tolist()): run(lm, p, params)[0] for p in reqs}
    make = oracle_factory(1.0, continuations)
    asked = []  # (rows decoding, max_tokens) at each propose

    def factory(handle):
        drafter = make()
        propose = drafter.propose

        def recorded(ctx):
            asked.append((sum(s.decoding for s in engine.running), ctx.max_tokens))
            return propose(ctx)

        drafter.propose = recorded
        return drafter

    prior = CostModel([1, 2, 4, 8], [0.002, 0.0022, 0.0025, 0.003])
    engine = Engine(make_rows(lm, 3), drafter_factory=factory, cost_prior=prior,
                    draft_length=DraftLengthConfig(6, 0, adaptive=True))
    plans = iter([2, 0, 3] * 100)
    monkeypatch.setattr(engine.batch_policy, "plan", lambda batch, alphas, draft_max, caps=None: next(plans))
    # the verify keeps every draft (its cap follows this machine's timing, not under test here)
    monkeypatch.setattr(engine.batch_policy, "choose", lambda lengths, alphas, fixed=None: max(lengths, default=0))
    seqs = [engine.add(f"r{i}", p, params) for i, p in enumerate(reqs)]
    out = {s.request_id: [] for s in seqs}
    while engine.has_work:
        for o in engine.step()[0]:
            out[o.request_id] += o.step.tokens
    for seq, p in zip(seqs, reqs):
        assert out[seq.request_id] == continuations[tuple(p.tolist())]
    batched = [k for rows, k in asked if rows > 1]
    assert len(batched) == len(asked)  # the rows ran together to the end
    assert set(batched) <= {1, 2, 3} and {2, 3} <= set(batched)  # the plans (or a row's budget), never 6
    for seq in seqs:
        assert seq.stats.drafted_tokens > 0
        assert seq.policy.alpha > 0.85  # every draft accepted (prior 0.6): the rows learned it
        assert seq.policy.t_draft is None and seq.policy.t_verify is None  # the batch's time is not theirs
