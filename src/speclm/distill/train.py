"""Distill a draft model: target answers -> soft labels -> a time-bounded training loop -> a folder.

Loss (default ``kl``): at every position of prompt + answer, the cross-entropy of the student's
log-probabilities against the target's top-k probabilities (renormalised): KL(p_target || q) up to
a constant, so the student learns the target's whole ranking, which is what sampled drafts are
judged on. ``ce`` trains on the target's greedy answer tokens only. Embeddings and LM head stay
frozen by default (they are the target's, and tied in small models); the kept layers and the
final norm learn. The learning rate warms up, then decays with the fraction of the time budget
used, so a run cut short by ``--max-minutes`` still ends at a low rate.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SpeclmError
from ..models.loading import cache_dir
from .data import Example, add_soft_labels, distill_prompts, target_answers
from .student import build_student, num_params, pick_layers


@dataclass
class DistillConfig:
    layers: int  # decoder layers in the student
    max_minutes: float = 15.0  # training time bound (data generation is not counted)
    max_steps: int = 0  # 0: until the time bound
    max_new_tokens: int = 128  # length of each target answer
    batch_tokens: int = 512  # tokens per training step (whole sequences, at least one)
    lr: float = 1e-3
    topk: int = 32  # soft-label width
    loss: str = "kl"  # "kl" (target top-k distributions) or "ce" (target answer tokens)
    train_embeddings: bool = False
    holdout: float = 0.1  # fraction of examples kept out to measure agreement
    num_prompts: int = 0  # 0: all prompts
    seed: int = 0
    extra_prompts: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.loss not in ("kl", "ce"):
            raise SpeclmError(f"--loss must be kl or ce, got {self.loss!r}")
        if not self.max_minutes > 0:
            raise SpeclmError(f"--max-minutes must be > 0, got {self.max_minutes}")
        for name in ("max_new_tokens", "batch_tokens", "topk"):
            if getattr(self, name) < 1:
                raise SpeclmError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.holdout < 0.9 or not self.lr > 0 or self.max_steps < 0 or self.num_prompts < 0:
            raise SpeclmError("need 0 <= holdout < 0.9, lr > 0, max steps >= 0 and num prompts >= 0")


def load_or_make_examples(target, tokenizer, prompts: list[str], eos_ids: list[int], config: DistillConfig,
                          target_path: str, progress: bool) -> tuple[list[Example], Path | None]:
    """The target's answers and soft labels, cached per target folder, prompts and settings (they
    take longer than a short training run, and another --layers or --lr can reuse them)."""
    path = None
    if target_path:
        key = hashlib.sha256(json.dumps([target_path, prompts, config.max_new_tokens, config.topk,
                                         str(target.dtype)]).encode()).hexdigest()[:16]
        path = cache_dir() / "distill-data" / f"{Path(target_path).name}-{key}.pt"
        if path.is_file():
            try:
                return [Example(**row) for row in torch.load(path)], path
            except Exception:  # a damaged cache file is rebuilt, not fatal
                pass
    examples = target_answers(target, tokenizer, prompts, eos_ids, max_new_tokens=config.max_new_tokens,
                              progress=progress)
    add_soft_labels(target, examples, config.topk, progress)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save([asdict(ex) for ex in examples], tmp)
            tmp.replace(path)
        except OSError:
            pass  # caching is an optimisation
    return examples, None


def _batches(examples: list[Example], batch_tokens: int, gen: torch.Generator):
    """Endless shuffled batches of whole examples, about ``batch_tokens`` tokens each."""
    while True:
        batch, size = [], 0
        for i in torch.randperm(len(examples), generator=gen).tolist():
            batch.append(examples[i])
            size += examples[i].ids.shape[0]
            if size >= batch_tokens:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def _loss(student, batch: list[Example], mode: str) -> torch.Tensor:
    width = max(ex.ids.shape[0] for ex in batch) - 1
    inputs = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T], padded at the end
    for b, ex in enumerate(batch):
        inputs[b, : ex.ids.shape[0] - 1] = ex.ids[:-1]
    logq = torch.log_softmax(student(input_ids=inputs.to(student.device)).logits.float(), -1)  # [B, T, V]
    total, count = logq.new_zeros(()), 0
    for b, ex in enumerate(batch):
        length = ex.ids.shape[0] - 1
        if mode == "kl":
            rows = logq[b, :length].gather(-1, ex.top_ids.long().to(logq.device))  # [T, k]
            total = total - (ex.top_probs.float().to(logq.device) * rows).sum()
            count += length
        else:  # the target's answer tokens (prompt tokens are the user's, not the target's)
            start = ex.prompt_len - 1
            wanted = ex.ids[start + 1 :].to(logq.device)  # [answer]
            total = total - logq[b, start:length].gather(-1, wanted.view(-1, 1)).sum()
            count += length - start
    return total / max(1, count)


@torch.inference_mode()
def agreement(student, target, examples: list[Example]) -> float:
    """Teacher-forced top-1 agreement of student and target on the answers: how often a greedy
    draft token would be accepted, given the tokens before it."""
    hits = total = 0
    for ex in examples:
        ids = ex.ids[:-1].view(1, -1)
        start = ex.prompt_len - 1
        mine = student(input_ids=ids.to(student.device)).logits[0, start:].argmax(-1).cpu()
        theirs = target(input_ids=ids.to(target.device)).logits[0, start:].argmax(-1).cpu()
        hits += int((mine == theirs).sum())
        total += mine.shape[0]
    return hits / max(1, total)


def distill(target, tokenizer, eos_ids: list[int], out: Path, config: DistillConfig, *,
            target_path: str = "", progress: bool = True,
            log=lambda msg: print(msg, file=sys.stderr)) -> dict:
    """Make, train and save the draft model; returns the figures written to speclm_distill.json."""
    config.check()
    check_output(out)
    started = time.perf_counter()
    layers = pick_layers(target.config.num_hidden_layers, config.layers)
    student = build_student(target, layers)
    prompts = distill_prompts(config.extra_prompts)
    if config.num_prompts:
        prompts = prompts[: config.num_prompts]
    log(f"speclm distill: student keeps target layers {layers} ({num_params(student) / 1e6:.1f}M "
        f"parameters); {len(prompts)} prompts")
    target.eval()
    examples, cached = load_or_make_examples(target, tokenizer, prompts, eos_ids, config, target_path, progress)
    if cached:
        log(f"speclm distill: reusing the target's answers and distributions from {cached}")
    data_seconds = time.perf_counter() - started
    gen = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(examples), generator=gen).tolist()
    held = max(1, round(len(examples) * config.holdout)) if config.holdout and len(examples) > 1 else 0
    holdout, train_set = [examples[i] for i in order[:held]], [examples[i] for i in order[held:]]
    before = agreement(student, target, holdout) if holdout else None

    for name, p in student.named_parameters():
        p.requires_grad_(config.train_embeddings or not ("embed" in name or "lm_head" in name))
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    budget = config.max_minutes * 60
    train_start = time.perf_counter()
    losses: list[float] = []
    student.train()
    bar = tqdm(total=config.max_steps or None, desc="distill", unit="step", disable=not progress, file=sys.stderr)
    for step, batch in enumerate(_batches(train_set, config.batch_tokens, gen)):
        elapsed = time.perf_counter() - train_start
        if elapsed >= budget or (config.max_steps and step >= config.max_steps):
            break
        done = max(elapsed / budget, step / config.max_steps if config.max_steps else 0.0)
        scale = min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        for group in opt.param_groups:
            group["lr"] = config.lr * max(scale, 0.05)
        loss = _loss(student, batch, config.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", left=f"{max(0.0, budget - elapsed) / 60:.1f}min")
    bar.close()
    train_seconds = time.perf_counter() - train_start
    student.eval()
    after = agreement(student, target, holdout) if holdout else None
    figures = dict(
        target=target_path, student_layers=layers, layers=len(layers), parameters=num_params(student),
        prompts=len(prompts), examples=len(examples), train_examples=len(train_set),
        train_tokens=sum(ex.ids.shape[0] for ex in train_set), steps=len(losses),
        data_seconds=round(data_seconds, 1), train_seconds=round(train_seconds, 1),
        loss_first=losses[0] if losses else None, loss_last=sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        holdout_agreement_before=before, holdout_agreement_after=after, config=asdict(config),
    )
    figures["size_bytes"] = save(student, tokenizer, out, figures)
    return figures


def check_output(out: Path) -> None:
    """``out`` must be new, empty, or an earlier distill result (which is replaced)."""
    out = Path(out).expanduser()
    if out.exists() and not (out.is_dir() and (not any(out.iterdir())
                                               or (out / "speclm_distill.json").is_file())):
        raise SpeclmError(f"--out {str(out)!r} exists and is not an earlier `speclm distill` "
                          "folder; give a new or empty folder")


def save(student, tokenizer, out: Path, figures: dict) -> int:
    """Write an ordinary transformers folder atomically; returns the weights' size in bytes."""
    out = Path(out).expanduser()
    check_output(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".distill-"))
    except OSError as exc:
        raise SpeclmError(f"cannot write to {out.parent}: {exc.strerror}") from None
    try:
        student.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        (tmp / "speclm_distill.json").write_text(json.dumps(dict(figures, size_bytes=size), indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return size
