"""benchmarks/serve_load.py's own logic: server specs refused in one line, the table's medians
and ratios (the servers themselves are exercised by the benchmark, not here)."""

from __future__ import annotations

import pytest

from .conftest import load_benchmark


@pytest.fixture(scope="module")
def serve_load():
    return load_benchmark("serve_load")


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


def test_the_steady_rate_counts_only_while_every_client_streams(serve_load):
    # two clients; the second request starts streaming at t=2, the first client runs out at t=6
    streams = [(0.0, 10, [(1.0 + t, 1) for t in range(10)]),  # chunks at 1..10, one char each
               (0.5, 4, [(2.0, 2), (4.0, 2)]),                 # 4 tokens over 4 chars, all inside
               (9.0, 6, [(9.5, 6)])]                           # after the window
    # inside [2, 6]: 5 of the first request's 10 chars (5 tokens) and all 4 of the second's
    assert serve_load.steady_rate(streams, 2, 6.0) == pytest.approx(9 / 4)
    assert serve_load.steady_rate(streams, 2, 1.5) != serve_load.steady_rate(streams, 2, 1.5)  # NaN: no window
    assert serve_load.steady_rate(streams[:1], 2, 6.0) != serve_load.steady_rate(streams[:1], 2, 6.0)
    # a request that streamed no text (end of sequence first) does not hold the window shut
    empty = [(0.2, 1, [])]
    assert serve_load.steady_rate(streams + empty, 2, 6.0) == pytest.approx(9 / 4)


def test_the_steady_column_divides_medians_and_skips_phases_without_a_window(serve_load):
    results = [dict(_row("on", 4, 10.0), steady_tok_s=v) for v in (12.0, float("nan"), 14.0)] + [
        dict(_row("off", 4, 10.0), steady_tok_s=v) for v in (10.0, 10.0, 13.0)]
    on = serve_load.table(results, [4], ["on", "off"], "off").splitlines()[2]
    assert on.startswith("| 4 | on | 10.0 | 1.00x | 13.0 | 1.30x |")
    # no phase of a server had a window: its steady cells say so instead of printing nan
    results = [dict(_row(label, 16, 10.0), steady_tok_s=float("nan")) for label in ("on", "off")]
    on = serve_load.table(results, [16], ["on", "off"], "off").splitlines()[2]
    assert on.startswith("| 16 | on | 10.0 | 1.00x | – | – |") and "nan" not in on
