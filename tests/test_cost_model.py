"""The measured cost model (speclm.cost_model) and the draft length it drives, on a fake backend
whose forward of T tokens advances a fake clock by a known cost curve (no timing is asserted)."""

from __future__ import annotations

import json
import os
import torch

from speclm import cost_model as cm
from speclm.draft_length import DraftLengthConfig, DraftLengthPolicy
from speclm.models.base import ForwardOutput

from .test_draft_length import drive


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeBackend:
    """A CausalLM whose forward of T tokens 'takes' curve(T) seconds of ``clock``."""

    backend_name = "fake"
    vocab_size = 50
    max_context = 512
    device = torch.device("cpu")
    dtype = torch.float32
    eos_token_ids = frozenset()

    def __init__(self, curve, clock: FakeClock | None = None) -> None:
        self.curve, self.clock, self.length, self.forwards = curve, clock or FakeClock(), 0, 0

    @property
    def cache_length(self) -> int:
        return self.length

    def forward(self, token_ids, start_pos, num_logits=1, return_hidden=False, tree=None):
        assert start_pos == self.length
        t = int(token_ids.shape[0])
        self.length += t
        self.forwards += 1
        self.clock.now += self.curve(t)
        return ForwardOutput(torch.zeros(num_logits, self.vocab_size))

    def rollback(self, length: int) -> None:
        self.length = length

    def reset(self) -> None:
        self.length = 0


STEEP = lambda t: 0.010 * (1 + 0.8 * (t - 1))  # noqa: E731  each drafted token: 0.8 of a step
FLAT = lambda t: 0.010 * (1 + 0.002 * (t - 1))  # noqa: E731  a GPU: a verify ~ a plain step


def test_measure_recovers_the_cost_curve_and_leaves_the_cache_empty():
    target = FakeBackend(STEEP)
    model = cm.measure(target, clock=target.clock)
    assert model.widths[0] == 1 and model.widths[-1] == 32
    for t in (1, 2, 5, 8, 20, 32):
        assert abs(model.verify_s(t) - STEEP(t)) < 1e-9  # interpolation is exact on a line
    assert abs(model.slope() - 0.8) < 1e-9 and abs(model.ratio(9) - 7.4) < 1e-9
    assert model.verify_s(40) > model.verify_s(32)  # extrapolated along the last slope
    assert target.cache_length == 0
    narrow = cm.measure(FakeBackend(FLAT), max_width=11)
    assert narrow.widths[-1] == 11
    slow = FakeBackend(lambda t: 0.5 * (1 + 0.3 * (t - 1)))  # half a second a step
    few = cm.measure(slow, clock=slow.clock, budget_s=3.0)
    assert few.widths[:2] == [1, 2] and len(few.widths) < len(cm.WIDTHS) and few.asked == 32
    assert slow.clock.now < 3.0 + 2 * 2 * 0.5 * (1 + 0.3 * 31)  # stops adding widths at the budget
    assert abs(few.ratio(32) - (1 + 0.3 * 31)) < 1e-9  # the rest extrapolated along the line
    assert "plain step 10.00 ms" in model.summary() and "1 + 0.80 (T - 1)" in model.summary()


