"""Prompts built on the target's own answers, so the data covers reading as well as writing.

Self-written prompts are short requests: the target mostly writes. Many real requests hand the
model a text to work on (translate it, summarise it, answer from it), and there the draft must
follow a long input it did not write. Passage prompts make such requests without another model
or dataset: each wraps one or two of the target's stored answers (to the other prompts of the
run) in a kind of task (``PASSAGE_TASKS``: generic task types, none taken from a benchmark); a
document-question prompt puts the question of one answer after two documents, one of them its
answer. The target then answers them like any other prompt.

The prompts are a function of ``seed`` and of the base prompts' answers in the order of those
prompts, so a resumed run makes the same prompts and answers only those it lacks; asking for
more keeps the first ones.
"""

from __future__ import annotations

import random

from .answers import Answer

# {0}, {1}: passages; {question}: the prompt that one of the passages answered.
PASSAGE_TASKS = (
    "Translate the following text into French:\n\n{0}",
    "Summarize the following text in two sentences:\n\n{0}",
    "Use the documents below to answer the question.\n\nDocument 1: {0}\n\nDocument 2: {1}\n\n"
    "Question: {question}",
    "Translate the following text into German:\n\n{0}",
    "List the main points of the following text:\n\n{0}",
    "Translate the following text into Spanish:\n\n{0}",
    "Rewrite the following text in plain, simple words:\n\n{0}",
    "Write a short summary of the following article:\n\n{0}\n\n{1}",
    "Answer the question using only the passage.\n\nPassage: {0}\n\nQuestion: {question}",
    "Extract every name, number and date mentioned in this text:\n\n{0}",
)
MAX_CHARS = 1500  # ~350 tokens of English: the prompt fits the data stage's 384-token budget whole


def passages(answers: list[Answer], decode, *, min_words: int = 40, max_words: int = 90) -> list[tuple[int, str]]:
    """(index into ``answers``, text) of the answers usable as passages: finished, prose rather
    than arithmetic, at least ``min_words`` long; a longer one is cut after its last sentence
    that ends within ``max_words`` words (two passages and a task then fit the prompt budget).
    ``decode``: answer token ids -> text."""
    out = []
    for i, a in enumerate(answers):
        if a.finish != "stop":
            continue
        text = decode(a.ids[a.prompt_len :]).strip()
        if len(text.split()) > max_words:
            head = text[: sum(len(w) + 1 for w in text.split()[:max_words])]
            end = max(head.rfind(". "), head.rfind("! "), head.rfind("? "), head.rfind(".\n"))
            text = head[: end + 1].strip() if end > 0 else ""
        if len(text.split()) < min_words:
            continue
        body = text.replace(" ", "")
        if sum(c.isalpha() for c in body) < 0.8 * len(body) or sum(c.isdigit() for c in body) > 0.03 * len(body):
            continue  # arithmetic (worked answers to word problems) rather than prose
        if "<|" in text or "=" in text:
            continue
        out.append((i, text))
    return out


def passage_prompts(answered: list[tuple[str, Answer]], decode, count: int, *, seed: int = 0) -> list[str]:
    """``count`` prompts (fewer if the answers offer too few passages) that wrap the target's
    answers in tasks; ``answered``: (prompt, the target's answer to it) pairs. Prompt ``i``
    takes task ``i`` modulo ``PASSAGE_TASKS``; distinct, and new to the answered prompts."""
    prompts = [p for p, _ in answered]
    usable = passages([a for _, a in answered], decode)
    if len(usable) < 2 or count <= 0:
        return []
    rng = random.Random(seed)
    seen = set(prompts)
    out: list[str] = []
    for i in range(4 * count):
        if len(out) >= count:
            break
        (a, first), (_, second) = rng.sample(usable, 2)
        task = PASSAGE_TASKS[i % len(PASSAGE_TASKS)]
        if "{1}" in task and rng.random() < 0.5:  # the answer to the question is either document
            first, second = second, first
        text = task.format(first, second, question=prompts[a].strip())
        if len(text) <= MAX_CHARS and text not in seen:
            seen.add(text)
            out.append(text)
    return out
