"""The batched engine: each request's output is what it would be alone.

- greedy: batched output == the solo engine's plain greedy output token for token, on tiny
  float64 models, for prompts of different lengths, ragged acceptance (prompt lookup, and an
  oracle drafter with exact mixed acceptance), requests joining mid-way and leaving early;
- the ragged cache: batched logits after random per-row rollbacks == recomputation from scratch;
- sampling: a seeded plain request in a batch draws exactly its solo tokens, and speculative
  sampling in a batch matches the target's exact sequence distribution (chi-square), seeded rows
  (keyed draws) and unseeded ones (rejection sampling) alike;
- the draft-length policy shrinks K to 0 when verification cost grows with the batch.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from speclm.batch import BatchDraftConfig, BatchModel, StepCostModel
from speclm.batch.draft_policy import BatchDraftPolicy
from speclm.bench.oracle import OracleDrafter
from speclm.drafters import NgramDrafter
from speclm.draft_length import DraftLengthConfig
from speclm.engine import Engine
from speclm.errors import SpeclmError
from speclm.models.rows import make_rows
from speclm.sampling import SamplingParams

from .conftest import backend, tiny_model
from .test_lossless import assert_matches_distribution, prompts, run, sampling_setup

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_model(VOCAB, seed=10)


def batch_engine(lm, max_batch, factory=None, draft_max=10, adaptive=True):
    """The engine over ``max_batch`` rows of ``lm``, each request drafting with ``factory()``."""
    return Engine(make_rows(lm, max_batch), drafter_factory=None if factory is None else lambda _: factory(),
                  draft_length=DraftLengthConfig(draft_max, 0, adaptive))


def drive(engine, arrivals, aborts=None):
    """Run the engine; ``arrivals`` maps step -> [(id, prompt, params[, generator])], ``aborts``
    step -> [id]. Returns id -> (tokens, finish_reason, stats)."""
    out, step, aborts = {}, 0, aborts or {}
    while engine.has_work or any(s >= step for s in arrivals):
        for rid, prompt, params, *generator in arrivals.get(step, []):
            engine.add(rid, prompt, params, generator=generator[0] if generator else None)
            out[rid] = [[], None, None]
        for rid in aborts.get(step, []):
            engine.abort(rid)
        outputs, _ = engine.step()
        for o in outputs:
            out[o.request_id][0] += o.step.tokens
            out[o.request_id][1:] = [o.step.finish_reason, o.stats]
        step += 1
        assert step < 10_000
    return out


def seeded_or_not(params: SamplingParams, i: int) -> tuple:
    """Request i's params and generator: odd i seeded (keyed draws), even i unseeded with a
    generator of its own (rejection sampling), both reproducible."""
    if i % 2:
        return replace(params, seed=i), None
    return params, torch.Generator().manual_seed(10_000 + i)


def assert_ragged_rows_match(engine, params: SamplingParams, prompt: torch.Tensor, n: int, vocab: int,
                             expected: torch.Tensor) -> None:
    """Run 4n/3 three-token requests through ``engine``: every fourth on a longer prompt (so rows
    are ragged), odd ones seeded (keyed draws), even ones unseeded (rejection sampling, their own
    generators). The sequences of each kind on ``prompt`` match ``expected`` by chi-square."""
    other = torch.cat([prompt, prompt])
    out = drive(engine, {0: [(f"r{i}", prompt if i % 4 else other, *seeded_or_not(params, i))
                             for i in range(n * 4 // 3)]})
    for seeded in (0, 1):
        counts = torch.zeros(vocab**3, dtype=torch.float64)
        accepted = 0
        for i in range(seeded, n * 4 // 3, 2):
            tokens, _, stats = out[f"r{i}"]
            if i % 4:
                counts[(torch.tensor(tokens) * torch.tensor([vocab**2, vocab, 1])).sum()] += 1
                accepted += stats.accepted_tokens
        assert accepted > counts.sum() // 10
        assert_matches_distribution(counts, expected)


def oracle_factory(accept_rate, continuations):
    """Oracle drafters replaying each prompt's greedy continuation (``continuations``: prompt
    tuple -> tokens) with each token kept with probability ``accept_rate``."""

    class PerPrompt(OracleDrafter):
        def reset(self, prompt_ids):
            self.set_continuation(len(prompt_ids), continuations[tuple(prompt_ids.tolist())])
            super().reset(prompt_ids)

    seeds = iter(range(10_000))
    return lambda: PerPrompt(accept_rate, VOCAB, seed=next(seeds))


@pytest.fixture(scope="module")
def workload(target):
    """14 prompts of different lengths, each with its own max_tokens (so requests leave at
    different steps), and their solo plain greedy outputs."""
    lm = backend(target)
    reqs = prompts(14, seed=5)
    lengths = [10 + 7 * (i % 5) for i in range(len(reqs))]
    solo = [run(lm, p, SamplingParams(max_tokens=m, ignore_eos=True))[0] for p, m in zip(reqs, lengths)]
    return reqs, lengths, solo


@pytest.mark.parametrize("setup", ["plain", "ngram-fixed", "ngram-adaptive", "oracle-0.5", "oracle-0.9"])
def test_batched_greedy_equals_solo(target, workload, setup):
    reqs, lengths, solo = workload
    factory = None
    if setup.startswith("ngram"):
        factory = lambda: NgramDrafter(1, 3)  # noqa: E731
    elif setup.startswith("oracle"):
        continuations = {tuple(p.tolist()): out for p, out in zip(reqs, solo)}
        factory = oracle_factory(float(setup.split("-")[1]), continuations)
    engine = batch_engine(backend(target), 5, factory, draft_max=6, adaptive=setup == "ngram-adaptive")
    if setup == "ngram-adaptive":
        # the policy learns a fixed cost (a step grows 2% per token fed per row, drafting is
        # free), not this machine's timings: on a loaded machine those can keep every step
        # plain, and the rows' ragged rollbacks then go untested
        policy = engine.batch_policy
        policy.update = lambda batch, fed, seconds: policy.cost.observe(  # type: ignore[method-assign]
            policy._computed(batch, fed), 1e-3 * (1 + 0.02 * batch * fed))
        policy.update_drafting = lambda *args, **kwargs: None  # type: ignore[method-assign]
    # some join at once (more than max_batch: they queue), others join mid-way
    arrivals = {0: [], 3: [], 11: []}
    for i, (p, m) in enumerate(zip(reqs, lengths)):
        arrivals[(0, 3, 11)[i % 3]].append((str(i), p, SamplingParams(max_tokens=m, ignore_eos=True)))
    out = drive(engine, arrivals)
    accepted = 0
    for i in range(len(reqs)):
        tokens, finish, stats = out[str(i)]
        assert tokens == solo[i], f"request {i} diverged from its solo output"
        assert finish == "length" and stats.generated_tokens == lengths[i]
        accepted += stats.accepted_tokens
    if setup != "plain":
        assert accepted > 0  # drafts were accepted, so rows rolled back by different amounts
    assert engine.rows.cache.lengths.sum() == 0 and not engine.running


def test_abort_mid_way_leaves_others_unchanged(target):
    lm = backend(target)
    reqs = prompts(6, seed=8)
    solo = [run(lm, p, SamplingParams(max_tokens=30, ignore_eos=True))[0] for p in reqs]
    engine = batch_engine(backend(target), 4, lambda: NgramDrafter(1, 3), draft_max=4, adaptive=False)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    out = drive(engine, {0: [(str(i), p, params) for i, p in enumerate(reqs)]},
                aborts={2: ["1"], 5: ["4"]})
    for i in (0, 2, 3, 5):
        assert out[str(i)][0] == solo[i]
    assert out["1"][1] is None and len(out["1"][0]) < 30  # cut short, never finished
    assert not engine.has_work


def test_prompts_of_any_length_join_together(target):
    """One-token prompts (nothing to prefill), short ones sharing a padded prefill, and long
    ones prefilled in their own forward, all joining at once."""
    lm = backend(target)
    gen = torch.Generator().manual_seed(3)
    long_ones = [torch.randint(1, VOCAB, (n,), generator=gen) for n in (150, 90)]
    reqs = [torch.tensor([7]), torch.tensor([9]), prompts(1, seed=4)[0], torch.tensor([3]), *long_ones]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = [run(lm, p, params)[0] for p in reqs]
    engine = batch_engine(backend(target), 6, lambda: NgramDrafter(1, 3))
    out = drive(engine, {0: [("0", reqs[0], params), ("1", reqs[1], params)],
                         2: [(str(i), reqs[i], params) for i in range(2, 6)]})
    assert [out[str(i)][0] for i in range(6)] == solo


def test_eos_and_context_end_requests(target):
    lm = backend(target)
    prompt = prompts(1, seed=2)[0]
    free = run(lm, prompt, SamplingParams(max_tokens=20, ignore_eos=True))[0]
    eos = free[5]  # pretend the sixth generated token is EOS
    lm.eos_token_ids = frozenset({eos})
    short = backend(tiny_model(VOCAB, seed=10, max_positions=len(prompt) + 8))
    short.eos_token_ids = frozenset({eos})
    engine = batch_engine(lm, 2, lambda: NgramDrafter(1, 3))
    out = drive(engine, {0: [("eos", prompt, SamplingParams(max_tokens=20))]})
    assert out["eos"][0] == free[: free.index(eos) + 1] and out["eos"][1] == "stop"
    engine = batch_engine(short, 2)
    out = drive(engine, {0: [("ctx", prompt, SamplingParams(max_tokens=50, ignore_eos=True))]})
    assert len(out["ctx"][0]) == 8 and out["ctx"][1] == "length"
    with pytest.raises(SpeclmError, match="context"):
        engine.add("long", torch.arange(1, 60), SamplingParams())
    with pytest.raises(SpeclmError, match="empty"):
        engine.add("empty", [], SamplingParams())


def check_against_recomputation(model, lengths, steps, seed):
    """Random per-row appends and rollbacks on a ragged batch of ``model``: every logit equals a
    from-scratch forward of the row's tokens on the one-row backend."""
    lm, rows = backend(model), BatchModel(backend(model), max_batch=len(lengths))
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]
    batch = slice(0, len(seqs))
    rows.forward(batch, torch.stack([torch.nn.functional.pad(s, (0, max(lengths) - len(s))) for s in seqs]), 1)
    rows.set_lengths(torch.tensor(lengths))
    for _ in range(steps):
        width = int(torch.randint(1, 6, (1,), generator=gen))
        fed = torch.randint(1, VOCAB, (len(seqs), width), generator=gen)
        logits = rows.forward(batch, fed, width).logits
        for b in range(len(seqs)):
            full = torch.cat([seqs[b], fed[b]])
            lm.reset()
            assert torch.allclose(logits[b], lm.forward(full, 0, num_logits=width).logits, atol=1e-10, rtol=0)
            seqs[b] = full[: len(seqs[b]) + int(torch.randint(0, width + 1, (1,), generator=gen))]  # ragged rollback
        rows.set_lengths(torch.tensor([len(q) for q in seqs]))
    return rows


