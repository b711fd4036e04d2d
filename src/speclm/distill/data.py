"""Training data for distillation: the target's own answers, and its distributions over them.

The prompts are speclm's own set (``data/distill_prompts.jsonl``: explanations, summaries,
passages to answer from, translations, short factual questions, word problems, writing, code and
chat, written for speclm and disjoint from Spec-Bench), plus any the user adds. The target answers
each one greedily (batched transformers ``generate``: deterministic, so no random state), and
then a teacher-forced pass records, at every position of prompt + answer, the target's top-k
next-token probabilities: the soft labels the student is trained on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SpeclmError
from ..prompts import encode_user_turn, load_prompts

DISTILL_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "distill_prompts.jsonl"


@dataclass
class Example:
    ids: torch.Tensor  # [T] prompt + answer token ids
    prompt_len: int  # the answer starts here
    top_ids: torch.Tensor | None = None  # [T - 1, k] int32: the target's top-k after each prefix
    top_probs: torch.Tensor | None = None  # [T - 1, k] float16, renormalised over the k


def distill_prompts(extra: list[str] | None = None) -> list[str]:
    """The built-in prompts, then the first turn of every prompt in the ``extra`` JSONL files."""
    texts = [row["turns"][0] for row in load_prompts(DISTILL_PROMPTS)]
    for path in extra or []:
        texts += [row["turns"][0] for row in load_prompts(path)]
    return texts


@torch.inference_mode()
def target_answers(model, tokenizer, prompts: list[str], eos_ids: list[int], *, max_new_tokens: int,
                   batch_size: int = 8, max_prompt_len: int = 384, progress: bool = True) -> list[Example]:
    """Greedy answers of ``model`` to ``prompts``, batched (left-padded) for throughput."""
    if not prompts:
        raise SpeclmError("no prompts to distill on")
    pad = eos_ids[0] if eos_ids else 0
    encoded = [encode_user_turn(tokenizer, p, max_prompt_len) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths batch well
    out: list[Example | None] = [None] * len(encoded)
    bar = tqdm(total=len(encoded), desc="target answers", unit="prompt", disable=not progress,
               file=sys.stderr)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [B, W], padded on the left
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
            mask[row, width - len(encoded[i]) :] = 1
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                             top_k=None, top_p=None, eos_token_id=eos_ids or None, pad_token_id=pad)
        for row, i in enumerate(chunk):
            answer = gen[row, width:].tolist()
            for j, tok in enumerate(answer):
                if tok in eos_ids:
                    answer = answer[: j + 1]
                    break
            out[i] = Example(torch.tensor(encoded[i] + answer, dtype=torch.long), len(encoded[i]))
        bar.update(len(chunk))
    bar.close()
    return [e for e in out if e is not None and e.ids.shape[0] > e.prompt_len]


@torch.inference_mode()
def add_soft_labels(model, examples: list[Example], k: int, progress: bool = True) -> None:
    """Record the target's top-k next-token probabilities at every position of each example."""
    for ex in tqdm(examples, desc="target distributions", unit="seq", disable=not progress, file=sys.stderr):
        logits = model(input_ids=ex.ids[:-1].view(1, -1).to(model.device), use_cache=False).logits[0]
        probs = torch.softmax(logits.float(), dim=-1)  # [T - 1, V]
        top = probs.topk(k, dim=-1)
        ex.top_ids = top.indices.to("cpu", torch.int32)
        ex.top_probs = (top.values / top.values.sum(-1, keepdim=True)).to("cpu", torch.float16)