def test_cache_is_keyed_by_model_file_and_version(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF" + bytes(16))
    target = FakeBackend(FLAT)
    first = cm.cost_model(target, weights, max_width=9, clock=target.clock)
    assert first.origin == "measured" and target.forwards > 0
    files = list((tmp_path / "cache" / "cost").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["backend"] == "fake"
    target.forwards = 0
    again = cm.cost_model(target, weights, max_width=9, clock=target.clock)
    assert again.origin == "cached" and target.forwards == 0 and again.seconds == first.seconds
    assert cm.cost_model(target, weights, max_width=17, clock=target.clock).origin == "measured"  # wider than cached
    os.utime(weights, ns=(1, 1))  # the model file changed: stale
    assert cm.cost_model(target, weights, max_width=9, clock=target.clock).origin == "measured"
    monkeypatch.setattr(cm, "VERSION", cm.VERSION + 1)  # another measurement version: stale
    assert cm.cost_model(target, weights, max_width=9, clock=target.clock).origin == "measured"
    assert cm.cost_model(target, None, clock=target.clock).origin == "measured"  # no file (random weights): never cached
    monkeypatch.setattr(cm, "kernel_in_use", lambda model: True)  # linear layers on speclm's CPU kernel
    for build in ("speclm_small_m_aaaa", "speclm_small_m_bbbb"):  # a changed kernel: a new build, stale
        monkeypatch.setattr(cm, "build_name", lambda build=build: build)
        assert cm.cost_model(target, weights, max_width=9, clock=target.clock).origin == "measured"
    assert cm.cost_model(target, weights, max_width=9, clock=target.clock).origin == "cached"
    calls = []

    def busy(t):  # another process took the CPU for a while: one plain step ten times slower
        calls.append(t)
        return FLAT(t) * (10 if len(calls) == 30 else 1)

    monkeypatch.setattr(cm, "VERSION", cm.VERSION + 2)
    slowed = FakeBackend(busy)
    noisy = cm.cost_model(slowed, weights, max_width=9, clock=slowed.clock)
    assert noisy.noisy and "noisy" in noisy.summary()
    assert cm.cost_model(target, weights, max_width=9, clock=target.clock).origin == "measured"  # not cached


def _chosen(curve, alpha: float, rounds: int = 300) -> list[int]:
    """K the prior-driven policy picks, with i.i.d. acceptance and the curve's step costs."""
    target = FakeBackend(curve)
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=10, adaptive=True),
                               prior=cm.measure(target, clock=target.clock))
    return drive(policy, alpha, lambda k: curve(1 + k), rounds)


def test_the_policy_plans_from_the_cost_model_from_the_first_round():
    steep = _chosen(STEEP, alpha=0.4)
    assert steep[0] == 0  # the first round already knows a verify is expensive
    assert sum(k == 0 for k in steep) > 0.8 * len(steep)  # plain steps, probing now and then
    flat = _chosen(FLAT, alpha=0.8)
    assert flat[0] == 10 and sorted(flat)[len(flat) // 2] == 10  # a long K when verifies are free
    mid = lambda t: 0.010 * (1 + 0.3 * (t - 1))  # noqa: E731  llama.cpp's Q4 kernels on a CPU
    assert 1 <= sorted(_chosen(mid, alpha=0.8))[150] <= 4  # good acceptance: short drafts pay


def test_the_policy_scales_the_prior_by_live_step_times():
    target = FakeBackend(FLAT)
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=4, adaptive=True),
                               prior=cm.measure(target, clock=target.clock))
    for _ in range(30):  # the machine got three times slower
        policy.update(0, 0, 0.0, 3 * FLAT(1))
    assert abs(policy.verify_s(0) - 3 * FLAT(1)) < 1e-3


def test_a_probing_drafter_decides_plain_steps_itself():
    target = FakeBackend(STEEP)
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=6, adaptive=True),
                               prior=cm.measure(target, clock=target.clock))
    assert policy.next_k() == 0 and policy.next_k(exploring=True) >= 1


def test_a_probe_is_as_long_as_a_good_acceptance_would_pay_for():
    """While plain steps win, a draft is still tried now and then (and auto measures its
    candidates): short where each drafted token costs most of a step, long where a verify is
    nearly free, never the whole draft_max on a backend where that would cost several steps."""
    mid = lambda t: 0.010 * (1 + 0.6 * (t - 1))  # noqa: E731  llama.cpp on a CPU
    probes = {}
    for name, curve in (("steep", STEEP), ("mid", mid), ("flat", FLAT)):
        target = FakeBackend(curve)
        policy = DraftLengthPolicy(DraftLengthConfig(draft_max=10, adaptive=True, probe_every=4),
                                   prior=cm.measure(target, clock=target.clock))
        policy.alpha = 0.0 if name != "flat" else policy.alpha  # drafting cannot pay (flat: it can)
        ks = [policy.next_k() for _ in range(8)]
        probes[name] = (ks, policy.next_k(exploring=True))
    for name in ("steep", "mid"):
        ks, exploring = probes[name]
        assert ks.count(0) == 6 and 1 <= max(ks) <= 3 and 1 <= exploring <= 3, (name, ks)
    assert probes["flat"][1] == 10  # a free verify: the probe drafts as far as allowed