def test_ragged_cache_matches_recomputation(target):
    check_against_recomputation(target, (3, 9, 5), steps=12, seed=0)


def test_rows_move_when_requests_leave(target):
    """Compaction copies a row into a freed slot; its later logits are unchanged."""
    lm = backend(target)
    model = BatchModel(backend(target), max_batch=2)
    a, b = torch.arange(1, 8), torch.arange(20, 24)
    model.forward(slice(0, 2), torch.stack([a, torch.nn.functional.pad(b, (0, 3))]), 1)
    model.set_lengths(torch.tensor([7, 4]))
    model.cache.move(1, 0)
    logits = model.forward(slice(0, 1), torch.tensor([[30, 31]]), 2).logits
    lm.reset()
    assert torch.allclose(logits[0], lm.forward(torch.cat([b, torch.tensor([30, 31])]), 0, 2).logits,
                          atol=1e-10, rtol=0)


def test_seeded_plain_sampling_in_a_batch_equals_solo(target):
    lm = backend(target)
    reqs = prompts(5, seed=11)
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=25, seed=100 + i, ignore_eos=True)
              for i in range(len(reqs))]
    solo = [run(lm, p, sp, gen=sp.make_generator())[0] for p, sp in zip(reqs, params)]
    engine = batch_engine(backend(target), 3)
    out = drive(engine, {0: [(str(i), p, sp) for i, (p, sp) in enumerate(zip(reqs, params))]})
    assert [out[str(i)][0] for i in range(len(reqs))] == solo


