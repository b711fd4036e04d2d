"""The target's own answers at scale: every prompt a row of the one batched engine, kept on disk.

A trained drafter learns to predict its target, so its data is the target's own answers to many
prompts (the lesson of the EAGLE and SpecForge training recipes: data volume is the largest
lever). Answering prompts one at a time leaves most of a CPU idle between memory-bound one-token
steps; here the prompts are requests of :class:`~speclm.engine.Engine` over the target's batched
rows (llama.cpp rows in one ``llama_decode``, or the ragged eager-torch cache), so each step
decodes up to ``rows`` answers for about the cost of a few.

Answers go to an append-only JSONL file (:class:`AnswerStore`), one line per finished answer,
keyed by the prompt's text: a run interrupted at any point (Ctrl-C, a time bound, a crash) keeps
every answer already written, a torn last line is dropped when the file is opened again, and
the next run answers only the prompts it lacks. Greedy answers are deterministic, so which run
made an answer does not matter.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..drafters.base import Draft
from ..errors import SpeclmError
from ..sampling import SamplingParams

ANSWERS_FILE = "answers.jsonl"


def text_key(text: str) -> str:
    """A prompt's identity in a store: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Answer:
    """One prompt and the target's answer to it."""

    key: str  # text_key of the prompt
    ids: list[int]  # prompt + answer token ids
    prompt_len: int  # the answer starts here
    finish: str  # "stop" (end of turn) or "length" (hit the answer budget)

    @property
    def answer_len(self) -> int:
        return len(self.ids) - self.prompt_len


class JsonlStore:
    """An append-only JSON-lines file that survives interruption: a last line cut off by a
    crash (no newline, or not JSON) is truncated away when the store is opened."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        if self.path.is_file():
            self._read()

    def _read(self) -> None:
        good = 0  # bytes up to the end of the last whole line
        with self.path.open("rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    self.rows.append(json.loads(raw))
                except ValueError:
                    break
                good += len(raw)
        if good != self.path.stat().st_size:
            with self.path.open("r+b") as f:
                f.truncate(good)
            print(f"speclm: dropped a torn last line of {self.path}", file=sys.stderr)

    def append(self, row: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rows.append(row)


class AnswerStore(JsonlStore):
    """The answers made so far for one target and answer budget (see the module docstring)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(Path(folder) / ANSWERS_FILE)
        self.keys = {row["key"] for row in self.rows}

    def add(self, answer: Answer) -> None:
        if answer.key in self.keys:
            return
        self.append(dict(key=answer.key, prompt_len=answer.prompt_len, finish=answer.finish, ids=answer.ids))
        self.keys.add(answer.key)

    def answers(self, keys: Iterable[str] | None = None) -> list[Answer]:
        """Stored answers (those of ``keys`` only, in their order, if given) with at least one
        answer token."""
        by_key = {row["key"]: row for row in self.rows}
        rows = self.rows if keys is None else [by_key[k] for k in dict.fromkeys(keys) if k in by_key]
        out = [Answer(r["key"], r["ids"], r["prompt_len"], r["finish"]) for r in rows]
        return [a for a in out if a.answer_len > 0]


