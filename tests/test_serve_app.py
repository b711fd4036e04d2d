"""The HTTP application in-process (Starlette's TestClient, lifespan included): bad input gets a
4xx with an OpenAI error body, auth, the bounded queue, engine crashes, streaming format,
stop strings and metrics. The real-process tests with the openai client are in
test_serve_process.py."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from speclm.api import LLM  # noqa: E402
from speclm.sampling import SamplingParams  # noqa: E402
from speclm.serve.launch import ServeOptions, build_app  # noqa: E402


def make_client(model_dir, **overrides) -> TestClient:
    opts = ServeOptions(model=str(model_dir), dtype="float64", max_batch=4, max_queue=4,
                        served_model_name="tiny", max_body_bytes=8192, shutdown_grace_s=2.0)
    for key, value in overrides.items():
        setattr(opts, key, value)
    return TestClient(build_app(opts))


@pytest.fixture(scope="module")
def client(model_dirs):
    with make_client(model_dirs["target"]) as c:
        yield c


@pytest.fixture(scope="module")
def solo(model_dirs):
    return LLM(str(model_dirs["target"]), None, dtype="float64")


def worker_of(client):
    """The app's engine worker (reached through the middleware stack's state)."""
    app = client.app
    for mw in app.user_middleware:
        if "state" in mw.kwargs:
            return mw.kwargs["state"].worker
    raise AssertionError("no worker found")


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 4}
BAD_INPUT = [
    # (route, body (dict or raw bytes), status, param, code, message fragment)
    ("chat", b"{not json", 400, None, None, "not valid JSON"),
    ("chat", b"[1, 2]", 400, None, None, "JSON object"),
    ("chat", b"\xff\xfe", 400, None, None, "not valid JSON"),
    ("chat", {**CHAT, "temperature": "hot"}, 400, "temperature", None, "valid number"),
    ("chat", {**CHAT, "temperature": 2.5}, 400, "temperature", None, "less than or equal to 2"),
    ("chat", {**CHAT, "top_p": 0}, 400, "top_p", None, "greater than 0"),
    ("chat", {**CHAT, "max_tokens": 0}, 400, "max_tokens", None, "greater than or equal to 1"),
    ("chat", {**CHAT, "max_tokens": "10"}, 400, "max_tokens", None, "valid integer"),
    ("chat", {**CHAT, "n": 2}, 400, "n", None, "only 1"),
    ("chat", {**CHAT, "seed": -1}, 400, "seed", None, "greater than or equal to 0"),
    ("chat", {**CHAT, "stream": "yes"}, 400, "stream", None, "valid boolean"),
    ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None, "at most 4"),
    ("chat", {**CHAT, "logprobs": True}, 400, "logprobs", None, "not supported"),
    ("chat", {**CHAT, "presence_penalty": 0.5}, 400, "presence_penalty", None, "only 0"),
    ("chat", {**CHAT, "model": "gpt-4"}, 404, "model", "model_not_found", "does not exist"),
    ("chat", {"model": "tiny"}, 400, "messages", None, "Field required"),
    ("chat", {**CHAT, "messages": []}, 400, "messages", None, "at least 1"),
    ("chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", None, "user"),
    ("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content.0.type", None, "text only"),
    ("chat", {**CHAT, "max_tokens": 1000}, 400, "messages", "context_length_exceeded", "context is 256"),
    ("completion", {**COMPLETION, "prompt": ""}, 400, "prompt", None, "empty"),
    ("completion", {**COMPLETION, "prompt": ["a", "b"]}, 400, "prompt", None, "one prompt"),
    ("completion", {**COMPLETION, "prompt": [1, 2, 10**6]}, 400, "prompt", None, "token ids"),
    ("completion", {**COMPLETION, "prompt": "fox " * 600}, 400, "prompt", "context_length_exceeded", "the prompt has"),
    ("completion", {**COMPLETION, "echo": True}, 400, "echo", None, "not supported"),
    ("completion", {**COMPLETION, "prompt": "x" * 9000}, 413, None, "body_too_large", "larger than"),
]


@pytest.mark.parametrize("route,body,status,param,code,fragment", BAD_INPUT,
                         ids=[f"{i}-{c[2]}-{c[3] or c[4] or c[5]}" for i, c in enumerate(BAD_INPUT)])
def test_bad_input_gets_an_openai_error(client, route, body, status, param, code, fragment):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    err = error_of(client.post(path, **kwargs), status)
    assert err["param"] == param and err["code"] == code
    assert fragment in err["message"]
    assert client.get("/health").status_code == 200  # and the worker is still serving


def test_unknown_routes_and_methods(client):
    assert error_of(client.get("/v1/nothing"), 404)["type"] == "not_found_error"
    error_of(client.get("/v1/chat/completions"), 405)
    assert error_of(client.get("/v1/models/other"), 404)["code"] == "model_not_found"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"


def test_greedy_responses_are_the_solo_output(client, solo):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected_chat = solo.chat([{"role": "user", "content": "hello"}], params).text
    expected_text = solo.generate("the quick brown fox", params)[0].text
    chat = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True}).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": expected_chat}
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 12
    assert chat["speclm"]["drafter"].startswith("ngram") and "alpha" in chat["speclm"]
    comp = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 12, "temperature": 0,
                                                "ignore_eos": True}).json()
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == expected_text


def test_stop_string_ends_the_request(client, solo):
    full = solo.generate("the quick brown fox", SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    body = {**COMPLETION, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}
    out = client.post("/v1/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["text"] == full[: full.index(stop)]


def test_streaming_format(client, solo):
    expected = solo.chat([{"role": "user", "content": "hello"}],
                         SamplingParams(max_tokens=10, ignore_eos=True)).text
    body = {**CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
    assert "tau" in final[0]["speclm"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_metrics_report_requests_latency_and_speculation(client):
    client.post("/v1/completions", json={**COMPLETION, "max_tokens": 8, "temperature": 0})
    text = client.get("/metrics").text
    for needle in ('speclm_requests_total{route="/v1/completions",status="200"}',
                   "speclm_time_to_first_token_seconds_count", "speclm_request_latency_seconds_bucket",
                   "speclm_generation_tokens_total", "speclm_spec_drafted_tokens_total",
                   "speclm_spec_accepted_tokens_total", "speclm_spec_alpha", "speclm_spec_tau",
                   "speclm_spec_draft_length ", "speclm_batch_size_bucket", "speclm_step_seconds_bucket"):
        assert needle in text, needle


def test_api_key_guards_every_route_but_health(model_dirs):
    with make_client(model_dirs["target"], api_key="s3cret") as c:
        assert c.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert error_of(c.get(path), 401)["code"] == "invalid_api_key"
            error_of(c.get(path, headers={"Authorization": "Bearer wrong"}), 401)
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        error_of(c.post("/v1/completions", json=COMPLETION), 401)
        ok = c.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def hold_steps(worker) -> threading.Event:
    """Make the engine thread wait before every step until the returned event is set."""
    gate, step = threading.Event(), worker.engine.step

    def gated_step():
        gate.wait(timeout=30)
        return step()

    worker.engine.step = gated_step
    return gate


def _post_in_thread(c, results, body):
    def go():
        results.append(c.post("/v1/completions", json=body))
    t = threading.Thread(target=go)
    t.start()
    return t


def test_full_queue_answers_429_then_recovers(model_dirs):
    with make_client(model_dirs["target"], max_batch=1, max_queue=1) as c:
        worker = worker_of(c)
        gate = hold_steps(worker)
        results = []
        threads = [_post_in_thread(c, results, {**COMPLETION, "max_tokens": 3}) for _ in range(2)]
        deadline = time.monotonic() + 20
        while worker.load < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        err = error_of(r := c.post("/v1/completions", json=COMPLETION), 429)
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
        gate.set()
        for t in threads:
            t.join(timeout=30)
        assert [r.status_code for r in results] == [200, 200]
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def test_engine_crash_fails_the_batch_with_500_and_keeps_serving(model_dirs):
    with make_client(model_dirs["target"]) as c:
        model = worker_of(c).engine.model
        forward, crashes = model.forward, [1]

        def crashing_forward(*args, **kwargs):
            if crashes:
                crashes.pop()
                raise RuntimeError("simulated device error")
            return forward(*args, **kwargs)

        model.forward = crashing_forward
        err = error_of(c.post("/v1/completions", json=COMPLETION), 500)
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        crashes.append(1)
        with c.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line]
        assert '"code":"engine_error"' in events[-2] and events[-1] == "data: [DONE]"
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200
        assert 'speclm_request_failures_total{reason="engine_error"} 2.0' in c.get("/metrics").text


def test_stop_cancels_what_outlives_the_grace_period(model_dirs):
    with make_client(model_dirs["target"]) as c:
        worker = worker_of(c)
        gate = hold_steps(worker)
        results = []
        thread = _post_in_thread(c, results, {**COMPLETION, "max_tokens": 50})
        while worker.load < 1:
            time.sleep(0.01)
        threading.Timer(0.5, gate.set).start()  # the stuck step ends after the grace period
        worker.stop(grace_s=0.2)
        thread.join(timeout=30)
        assert error_of(results[0], 503)["code"] == "shutting_down"
        assert error_of(c.post("/v1/completions", json=COMPLETION), 503)["code"] == "shutting_down"
        assert c.get("/health").status_code == 503