def test_seeded_speculative_sampling_is_independent_of_the_batch(target):
    """The batch's adaptive cap cuts seeded rows' drafts as it cuts greedy rows' (to nothing
    here), and their tokens stay the solo engine's with every draft verified (same seed): the
    keyed draws do not depend on what was drafted."""
    lm = backend(target)
    reqs = prompts(6, seed=12)
    sampled = [SamplingParams(temperature=0.8, max_tokens=30, seed=7 + i, ignore_eos=True)
               for i in range(3)]
    solos = [run(lm, p, sp, NgramDrafter(1, 3), DraftLengthConfig(draft_max=5), sp.make_generator())
             for p, sp in zip(reqs, sampled)]
    solo = [tokens for tokens, _ in solos]
    assert sum(stats.drafted_tokens for _, stats in solos) > 0
    engine = batch_engine(backend(target), 6, lambda: NgramDrafter(1, 3), draft_max=5, adaptive=True)
    engine.batch_policy.cost.observe(6, 1e-3)  # make drafting look expensive: the cap goes to 0
    engine.batch_policy.cost.observe(36, 1.0)
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    out = drive(engine, {0: [(str(i), p, sampled[i] if i < 3 else greedy) for i, p in enumerate(reqs)]})
    assert [out[str(i)][0] for i in range(3)] == solo
    assert sum(out[str(i)][2].drafted_tokens for i in range(3)) == 0