class FeatureRecorder:
    """A drafter that never drafts and records the target's features: the engine hands a
    drafter with ``feature_layers`` the target's hidden states at every position it feeds
    (speclm.drafters.base), so an answer's features come from the very pass that decoded it,
    with no second forward. Rows of plain decoding feed every position but the last token.

    With the target's ``lm_head``, it also records the target's own greedy choice after each
    prompt position (from the last layer, which it asks for beside ``layers``): the label the
    drafter's first step learns there. After an answer position the choice is the answer's
    next token (greedy decoding), so the head runs on the prompt's positions only."""

    def __init__(self, layers: list[int], lm_head: torch.nn.Module | None = None) -> None:
        self.layers = tuple(layers)
        self.lm_head = lm_head
        self.feature_layers = self.layers + ((-1,) if lm_head is not None else ())
        self.parts: list[torch.Tensor] = []
        self.choices: list[torch.Tensor] = []  # [t] int32 per prompt chunk
        self.prompt_positions = 0  # positions whose choice is not the next committed token
        self.seen = 0

    def reset(self, prompt_ids: torch.Tensor) -> None:
        self.parts, self.choices, self.seen = [], [], 0
        self.prompt_positions = max(0, int(prompt_ids.shape[0]) - 1)

    def propose(self, ctx) -> Draft:
        return Draft.empty()

    def on_verified(self, num_accepted: int, emitted: list[int]) -> None:
        pass

    @torch.inference_mode()
    def on_target_features(self, features: torch.Tensor) -> None:  # [t, (L [+ 1]) * H]
        width = features.shape[1] // len(self.feature_layers) * len(self.layers)
        self.parts.append(features[:, :width].to(torch.bfloat16, copy=True))  # stays on the device
        prompt = min(features.shape[0], self.prompt_positions - self.seen)
        if self.lm_head is not None and prompt > 0:
            last = features[:prompt, width:].to(self.lm_head.weight.dtype)  # [p, H] after the final norm
            self.choices.append(self.lm_head(last).argmax(-1).to(torch.int32))
        self.seen += features.shape[0]

    def features(self, length: int) -> torch.Tensor:
        """[length, L * H]: the recorded positions, then zeros for the last token (never fed,
        and never a training input: nothing follows it)."""
        fed = torch.cat(self.parts).cpu()  # one copy to the host per answer
        if fed.shape[0] > length:
            raise RuntimeError(f"recorded {fed.shape[0]} positions for a sequence of {length}")
        return torch.cat([fed, fed.new_zeros(length - fed.shape[0], fed.shape[1])])

    def target_next(self, ids: list[int]) -> torch.Tensor | None:
        """[len(ids)] int32: the target's greedy choice after each position (the prompt's from
        its LM head, the answer's its next token; 0 after the last), or None without a head."""
        if self.lm_head is None:
            return None
        prompt = torch.cat(self.choices).cpu() if self.choices else torch.empty(0, dtype=torch.int32)
        if prompt.shape[0] != self.prompt_positions:
            raise RuntimeError(f"recorded {prompt.shape[0]} prompt choices for {self.prompt_positions} positions")
        answer = torch.tensor(ids[self.prompt_positions + 1:] + [0], dtype=torch.int32)
        return torch.cat([prompt, answer])


@dataclass
class RunReport:
    """What a batched generation run did."""

    requests: int = 0  # finished this run
    tokens: int = 0  # generated this run
    seconds: float = 0.0
    stopped_early: bool = False  # the deadline came first

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def run_requests(target, requests: Iterator[tuple[str, list[int], SamplingParams]], *, rows: int,
                 deadline: float | None, on_done, progress_total: int, desc: str,
                 until: Callable[[], bool] | None = None, drafter_for: Callable[[str], object] | None = None,
                 progress: bool = True) -> RunReport:
    """Decode ``requests`` (id, prompt ids, params) as rows of one engine, at most ``rows`` at a
    time, calling ``on_done(id, prompt_ids, answer_ids, finish)`` as each finishes (it may return
    how far that moves the progress bar, default 1). Stops at ``deadline`` (time.monotonic()) or
    as soon as ``until()`` holds, dropping unfinished rows.
    ``drafter_for(id)``: the request's drafter (a :class:`FeatureRecorder`), if any."""
    from ..engine import Engine
    from ..models.rows import make_rows

    engine = Engine(make_rows(target, rows))
    live: dict[str, tuple[list[int], list[int]]] = {}
    report = RunReport()
    start = time.monotonic()
    bar = tqdm(total=progress_total, desc=desc, unit="req", disable=not progress, file=sys.stderr,
               smoothing=0.05)
    exhausted = False
    try:
        while True:
            while not exhausted and len(engine.waiting) < rows:  # keep the next rows queued
                item = next(requests, None)
                if item is None:
                    exhausted = True
                    break
                rid, prompt, params = item
                engine.add(rid, prompt, params, drafter=drafter_for(rid) if drafter_for is not None else None)
                live[rid] = (prompt, [])
            if not engine.has_work:
                break
            if deadline is not None and time.monotonic() >= deadline:
                report.stopped_early = True
                break
            if until is not None and until():
                break
            outputs, _ = engine.step()
            for out in outputs:
                prompt, answer = live[out.request_id]
                answer += out.step.tokens
                report.tokens += len(out.step.tokens)
                if out.step.finish_reason is not None:
                    del live[out.request_id]
                    progressed = on_done(out.request_id, prompt, answer, out.step.finish_reason)
                    report.requests += 1
                    bar.update(1 if progressed is None else progressed)
            report.seconds = time.monotonic() - start
            bar.set_postfix_str(f"{report.tokens_per_s:.0f} tok/s", refresh=False)
    finally:
        engine.close()
        bar.close()
        report.seconds = time.monotonic() - start
    return report


