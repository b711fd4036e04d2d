"""``auto``: probing, choosing by measured rate, switching when a drafter's rate changes, lazy
resets, learners kept informed, and the decisions reported in RequestStats."""

from __future__ import annotations

import pytest
import torch

from speclm import SpeclmError
from speclm.draft_length import DraftLengthConfig
from speclm.drafters import Draft, DraftContext, NgramDrafter
from speclm.drafters.auto import AutoDrafter, NoDrafter
from speclm.drafters.recycle import RecycleDrafter
from speclm.drafters.suffix import SuffixDrafter
from speclm.engine import generate_tokens
from speclm.sampling import SamplingParams
from speclm.stats import RequestStats

from .conftest import backend, tiny_model


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Fake:
    """Drafts ``k`` tokens per round, costs ``seconds`` of (fake) time per round."""

    def __init__(self, clock, seconds, accepted):
        self.clock, self.seconds, self.accepted = clock, seconds, accepted
        self.resets = 0

    def reset(self, prompt_ids):
        self.resets += 1

    def propose(self, ctx):
        self.clock.now += self.seconds
        return Draft(torch.zeros(ctx.max_tokens, dtype=torch.long))

    def on_verified(self, num_accepted, emitted):
        pass


def play(auto, fakes, rounds):
    """Drive ``auto`` as the engine would; each round commits (accepted + 1) tokens, which the
    next round's context holds."""
    tokens = auto._context.tolist() + auto._tail if auto._context is not None else [1, 2, 3]
    for _ in range(rounds):
        auto.propose(DraftContext(torch.tensor(tokens), 4, SamplingParams(), torch.Generator()))
        accepted = fakes[auto._active].accepted
        auto.on_verified(accepted, [0] * (accepted + 1))
        tokens += [0] * (accepted + 1)


@pytest.fixture()
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("speclm.drafters.auto.time.perf_counter", clock)
    return clock


def test_probes_then_keeps_the_fastest_and_switches_when_it_slows(clock):
    fakes = {"slow": Fake(clock, 1.0, 1), "fast": Fake(clock, 1.0, 3), "free": Fake(clock, 0.5, 0)}
    auto = AutoDrafter({n: (d, 4) for n, d in fakes.items()}, probe_rounds=3, reprobe_every=1000)
    auto.reset(torch.tensor([1, 2, 3]))
    play(auto, fakes, 9)  # three probes of three rounds
    assert auto.choice == "fast"
    assert auto.rates["fast"].pooled == pytest.approx(4.0) and auto.rates["slow"].pooled == pytest.approx(2.0)
    assert auto.rates["free"].pooled == pytest.approx(2.0)
    play(auto, fakes, 10)
    assert auto._request["rounds"]["fast"] == 3 + 10  # exploiting
    fakes["fast"].accepted = 0  # acceptance collapses: 1 token per second now
    play(auto, fakes, 40)
    report = auto.report()
    assert auto.choice in ("slow", "free")
    actions = [d["action"] for d in report["decisions"]]
    assert actions[0] == "fast" and "probe" in actions
    assert any("switch from fast" in d["reason"] for d in report["decisions"])
    assert "fell to" in next(d["reason"] for d in report["decisions"] if d["action"] == "probe")


def test_periodic_reprobe(clock):
    fakes = {"a": Fake(clock, 1.0, 2), "b": Fake(clock, 1.0, 1)}
    # re-probe every 15 committed tokens: 5 of a's rounds (3 tokens each)
    auto = AutoDrafter({n: (d, 4) for n, d in fakes.items()}, probe_rounds=2, reprobe_every=15)
    auto.reset(torch.tensor([1]))
    play(auto, fakes, 4 + 5 + 4)
    reasons = [d["reason"] for d in auto.report()["decisions"]]
    assert reasons.count("periodic re-probe") == 1 and auto.choice == "a"