def test_batched_speculative_sampling_matches_target_distribution():
    """Three tokens per request, K = 2, prompt lookup; 32 rows per batch, seeded and unseeded."""
    vocab, length, n = 5, 3, 2400
    _, lm, params, prompt, expected = sampling_setup(vocab, length)
    engine = batch_engine(lm, 32, lambda: NgramDrafter(1, 2), draft_max=2, adaptive=False)
    assert_ragged_rows_match(engine, params, prompt, n, vocab, expected)


def test_step_cost_model_interpolates_and_extrapolates():
    cost = StepCostModel()
    assert cost.estimate(4) is None
    cost.observe(4, 0.01)
    assert cost.estimate(40) == 0.01  # one point: optimistic, so larger sizes get explored
    cost.observe(44, 0.05)
    assert cost.estimate(24) == pytest.approx(0.03)
    assert cost.estimate(84) == pytest.approx(0.09)
    assert cost.estimate(2) == 0.01
    cost.observe(48, 0.09)  # one slow step just past the last: the slope is the whole range's
    assert cost.estimate(92) == pytest.approx(0.17)  # (the last two sizes: 0.53)


def test_step_cost_model_never_prices_a_size_above_a_larger_one():
    """A size measured once in a cold or contended moment (a server's first steps) keeps its
    slow figure until it is measured again; a larger size measured since bounds it, since a
    forward over more tokens (or a draft over more rows) does not cost less."""
    cost = StepCostModel()
    cost.observe(2, 0.15)  # a cold draft over 2 rows
    cost.observe(16, 0.06)  # ... and over 16 rows, warm
    assert cost.estimate(2) == cost.estimate(1) == cost.estimate(10) == 0.06
    cost.observe(8, 0.04)
    assert cost.estimate(8) == 0.04 and cost.estimate(12) == pytest.approx(0.05)
    assert cost.estimate(4) == 0.04  # between 2 (0.15) and 8: no more than 8 costs
    # a prior's figure (one row of 8 tokens) bounds nothing: 4 rows run one by one cost more
    priced = StepCostModel()
    priced.observe(8, 0.003, prior=True)
    priced.observe(4, 0.02)
    assert priced.estimate(4) == 0.02 and priced.estimate(8) == 0.003
    priced.observe(8, 0.04)  # a real step of that size replaces the prior's figure at once
    assert priced.estimate(8) == 0.04
    priced.observe(8, 0.001, prior=True)  # ... and a prior no longer moves it
    assert priced.estimate(8) == 0.04 and priced.estimate(6) == 0.03


