"""One thread owns a server's model: it loads, warms and steps it (speclm.serve.owner), and a
compiled step raises dynamo's per-thread limits on whichever thread compiles."""

from __future__ import annotations

import contextvars
import threading
from types import SimpleNamespace

import pytest
import torch

from speclm.models.compiled_step import CompiledStep
from speclm.serve.owner import OwnerThread

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from speclm.serve.launch import ServeOptions, build_app  # noqa: E402

MARK: contextvars.ContextVar[str] = contextvars.ContextVar("MARK", default="unset")


def test_owner_thread_runs_jobs_in_order_on_one_thread_and_returns_errors():
    owner = OwnerThread(name="test-owner")
    try:
        idents = [owner.call(threading.get_ident) for _ in range(3)]
        assert len(set(idents)) == 1 and idents[0] != threading.get_ident()
        order: list[int] = []
        futures = [owner.submit(order.append, i) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == [None] * 5 and order == [0, 1, 2, 3, 4]
        with pytest.raises(ZeroDivisionError):
            owner.call(lambda: 1 / 0)
        assert owner.call(lambda: owner.call(lambda: 7)) == 7  # a call from the owner runs at once
    finally:
        owner.close()
    owner._thread.join(timeout=10)
    assert not owner.alive
    with pytest.raises(RuntimeError, match="stopped"):
        owner.submit(print)


def test_owner_thread_sees_its_creators_context_variables():
    token = MARK.set("creator")
    try:
        owner = OwnerThread()
    finally:
        MARK.reset(token)
    try:
        assert owner.call(MARK.get) == "creator"
        plain = []
        t = threading.Thread(target=lambda: plain.append(MARK.get()))
        t.start()
        t.join()
        assert plain == ["unset"]  # what a plain thread would have seen
    finally:
        owner.close()


def test_server_steps_its_model_on_the_thread_that_built_it(model_dirs, monkeypatch):
    from speclm.engine import Engine
    from speclm.serve import build

    built, stepped = [], []
    real_build, real_step = build.build_engine, Engine.step

    def recording_build(opts):
        built.append(threading.get_ident())
        return real_build(opts)

    def recording_step(self):
        stepped.append(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(build, "build_engine", recording_build)
    monkeypatch.setattr(Engine, "step", recording_step)
    opts = ServeOptions(model=str(model_dirs["target"]), dtype="float64", max_batch=2,
                        served_model_name="tiny", shutdown_grace_s=1.0)
    with TestClient(build_app(opts), base_url="http://localhost") as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
    assert len(built) == 1 and stepped and set(stepped) == set(built)
    assert built[0] != threading.get_ident()


class _Logits(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True,
                output_hidden_states=False, past_key_values=None):
        return SimpleNamespace(logits=input_ids.float().unsqueeze(-1) * 2)


def test_a_step_compiled_on_another_thread_keeps_more_than_dynamos_default_graphs():
    import torch._dynamo.config as dynamo_config

    step = CompiledStep(_Logits(), None, backend="eager")
    step.allow_graphs(40)
    seen = {}

    def compile_many():
        for width in range(1, 13):  # 12 shapes: past dynamo's default of 8 graphs
            ids = torch.ones(1, width, dtype=torch.long)
            out = step(("w", width), None, ids, ids, ids)
            assert torch.equal(out, ids.float().unsqueeze(-1) * 2)
        seen["limit"] = dynamo_config.recompile_limit

    t = threading.Thread(target=compile_many)
    t.start()
    t.join()
    assert seen["limit"] >= 40