def test_fixed_k_ignores_the_cost_model():
    target = FakeBackend(STEEP)
    policy = DraftLengthPolicy(DraftLengthConfig(draft_max=6, adaptive=False),
                               prior=cm.measure(target, clock=target.clock))
    assert policy.next_k() == 6


def test_the_batched_policy_starts_from_the_cost_model():
    from speclm.batch.draft_policy import BatchDraftConfig, BatchDraftPolicy

    steep, flat = FakeBackend(STEEP), FakeBackend(FLAT)
    config = BatchDraftConfig(draft_max=10)
    assert BatchDraftPolicy(config, cm.measure(steep, clock=steep.clock)).choose([10], [0.4]) == 0
    assert BatchDraftPolicy(config, cm.measure(flat, clock=flat.clock)).choose([10], [0.8]) == 10


def test_adaptive_by_default_in_generate_chat_bench_and_the_api(model_dirs, capsys, monkeypatch):
    from speclm import LLM
    from speclm.bench import parse_method
    from speclm.cli import main

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(model_dirs["target"].parent / "cost-cache"))
    target = str(model_dirs["target"])
    assert LLM(target, "ngram", dtype="float64").speculation.draft_length.adaptive
    from speclm.serve.launch import ServeOptions

    assert ServeOptions().adaptive  # the server's batched policy too
    assert parse_method("ngram").options["adaptive"] == 1 and parse_method("ngram:adaptive=0").options["adaptive"] == 0
    assert main(["generate", "the quick brown fox", "--model", target, "--dtype", "float64", "-n", "8",
                 "--raw", "--verbose"]) == 0
    assert "verify cost (" in capsys.readouterr().err  # measured or cached, shown with --verbose
    assert main(["generate", "the quick brown fox", "--model", target, "--dtype", "float64", "-n", "8",
                 "--raw", "--verbose", "--no-adaptive"]) == 0
    assert "verify cost" not in capsys.readouterr().err  # a fixed K needs no cost model
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n/stats\n/exit\n"))
    assert main(["chat", "--model", target, "--dtype", "float64", "-n", "4", "--verbose"]) == 0
    assert "verify cost (" in capsys.readouterr().err  # cached, or measured again if the machine was busy


def test_a_tree_drafter_s_verify_cost_is_measured_as_wide_as_its_tree(model_dirs, monkeypatch):
    """A tree of 12 nodes plus a 3-token lookup branch verifies up to 16 tokens: the cost curve
    reaches that width instead of the draft cap's, so its nodes are priced by measurement, not
    by extrapolating a curve that stopped at 1 + K."""
    from speclm import LLM
    from speclm.sampling import SamplingParams

    monkeypatch.setenv("SPECLM_CACHE_DIR", str(model_dirs["target"].parent / "cost-cache-tree"))
    llm = LLM(str(model_dirs["target"]), f"draft:path={model_dirs['draft']},tree=2,budget=12,lookup=3",
              num_speculative_tokens=4, dtype="float64")
    spec = llm.speculation
    assert spec.draft_length.draft_max == 4 and spec.widest == 12 + 3
    out = llm.generate("the quick brown fox", SamplingParams(max_tokens=6))[0]
    assert out.stats.cost_model and llm.cost_model().asked == 1 + spec.widest
    assert llm.cost_model().widths[-1] == 1 + spec.widest