def test_policy_shrinks_the_draft_as_verification_gets_expensive():
    config = BatchDraftConfig(draft_max=8, adaptive=True, probe_every=4, probe_share=1.0)
    drafts, alphas = [8] * 16, [0.5] * 16
    cheap = BatchDraftPolicy(config)  # a GPU-like cost: flat in the tokens fed
    assert cheap.choose(drafts, alphas) == 0  # first, measure the plain step
    cheap.update(16, 1, 0.010)
    assert cheap.choose(drafts, alphas) == 8  # unmeasured sizes look free: explore
    cheap.update(16, 9, 0.011)
    assert cheap.choose(drafts, alphas) >= 4  # verification nearly free: keep drafting
    steep = BatchDraftPolicy(config)  # a CPU-like cost: linear in the tokens fed
    steep.update(16, 1, 0.010)
    steep.update(16, 9, 0.090)
    picks = [steep.choose(drafts, alphas) for _ in range(16)]
    # plain, with short probes: the 4th step, then after 7 more plain steps (interval 8), ...
    assert [i for i, k in enumerate(picks) if k] == [3, 11] and picks[3] == picks[11] == 2
    # a small batch on the same steep curve still pays for a few drafts at high acceptance
    steep.update(1, 1, 0.004)
    steep.update(1, 9, 0.006)
    assert steep.choose([8], [0.9]) > 0
    fixed = BatchDraftPolicy(BatchDraftConfig(draft_max=8, adaptive=False))
    assert fixed.choose([3, 5], [0.1, 0.1]) == 5


def test_policy_costs_steps_at_the_padded_shape_the_backend_runs():
    """The compiled path runs graphs at padded (rows, tokens): 3 rows of 2 tokens cost what 4 rows
    of 4 cost. A policy told so drafts a whole token bucket or nothing; measured per real token
    it saw K = 1 as cheap and drafted at an acceptance where plain steps win."""

    def pad(n, sizes):
        return next(b for b in sizes if b >= n)

    def computed(rows, width):
        return pad(rows, (1, 2, 4, 8)) * pad(width, (1, 4, 8, 16))

    def seconds(rows, width):  # what the padded forward costs: 0.010 s + 0.0005 s a token
        return 0.010 + 0.0005 * computed(rows, width)

    config = BatchDraftConfig(draft_max=3, adaptive=True, probe_every=1000)
    padded, flat = BatchDraftPolicy(config, computed=computed), BatchDraftPolicy(config)
    for policy in (padded, flat):  # steps seen so far: one row of 1-8 tokens, three rows of 1
        for rows, width in ((1, 1), (1, 2), (1, 4), (1, 8), (3, 1)):
            policy.update(rows, width, seconds(rows, width))
    drafts = [3, 3, 3]
    # alpha 0.3: 1.3-1.42 tokens a row for 1.4x the plain step's cost at any K: plain
    assert padded.choose(drafts, [0.3] * 3) == 0
    assert flat.choose(drafts, [0.3] * 3) == 1  # the cost per real token thought K = 1 paid
    # alpha 0.8: drafting pays; the bucket is paid for anyway, so the whole draft goes in
    assert padded.choose(drafts, [0.8] * 3) == 3


