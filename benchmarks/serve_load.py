"""Throughput and time to first token of OpenAI-compatible servers at 1, 4 and 16 concurrent
clients: ``speclm serve`` with speculation on and off, and the peers a CPU user would run instead on
the same GGUF, llama.cpp's own C++ ``llama-server`` (continuous batching, its own n-gram or
draft-model speculation) and llama-cpp-python's ``python -m llama_cpp.server``, all in one run.

Every server runs side by side for the whole run (only the one being measured is busy). The phases
are interleaved: for each round and concurrency level every server takes its turn, in an order
that rotates per round, so that drifting machine load hits all alike. Each client streams chat
completions back to back through the official ``openai`` client, greedy; tokens/s is all
completion tokens over the phase's wall time, TTFT is measured per request at the client (request
sent -> first content chunk). Steady tokens/s counts only the window in which every client had a
stream running (from the moment the first requests all streamed to the moment the first client
found no request left): a phase is a fixed wave of requests, and its ramp-up and tail run fewer
streams than a server under steady load does, which weighs on servers whose streams finish
apart. It needs a few requests per client (``--min-requests``, e.g. 3x the largest client count). speclm's /metrics give the mean batch, the mean draft cap per step,
the share of steps the policy ran plain, and alpha. Prompt caching is off on llama-server
(``cache_prompt: false``), since the same prompts come back every round and speclm caches none.

A server is ``LABEL=PROGRAM FLAGS...``; PROGRAM is ``speclm`` (``speclm serve`` flags), ``llama-server``
(its own flags, e.g. ``--spec-type ngram-simple``; threads, context, batch sizes and slots are
set here) or ``llama-cpp-python``. Without ``--server``: speclm on and off on ``--backend``.

    python benchmarks/serve_load.py --rounds 3 --max-tokens 48 \\
        --server 'speclm on=speclm --backend llamacpp' \\
        --server 'speclm off=speclm --backend llamacpp --no-spec' \\
        --server 'llama-server=llama-server' \\
        --server 'llama-server ngram=llama-server --spec-type ngram-simple' \\
        --server 'llama-cpp-python=llama-cpp-python' --reference 'speclm off' --out serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai

from speclm.prompts import DEFAULT_PROMPTS, load_prompts, spread
from speclm.serve.process import free_port, serve_process, stop, wait_ready

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
PROGRAMS = ("speclm", "llama-server", "llama-cpp-python")
CONTEXT_PER_SLOT = 4096


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


SPECLM_METRICS = ("speclm_spec_draft_length_per_step_sum", "speclm_spec_draft_length_per_step_count",
                  "speclm_spec_off_steps_total", "speclm_spec_drafted_tokens_total",
                  "speclm_spec_accepted_tokens_total", "speclm_batch_size_sum", "speclm_batch_size_count")


def spec_figures(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {k: metric(text, k) for k in SPECLM_METRICS}


class TokenCounter:
    """Completion tokens of a reply whose stream carries no usage (llama_cpp.server): the text
    tokenized again by the GGUF's own tokenizer, as serving benchmarks do."""

    def __init__(self, gguf: Path) -> None:
        self.gguf, self._vocab = gguf, None

    def __call__(self, text: str) -> int:
        if self._vocab is None:
            from llama_cpp import Llama

            self._vocab = Llama(str(self.gguf), vocab_only=True, verbose=False)
        return len(self._vocab.tokenize(text.encode(), add_bos=False, special=True))


