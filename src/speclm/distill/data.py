"""Training data for distillation: the target's own answers, and its distributions over them.

The prompts are speclm's own set (``data/distill_prompts.jsonl``: explanations, summaries,
passages to answer from, translations, short factual questions, word problems, writing, code and
chat, written for speclm and disjoint from Spec-Bench), plus any the user adds. The target answers
each one greedily (rows of the batched engine: deterministic, so no random state), and
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
from ..prompts import load_prompts

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


def target_answers(model, tokenizer, prompts: list[str], eos_ids: list[int], *, max_new_tokens: int,
                   rows: int = 32, max_prompt_len: int = 384, progress: bool = True) -> list[Example]:
    """Greedy answers of ``model`` (a transformers model) to ``prompts``: rows of the batched
    engine (speclm.learned.answers), through a temporary answer store (the caller caches the
    finished examples with their soft labels)."""
    import tempfile

    from ..learned.answers import AnswerStore, answer_prompts, text_key
    from ..models.hf import HFCausalLM

    if not prompts:
        raise SpeclmError("no prompts to distill on")
    backend = HFCausalLM(model, frozenset(eos_ids))
    with tempfile.TemporaryDirectory() as tmp:
        store = AnswerStore(Path(tmp))
        answer_prompts(backend, tokenizer, prompts, store, max_new_tokens=max_new_tokens,
                       max_prompt_len=max_prompt_len, rows=rows, progress=progress)
        answers = store.answers([text_key(p) for p in prompts])
    return [Example(torch.tensor(a.ids, dtype=torch.long), a.prompt_len) for a in answers]


@torch.inference_mode()
def add_soft_labels(model, examples: list[Example], k: int, progress: bool = True) -> None:
    """Record the target's top-k next-token probabilities at every position of each example."""
    for ex in tqdm(examples, desc="target distributions", unit="seq", disable=not progress, file=sys.stderr):
        logits = model(input_ids=ex.ids[:-1].view(1, -1).to(model.device), use_cache=False).logits[0]
        probs = torch.softmax(logits.float(), dim=-1)  # [T - 1, V]
        top = probs.topk(k, dim=-1)
        ex.top_ids = top.indices.to("cpu", torch.int32)
        ex.top_probs = (top.values / top.values.sum(-1, keepdim=True)).to("cpu", torch.float16)
