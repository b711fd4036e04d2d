"""Can the target's verify and the drafter's work overlap on this machine?

Asynchronous drafting (``async=1``) only pays when a verify and draft steps run side by side
at close to their solo speed. This script measures exactly that on the CPU: the target's verify
forward (``--width`` tokens at ``--context``) and the draft model's one-token step, each alone
with all threads, alone with its share of the threads, and both at once on two threads with
their shares (the split speclm's async drafter uses). Medians of ``--reps`` runs.

    python benchmarks/overlap.py --draft ~/.cache/speclm/distilled/<name>-6layers
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from speclm.models import load_model


def _timed(step, reps: int) -> float:
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", required=True, help="draft model folder (e.g. from speclm distill)")
    ap.add_argument("--width", type=int, default=3, help="tokens per verify (K + 1)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    target = load_model(args.model).backend
    draft = load_model(args.draft).backend
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (args.context,), generator=gen)
    target.forward(prompt, 0)
    draft.forward(prompt, 0)
    verify_ids = torch.randint(0, target.vocab_size, (args.width,), generator=gen)
    draft_id = prompt[-1:]

    def verify() -> None:
        target.forward(verify_ids, args.context, num_logits=args.width)
        target.rollback(args.context)

    def draft_step() -> None:
        draft.forward(draft_id, args.context)
        draft.rollback(args.context)

    total = torch.get_num_threads()
    share = max(1, total // 2)
    rows = [("threads", "verify ms", "draft step ms")]
    rows.append((f"{total} each, alone", _timed(verify, args.reps), _timed(draft_step, args.reps)))
    torch.set_num_threads(share)
    rows.append((f"{share} each, alone", _timed(verify, args.reps), _timed(draft_step, args.reps)))

    stop = threading.Event()
    draft_times: list[float] = []

    def background() -> None:
        torch.set_num_threads(share)
        while not stop.is_set():
            start = time.perf_counter()
            draft_step()
            draft_times.append(time.perf_counter() - start)

    worker = threading.Thread(target=background)
    worker.start()
    try:
        time.sleep(0.2)
        concurrent_verify = _timed(verify, args.reps)
    finally:
        stop.set()
        worker.join()
    rows.append((f"{share} each, at once", concurrent_verify, statistics.median(draft_times[2:]) * 1e3))
    torch.set_num_threads(total)
    print(f"target {args.model}: verify of {args.width} tokens at context {args.context}; "
          f"draft {args.draft}: one-token step")
    print("| " + " | ".join(rows[0]) + " |\n|---|---:|---:|")
    for name, v, d in rows[1:]:
        print(f"| {name} | {v:.1f} | {d:.1f} |")


if __name__ == "__main__":
    main()
