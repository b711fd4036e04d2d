"""Prompt sets: the Spec-Bench questions when available, else speclm's own small default set.

Both use the Spec-Bench JSONL layout: one object per line with ``question_id``, ``category`` and
``turns`` (a list of user messages). The default set ships with the package and was written for
speclm; it covers the same kinds of task so that benchmarks run anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SpeclmError

DEFAULT_PROMPTS = Path(__file__).with_name("data") / "prompts.jsonl"
# Spec-Bench reports MT-bench's eight sub-categories together as multi-turn conversation
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                       "humanities"}


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """Read a prompt JSONL; MT-bench's sub-categories are reported as ``multi_turn``."""
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SpeclmError(f"cannot read prompts file {str(path)!r}: {exc.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = row["turns"] if "turns" in row else [row["prompt"]]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpeclmError(f"{path}:{number}: expected a JSON object with 'turns' or 'prompt'") from None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise SpeclmError(f"{path}:{number}: 'turns' must be a non-empty list of non-empty strings")
        subcategory = str(row.get("category", "default"))
        category = "multi_turn" if subcategory in MT_BENCH_CATEGORIES else subcategory
        rows.append({"id": row.get("question_id", number), "category": category,
                     "subcategory": subcategory, "turns": turns})
    return rows


def encode_user_turn(tokenizer, text: str, max_len: int | None = None) -> list[int]:
    """Token ids of ``text`` as one user message through the chat template (plain text when the
    tokenizer has none), keeping the last ``max_len`` tokens: how calibration and distillation
    present speclm's prompt sets to a model."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return ids[-max_len:] if max_len else ids


def per_category(rows: list[dict], num: int, categories: list[str] | None = None) -> list[dict]:
    """``num`` prompts of each category (optionally only ``categories``); within a category,
    round-robin over sub-categories (MT-bench's writing, roleplay, ...), in file order."""
    if num < 1:
        raise SpeclmError(f"prompts per category must be >= 1, got {num}")
    if categories:
        unknown = sorted(set(categories) - {r["category"] for r in rows})
        if unknown:
            known = ", ".join(sorted({r["category"] for r in rows}))
            raise SpeclmError(f"no prompts in categor{'y' if len(unknown) == 1 else 'ies'} "
                              f"{', '.join(unknown)}; the file has: {known}")
        rows = [r for r in rows if r["category"] in categories]
    if not rows:
        raise SpeclmError("the prompt selection is empty")
    picked = []
    for category in dict.fromkeys(r["category"] for r in rows):  # first-seen order
        members = [r for r in rows if r["category"] == category]
        picked += spread(members, num, key="subcategory")
    return picked


def spread(rows: list[dict], num: int, key: str = "category") -> list[dict]:
    """Pick ``num`` prompts round-robin over ``key`` (category), in file order within each."""
    by_cat: dict[str, list[dict]] = {}
    for row in rows:
        by_cat.setdefault(row.get(key, ""), []).append(row)
    picked, i = [], 0
    while len(picked) < num and any(i < len(v) for v in by_cat.values()):
        picked += [v[i] for v in by_cat.values() if i < len(v)][: num - len(picked)]
        i += 1
    return picked
