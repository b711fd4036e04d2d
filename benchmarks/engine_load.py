"""The server's engine under N concurrent requests, without HTTP: a drafting server vs ``--no-spec``.

Builds both engines as ``speclm serve`` does (speclm.serve.build), keeps ``--clients`` requests
in each (a finished one is replaced at once, as a client sending its next request would), and
runs the phases interleaved, alternating which goes first. Prints tokens/s per phase, the ratio
per round and of the medians, how the steps were spent (rows x draft cap, drafting and verify
seconds) and checks that both engines produced the same tokens (greedy).

Without the HTTP layer and the client processes, this isolates what the engine and its batch
policy do at a concurrency; ``benchmarks/serve_load.py`` measures the whole server.

    python benchmarks/engine_load.py --model <gemma-3-270m-q4_k_m.gguf> --drafter quant:bits=8,vocab=65536 \\
        --prompts SHORT.jsonl --clients 16 --requests 48 --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from speclm import SamplingParams
from speclm.errors import SpeclmError
from speclm.models.quantize import CHOICES
from speclm.prompts import load_prompts, spread
from speclm.serve.build import ServeOptions, build_engine


def run_phase(llm, engine, prompts: list[str], clients: int, requests: int, max_tokens: int,
              chat: bool = False) -> dict:
    """``requests`` greedy requests, ``clients`` at a time, through ``engine`` until done;
    ``chat``: each prompt a user turn in the model's chat template (as the server's chat
    endpoint renders it), else the text as it is."""
    todo = [llm.encode([{"role": "user", "content": prompts[i % len(prompts)]}] if chat
                       else prompts[i % len(prompts)]) for i in range(requests)]
    tokens: dict[str, list[int]] = {}
    steps: collections.Counter = collections.Counter()  # (rows, draft cap) -> steps
    draft_s = verify_s = 0.0
    added = 0

    def add() -> None:
        nonlocal added
        engine.add(str(added), todo[added], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        tokens[str(added)] = []
        added += 1

    while added < min(clients, requests):
        add()
    start = time.perf_counter()
    while engine.has_work:
        outputs, report = engine.step()
        if report.batch_size:
            steps[report.batch_size, report.draft_cap] += 1
            draft_s += report.draft_s
            verify_s += report.decode_s
        for out in outputs:
            tokens[out.request_id] += out.step.tokens
            if out.step.finish_reason is not None and added < requests:
                add()
    seconds = time.perf_counter() - start
    count = sum(len(t) for t in tokens.values())
    return {"rate": count / seconds, "tokens": tokens, "count": count, "steps": steps, "draft_s": draft_s,
            "verify_s": verify_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "llamacpp"],
                    help="both engines' --backend (default: %(default)s)")
    ap.add_argument("--compile", action="store_true", help="both engines on the compiled static-cache path")
    ap.add_argument("--quantize", choices=CHOICES, default=None, help="both engines' --quantize")
    ap.add_argument("--drafter", default="ngram", help="the drafting engine's --drafter (default: %(default)s)")
    ap.add_argument("--prompts", required=True, help="JSON lines with a 'prompt' or Spec-Bench 'turns' field")
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts spread over the file's categories")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48, help="requests a phase")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds, after one warm-up round")
    ap.add_argument("--chat", action="store_true",
                    help="send each prompt as a user turn in the model's chat template (what "
                         "benchmarks/serve_load.py's chat requests get); default: the text as it is")
    args = ap.parse_args()
    if min(args.clients, args.requests, args.rounds, args.max_tokens) < 1:
        raise SystemExit("--clients, --requests, --rounds and --max-tokens must be >= 1")
    try:
        prompts = [row["turns"][0] if "turns" in row else row["prompt"]
                   for row in spread(load_prompts(args.prompts), args.num_prompts)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--prompts {args.prompts}: not a readable JSON-lines prompts file ({exc})") from None
    if not prompts:
        raise SystemExit(f"--prompts {args.prompts}: no prompts")
    target = dict(model=args.model, backend=args.backend, compile=args.compile, quantize=args.quantize,
                  max_batch=args.clients)
    configs = {"spec": ServeOptions(drafter=args.drafter, **target),
               "off": ServeOptions(speculative=False, **target)}
    built = {}
    for name, opts in configs.items():
        try:
            opts.check()
            built[name] = build_engine(opts)
        except SpeclmError as exc:
            raise SystemExit(f"{name}: {exc}") from None
    if args.chat:
        try:
            built["off"][0].encode([{"role": "user", "content": prompts[0]}])
        except SpeclmError as exc:
            raise SystemExit(f"--chat: {exc}") from None
    rates: dict[str, list[float]] = {name: [] for name in configs}
    first: dict[str, dict] = {}
    for r in range(args.rounds + 1):  # round 0 warms up (and lets the batch policy learn)
        for name in (["off", "spec"] if r % 2 == 0 else ["spec", "off"]):
            phase = run_phase(*built[name], prompts, args.clients, args.requests, args.max_tokens, args.chat)
            first.setdefault(name, phase)
            label = "warm-up" if r == 0 else f"round {r}"
            print(f"{label} {name:4}: {phase['rate']:6.2f} tok/s, {phase['count']} tokens, drafting "
                  f"{phase['draft_s']:.1f} s, verify {phase['verify_s']:.1f} s, steps (rows, cap): "
                  f"{sorted(phase['steps'].items())}", flush=True)
            if r:
                rates[name].append(phase["rate"])
    ratios = [s / o for s, o in zip(rates["spec"], rates["off"])]
    print(f"spec / off per round: {', '.join(f'{x:.2f}x' for x in ratios)}; medians "
          f"{statistics.median(rates['spec']):.2f} / {statistics.median(rates['off']):.2f} tok/s = "
          f"{statistics.median(rates['spec']) / statistics.median(rates['off']):.2f}x")
    same = sum(first["spec"]["tokens"][k] == first["off"]["tokens"][k] for k in first["off"]["tokens"])
    print(f"identical outputs: {same}/{len(first['off']['tokens'])}")


if __name__ == "__main__":
    main()
