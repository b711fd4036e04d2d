"""The compiled path's batched rows (models/compiled_rows.py) against the eager one-row backend.

On a tiny float64 Llama compiled with ``aot_eager`` (the same tracing, padding and batched static
cache as inductor): every row's logits, fed chains and token trees at its own length with random
rollbacks, equal a from-scratch eager forward of that row alone; rows keep their logits when they
move or swap slots; the engine over these rows gives each greedy row its solo output and each
seeded sampled row its solo tokens; the graph cache stops growing once the shapes are seen; the server warms every rows and token
bucket up front.
"""

from __future__ import annotations

import pytest
import torch

from speclm.draft_length import DraftLengthConfig
from speclm.drafters.ngram import NgramDrafter
from speclm.engine import Engine, generate_tokens
from speclm.errors import CacheContractError
from speclm.models.compiled_rows import CompiledRows, row_buckets
from speclm.models.rows import SlotRows, make_rows
from speclm.sampling import SamplingParams
from speclm.tree import TreeMeta

from .conftest import backend

from .test_compiled import EOS, VOCAB, quick, target64  # noqa: F401  (fixtures)

pytestmark = pytest.mark.compiled


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _solo(ref, tokens: torch.Tensor, n: int, tree: TreeMeta | None = None) -> torch.Tensor:
    """The last ``n`` logits of ``tokens`` fed from scratch to the one-row eager backend."""
    ref.reset()
    past = tokens.shape[0] - n
    if past:
        ref.forward(tokens[:past], 0)
    return ref.forward(tokens[past:], past, num_logits=n, tree=tree).logits


def test_row_buckets():
    assert row_buckets(1) == (1,)
    assert row_buckets(6) == (1, 2, 4, 6)
    assert row_buckets(16) == (1, 2, 4, 8, 16)


def test_rows_match_recomputation(quick, target64):
    """Random widths, trees and ragged rollbacks over 3 of 4 slots; the 32- and 64-slot
    capacities are crossed on the way."""
    ref, rows = backend(target64), CompiledRows(quick, 4)
    gen = torch.Generator().manual_seed(0)
    seqs = [_ids(n, seed=n) for n in (3, 11, 6)]
    width = max(len(s) for s in seqs)
    fed = torch.stack([torch.nn.functional.pad(s, (0, width - len(s))) for s in seqs])
    rows.forward(range(3), fed, [len(s) for s in seqs], logits=False)  # prefill: eager
    for b, s in enumerate(seqs):
        rows.keep(b, len(s), [])
    for step in range(14):
        ks = [int(torch.randint(0, 6, (1,), generator=gen)) for _ in seqs]
        trees = [TreeMeta.from_parents([-1, -1, 0, 1, 1]) if (step + b) % 3 == 0 else None
                 for b in range(len(seqs))]
        ks = [5 if tree is not None else k for k, tree in zip(ks, trees)]  # 5 nodes
        width = 1 + max(ks)
        fed = torch.randint(1, VOCAB, (len(seqs), width), generator=gen)
        out = rows.forward(range(len(seqs)), fed, [k + 1 for k in ks], trees=trees)
        for b, (k, tree) in enumerate(zip(ks, trees)):
            full = torch.cat([seqs[b], fed[b, : k + 1]])
            torch.testing.assert_close(out.logits[b, : k + 1], _solo(ref, full, k + 1, tree), rtol=0, atol=1e-10)
            if tree is not None:  # keep the path pending -> node 1 -> node 3
                rows.keep(b, len(seqs[b]) + 1, [1, 3])
                seqs[b] = torch.cat([full[:1 + len(seqs[b])], full[len(seqs[b]) + 2 : len(seqs[b]) + 3],
                                     full[len(seqs[b]) + 4 : len(seqs[b]) + 5]])
            else:  # a ragged verdict: keep a random prefix of what was fed
                kept = int(torch.randint(0, k + 2, (1,), generator=gen))
                rows.keep(b, len(seqs[b]), list(range(kept)))
                seqs[b] = full[: len(seqs[b]) + kept]
            assert rows.length(b) == len(seqs[b])
    assert rows.cache.capacity == 64 and any(len(key) == 2 for key in quick._step.seen)


