"""Throughput and time to first token of ``speclm serve`` at 1, 4 and 16 concurrent clients,
with speculation on (prompt lookup, adaptive K) and off (``--no-spec``), measured in one run.

Two servers run side by side on the same model (only the one being measured is busy); the
phases are interleaved (on/off order alternates per round) so that drifting machine load hits
both alike. Each client streams chat completions back to back through the official ``openai``
client; tokens/s is all completion tokens over the phase's wall time, TTFT is measured per
request at the client (request sent -> first content chunk). The server's /metrics give the
mean draft cap per step and the share of steps the policy ran plain.

    python benchmarks/serve_load.py --rounds 3 --max-tokens 48 [--backend llamacpp] [--drafter ngram] \
        --out results/serve_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from speclm.prompts import DEFAULT_PROMPTS, load_prompts, spread
from speclm.serve.process import serve_process

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def spec_figures(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {k: metric(text, k) for k in (
        "speclm_spec_draft_length_per_step_sum", "speclm_spec_draft_length_per_step_count",
        "speclm_spec_off_steps_total", "speclm_spec_drafted_tokens_total",
        "speclm_spec_accepted_tokens_total", "speclm_batch_size_sum", "speclm_batch_size_count")}


async def run_phase(url: str, prompts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    queue = list(range(requests))
    ttfts, tokens, errors = [], [], []

    async def worker():
        while queue:
            i = queue.pop()
            sent = time.perf_counter()
            first = None
            try:
                stream = await client.chat.completions.create(
                    model="default", messages=[{"role": "user", "content": prompts[i % len(prompts)]}],
                    max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True})
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - sent
                    if chunk.usage is not None:
                        tokens.append(chunk.usage.completion_tokens)
            except Exception as exc:
                errors.append(repr(exc))
            if first is not None:
                ttfts.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    ttfts.sort()
    return {"clients": clients, "requests": requests, "tokens": sum(tokens), "wall_s": wall,
            "tok_s": sum(tokens) / wall, "ttft_median_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="auto", help="the servers' --backend (default: %(default)s)")
    ap.add_argument("--drafter", help="the speculative server's --drafter (default: the server's)")
    ap.add_argument("--clients", default="1,4,16", help="concurrency levels (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=3, help="at least this many per phase")
    ap.add_argument("--prompts", default=str(SPEC_BENCH) if SPEC_BENCH.is_file() else str(DEFAULT_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--out", help="write the raw results as JSON here")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    prompts = [row["turns"][0] for row in spread(load_prompts(args.prompts), args.num_prompts)]
    logs = Path(tempfile.mkdtemp(prefix="serve_load-"))
    common = ["--model", args.model, "--backend", args.backend, "--max-batch", str(max(levels)),
              "--log-level", "warning"]
    spec_args = common + (["--drafter", args.drafter] if args.drafter else [])
    results = []
    with serve_process(spec_args, logs, threads=None) as spec, \
            serve_process(common + ["--no-spec"], logs, threads=None) as plain:
        servers = {"spec": spec.url, "plain": plain.url}
        for url in servers.values():  # warm-up: first-use costs out of the way
            asyncio.run(run_phase(url, prompts, 2, 2, 8))
        for rnd in range(args.rounds):
            for clients in levels:
                order = ["spec", "plain"] if (rnd + clients) % 2 == 0 else ["plain", "spec"]
                for mode in order:
                    before = spec_figures(servers[mode])
                    n = max(args.min_requests, clients * args.requests_per_client)
                    row = asyncio.run(run_phase(servers[mode], prompts, clients, n, args.max_tokens))
                    after = spec_figures(servers[mode])
                    delta = {k: after[k] - before[k] for k in after}
                    steps = delta["speclm_spec_draft_length_per_step_count"]
                    row.update(mode=mode, round=rnd,
                               mean_batch=delta["speclm_batch_size_sum"] / max(1, delta["speclm_batch_size_count"]),
                               mean_draft_cap=delta["speclm_spec_draft_length_per_step_sum"] / steps if steps else 0.0,
                               plain_step_share=delta["speclm_spec_off_steps_total"] / steps if steps else 0.0,
                               alpha=delta["speclm_spec_accepted_tokens_total"] / delta["speclm_spec_drafted_tokens_total"]
                               if delta["speclm_spec_drafted_tokens_total"] else 0.0)
                    results.append(row)
                    print(f"round {rnd} clients {clients:2d} {mode:5s}: {row['tok_s']:6.1f} tok/s, "
                          f"TTFT median {row['ttft_median_s']:.2f} s p95 {row['ttft_p95_s']:.2f} s, "
                          f"batch {row['mean_batch']:.1f}, K {row['mean_draft_cap']:.1f}, "
                          f"errors {len(row['errors'])}", file=sys.stderr, flush=True)
    print(table(results, levels))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 1 if any(r["errors"] for r in results) else 0


def table(results: list[dict], levels: list[int]) -> str:
    """Medians over rounds, per concurrency level and mode."""
    lines = ["| clients | speculation | tokens/s | TTFT median (s) | TTFT p95 (s) | mean batch | "
             "mean K | plain-step share | alpha | tok/s on/off |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for clients in levels:
        med = {}
        for mode in ("spec", "plain"):
            rows = [r for r in results if r["clients"] == clients and r["mode"] == mode]
            med[mode] = {k: statistics.median(r[k] for r in rows) for k in (
                "tok_s", "ttft_median_s", "ttft_p95_s", "mean_batch", "mean_draft_cap",
                "plain_step_share", "alpha")}
        for mode in ("spec", "plain"):
            m = med[mode]
            ratio = f"{med['spec']['tok_s'] / med['plain']['tok_s']:.2f}x" if mode == "spec" else ""
            spec_cols = (f"{m['mean_draft_cap']:.1f} | {m['plain_step_share']:.0%} | {m['alpha']:.2f}"
                         if mode == "spec" else "– | – | –")
            lines.append(f"| {clients} | {'on' if mode == 'spec' else 'off'} | {m['tok_s']:.1f} | "
                         f"{m['ttft_median_s']:.2f} | {m['ttft_p95_s']:.2f} | {m['mean_batch']:.1f} | "
                         f"{spec_cols} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