def answer_prompts(target, tokenizer, prompts: list[str], store: AnswerStore, *, max_new_tokens: int,
                   max_prompt_len: int = 384, rows: int = 16, deadline: float | None = None,
                   features=None, feature_layers: list[int] | None = None, shard_tokens: int = 65536,
                   max_feature_bytes: int | None = None, progress: bool = True) -> RunReport:
    """Greedy answers of ``target`` (a speclm backend: ``LoadedModel.backend``) to the ``prompts``
    the store lacks, ``rows`` at a time, each written to ``store`` as it finishes. With
    ``features`` (a :class:`~speclm.learned.features.FeatureShards`) and ``feature_layers``, the
    target's features at those layers are recorded in the same pass and written to its shards,
    with its greedy choice after every position, until the shards reach ``max_feature_bytes``."""
    from ..prompts import encode_user_turn
    from .train import Sequence

    if max_new_tokens < 1 or rows < 1:
        raise SpeclmError(f"max_new_tokens and rows must be >= 1, got {max_new_tokens} and {rows}")
    if features is not None and not feature_layers:
        raise SpeclmError("recording features needs the feature layers")
    todo = {text_key(p): p for p in prompts}
    todo = {k: p for k, p in todo.items() if k not in store.keys}
    limit = max(1, min(max_prompt_len, target.max_context - max_new_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    recorders: dict[str, FeatureRecorder] = {}
    pending: list[tuple[str, Sequence]] = []

    def requests() -> Iterator[tuple[str, list[int], SamplingParams]]:
        for key, text in todo.items():
            yield key, encode_user_turn(tokenizer, text, limit), params

    def recorder(key: str) -> FeatureRecorder | None:
        if features is None or key in features.keys or (
                max_feature_bytes is not None and features.nbytes >= max_feature_bytes):
            return None
        recorders[key] = FeatureRecorder(feature_layers, target.model.get_output_embeddings())
        return recorders[key]

    def flush() -> None:
        if pending:
            features.write(pending)
            pending.clear()

    def done(key: str, prompt: list[int], answer: list[int], finish: str) -> None:
        ids = prompt + answer
        store.add(Answer(key, ids, len(prompt), finish))
        rec = recorders.pop(key, None)
        if rec is not None and answer:
            pending.append((key, Sequence(torch.tensor(ids), len(prompt), rec.features(len(ids)),
                                          rec.target_next(ids))))
            if sum(len(s.ids) for _, s in pending) >= shard_tokens:
                flush()

    if not todo:
        return RunReport()
    try:
        return run_requests(target, requests(), rows=rows, deadline=deadline, on_done=done,
                            progress_total=len(todo), desc="target answers", drafter_for=recorder,
                            progress=progress)
    finally:
        if features is not None:
            flush()


def answers_folder(root: Path, target_name: str, fingerprint: float, backend: str, max_new_tokens: int) -> Path:
    """Where a target's answers live in the speclm cache: one store per target, backend and
    answer budget, shared by every drafter trained for that target (and by ``speclm distill``)."""
    text = json.dumps([3, target_name, fingerprint, backend, max_new_tokens])
    return Path(root) / "answers" / hashlib.sha256(text.encode()).hexdigest()[:16]

