"""Aggregates over benchmark rows, and the Leviathan et al. (2023) speedup bound.

With per-token acceptance alpha (i.i.d.), K draft tokens per round and draft cost ratio
c = (draft time per token) / (target time per forward), the expected walltime improvement is

    bound(alpha, K, c) = (1 - alpha^(K+1)) / ((1 - alpha) * (c * K + 1))

It assumes a verify over K+1 tokens costs what a one-token step costs. Where it does not (CPUs:
a forward over 8 tokens can cost twice a one-token step), the measured verify cost ratio
v = (target time per speculative forward) / (target time per plain step) gives a second bound,

    bound_v(alpha, K, c, v) = (1 - alpha^(K+1)) / ((1 - alpha) * (c * K + v))

so that efficiency = measured / bound separates what the hardware costs (v) from what the engine
loses around the forwards (measured / bound_v).
"""

from __future__ import annotations

import statistics


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per round] with i.i.d. per-token acceptance alpha and K draft tokens."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def leviathan_bound(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Expected speedup over plain decoding; ``v`` = verify cost / one-token step (1 in the paper)."""
    return expected_tokens(alpha, k) / (c * k + v)


def decode_rate(rows: list[dict]) -> float | None:
    """Pooled decode tokens per second (prefill excluded); None where prefill is unknown."""
    if not rows or any("prefill_s" not in r for r in rows):
        return None
    decode_s = sum(r["time_s"] - r["prefill_s"] for r in rows)
    return sum(r["tokens"] for r in rows) / decode_s if decode_s > 0 else None


def summarize(rows: list[dict], plain_step_s: float | None, plain_rows: list[dict] | None = None) -> dict:
    """One method's rows (any category mix) -> the table's figures.

    ``plain_rows`` are plain decoding's rows; the decode-only speedup pools both over the
    (prompt, turn) pairs where both succeeded.
    """
    ok = [r for r in rows if r.get("error") is None]
    out: dict = {"requests": len(rows), "errors": len(rows) - len(ok)}
    if not ok:
        return out
    tokens = sum(r["tokens"] for r in ok)
    out["compiled"] = sum(1 for r in ok if r.get("compiled"))  # requests whose time has a compile
    out.update(
        tokens=tokens,
        time_s=sum(r["time_s"] for r in ok),
        tok_s=statistics.median(r["tok_s"] for r in ok),
        speedup=statistics.median(r["speedup"] for r in ok if r["speedup"] is not None)
        if any(r["speedup"] is not None for r in ok) else None,
        vs_baseline=statistics.median(r["vs_baseline"] for r in ok if r.get("vs_baseline") is not None)
        if any(r.get("vs_baseline") is not None for r in ok) else None,
        identical=sum(1 for r in ok if r["identical"]),
        checked=sum(1 for r in ok if r["identical"] is not None),
    )
    if plain_rows is not None:
        plain_ok = {(r["prompt_id"], r["turn"]): r for r in plain_rows if r.get("error") is None}
        pairs = [(r, plain_ok[(r["prompt_id"], r["turn"])]) for r in ok
                 if (r["prompt_id"], r["turn"]) in plain_ok]
        mine, base = decode_rate([a for a, _ in pairs]), decode_rate([b for _, b in pairs])
        if mine and base:
            out["decode_speedup"] = mine / base
    if all("forwards" in r for r in ok):  # speclm's engine (peers report no internals)
        forwards = sum(r["forwards"] for r in ok)
        out["tau"] = tokens / forwards if forwards else 0.0
    if all("drafted" in r for r in ok):  # speclm's rows, and peers that count their drafts
        drafted = sum(r["drafted"] for r in ok)
        out["alpha"] = sum(r["accepted"] for r in ok) / drafted if drafted else 0.0
    if all("judged_per_position" in r for r in ok):
        drafted = sum(r["drafted"] for r in ok)
        width = max(len(r["judged_per_position"]) for r in ok)
        judged = [sum(r["judged_per_position"][i] for r in ok if i < len(r["judged_per_position"]))
                  for i in range(width)]
        acc = [sum(r["accepted_per_position"][i] for r in ok if i < len(r["accepted_per_position"]))
               for i in range(width)]
        out.update(
            acceptance_by_position=[a / j if j else 0.0 for a, j in zip(acc, judged)],
            # per-token acceptance as the bound's i.i.d. model sees it: successes / trials
            alpha_iid=sum(acc) / sum(judged) if sum(judged) else 0.0,
        )
        draft_s = sum(r["draft_s"] for r in ok)
        if drafted and plain_step_s:
            out["c"] = draft_s / drafted / plain_step_s
            # verify cost: target time per speculative forward, over plain's per step
            spec_forwards = sum(r["forwards"] for r in ok)
            out["v"] = sum(r["target_s"] for r in ok) / spec_forwards / plain_step_s
    return out