def test_policy_probes_within_a_share_of_the_plain_steps_time():
    """A probe over many rows costs several plain steps on a CPU: it waits until it is at most
    ``probe_share`` of the plain steps run since the last one; a cheap probe comes on time."""
    config = BatchDraftConfig(draft_max=8, adaptive=True, probe_every=4, probe_share=0.1)

    def steep():
        policy = BatchDraftPolicy(config)
        policy.update(16, 1, 0.010)
        policy.update(16, 9, 0.090)  # a probe (16 x 3 tokens) costs 0.03 s: 0.02 s more than plain
        return policy

    policy = steep()
    picks = [policy.choose([8] * 16, [0.5] * 16) for _ in range(50)]
    assert [i for i, k in enumerate(picks) if k] == [19, 39]  # 20 plain steps' 0.2 s x 0.1 pays for it
    policy = steep()
    asks = [policy.plan(16, [0.5] * 16, 8) for _ in range(20)]
    assert asks == [0] * 19 + [2]  # the probe asks for its short depth only
    cheap = BatchDraftPolicy(config)
    cheap.update(1, 1, 0.010)
    cheap.update(1, 9, 0.018)  # a probe (3 tokens) costs 0.002 s more: due after 4 plain steps
    picks = [cheap.choose([8], [0.1]) for _ in range(12)]
    assert [i for i, k in enumerate(picks) if k] == [3, 11]
    with pytest.raises(SpeclmError):
        BatchDraftConfig(probe_share=0.0)


def test_policy_skips_asking_drafters_when_no_draft_could_pay_and_still_probes():
    config = BatchDraftConfig(draft_max=8, adaptive=True, probe_every=4, probe_share=1.0)
    steep = BatchDraftPolicy(config)  # a CPU-like cost: linear in the tokens fed
    assert steep.plan(16, [0.5] * 16, 8) == 0  # the plain step is not measured yet
    steep.update(16, 1, 0.010)
    steep.update(16, 9, 0.090)
    asks = [steep.plan(16, [0.5] * 16, 8) for _ in range(6)]
    # plain steps 2 and 3 skip the drafters; then a probe is due (every 4th step) and they are
    # asked for the probe's depth
    assert asks == [0, 0, 2, 2, 2, 2]
    assert steep.choose([2] * 16, [0.5] * 16) == 2  # ... which choose() runs on the real drafts
    cheap = BatchDraftPolicy(config)
    cheap.update(4, 1, 0.010)
    cheap.update(4, 9, 0.011)
    assert cheap.plan(4, [0.3] * 4, 8) > 0  # a wide step costs about what a plain one does
    assert BatchDraftPolicy(BatchDraftConfig(draft_max=8, adaptive=False)).plan(4, [0.0] * 4, 8) == 8


def sliding_model(kind):
    """Tiny float64 models with sliding-window layers: Mistral (every layer, window 8, one mask)
    and Gemma-3 (local and global layers, window 4, a mask per layer type)."""
    torch.manual_seed(7)
    if kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                               initializer_range=0.3)
        return MistralForCausalLM(config).to(torch.float64).eval()
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                              max_position_embeddings=256, initializer_range=0.3)
    return Gemma3ForCausalLM(config).to(torch.float64).eval()


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_sliding_window_rows_match_recomputation(kind):
    """Rows far past the window (transformers' own sliding masks on the one-row backend)."""
    rows = check_against_recomputation(sliding_model(kind), (3, 19, 11), steps=10, seed=1)
    assert rows.masks.window == (8 if kind == "mistral" else 4)


