"""``speclm serve`` as a real process on loopback, driven by the official ``openai`` package:
streaming and not, errors, seeded sampling, a 16-client streaming load test whose every
response must be complete and equal to its solo output, client disconnects, graceful shutdown.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from speclm.api import LLM  # noqa: E402
from speclm.sampling import SamplingParams  # noqa: E402

from speclm.serve.process import serve_process, stop  # noqa: E402

KEY = "test-key"
PROMPTS = ["the quick brown fox", "Speculative decoding drafts tokens", "def add(a, b):",
           "the lazy dog. the lazy dog.", "naïve café", "héllo wörld and more"]


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    args = ["--model", str(model_dirs["target"]), "--dtype", "float64", "--served-model-name", "tiny",
            "--api-key", KEY, "--max-batch", "16", "--max-queue", "32"]
    with serve_process(args, tmp_path_factory.mktemp("logs")) as srv:
        yield srv


@pytest.fixture(scope="module")
def solo(model_dirs):
    return LLM(str(model_dirs["target"]), "ngram", 10, dtype="float64")


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0)


def greedy(solo, prompt, max_tokens, chat=False):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if chat:
        return solo.chat([{"role": "user", "content": prompt}], params, speculative=False).text
    return solo.generate(prompt, params, speculative=False)[0].text


EXTRA = {"ignore_eos": True}  # tiny random models rarely say EOS; fixed lengths are checkable


def test_non_streaming(client, solo):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=12, temperature=0, extra_body=EXTRA)
    assert chat.choices[0].message.content == greedy(solo, PROMPTS[0], 12, chat=True)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens > 0
    spec = chat.model_extra["speclm"]
    assert spec["drafter"] == "ngram[2..3]" and spec["target_forwards"] >= 1
    comp = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                     extra_body=EXTRA)
    assert comp.choices[0].text == greedy(solo, PROMPTS[3], 16)
    assert comp.usage.total_tokens == comp.usage.prompt_tokens + 16


def test_streaming(client, solo):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=20,
        temperature=0, stream=True, stream_options={"include_usage": True}, extra_body=EXTRA)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(solo, PROMPTS[1], 20, chat=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=15, temperature=0,
                                       stream=True, extra_body=EXTRA)
    assert "".join(c.choices[0].text for c in stream) == greedy(solo, PROMPTS[2], 15)


def test_errors_through_the_client(server, client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=5)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed


def test_seeded_sampling_is_reproducible_and_is_the_solo_output(client, solo):
    kwargs = dict(model="tiny", prompt=PROMPTS[3], max_tokens=24, temperature=0.8, seed=11,
                  extra_body=EXTRA)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    params = SamplingParams(temperature=0.8, max_tokens=24, seed=11, ignore_eos=True)
    assert first == second == solo.generate(PROMPTS[3], params)[0].text


def test_load_16_concurrent_streaming_clients(server, solo):
    """16 clients stream requests back to back for a bounded time: no errors, every response
    complete and equal to the same request run alone."""
    cases = [(p, 8 + 6 * (i % 4), i % 2 == 0) for i, p in enumerate(PROMPTS)]
    expected = {(p, m, c): greedy(solo, p, m, chat=c) for p, m, c in cases}
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0)
    errors, done = [], []

    async def one_client(index: int, deadline: float):
        i = index
        while time.monotonic() < deadline:
            prompt, max_tokens, chat = cases[i % len(cases)]
            i += 1
            try:
                if chat:
                    stream = await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": prompt}],
                        max_tokens=max_tokens, temperature=0, stream=True, extra_body=EXTRA)
                    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
                else:
                    stream = await client.completions.create(
                        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                        stream=True, extra_body=EXTRA)
                    pieces = [c.choices[0].text async for c in stream]
                done.append(((prompt, max_tokens, chat), "".join(pieces)))
            except Exception as exc:  # any error fails the test below
                errors.append(repr(exc))

    async def main():
        deadline = time.monotonic() + 8.0
        await asyncio.wait_for(asyncio.gather(*(one_client(i, deadline) for i in range(16))), 120)
        await client.close()

    asyncio.run(main())
    assert errors == []
    assert len(done) >= 16
    wrong = [(case, text) for case, text in done if text != expected[case]]
    assert wrong == []
    metrics = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    batch_sum = float(metrics.split("speclm_batch_size_sum ")[1].split()[0])
    batch_count = float(metrics.split("speclm_batch_size_count ")[1].split()[0])
    assert batch_sum / batch_count > 2  # requests really were decoded together


def test_client_disconnect_frees_its_row(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 240, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        # the connection is closed mid-stream; the server must notice and free the row (the
        # request leaves at once; the running gauge follows at the engine's next step)
        deadline = time.monotonic() + 20

        def freed() -> bool:
            return (http.get("/health").json()["load"] == 0
                    and "speclm_running_requests 0.0" in http.get("/metrics").text)

        while not freed() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http.get("/health").json()["load"] == 0
        assert "speclm_running_requests 0.0" in http.get("/metrics").text


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[str]]:
    """POST a streaming request from a thread; returns once its first line has arrived, with the
    thread and the list its lines are appended to."""
    lines, started = [], threading.Event()

    def consume():
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(30)
    return reader, lines


def test_graceful_shutdown_finishes_in_flight_streams(model_dirs, tmp_path):
    args = ["--model", str(model_dirs["target"]), "--dtype", "float64", "--shutdown-timeout", "30"]
    with serve_process(args, tmp_path) as srv:
        body = {"model": model_dirs["target"].name, "prompt": PROMPTS[0], "max_tokens": 200,
                "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        reader, lines = _stream_in_thread(f"{srv.url}/v1/completions", body)
        code = stop(srv.proc, timeout=60)  # SIGTERM while the stream is running
        reader.join(timeout=30)
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-3]
        assert '"completion_tokens":200' in events[-2]  # every token arrived
        # uvicorn re-raises the signal once it has shut down cleanly
        assert code in (0, -signal.SIGTERM), srv.output()
        assert "Traceback" not in srv.output()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health", timeout=2)


def test_shutdown_ends_streams_that_outlive_the_grace_period(tiny_tokenizer, tmp_path):
    """SIGTERM during a long stream: new requests get 503 at once, and after the grace period
    the stream ends with an error event and [DONE] (it used to be cut mid-body, with a
    CancelledError traceback in the log)."""
    import json

    from tests.conftest import _save, tiny_model

    folder = _save(tmp_path / "long", tiny_model(len(tiny_tokenizer), seed=0, max_positions=4096),
                   tiny_tokenizer)
    args = ["--model", str(folder), "--dtype", "float64", "--shutdown-timeout", "1", "--no-spec"]
    with serve_process(args, tmp_path) as srv:
        body = {"model": "long", "prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0,
                "stream": True, "ignore_eos": True}
        reader, lines = _stream_in_thread(f"{srv.url}/v1/completions", body)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.4)  # the server is draining now
        late = httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2},
                          timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
        code = stop(srv.proc, timeout=60)
        reader.join(timeout=30)
        events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == "shutting_down"
        assert code in (0, -signal.SIGTERM), srv.output()
        assert "Traceback" not in srv.output() and "CancelledError" not in srv.output()
