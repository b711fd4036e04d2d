"""The bench's llama-server peer: method specs, the process and request protocol, and the real server.

The protocol is checked against a stand-in server (a small Python script named by
``$SPECLM_LLAMA_SERVER``) that records what it was sent; the real ``llama-server`` (built by
scripts/build-llama-server.sh) must match llama.cpp's own plain decoding token for token on the
default model, and is skipped where it was never built.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import urllib.request

import pytest

from speclm import SamplingParams
from speclm.bench.llama_server import LlamaServerPeer, LlamaServerProcess, server_args, server_binary
from speclm.bench.methods import parse_method
from speclm.errors import SpeclmError

FAKE = textwrap.dedent("""\
    #!{python}
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    if "--crash" in open("{mode}").read():
        print("error: cannot load model"); sys.exit(3)
    port = int(args[args.index("--port") + 1])
    open("{record}", "a").write(json.dumps(dict(argv=args)) + "\\n")
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self._send(dict(status="ok"))
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            open("{record}", "a").write(json.dumps(dict(body=body)) + "\\n")
            tokens = [t + 1 for t in body["prompt"][-3:]] + [2]  # ends on the end token 2
            self._send(dict(tokens=tokens, stop_type="eos", timings=dict(draft_n=5, draft_n_accepted=4)))
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    record, mode = tmp_path / "record.jsonl", tmp_path / "mode"
    mode.write_text("")
    script = tmp_path / "llama-server"
    script.write_text(FAKE.format(python=sys.executable, record=record, mode=mode))
    script.chmod(0o755)
    monkeypatch.setenv("SPECLM_LLAMA_SERVER", str(script))
    return record, mode


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_method_specs_map_to_server_flags():
    spec = parse_method("llama-server:spec=ngram-simple,k=8,ngram=3")
    assert server_args(spec.options) == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "8",
                                         "--spec-ngram-simple-size-n", "3"]
    assert server_args(parse_method("llama-server").options) == []
    mod = server_args(parse_method("llama-server:spec=ngram-mod,k=6").options)
    assert mod[-2:] == ["--spec-ngram-mod-n-min", "1"]  # its own minimum of 48 would never draft 6
    assert parse_method("llama-server:spec=ngram-mod,k=6").is_peer


@pytest.mark.parametrize("text, words", [
    ("llama-server:spec=ngram-bogus", "unknown spec"),
    ("llama-server:spec=ngram-cache,k=4", "takes no k="),
    ("llama-server:spec=draft-simple", "draft=PATH"),
    ("llama-server:k=0", "k must be >= 1"),
    ("llama-server:threads=2", "known key"),
])
def test_bad_method_specs_are_refused_in_one_line(text, words):
    with pytest.raises(SpeclmError, match=words) as err:
        parse_method(text)
    assert "\n" not in str(err.value)


def test_missing_binary_names_the_build_script(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECLM_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("SPECLM_LLAMA_SERVER_CACHE", str(tmp_path))
    pytest.importorskip("llama_cpp")
    with pytest.raises(SpeclmError, match="build-llama-server.sh"):
        server_binary()
    monkeypatch.setenv("SPECLM_LLAMA_SERVER", str(tmp_path / "nothing"))
    with pytest.raises(SpeclmError, match="not an executable"):
        server_binary()


def test_peer_sends_token_ids_greedy_and_reads_tokens_and_counts(fake_server, tmp_path):
    record, _ = fake_server
    peer = LlamaServerPeer(parse_method("llama-server:spec=ngram-simple,k=4"), tmp_path / "m.gguf",
                           frozenset({2}), n_ctx=64)
    try:
        ids, seconds, counts = peer.run([5, 6, 7, 8], SamplingParams(max_tokens=10))
    finally:
        peer.close()
    assert ids == [7, 8, 9, 2] and seconds > 0 and counts == {"drafted": 5, "accepted": 4}
    argv, body = (r for r in _records(record))
    args = argv["argv"]
    assert args[args.index("-m") + 1] == str(tmp_path / "m.gguf") and args[args.index("-np") + 1] == "1"
    assert args[args.index("--spec-type") + 1] == "ngram-simple"
    body = body["body"]
    assert body["prompt"] == [5, 6, 7, 8] and body["n_predict"] == 10 and body["return_tokens"]
    assert body["temperature"] == 0 and body["top_k"] == 1 and body["cache_prompt"] is False
    assert peer.server.proc.poll() is not None  # stopped with the peer


def test_a_serving_process_has_one_context_per_slot_and_stops_on_exit(fake_server, tmp_path):
    record, _ = fake_server
    with LlamaServerProcess(tmp_path / "m.gguf", ["--spec-type", "ngram-simple"], parallel=4, n_ctx=64) as server:
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as reply:
            assert reply.status == 200
    args = _records(record)[0]["argv"]
    assert args[args.index("-np") + 1] == "4" and args[args.index("-c") + 1] == "256"  # 4 slots x 64
    assert args[-2:] == ["--spec-type", "ngram-simple"]
    assert server.proc.poll() is not None


def test_peer_refuses_what_it_cannot_run(fake_server, tmp_path):
    peer = LlamaServerPeer(parse_method("llama-server"), tmp_path / "m.gguf", frozenset({2}), n_ctx=16)
    try:
        with pytest.raises(SpeclmError, match="greedy"):
            peer.run([1, 2], SamplingParams(max_tokens=4, temperature=0.7))
        with pytest.raises(SpeclmError, match="context of 16"):
            peer.run(list(range(10)), SamplingParams(max_tokens=8))
    finally:
        peer.close()


def test_a_server_that_dies_is_reported_with_its_log(fake_server, tmp_path):
    _, mode = fake_server
    mode.write_text("--crash")
    with pytest.raises(SpeclmError, match="exited with 3.*cannot load model"):
        LlamaServerPeer(parse_method("llama-server"), tmp_path / "m.gguf", frozenset({2}))


def _built() -> bool:
    try:
        server_binary()
    except SpeclmError:
        return False
    return True


@pytest.mark.real_model
@pytest.mark.skipif(os.environ.get("SPECLM_LLAMA_SERVER") is None and not _built(),
                    reason="llama-server not built (scripts/build-llama-server.sh)")
def test_real_llama_server_matches_llamacpp_plain():
    from speclm.bench.runner import EnginePool, run_bench

    pool = EnginePool("default", "cpu", ("llamacpp", 0, None, None))
    specs = [parse_method(m) for m in ["llamacpp", "llama-server", "llama-server:spec=ngram-simple,k=4,ngram=2"]]
    prompts = [dict(id=1, category="qa", turns=["Repeat this list twice: red, green, blue, yellow, "
                                                  "purple, orange."])]
    rows = run_bench(pool, specs, prompts, SamplingParams(max_tokens=40), progress=False, baseline="llamacpp")
    by = {r["method"]: r for r in rows}
    assert not any(r.get("error") for r in rows), rows
    assert by["llama-server"]["identical"] and by["llama-server:spec=ngram-simple,k=4,ngram=2"]["identical"]
    assert by["llama-server:spec=ngram-simple,k=4,ngram=2"]["drafted"] > 0
    # the server's speculation is checked against the same server's plain decoding
    assert by["llama-server:spec=ngram-simple,k=4,ngram=2"]["reference"] == "llama-server"