def test_sliding_window_tree_rows_see_what_plain_decoding_sees():
    """A token tree on a Gemma-3-style model past its window: each node's logits equal a plain
    forward of the prompt and the node's path (the window counts positions, not cache slots), and
    after keeping a path the next forward still does."""
    from speclm.tree import TreeMeta

    model = sliding_model("gemma3")
    lm, rows = backend(model), BatchModel(backend(model), max_batch=1)
    prompt = torch.arange(1, 13)
    rows.forward(slice(0, 1), prompt[None, :-1], 1)
    rows.set_lengths(torch.tensor([11]))
    parents = [-1, -1, 0, 2, 3, 1]  # a chain of four under node 0, one more child of the root
    nodes = torch.tensor([20, 21, 22, 23, 24, 25])
    tree = TreeMeta.from_parents(parents)
    logits = rows.forward(slice(0, 1), torch.cat([prompt[-1:], nodes])[None], 7, trees=[tree]).logits[0]
    paths = {0: [], 1: [0], 2: [1], 3: [0, 2], 4: [0, 2, 3], 5: [0, 2, 3, 4], 6: [1, 5]}
    for row, path in paths.items():  # row 0: the pending token; row i: node i - 1
        lm.reset()
        plain = lm.forward(torch.cat([prompt, nodes[path]]), 0).logits[-1]
        assert torch.allclose(logits[row], plain, atol=1e-10, rtol=0), f"tree row {row}"
    rows.cache.compact(0, 11, [0, 1, 3, 4, 5])  # pending, then nodes 0, 2, 3, 4
    after = rows.forward(slice(0, 1), torch.tensor([[30]]), 1).logits[0, 0]
    lm.reset()
    path = torch.cat([prompt, nodes[[0, 2, 3, 4]], torch.tensor([30])])
    assert torch.allclose(after, lm.forward(path, 0).logits[-1], atol=1e-10, rtol=0)


