"""benchmarks/serve_load.py's own logic: server specs refused in one line, the table's medians
and ratios (the servers themselves are exercised by the benchmark, not here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_server_specs_name_a_program_and_keep_its_flags(serve_load):
    assert serve_load.parse_server("on=speclm --backend llamacpp --drafter ngram:k=4") == (
        "on", "speclm", ["--backend", "llamacpp", "--drafter", "ngram:k=4"])
    assert serve_load.parse_server("ls ngram=llama-server --spec-type 'ngram-simple'") == (
        "ls ngram", "llama-server", ["--spec-type", "ngram-simple"])
    for bad in ("speclm --no-spec", "x=vllm serve", "=speclm", "x="):
        with pytest.raises(SystemExit, match="LABEL=PROGRAM"):
            serve_load.parse_server(bad)


def _row(server, clients, tok_s, speclm=True):
    row = dict(server=server, clients=clients, tok_s=tok_s, ttft_median_s=0.5, ttft_p95_s=1.0)
    if speclm:
        row.update(mean_batch=1.0, mean_draft_cap=2.0, plain_step_share=0.25, alpha=0.5)
    return row


def test_table_takes_medians_over_rounds_and_divides_by_the_reference(serve_load):
    results = [_row("on", 1, t) for t in (10.0, 30.0, 20.0)] + [
        _row("peer", 1, t, speclm=False) for t in (8.0, 12.0, 10.0)]
    text = serve_load.table(results, [1], ["on", "peer"], "peer")
    on, peer = text.splitlines()[2:]
    assert on.startswith("| 1 | on | 20.0 | 2.00x |") and "| 1.0 | 2.0 | 25% | 0.50 |" in on
    assert peer.startswith("| 1 | peer | 10.0 | 1.00x |") and peer.endswith("| – | – | – | – |")
