"""How far llama.cpp's one-token forward and its several-token forward disagree, per setting.

Greedy speculative decoding is token-identical to plain decoding only if the logits of a token
computed in a verify (several rows in one ``llama_decode``) equal those of the same token
computed alone (one row). llama.cpp picks other kernels for one row than for several, so they
differ; this script measures by how much, for the context settings that might matter:
flash attention on/off and the KV cache type (f16, llama.cpp's default, or f32).

For each prompt it decodes greedily one token at a time, keeping each step's one-row logits,
then recomputes every step's logits as the last row of a ``--width``-token forward (what a
verify of width-1 drafted tokens computes) and compares: max |difference| over the vocabulary,
and whether the argmax differs. (``speclm bench`` measures the same divergence at each
position where a greedy output differs from plain decoding, to tell a near-tie from a bug.)

    python benchmarks/llamacpp_divergence.py [--model GGUF] [--prompts N] [--tokens 64] [--width 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from speclm.models.llamacpp import LlamaCppLM, LlamaCppModel, import_llama_cpp
from speclm.models.loading import load_model

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"
SETTINGS = {  # name: (flash attention, KV type; ggml: 0 = f32, 1 = f16)
    "flash-f16": (1, 1),  # the backend's setting
    "flash-f32": (1, 0),
    "noflash-f16": (0, 1),
    "noflash-f32": (0, 0),
}


def make_context(weights: LlamaCppModel, eos, flash: int, kv_type: int) -> LlamaCppLM:
    lc = weights.lc
    default = lc.llama_context_default_params

    def patched():
        params = default()
        params.type_k = params.type_v = kv_type
        return params

    lc.llama_context_default_params = patched
    try:
        ctx = LlamaCppLM(weights, eos)
    finally:
        lc.llama_context_default_params = default
    if not flash:  # set after construction: the constructor turns it on
        ctx = _reinit(ctx, weights, kv_type)
    return ctx


def _reinit(ctx: LlamaCppLM, weights: LlamaCppModel, kv_type: int) -> LlamaCppLM:
    lc = weights.lc
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = ctx.max_context, ctx.max_batch, ctx.max_batch
    params.n_seq_max = 64
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = weights.threads
    params.type_k = params.type_v = kv_type
    params.flash_attn_type = 0
    lc.llama_free(ctx.ctx)
    ctx.ctx = lc.llama_init_from_model(weights.ptr, params)
    ctx.mem = lc.llama_get_memory(ctx.ctx)
    return ctx


def measure(ctx: LlamaCppLM, prompt: list[int], tokens: int, width: int) -> tuple[list[float], int]:
    """(max |one-row - several-row| per step, steps whose argmax differs)."""
    ctx.reset()
    ids = torch.tensor(prompt)
    out = ctx.forward(ids, 0).logits[-1]
    seq, single = list(prompt), []
    for _ in range(tokens):
        nxt = int(out.argmax())
        seq.append(nxt)
        single.append(out)
        out = ctx.forward(torch.tensor([nxt]), len(seq) - 1).logits[-1]
    diffs, flips = [], 0
    n0 = len(prompt)
    for step in range(1, tokens):
        end = n0 + step  # the logits after seq[:end] were single[step]
        start = max(1, end - width)
        ctx.rollback(start)
        several = ctx.forward(torch.tensor(seq[start:end]), start).logits[-1]
        diffs.append(float((several - single[step]).abs().max()))
        flips += int(several.argmax() != single[step].argmax())
    return diffs, flips


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of: "
                   + "; ".join(SETTINGS))
    args = p.parse_args()
    import_llama_cpp()
    loaded = load_model(args.model, backend="llamacpp")
    tok, eos = loaded.tokenizer, loaded.backend.eos_token_ids
    weights = loaded.backend.weights
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    picked = rows[:: max(1, len(rows) // args.prompts)][: args.prompts]
    if tok.chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}],
                                         add_generation_prompt=True, tokenize=False) for r in picked]
    else:  # a base model (Gemma-3-270M): the question as plain text
        texts = [r["turns"][0] + "\n" for r in picked]
    prompts = [tok(t, add_special_tokens=not tok.chat_template)["input_ids"] for t in texts]
    print(f"model {args.model}, {len(prompts)} prompts, {args.tokens} tokens each, verify width "
          f"{args.width}, {weights.threads} threads")
    print("| setting | max |Δlogit| | median of per-step max | argmax flips |")
    print("|---|---:|---:|---:|")
    for name in args.settings.split(","):
        flash, kv = SETTINGS[name]
        ctx = make_context(weights, eos, flash, kv)
        all_diffs, flips = [], 0
        for prompt in prompts:
            d, f = measure(ctx, prompt, args.tokens, args.width)
            all_diffs += d
            flips += f
        print(f"| {name} | {max(all_diffs):.3f} | {statistics.median(all_diffs):.3f} | "
              f"{flips}/{len(all_diffs)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