def test_attention_the_ragged_cache_cannot_mask_is_refused():
    from types import SimpleNamespace

    from speclm.batch.model import mask_plan

    chunked = SimpleNamespace(model_type="llama4", layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(SpeclmError, match="chunked_attention"):
        mask_plan(chunked)
    with pytest.raises(SpeclmError, match="window"):
        mask_plan(SimpleNamespace(model_type="x", layer_types=["sliding_attention"], sliding_window=None))
    assert mask_plan(SimpleNamespace(model_type="llama", layer_types=None, sliding_window=None)).window is None


def test_ragged_tree_forward_and_compaction_match_one_row(target):
    """Two rows, one a token tree and one a padded chain: each row's logits equal the one-row
    backend's; after keeping a path of the tree, the next forward still matches."""
    from speclm.tree import TreeMeta
    from speclm.errors import CacheContractError

    lm = backend(target)
    model = BatchModel(backend(target), max_batch=2)
    a, b = torch.arange(1, 9), torch.arange(30, 35)
    model.forward(slice(0, 2), torch.stack([a[:-1], torch.nn.functional.pad(b[:-1], (0, 3))]), 1)
    model.set_lengths(torch.tensor([7, 4]))
    tree = TreeMeta.from_parents([-1, -1, 0, 2])  # two first tokens, a chain of two under the first
    nodes, chain = torch.tensor([11, 12, 13, 14]), torch.tensor([b[-1], 40, 41])
    fed = torch.stack([torch.cat([a[-1:], nodes]), torch.nn.functional.pad(chain, (0, 2))])
    logits = model.forward(slice(0, 2), fed, 5, trees=[tree, None]).logits  # [2, 5, V]
    lm.reset()
    lm.forward(a[:-1], 0)
    expected = lm.forward(torch.cat([a[-1:], nodes]), 7, num_logits=5, tree=tree).logits
    assert torch.allclose(logits[0], expected, atol=1e-10, rtol=0)
    lm.reset()
    assert torch.allclose(logits[1, :3], lm.forward(torch.cat([b[:-1], chain]), 0, num_logits=3).logits,
                          atol=1e-10, rtol=0)
    model.cache.compact(0, 8, [0, 2])  # keep nodes 0 and 2: the path 11 -> 13
    model.cache.lengths[1] = 6
    with pytest.raises(CacheContractError):
        model.cache.compact(0, 8, [1, 0])
    after = model.forward(slice(0, 2), torch.tensor([[15], [42]]), 1).logits
    lm.reset()
    path = torch.cat([a, torch.tensor([11, 13, 15])])
    assert torch.allclose(after[0, 0], lm.forward(path, 0).logits[0], atol=1e-10, rtol=0)


def test_policy_counts_what_drafting_costs_before_asking():
    """Verification alone says drafting pays (alpha 0.9, a 9-token step costs 1.5 plain ones),
    but each drafted depth costs a draft-model forward over the rows: once that is measured, a
    busy batch asks for fewer tokens or none (prompt lookup's microseconds change nothing). The
    cost is per depth at the batch's size: a batched draft forward of 16 rows costs little more
    than one of 2, so a price measured on a few rows must not make 16 look 8 times dearer."""
    config = BatchDraftConfig(draft_max=8, adaptive=True, probe_every=1000)
    policy = BatchDraftPolicy(config)
    policy.update(4, 1, 0.040)
    policy.update(4, 9, 0.060)
    assert policy.plan(4, [0.9] * 4, 8) == 8 and policy.draft_s(4, 8) == 0.0
    policy.update_drafting(0.0004, 4, 8)  # prompt lookup: 4 rows x 8 tokens in 0.4 ms
    assert policy.plan(4, [0.9] * 4, 8) == 8 and policy.drafting_pays(4, [0.9] * 4, 8)
    for _ in range(30):  # a draft model: 0.08 s a depth
        policy.update_drafting(0.64, 4, 8)
    assert policy.draft_s(4, 1) == pytest.approx(0.08, rel=0.05)
    assert policy.plan(4, [0.9] * 4, 8) == 0
    assert policy.drafting_pays(4, [0.9] * 4, 8) is False  # a joining row's draft skips its prefill
    assert policy.drafting_pays(3, [0.9] * 3, 8) is False  # a size never run: its plain step first
    assert policy.choose([8] * 4, [0.9] * 4) == 8  # drafts already made: their cost is spent
    policy.update_drafting(0.0, 4, 0)  # a step that asked for nothing measures nothing
    assert policy.draft_s(4, 1) == pytest.approx(0.08, rel=0.05)
    # a cheaper draft at the same rows: a short depth pays, the full one does not
    for _ in range(30):
        policy.update_drafting(0.04, 4, 8)  # 5 ms a depth
    assert 0 < policy.plan(4, [0.9] * 4, 8) < 8
    # per depth, by rows: measured at 2 and 16 rows, a size between is interpolated, and a
    # cost measured at 2 rows alone is not multiplied by the rows
    rows = BatchDraftPolicy(config)
    rows.update_drafting(0.02, 2, 2)
    assert rows.draft_s(16, 1) == pytest.approx(0.01)
    rows.update_drafting(0.06, 16, 2)
    assert rows.draft_s(9, 2) == pytest.approx(0.04)
    # a probe drafts too (a draft model first catches up on what it missed): its price waits
    # for a share of that many more plain steps
    probing = BatchDraftConfig(draft_max=8, adaptive=True, probe_every=4, probe_share=0.1)
    cheap_drafts, dear_drafts = BatchDraftPolicy(probing), BatchDraftPolicy(probing)
    for p in (cheap_drafts, dear_drafts):
        p.update(4, 1, 0.040)
        p.update(4, 9, 0.120)
        p.update(4, 3, 0.060)
    dear_drafts.update_drafting(0.8, 4, 2)  # 0.4 s a depth: a probe drafts 2, 0.8 s
    streaks = []
    for p in (cheap_drafts, dear_drafts):
        picks = [p.choose([8] * 4, [0.2] * 4) for _ in range(400)]  # plain wins at alpha 0.2
        streaks.append(next(i for i, k in enumerate(picks) if k))
    assert streaks[0] == 4 and 200 <= streaks[1] <= 206  # 0.02 s: 5 plain steps (0.2 s); 0.82 s: ~205 (8.2 s)
    # rows that sat out catch up first: that is measured apart, and prices the probe alone
    caught_up = BatchDraftPolicy(probing)
    caught_up.update(4, 1, 0.040)
    caught_up.update(4, 9, 0.120)
    caught_up.update(4, 3, 0.060)
    caught_up.update_drafting(0.0008, 4, 2, catch_up_s=0.8)
    assert caught_up.draft_s(4, 1) == pytest.approx(0.0004)
    picks = [caught_up.choose([8] * 4, [0.2] * 4) for _ in range(400)]
    assert 200 <= next(i for i, k in enumerate(picks) if k) <= 206