def test_lazy_resets_and_learners_see_every_request(clock):
    fake = Fake(clock, 1.0, 1)
    never = Fake(clock, 1.0, 1)
    suffix = SuffixDrafter(capacity=256, factor=0)
    auto = AutoDrafter({"fake": (fake, 4), "suffix": (suffix, 4), "never": (never, 4)},
                       probe_rounds=2)
    auto.reset(torch.tensor([1, 2, 3]))
    ctx = DraftContext(torch.tensor([1, 2, 3]), 4, SamplingParams(), torch.Generator())
    auto.propose(ctx)
    auto.on_verified(1, [40, 41])
    assert fake.resets == 1 and never.resets == 0  # never asked: never reset
    auto.reset(torch.tensor([9, 3, 40]))  # the next request: suffix saw request 1 via observe
    assert suffix.propose(DraftContext(torch.tensor([9, 3, 40]), 4, SamplingParams(),
                                       torch.Generator())).tokens.tolist() == [41]


def test_through_the_engine_lossless_with_decisions_in_stats():
    lm = backend(tiny_model(48, seed=8))
    auto = AutoDrafter({"none": (NoDrafter(), 1), "ngram": (NgramDrafter(1, 2), 4),
                        "recycle": (RecycleDrafter(48, 4), 4)}, probe_rounds=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = torch.tensor([3, 4, 5, 3, 4, 5])
    plain = [t for s in generate_tokens(lm, prompt, params) for t in s.tokens]
    stats = RequestStats()
    out = [t for s in generate_tokens(lm, prompt, params, drafter=auto, stats=stats,
                                      draft_length=DraftLengthConfig(4)) for t in s.tokens]
    assert out == plain
    report = stats.drafter_report
    assert report["choice"] in ("none", "ngram", "recycle") and set(report["rates"]) == {"none", "ngram", "recycle"}
    assert report["decisions"][0]["reason"] == "probed"
    # every drafted round is counted (a last round with no budget left drafts nothing)
    assert stats.target_forwards - 1 <= sum(report["rounds"].values()) <= stats.target_forwards
    assert "auto: chose" in stats.summary() and "round " in stats.summary()


def test_bad_auto_settings(model_dirs):
    from speclm import LLM

    with pytest.raises(SpeclmError, match="at least one"):
        AutoDrafter({})
    with pytest.raises(SpeclmError, match="probe"):
        AutoDrafter({"none": (NoDrafter(), 1)}, probe_rounds=1)
    llm = LLM(str(model_dirs["target"]), dtype="float64")
    for spec, needle in [("auto:candidates=auto", "cannot be a candidate"),
                         ("auto:candidates=ngram,hydra", "unknown drafter"),
                         ("auto:probe=1", "probe >= 2")]:
        with pytest.raises(SpeclmError, match=needle):
            llm.make_speculation(spec)
    spec = llm.make_speculation("auto:candidates=none,ngram,suffix,recycle,probe=3")
    assert list(spec.drafter.candidates) == ["none", "ngram", "suffix", "recycle"]
    assert spec.drafter.wants_target_topk == 8 and spec.draft_length.draft_max == 10


def test_a_clear_loser_sits_out_more_and_more_reprobes(clock):
    fakes = {"good": Fake(clock, 1.0, 2), "bad": Fake(clock, 4.0, 0)}
    # re-probe every 12 committed tokens: 4 of good's rounds (3 tokens each)
    auto = AutoDrafter({n: (d, 4) for n, d in fakes.items()}, probe_rounds=2, reprobe_every=12)
    auto.reset(torch.tensor([1]))
    played = []
    for _ in range(60):
        play(auto, fakes, 1)
        played.append(auto._active)
    probes = [d for d in auto.report()["decisions"] if d["action"] == "probe"]
    bad_probes = sum(1 for a, b in zip(played, played[1:]) if a == "good" and b == "bad")
    assert auto.choice == "good" and len(probes) >= 6
    assert bad_probes <= 3  # probed after re-probes 2 and 5 (sitting out 1, then 2), not each time


def test_the_default_drafter_decides_in_the_first_request_and_remembers(model_dirs, monkeypatch, capsys):
    """Without a draft model the CLI runs ``auto`` (plain decoding a candidate); its choice is
    made within the first request, shown in the stats line and remembered for the model."""
    from speclm import LLM
    from speclm.cli import main

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(model_dirs["target"].parent / "auto-cache"))
    target = str(model_dirs["target"])
    assert main(["generate", "the quick brown fox the quick brown fox", "--model", target,
                 "--dtype", "float64", "-n", "48", "--raw"]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("drafter auto (chose ")  # decided within the first request
    llm = LLM(target, "auto", dtype="float64")
    auto = llm.drafter
    assert auto.choice == auto.remembered and auto.choice in auto.candidates  # no probe needed
    assert "none" in auto.candidates  # plain decoding competes
    out = llm.generate("the quick brown fox", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert "remembered for this model" in out.stats.drafter_report["summary"]


def test_plain_decoding_as_the_choice_still_reprobes_after_enough_tokens(clock):
    """With plain decoding chosen the engine rarely asks auto (K = 0 rounds skip the drafter),
    so re-probes are counted in committed tokens: a request that turns repetitive is noticed."""
    fakes = {"none": Fake(clock, 0.5, 0), "d": Fake(clock, 2.0, 0)}
    auto = AutoDrafter({n: (d, 4) for n, d in fakes.items()}, probe_rounds=2, reprobe_every=40)
    auto.reset(torch.tensor([1]))
    play(auto, fakes, 4)
    assert auto.choice == "none"
    tokens = auto._context.tolist() + auto._tail
    for _ in range(6):  # asked once every 8 tokens, as with plain steps between
        tokens += [0] * 7
        auto.propose(DraftContext(torch.tensor(tokens), 4, SamplingParams(), torch.Generator()))
        auto.on_verified(0, [0])
        tokens += [0]
    assert [d["reason"] for d in auto.report()["decisions"]].count("periodic re-probe") == 1


def test_top_k_feedback_only_while_a_learner_may_draft(clock):
    """Token recycling learns from the target's top-k; once another candidate is the choice no
    round computes a top-k over the vocabulary for it."""
    fakes = {"good": Fake(clock, 1.0, 3)}
    recycle = RecycleDrafter(vocab_size=16, topk=4)
    auto = AutoDrafter({"good": (fakes["good"], 4), "recycle": (recycle, 2)}, probe_rounds=2)
    auto.reset(torch.tensor([1]))
    assert auto.wants_target_topk == 4  # probing: recycle may be measured
    fakes["recycle"] = Fake(clock, 5.0, 0)  # what play() reads for recycle's rounds
    play(auto, fakes, 4)
    assert auto.choice == "good" and auto.wants_target_topk == 0


def test_a_seeded_request_gets_plain_decodings_tokens_whatever_auto_chose():
    """A seeded sampling request's tokens follow from its seed alone: fresh and probing, or
    settled on plain decoding, auto times and chooses as for any request, and the tokens are
    plain seeded decoding's."""
    lm = backend(tiny_model(48, seed=8))
    params = SamplingParams(temperature=0.8, seed=4, max_tokens=40, ignore_eos=True)
    prompt = torch.tensor([3, 4, 5, 3, 4, 5, 3, 4])
    plain = [t for s in generate_tokens(lm, prompt, params) for t in s.tokens]
    for settled in (False, True):
        auto = AutoDrafter({"none": (NoDrafter(), 1), "ngram": (NgramDrafter(1, 2), 4),
                            "recycle": (RecycleDrafter(48, 4), 4)}, probe_rounds=2)
        if settled:
            auto.choice, auto._queue = "none", []
        stats = RequestStats()
        tokens = [t for s in generate_tokens(lm, prompt, params, drafter=auto, stats=stats,
                                             draft_length=DraftLengthConfig(4, adaptive=True))
                  for t in s.tokens]
        assert tokens == plain
        if not settled:  # probing measured the candidates on this request's rounds
            assert stats.drafted_tokens > 0 and any(r.seconds > 0 for r in auto.rates.values())