def test_moves_swaps_and_eager_rows(quick, target64):
    """Rows keep their logits when moved or swapped; rows that do not start at slot 0 and
    hidden-state forwards run eagerly on the same cache, with the same numbers."""
    ref, rows = backend(target64), CompiledRows(quick, 3)
    a, b = _ids(7, 1), _ids(4, 2)
    rows.forward(range(1, 3), torch.stack([a, torch.nn.functional.pad(b, (0, 3))]), [7, 4], logits=False)
    rows.keep(1, 7, [])
    rows.keep(2, 4, [])
    rows.swap(1, 2)  # b in slot 1, a in slot 2
    rows.move(2, 0)  # a in slot 0
    assert (rows.length(0), rows.length(1), rows.length(2)) == (7, 4, 0)
    nxt = torch.tensor([[30, 31], [40, 41]])
    out = rows.forward(range(2), nxt, [2, 2], return_hidden=[-1])
    for row, seq in enumerate((a, b)):
        full = torch.cat([seq, nxt[row]])
        ref.reset()
        want = ref.forward(full, 0, num_logits=2, return_hidden=[-1])
        torch.testing.assert_close(out.logits[row], want.logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(out.hidden_states[-1][row], want.hidden_states[-1][-2:], rtol=0, atol=1e-10)
    with pytest.raises(CacheContractError):
        rows.keep(0, 5, [0, 6])  # slot 0 holds 9 entries: 5 + 6 is past them


def test_make_rows_picks_the_batched_static_cache(quick):
    assert isinstance(make_rows(quick, 4), CompiledRows)
    assert isinstance(make_rows(quick, 1), SlotRows)  # a batch of one is the single-row path


def _run(engine: Engine, prompts, params_of) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add(str(i), p, params_of(i))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step()[0]:
            out[o.request_id] += o.step.tokens
    return out


def test_engine_rows_equal_solo_and_graphs_stop_growing(quick):
    """Greedy and seeded sampled rows mixed in one batch of 3 slots (5 requests: rows join and
    leave): each row's tokens are its solo tokens. A second round of the same requests compiles
    nothing new."""
    prompts = [_ids(5 + 7 * i, seed=i).repeat(2) for i in range(5)]

    def params_of(i: int) -> SamplingParams:
        if i % 2:
            return SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=100 + i)
        return SamplingParams(max_tokens=20, ignore_eos=True)

    solo = []
    for i, p in enumerate(prompts):
        quick.reset()
        steps = generate_tokens(quick, p, params_of(i), drafter=NgramDrafter(1, 3),
                                draft_length=DraftLengthConfig(4))
        solo.append([t for s in steps for t in s.tokens])
    engine = Engine(make_rows(quick, 3), drafter_factory=lambda h: NgramDrafter(1, 3),
                    draft_length=DraftLengthConfig(4))
    out = _run(engine, prompts, params_of)
    assert [out[str(i)] for i in range(len(prompts))] == solo
    seen, calls = set(quick._step.seen), quick._step.direct_calls
    assert _run(engine, prompts, params_of) == out
    assert quick._step.seen == seen
    assert quick._step.direct_calls > calls  # the rows' graphs ran without dynamo (direct_call.py)
    assert any(len(entry) == 2 and graph for (entry, _), graph in quick._step.direct.items())


def test_server_batches_rows_on_the_compiled_path(model_dirs, monkeypatch):
    """`speclm serve --compile` with prompt lookup: four concurrent requests share compiled
    batched steps (warmed up when the app starts), each greedy answer equals plain decoding's."""
    import functools
    import threading

    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from speclm.api import LLM
    from speclm.models import compiled
    from speclm.serve.launch import ServeOptions, build_app

    monkeypatch.setattr(compiled, "make_compiled", functools.partial(compiled.make_compiled, compile_backend="aot_eager"))
    widths: list[int] = []
    graphs: list[set] = []  # the graphs compiled when warm-up ends
    forward = CompiledRows._compiled
    monkeypatch.setattr(CompiledRows, "_compiled", lambda self, rows, *a: widths.append(len(rows)) or forward(self, rows, *a))
    warmup = CompiledRows.warmup
    steps = []

    def warm(self, k, layers=()):
        assert not layers  # prompt lookup reads no features
        spent = warmup(self, k, layers=layers)
        graphs.append({key for key in self._step.seen if len(key) == 2})  # (rows, tokens)
        steps.append(self._step)
        return spent

    monkeypatch.setattr(CompiledRows, "warmup", warm)
    prompts = ["the quick brown fox", "def add(a, b):", "the lazy dog. the lazy dog.", "naïve café"]
    opts = ServeOptions(model=str(model_dirs["target"]), dtype="float64", max_batch=4, max_queue=4,
                        served_model_name="tiny", draft_max=3, compile=True)
    with TestClient(build_app(opts), base_url="http://localhost") as http:
        warmed = len(widths)
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="none", http_client=http, max_retries=0)
        answers: dict[int, object] = {}

        def ask(i: int) -> None:
            answers[i] = client.completions.create(model="tiny", prompt=prompts[i] * 2, max_tokens=16,
                                                   temperature=0, extra_body={"ignore_eos": True})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    solo = LLM(str(model_dirs["target"]), None, dtype="float64")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        assert answers[i].choices[0].text == solo.generate(prompt * 2, params, speculative=False)[0].text
    assert warmed == 3 * 3  # rows 1, 2, 4 x tokens 1, 2, 4 (K = 3)
    assert graphs[0] == {(r, t) for r in (1, 2, 4) for t in (1, 2, 4)}
    assert max(widths[warmed:]) > 1  # rows shared a compiled step
    assert len(steps) == 1 and {key for key in steps[0].seen if len(key) == 2} == graphs[0]  # none compiled later