async def run_phase(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
                    extra_body: dict, count_tokens: TokenCounter, endpoint: str = "chat") -> dict:
    """One phase: ``clients`` concurrent streams, ``requests`` in all. ``endpoint``: ``chat``
    (the prompt as a user turn, through the chat template) or ``completions`` (the prompt as
    plain text, for base models without a chat template)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=900, max_retries=0)
    common = dict(model="default", max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra_body or None)

    def request(prompt: str):
        if endpoint == "completions":
            return client.completions.create(prompt=prompt, **common)
        return client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)

    def content(chunk) -> str | None:
        if not chunk.choices:
            return None
        return chunk.choices[0].text if endpoint == "completions" else chunk.choices[0].delta.content

    queue = list(range(requests))
    ttfts, tokens, errors, streams, exits = [], [], [], [], []

    async def worker():
        while queue:
            i = queue.pop()
            sent = time.perf_counter()
            first, usage, text, chunks = None, None, [], []
            try:
                stream = await request(prompts[i % len(prompts)])
                async for chunk in stream:
                    piece = content(chunk)
                    if piece:
                        now = time.perf_counter()
                        if first is None:
                            first = now - sent
                        text.append(piece)
                        chunks.append((now, len(piece)))
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                tokens.append(usage if usage is not None else count_tokens("".join(text)))
                streams.append((sent, tokens[-1], chunks))
            except Exception as exc:
                errors.append(repr(exc))
            if first is not None:
                ttfts.append(first)
        exits.append(time.perf_counter())  # from now on fewer than ``clients`` streams run

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    ttfts = sorted(ttfts) or [float("nan")]
    return {"clients": clients, "requests": requests, "tokens": sum(tokens), "wall_s": wall,
            "tok_s": sum(tokens) / wall, "steady_tok_s": float("nan") if errors else steady_rate(streams, clients, min(exits)),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "errors": errors}


def steady_rate(streams: list[tuple[float, int, list[tuple[float, int]]]], clients: int, end: float) -> float:
    """Tokens/s while all ``clients`` streams ran: from the moment the first ``clients`` requests
    had all begun streaming to the moment the first client found no request left (a phase's
    ramp-up and its tail, where fewer streams run, left out; a server under steady load sees
    neither). ``streams``: (sent time, completion tokens, [(chunk time, characters)]) per request;
    a request's tokens are spread over its chunks by their characters. NaN where the phase had
    no such window (too few requests for its clients; a failed request makes the phase NaN too,
    its caller's check). A request that streamed no text (an end-of-sequence token first) held
    its client for no time and is passed over."""
    ordered = sorted((s for s in streams if s[2]), key=lambda s: s[0])[:clients]
    if len(ordered) < clients:
        return float("nan")
    begin = max(chunks[0][0] for _, _, chunks in ordered)
    if end <= begin:
        return float("nan")
    inside = 0.0
    for _, count, chunks in streams:
        chars = sum(n for _, n in chunks)
        if chars:
            inside += count * sum(n for t, n in chunks if begin <= t <= end) / chars
    return inside / (end - begin)


@contextmanager
def llama_cpp_python_server(gguf: Path, log_dir: Path, threads: int, ready_timeout: float = 120.0):
    """``python -m llama_cpp.server`` on the GGUF, until it stops. It answers one request at a time
    (the others wait on its lock); by default a new request would cancel the running one, which
    no serving comparison wants, so that is switched off."""
    port = free_port()
    log = log_dir / f"llama-cpp-python-{port}.log"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
               "--n_ctx", str(CONTEXT_PER_SLOT), "--n_batch", "512", "--verbose", "False",
               "--interrupt_requests", "False"]  # its default: a new request cancels the running one
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{url}/v1/models", lambda: log.read_text(errors="replace")[-2000:], ready_timeout,
                   name="llama_cpp.server (is speclm's [peers] extra installed?)", error=SystemExit)
        yield url
    finally:
        stop(proc)


def parse_server(text: str) -> tuple[str, str, list[str]]:
    label, sep, command = text.partition("=")
    words = shlex.split(command)
    if not sep or not label.strip() or not words or words[0] not in PROGRAMS:
        raise SystemExit(f"--server {text!r}: expected LABEL=PROGRAM FLAGS..., PROGRAM one of {', '.join(PROGRAMS)}")
    return label.strip(), words[0], words[1:]


def start_servers(stack: ExitStack, servers: list[tuple[str, str, list[str]]], args, logs: Path) -> dict:
    """label -> (url, program); every server started before any is measured."""
    from speclm.bench.llama_server import LlamaServerProcess
    from speclm.models.llamacpp import LlamaCppModel
    from speclm.models.loading import find_gguf

    gguf = find_gguf(args.model)
    slots = max(args.levels)
    threads = LlamaCppModel.default_threads()
    started = {}
    for label, program, flags in servers:
        if program == "speclm":
            server = stack.enter_context(serve_process(
                ["--model", args.model, "--served-model-name", "default", "--max-batch", str(slots),
                 "--log-level", "warning", *flags],
                logs, threads=None, ready_timeout=args.ready_timeout))
            url = server.url
        elif program == "llama-server":
            url = stack.enter_context(LlamaServerProcess(gguf, flags, parallel=slots, n_ctx=CONTEXT_PER_SLOT)).url
        else:
            url = stack.enter_context(llama_cpp_python_server(gguf, logs, threads))
        started[label] = (url, program)
        print(f"started {label}: {program} {shlex.join(flags)} at {url}", file=sys.stderr, flush=True)
    return started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="default")
    ap.add_argument("--server", action="append", default=[], metavar="LABEL=PROGRAM FLAGS",
                    help="a server to measure (repeatable; see below)")
    ap.add_argument("--reference", help="the server the ratio column divides by (default: the last speclm "
                                        "server, which without --server is --no-spec)")
    ap.add_argument("--backend", default="auto", help="without --server: the speclm servers' --backend")
    ap.add_argument("--drafter", help="without --server: the speculative server's --drafter")
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                    help="chat completions (the prompt as a user turn) or completions (plain text: "
                         "base models without a chat template, e.g. Gemma-3-270M)")
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=3, help="at least this many per phase")
    ap.add_argument("--prompts", default=str(SPEC_BENCH) if SPEC_BENCH.is_file() else str(DEFAULT_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--ready-timeout", type=float, default=1800.0,
                    help="seconds a server may take to start, compiling included (a compiled speclm server's "
                         "first start on a 2-core CPU compiles ~25 graphs: about 20 minutes)")
    ap.add_argument("--out", help="write the raw results as JSON here")
    args = ap.parse_args()
    args.levels = [int(c) for c in args.clients.split(",")]
    servers = [parse_server(s) for s in args.server] or [
        ("spec", "speclm", ["--backend", args.backend] + (["--drafter", args.drafter] if args.drafter else [])),
        ("plain", "speclm", ["--backend", args.backend, "--no-spec"])]
    labels = [label for label, _, _ in servers]
    if len(set(labels)) != len(labels):
        raise SystemExit("--server labels must differ")
    reference = args.reference or ([label for label, program, _ in servers if program == "speclm"] or labels)[-1]
    if reference not in labels:
        raise SystemExit(f"--reference {reference!r} is not a server label")
    prompts = [row["turns"][0] for row in spread(load_prompts(args.prompts), args.num_prompts)]
    logs = Path(tempfile.mkdtemp(prefix="serve_load-"))
    results = []
    with ExitStack() as stack:
        started = start_servers(stack, servers, args, logs)
        from speclm.models.loading import find_gguf

        count_tokens = TokenCounter(find_gguf(args.model))
        extra = {label: {"cache_prompt": False} if program == "llama-server" else {}
                 for label, (_, program) in started.items()}
        for label, (url, _) in started.items():  # warm-up: first-use costs out of the way
            asyncio.run(run_phase(url, prompts, 2, 2, 8, extra[label], count_tokens, args.endpoint))
        for rnd in range(args.rounds):
            for clients in args.levels:
                shift = (rnd + clients) % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    url, program = started[label]
                    before = spec_figures(url) if program == "speclm" else None
                    n = max(args.min_requests, clients * args.requests_per_client)
                    row = asyncio.run(run_phase(url, prompts, clients, n, args.max_tokens, extra[label],
                                                count_tokens, args.endpoint))
                    row.update(server=label, program=program, round=rnd)
                    if before is not None:
                        after = spec_figures(url)
                        d = {k: after[k] - before[k] for k in after}
                        steps = d["speclm_spec_draft_length_per_step_count"]
                        row.update(
                            mean_batch=d["speclm_batch_size_sum"] / max(1, d["speclm_batch_size_count"]),
                            mean_draft_cap=d["speclm_spec_draft_length_per_step_sum"] / steps if steps else 0.0,
                            plain_step_share=d["speclm_spec_off_steps_total"] / steps if steps else 0.0,
                            alpha=d["speclm_spec_accepted_tokens_total"] / d["speclm_spec_drafted_tokens_total"]
                            if d["speclm_spec_drafted_tokens_total"] else 0.0)
                    results.append(row)
                    print(f"round {rnd} clients {clients:2d} {label:18s}: {row['tok_s']:6.1f} tok/s "
                          f"(steady {row['steady_tok_s']:6.1f}), "
                          f"TTFT median {row['ttft_median_s']:.2f} s p95 {row['ttft_p95_s']:.2f} s, "
                          f"{row['tokens']} tokens, errors {len(row['errors'])}", file=sys.stderr, flush=True)
    print(table(results, args.levels, labels, reference))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "servers": servers, "cpu": cpu_name(),
                                              "results": results}, indent=1))
    return 1 if any(r["errors"] for r in results) else 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return "unknown"


def _median(values: list[float]) -> float:
    """The median of the values that are numbers (a phase with no steady window gives NaN)."""
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def table(results: list[dict], levels: list[int], labels: list[str], reference: str) -> str:
    """Medians over rounds, per concurrency level and server; the ratio is of medians."""
    lines = [f"| clients | server | tokens/s | vs {reference} | steady tokens/s | vs {reference} | TTFT median (s) | "
             "TTFT p95 (s) | mean batch | mean K | plain-step share | alpha |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for clients in levels:
        med = {}
        for label in labels:
            rows = [r for r in results if r["clients"] == clients and r["server"] == label]
            med[label] = {k: _median([r[k] for r in rows]) if k in rows[0] else None for k in (
                "tok_s", "steady_tok_s", "ttft_median_s", "ttft_p95_s", "mean_batch", "mean_draft_cap",
                "plain_step_share", "alpha")}
        for label in labels:
            m = med[label]
            ratio = m["tok_s"] / med[reference]["tok_s"] if med[reference]["tok_s"] else float("nan")
            steady = (m["steady_tok_s"] or float("nan"), med[reference]["steady_tok_s"] or float("nan"))
            speclm = (f"{m['mean_batch']:.1f} | {m['mean_draft_cap']:.1f} | {m['plain_step_share']:.0%} | "
                      f"{m['alpha']:.2f}" if m["mean_batch"] is not None else "– | – | – | –")
            window = (f"{steady[0]:.1f} | {steady[0] / steady[1]:.2f}x" if steady[0] == steady[0] and steady[1] == steady[1]
                      else (f"{steady[0]:.1f}" if steady[0] == steady[0] else "–") + " | –")  # NaN: no window
            lines.append(f"| {clients} | {label} | {m['tok_s']:.1f} | {ratio:.2f}x | {window} | "
                         f"{m['ttft_median_s']:.2f} | "
                         f"{m['ttft_p95_s']:.2f} | {speclm} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
