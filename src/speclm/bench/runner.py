"""Runs every method on every prompt (and turn), interleaved, and returns one row per request.

Per prompt, plain decoding runs first on each turn (the oracle replays its tokens and the
greedy identity check compares against them); the other methods follow in an order that rotates
from prompt to prompt, so no method is always first or last. Multi-turn conversations are played
turn by turn, each method with its own earlier answers as history. Each method runs once on a
short warm-up request before timing starts. A peer that fails is recorded, not fatal.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from tqdm import tqdm

from ..api import LLM, Speculation
from ..draft_length import DraftLengthConfig
from ..errors import SpeclmError
from ..sampling import SamplingParams
from .methods import MethodSpec
from .oracle import OracleDrafter
from .peers import HFPeer


def build_setups(llm: LLM, specs: list[MethodSpec]) -> dict[str, object]:
    """label -> a Speculation (speclm methods), False (plain), an HFPeer, or the error string of
    a peer that could not be set up (reported on every row, not fatal)."""
    setups: dict[str, object] = {}
    for spec in specs:
        o = spec.options
        if spec.name == "plain":
            setups[spec.label] = False
        elif spec.drafter is not None:
            setups[spec.label] = llm.make_speculation(spec.drafter, o["k"], adaptive_draft=bool(o["adaptive"]))
        elif spec.name == "oracle":
            drafter = OracleDrafter(o["a"], llm.target.vocab_size, seed=o["seed"])
            setups[spec.label] = Speculation(drafter, DraftLengthConfig(o["k"]), spec.label)
        else:
            try:
                setups[spec.label] = HFPeer(spec, llm)
            except Exception as exc:
                setups[spec.label] = f"setup failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return setups


def _run_one(llm: LLM, setup, messages: list[dict], params: SamplingParams) -> dict:
    if isinstance(setup, HFPeer):
        prompt_ids = llm.encode(messages)
        ids, elapsed = setup.run(prompt_ids, params)
        text = llm.tokenizer.decode(ids, skip_special_tokens=True)
        return dict(token_ids=ids, text=text, tokens=len(ids), prompt_tokens=len(prompt_ids),
                    time_s=elapsed, tok_s=len(ids) / elapsed if elapsed > 0 else 0.0)
    out = llm.chat(messages, params, speculative=setup)
    s = out.stats
    row = dict(token_ids=out.token_ids, text=out.text, tokens=s.generated_tokens,
               prompt_tokens=s.prompt_tokens, time_s=s.total_time_s, tok_s=s.tokens_per_s,
               prefill_s=s.prefill_time_s)
    if s.drafter_report is not None:
        row["drafter_report"] = s.drafter_report
    if setup is not False:
        row.update(forwards=s.target_forwards, drafted=s.drafted_tokens, accepted=s.accepted_tokens,
                   draft_s=s.draft_time_s, target_s=s.target_time_s,
                   judged_per_position=s.judged_per_position,
                   accepted_per_position=s.accepted_per_position)
    else:
        row.update(forwards=s.target_forwards, target_s=s.target_time_s)
    return row


# logit gaps below these are within what a one-token and a multi-token forward can round apart
_TIE_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-2, torch.bfloat16: 0.5, torch.float16: 0.1}


def diagnose_mismatch(llm: LLM, messages: list[dict], plain_ids: list[int], ids: list[int]) -> dict:
    """Why a greedy output differs from plain decoding: the first differing position and the
    target's logit gap there between plain's token and the other, computed afresh. A gap within
    rounding of the dtype is a numerical near-tie; anything larger is a bug."""
    at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), None)
    if at is None:  # one is a prefix of the other: the stopping rule differed, never a tie
        return dict(position=min(len(ids), len(plain_ids)), margin=None,
                    verdict=f"BUG: lengths differ ({len(ids)} vs plain's {len(plain_ids)})")
    prefix = torch.tensor(llm.encode(messages) + plain_ids[:at], dtype=torch.long)
    target = llm.target
    target.reset()
    logits = target.forward(prefix, 0).logits[-1].double()  # [V]
    target.reset()
    margin = float(logits[plain_ids[at]] - logits[ids[at]])
    tolerance = _TIE_TOLERANCE.get(getattr(target, "dtype", torch.float32), 1e-2)
    verdict = (f"numerical near-tie (logit gap {margin:.2g} in {str(target.dtype).removeprefix('torch.')})"
               if abs(margin) <= tolerance else f"BUG: the target prefers plain's token by {margin:.3g} logits")
    return dict(position=at, margin=margin, verdict=verdict)


def run_bench(
    llm: LLM,
    specs: list[MethodSpec],
    prompts: list[dict],
    params: SamplingParams,
    *,
    warmup: bool = True,
    progress: bool = True,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> list[dict]:
    if not any(s.name == "plain" for s in specs):
        specs = [MethodSpec("plain", "plain", {})] + specs
    setups = build_setups(llm, specs)
    plain_label = next(s.label for s in specs if s.name == "plain")
    others = [s.label for s in specs if s.label != plain_label]
    if warmup:
        short = SamplingParams(max_tokens=8, temperature=params.temperature, seed=params.seed)
        for label, setup in setups.items():
            if not isinstance(setup, str) and not isinstance(getattr(setup, "drafter", None), OracleDrafter):
                try:
                    _run_one(llm, setup, [{"role": "user", "content": "Say hello."}], short)
                except Exception as exc:  # reported again, per request, in the results
                    log(f"warm-up of {label} failed: {exc}")
    rows: list[dict] = []
    total = sum(len(p["turns"]) for p in prompts)
    bar = tqdm(total=total, desc="bench", unit="turn", disable=not progress, file=sys.stderr)
    for i, prompt in enumerate(prompts):
        order = others[i % len(others):] + others[: i % len(others)] if others else []
        history = {label: [] for label in setups}
        failed: dict[str, str] = {}  # a failed turn ends that method's conversation
        for turn, text in enumerate(prompt["turns"]):
            plain_row = None
            for label in [plain_label] + order:
                setup = setups[label]
                messages = history[label] + [{"role": "user", "content": text}]
                try:
                    if isinstance(setup, str):
                        raise SpeclmError(setup)
                    if label in failed:
                        raise SpeclmError(f"skipped: turn {failed[label]} failed")
                    if plain_row is not None and plain_row.get("error"):
                        raise SpeclmError(f"plain decoding failed: {plain_row['error']}")
                    if isinstance(getattr(setup, "drafter", None), OracleDrafter):
                        setup.drafter.set_continuation(len(llm.encode(messages)), plain_row["token_ids"])
                    row = _run_one(llm, setup, messages, params)
                except Exception as exc:
                    # a user-level problem (a prompt longer than the context) or a peer's failure
                    # is recorded; anything else in speclm's own methods is a bug and propagates
                    if not isinstance(setup, HFPeer) and not isinstance(exc, SpeclmError):
                        raise
                    row = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    failed.setdefault(label, str(turn))
                row.update(prompt_id=prompt["id"], category=prompt["category"], turn=turn, method=label)
                if isinstance(getattr(setup, "drafter", None), OracleDrafter):
                    row["oracle_diverged"] = setup.drafter.diverged
                if label == plain_label:
                    plain_row = row
                if row.get("error") is None:
                    row["speedup"] = row["tok_s"] / plain_row["tok_s"] if plain_row["tok_s"] else None
                    row["identical"] = (row["token_ids"] == plain_row["token_ids"]) if params.greedy else None
                    if row["identical"] is False:
                        row["mismatch"] = diagnose_mismatch(llm, messages, plain_row["token_ids"],
                                                            row["token_ids"])
                    history[label] = messages + [{"role": "assistant", "content": row["text"]}]
                rows.append(row)
            bar.update(1)
    bar.close()
    return rows
