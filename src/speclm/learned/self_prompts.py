"""Prompts the target writes itself, so that a user with no dataset still gets varied data.

A chat model is shown the opening of a user turn (its chat template up to where the user's text
would go) and samples the user's message, ended by its end-of-turn token; a base model (no chat
template) samples a paragraph from its BOS token. Left alone, a small chat model asks mostly for
advice and guides, so by default every other attempt starts the message with the opening words
of a kind of task (translate, summarise a text it then writes, answer from a passage, write code,
solve a word problem, role-play, ...: ``TASK_STARTS``, generic task types, none taken from a
benchmark) and the model writes the rest, the text to work on included. Each attempt ``i``
samples with its own seed (``seed`` and ``i``) and takes start ``i`` modulo the starts, so the
prompts are reproducible and a resumed run makes only the attempts it lacks. Kept: messages that
ended by themselves, of a sensible length, mostly letters, not repeating themselves, and new
(normalised text not seen before, among the user's prompts either). Every attempt, kept or not,
is one line of ``self-prompts-seed<seed>[-<hash of the starts>].jsonl`` in the answers folder.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

from ..errors import SpeclmError
from ..sampling import SamplingParams
from .answers import JsonlStore, RunReport, run_requests

PROMPTS_FILE = "self-prompts-seed{seed}{tag}.jsonl"
SENTINEL = "\u2063speclm-user-text\u2063"

# How self-written messages start (attempt i takes entry i modulo the list); "" leaves the whole
# message to the model. Generic kinds of requests, so the answers cover more than advice.
TASK_STARTS = (
    "", "Translate the following sentence into French:", "", "Summarize the following text in two sentences:\n\n",
    "", "Write a Python function that", "", "Answer the question using the passage below.\n\nPassage:",
    "", "Solve this word problem step by step:", "", "Rewrite this paragraph to sound more formal:\n\n",
    "", "Extract every name and date from this text:\n\n", "", "Imagine you are",
    "", "Explain the difference between", "", "Write a short story about",
    "", "Translate this text into German:", "", "What would happen if",
    "", "Explain what this code does:\n\n", "", "Write an email to",
    "", "Give me a list of", "", "Summarize this article:\n\n",
    "", "Classify each of the following", "", "Write a poem about",
    "", "Why does", "", "Translate into Spanish:",
)


def user_turn_opener(tokenizer) -> list[int]:
    """Token ids that open a user message: the chat template rendered around a sentinel, cut
    where the sentinel starts (a base model: its BOS token, or nothing)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
        head = text.split(SENTINEL)[0]
        if head == text:
            raise SpeclmError("the chat template drops the user's text; cannot open a user turn")
        return tokenizer(head, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None else []


def normalise(text: str) -> str:
    """What two prompts must differ in to count as different: letters and digits, lower case."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def degenerate(text: str, *, min_words: int = 4, max_words: int = 250) -> str | None:
    """Why ``text`` is not a usable prompt (None: it is)."""
    words = text.split()
    if not min_words <= len(words) <= max_words:
        return "length"
    if "<|" in text or "|>" in text or "<start_of_turn>" in text:
        return "template text"
    letters = sum(c.isalpha() for c in text)
    if letters < 0.5 * len(text.replace(" ", "")):
        return "not prose"
    if len(words) >= 12:
        trigrams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
        if len(set(trigrams)) < 0.6 * len(trigrams):
            return "repetitive"
    return None


def write_prompts(target, tokenizer, count: int, folder: Path, *, seed: int = 0, known: list[str] = (),
                  rows: int = 16, max_tokens: int = 128, temperature: float = 1.0, top_p: float = 0.95,
                  deadline: float | None = None, max_attempts: int | None = None,
                  starts: tuple[str, ...] = TASK_STARTS, progress: bool = True) -> tuple[list[str], RunReport]:
    """Until ``count`` prompts are kept in ``folder``'s store (or ``max_attempts``, default
    4 x ``count``, are spent, or the deadline comes): sample user messages from ``target``,
    attempt i's beginning with ``starts[i % len(starts)]`` (``("",)``: the model's own messages).
    Returns every kept prompt (this run's and earlier runs') and this run's report."""
    starts = tuple(starts) or ("",)
    tag = "" if starts == ("",) else "-" + hashlib.sha256("\0".join(starts).encode()).hexdigest()[:8]
    store = JsonlStore(Path(folder) / PROMPTS_FILE.format(seed=seed, tag=tag))
    seen = {normalise(p) for p in known}
    kept = []
    for row in store.rows:
        if row["text"] is not None:
            seen.add(normalise(row["text"]))
            kept.append(row["text"])
    attempts = max_attempts if max_attempts is not None else 4 * count
    tried = {row["attempt"] for row in store.rows}
    opener = user_turn_opener(tokenizer)
    if not opener:
        raise SpeclmError("the model has neither a chat template nor a BOS token to start a prompt from")
    eos = set(target.eos_token_ids)
    chat = bool(getattr(tokenizer, "chat_template", None))
    base_seed = seed * 1_000_003
    start_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] if t else [] for t in starts]

    def requests() -> Iterator[tuple[str, list[int], SamplingParams]]:
        for i in range(attempts):
            if len(kept) >= count:
                return
            if i in tried:
                continue
            params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                    seed=base_seed + i)
            yield str(i), opener + start_ids[i % len(starts)], params

    def finished(rid: str, prompt: list[int], answer: list[int], finish: str) -> int:
        text = tokenizer.decode([t for t in answer if t not in eos], skip_special_tokens=True)
        if not chat:  # a base model's prompt: its first paragraph
            head, sep, _ = text.partition("\n\n")
            text, finish = (head, "stop") if sep and head.strip() else (text, finish)
        text = (starts[int(rid) % len(starts)] + text).strip()
        why = "unfinished" if finish != "stop" else degenerate(text)
        if why is None and normalise(text) in seen:
            why = "duplicate"
        if why is None and len(kept) >= count:
            return 0  # enough already: a later run may keep this attempt
        if why is None:
            seen.add(normalise(text))
            kept.append(text)
        store.append(dict(attempt=int(rid), text=text if why is None else None, why=why))
        return int(why is None)

    if len(kept) >= count or len(tried) >= attempts:
        return kept[:count], RunReport()
    report = run_requests(target, requests(), rows=rows, deadline=deadline, on_done=finished,
                          progress_total=count - len(kept), desc="writing prompts",
                          until=lambda: len(kept) >= count, progress=progress)
    return kept[:count], report
