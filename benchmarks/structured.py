"""Structured outputs with speculation: a JSON extraction workload.

    python benchmarks/structured.py [--n 32] [--max-tokens 256] [--temperatures 0,0.7]
                                    [--drafter auto] [--backend auto] [--model default] [--out F]

Each request gives the model a news article (the first ~1,500 characters of a Spec-Bench
summarization context, read from ../shared/data/spec_bench/question.jsonl or --prompts) and
asks for its facts as JSON under a schema (people, places, dates, numbers, a headline; bounded
lengths so a complete answer fits the token budget). Three methods run the same requests,
interleaved request by request in a rotating order after a warm-up:

- ``plain``: unconstrained plain decoding (what the model writes without a grammar);
- ``plain+schema``: plain decoding constrained by the schema;
- ``spec+schema``: speculative decoding (``--drafter``, default ``auto``) with the schema.

Reported per temperature: validity (the output parses and validates against the schema, checked
with the ``jsonschema`` package, independently of speclm's grammar engine), median tokens/s
(wall time, the prompt's prefill included) and median decode tokens/s (prefill excluded), the
median per-request speedup of spec+schema over plain+schema (both ways) and over unconstrained plain,
tau, forced and grammar-rejected draft tokens, and (greedy) whether spec+schema is token-identical
to plain+schema, each difference diagnosed as ``speclm bench`` does (a numerical near-tie of the
kernels at the first differing token, or a bug).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema

from speclm import LLM, SamplingParams
from speclm.bench.report import environment
from speclm.bench.runner import bench_prompt, diagnose_mismatch

NAME = {"type": "string", "pattern": "^[A-Za-z][A-Za-z .'-]{0,23}$"}  # one to 24 plain characters
# Every field is bounded in characters and kept to plain ASCII, so even a degenerate sample (a
# model repeating digits or emoji at T = 0.7) finishes within the 256-token budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "headline": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9 ,.'-]{0,59}$"},
        "people": {"type": "array", "items": NAME, "maxItems": 3},
        "places": {"type": "array", "items": NAME, "maxItems": 3},
        "dates": {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z0-9 ,-]{1,16}$"},
                  "maxItems": 2},
        "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999999},
                    "maxItems": 3},
    },
    "required": ["headline", "people", "places", "dates", "numbers"],
    "additionalProperties": False,
}
INSTRUCTION = ("Read the article and extract its facts as JSON with the keys headline, people, "
               "places, dates and numbers (at most three people, three places, two dates and three "
               "numbers).\n\nArticle: ")


def articles(path: Path, n: int, chars: int = 1500) -> list[str]:
    """The first ``n`` summarization contexts, cut at a sentence end near ``chars``."""
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if q.get("category") != "summarization":
            continue
        text = q["turns"][0].removeprefix("Summarize:").strip()
        cut = text[:chars]
        out.append(cut[: cut.rfind(". ") + 1] or cut)
        if len(out) == n:
            break
    return out


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", help="Spec-Bench question.jsonl (its summarization contexts are the articles)",
                    default=str(Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"))
    ap.add_argument("--n", type=int, default=32, help="requests (articles) per temperature")
    ap.add_argument("--max-tokens", type=int, default=256, help="token budget per answer")
    ap.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 is greedy")
    ap.add_argument("--drafter", default="auto", help="the drafter of spec+schema, as --drafter of speclm generate")
    ap.add_argument("--backend", default="auto", help="auto (llama.cpp for a GGUF when installed), torch or llamacpp")
    ap.add_argument("--model", default="default", help="target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out", help="write the per-request rows and the summary here (JSON)")
    args = ap.parse_args()

    texts = articles(Path(args.prompts), args.n)
    plain = LLM(args.model, backend=args.backend)
    spec = LLM(args.model, speculative_model=args.drafter, backend=args.backend)
    methods = {"plain": (plain, False), "plain+schema": (plain, True), "spec+schema": (spec, True)}
    warm = [{"role": "user", "content": INSTRUCTION + texts[0][:300]}]
    for llm, constrained in methods.values():
        ask(llm, warm, SamplingParams(max_tokens=16, json_schema=SCHEMA if constrained else None))

    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for i, text in enumerate(texts):
            messages = [{"role": "user", "content": INSTRUCTION + text}]
            names = list(methods)
            names = names[i % 3:] + names[: i % 3]  # rotate the order request by request
            for name in names:
                llm, constrained = methods[name]
                params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i,
                                        json_schema=SCHEMA if constrained else None)
                start = time.perf_counter()
                result = ask(llm, messages, params)
                seconds = time.perf_counter() - start
                out, stats = result, result.stats
                rows.append({"temperature": temperature, "request": i, "method": name,
                             "text": out.text, "token_ids": list(out.token_ids),
                             "tokens": len(out.token_ids), "seconds": seconds,
                             "tok_s": len(out.token_ids) / seconds, "prefill_s": stats.prefill_time_s,
                             "decode_tok_s": len(out.token_ids) / max(stats.decode_time_s, 1e-9),
                             "valid": valid(out.text),
                             "tau": stats.tau, "alpha": stats.alpha,
                             "drafter": (stats.drafter_report or {}).get("choice", stats.drafter),
                             "forced": stats.forced_tokens, "forced_accepted": stats.forced_accepted,
                             "grammar_rejected": stats.grammar_rejected_tokens})
            print(f"T={temperature} request {i + 1}/{len(texts)}", flush=True)

    diagnose(plain, texts, rows)
    summary = summarize(rows)
    machine = environment()
    print(json.dumps({"machine": machine, **summary}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "machine": machine, "summary": summary,
                                              "rows": rows}, indent=1))


def ask(llm: LLM, messages: list[dict], params: SamplingParams):
    """One request: through the chat template, or as plain text for a base model (as the bench)."""
    prompt = bench_prompt(llm, messages)
    return llm.chat(prompt, params) if isinstance(prompt, list) else llm.generate(prompt, params)[0]


def diagnose(llm: LLM, texts: list[str], rows: list[dict]) -> None:
    """Every greedy spec+schema output that differs from plain+schema gets the bench's verdict:
    a numerical near-tie of the kernels at the first differing token, or a bug. The grammar does
    not enter: both tokens there are allowed after the same prefix, and the mask leaves their
    logits as they are."""
    by = {(r["method"], r["request"]): r for r in rows if r["temperature"] == 0}
    for i, text in enumerate(texts):
        spec, ref = by.get(("spec+schema", i)), by.get(("plain+schema", i))
        if spec and ref and spec["token_ids"] != ref["token_ids"]:
            messages = [{"role": "user", "content": INSTRUCTION + text}]
            spec["mismatch"] = diagnose_mismatch(llm, messages, ref["token_ids"], spec["token_ids"])


def summarize(rows: list[dict]) -> dict:
    out = {}
    for temperature in sorted({r["temperature"] for r in rows}):
        by = {(r["method"], r["request"]): r for r in rows if r["temperature"] == temperature}
        requests = sorted({i for _, i in by})
        t = {}
        for m in ("plain", "plain+schema", "spec+schema"):
            rs = [by[m, i] for i in requests]
            t[m] = {"valid": f"{sum(r['valid'] for r in rs)}/{len(rs)}",
                    "median_tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
                    "median_decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in rs), 1),
                    "tokens": sum(r["tokens"] for r in rs)}
        spec = [by["spec+schema", i] for i in requests]
        t["spec+schema"]["speedup_vs_plain+schema"] = round(statistics.median(
            by["spec+schema", i]["tok_s"] / by["plain+schema", i]["tok_s"] for i in requests), 3)
        t["spec+schema"]["decode_speedup_vs_plain+schema"] = round(statistics.median(
            by["spec+schema", i]["decode_tok_s"] / by["plain+schema", i]["decode_tok_s"] for i in requests), 3)
        t["spec+schema"]["speedup_vs_plain"] = round(statistics.median(
            by["spec+schema", i]["tok_s"] / by["plain", i]["tok_s"] for i in requests), 3)
        t["spec+schema"]["forced"] = sum(r["forced"] or 0 for r in spec)
        t["spec+schema"]["forced_accepted"] = sum(r["forced_accepted"] or 0 for r in spec)
        t["spec+schema"]["grammar_rejected"] = sum(r["grammar_rejected"] or 0 for r in spec)
        taus = [r["tau"] for r in spec if r["tau"]]
        t["spec+schema"]["median_tau"] = round(statistics.median(taus), 2) if taus else None
        if temperature == 0:
            same = sum(by["spec+schema", i]["token_ids"] == by["plain+schema", i]["token_ids"] for i in requests)
            t["spec+schema"]["identical_to_plain+schema"] = f"{same}/{len(requests)}"
            verdicts = [by["spec+schema", i].get("mismatch", {}).get("verdict", "") for i in requests]
            t["spec+schema"]["near_ties"] = sum(v.startswith("numerical near-tie") for v in verdicts)
            t["spec+schema"]["bugs"] = sum(v.startswith("BUG") for v in verdicts)
        out[f"T={temperature}"] = t
    return out


if __name__ == "__main__":
    main()
