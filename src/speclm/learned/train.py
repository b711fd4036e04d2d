"""Training Medusa heads and the EAGLE head on the target's own answers (self-distillation).

The data are sequences (prompt + the target's answer) with the target's hidden states and its own
greedy next-token choice at every position. Losses are cross-entropy against the target's choices:

- Medusa head d at position t learns token t + 2 + d.
- The EAGLE head learns token t + 2 from the pair (features at t, token t + 1), and then, as at
  drafting time, from its own output standing in for the target's features ("training-time
  test", EAGLE-3): ``unroll`` extra steps, each attending to the true pairs before it and its
  own earlier steps on the diagonal, exactly the attention pattern of a draft chain.

The first prediction (Medusa's first head, EAGLE's first step) learns at every position, prompt
included: the label there is the target's own choice given the text so far, which is exactly what
verification will compare against, and prompts are most of the tokens. Deeper predictions learn
on the answers only, where the text is the target's own greedy continuation (in a prompt, the next
token need not be the target's choice, so a chain of guesses would be judged against the wrong
prefix).

After every epoch a held-out split measures top-k accuracy per draft position: the chance the
target accepts the drafter's guess there, which is what acceptance will be.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

IGNORE = -100


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] prompt + answer
    prompt_len: int  # answer tokens start here
    features: torch.Tensor  # [T, F] target hidden states (the drafter's feature layers), float16
    target_next: torch.Tensor | None = None  # [T] the target's greedy choice after each position
    key: str = ""  # the answer store's key of the prompt (what the held-out split is drawn from)


@dataclass
class TrainState:
    epoch: int = 0
    step: int = 0
    seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # per epoch: loss, held-out accuracy


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` tokens the target chooses most often in the data (plus ``always``, e.g.
    EOS), sorted: [N] ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in sequences:
        chosen = s.target_next if s.target_next is not None else s.ids[s.prompt_len :]
        counts += torch.bincount(chosen.long(), minlength=vocab_size)
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    size = min(size, vocab_size)
    return torch.sort(torch.topk(counts, size).indices).values


def _to_draft_ids(ids: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target ids -> draft ids, IGNORE where the draft vocabulary lacks the token."""
    table = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    table[draft_to_target] = torch.arange(draft_to_target.shape[0])
    return table[ids]


def _batches(items: list[Sequence], size: int, rng: random.Random, group: int = 32) -> list[list[Sequence]]:
    """Shuffled batches of ``size`` sequences of similar length: each window of ``group`` batches
    is sorted by length before it is cut, so a batch pads little, and the batches are shuffled
    again so lengths do not come in order."""
    order = list(range(len(items)))
    rng.shuffle(order)
    window = size * group
    batches = []
    for w in range(0, len(order), window):
        part = sorted(order[w : w + window], key=lambda i: items[i].ids.shape[0])
        batches += [[items[i] for i in part[j : j + size]] for j in range(0, len(part), size)]
    rng.shuffle(batches)
    return batches


def _pad(sequences: list[Sequence], table: torch.Tensor, device, dtype=torch.float32, multiple: int = 1) -> tuple:
    """Right-pad a batch: ids [B, T], features [B, T, F], and two label tensors [B, T] holding,
    at position p, the draft id of the target's choice for p: ``answer`` on answer positions only,
    ``everywhere`` at every position (IGNORE elsewhere, and where the draft vocabulary lacks it).
    T is the longest sequence rounded up to ``multiple`` (padding is causal-masked out and unlabelled)."""
    width = -(-max(s.ids.shape[0] for s in sequences) // multiple) * multiple
    feat_dim = sequences[0].features.shape[1]
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    feats = torch.zeros(len(sequences), width, feat_dim, dtype=dtype)
    answer = torch.full((len(sequences), width), IGNORE, dtype=torch.long)
    everywhere = answer.clone()
    for b, s in enumerate(sequences):
        t = s.ids.shape[0]
        ids[b, :t] = s.ids
        feats[b, :t] = s.features.to(dtype)
        answer[b, s.prompt_len : t] = table[s.ids[s.prompt_len :]]
        if s.target_next is not None:
            everywhere[b, 1:t] = table[s.target_next[: t - 1].long()]
        else:
            everywhere[b] = answer[b]
    return ids.to(device), feats.to(device), answer.to(device), everywhere.to(device)


class Trainer:
    """Shared loop: epochs over shuffled batches, AdamW with warm-up and cosine decay, a time
    bound, held-out evaluation per epoch, and a state that lets a run resume."""

    def __init__(self, module: nn.Module, train: list[Sequence], held_out: list[Sequence], *,
                 vocab_size: int, epochs: int, batch_size: int, lr: float, device,
                 max_seconds: float | None, progress: bool = True, seed: int = 0,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.module, self.train, self.held_out = module, train, held_out
        self.table = _to_draft_ids(torch.arange(vocab_size), module.draft_to_target.cpu(), vocab_size)
        self.epochs, self.batch_size, self.device = epochs, batch_size, device
        self.dtype = next(module.parameters()).dtype
        self.max_seconds, self.progress = max_seconds, progress
        self.seed = seed
        # bfloat16: products run under autocast (weights, gradients and AdamW's state stay float32)
        self.compute_dtype = compute_dtype if compute_dtype not in (None, self.dtype) else None
        # oneDNN, which runs bfloat16 products on a CPU, builds a kernel per shape: batch widths
        # rounded up to 64 repeat shapes (1.3x faster steps on the AMX VM, docs/benchmarks.md)
        self.pad_multiple = 64 if self.compute_dtype is not None else 1
        params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        total = max(1, epochs * math.ceil(len(train) / batch_size))
        warmup = max(1, total // 20)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
        self.state = TrainState()

    def predictions(self, batch, everywhere: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft position, (logits [B, T', N], labels [B, T']); the first position's labels
        cover every position when ``everywhere`` (training), the answers only otherwise."""
        raise NotImplementedError  # pragma: no cover - overridden

    def loss(self, batch) -> tuple[torch.Tensor, dict]:
        losses = [nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), lb.reshape(-1), ignore_index=IGNORE)
                  for lg, lb in self.predictions(batch, everywhere=True)]
        losses = [x for x in losses if torch.isfinite(x)]
        return sum(w * x for w, x in zip((0.8 ** d for d in range(len(losses))), losses)), {}

    def autocast(self):
        """The products' precision for a forward: ``compute_dtype`` under autocast, else as stored."""
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.compute_dtype or self.dtype,
                              enabled=self.compute_dtype is not None)

    def train_step(self, chunk: list[Sequence]) -> tuple[float, dict]:
        """One optimizer step on a batch of sequences: its loss and the figures for the progress bar."""
        with self.autocast():
            loss, figures = self.loss(_pad(chunk, self.table, self.device, self.dtype, self.pad_multiple))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.state.step += 1
        return float(loss.detach()), figures

    def accuracy(self, batch, top: int) -> torch.Tensor:
        """[positions, top + 1]: hits at each rank, then the number of labelled positions."""
        return _topk_hits(self.predictions(batch, everywhere=False), top)

    def state_dict(self) -> dict:
        return dict(module=self.module.state_dict(), optimizer=self.optimizer.state_dict(),
                    scheduler=self.scheduler.state_dict(), state=self.state.__dict__)

    def load_state_dict(self, saved: dict) -> None:
        self.module.load_state_dict(saved["module"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state = TrainState(**saved["state"])

    @torch.no_grad()
    def evaluate(self, top: int = 4) -> list[list[float]]:
        """Held-out top-r accuracy per draft position: acc[d][r] = P(label is the rank-r guess).

        Every answer token counts, those the draft vocabulary lacks as misses: at inference
        they are always rejected, so the figure is the acceptance a drafted token can expect."""
        self.module.eval()
        totals = None
        for chunk in _batches(self.held_out, self.batch_size, random.Random(0)):
            with self.autocast():
                counts = self.accuracy(_pad(chunk, self.table, self.device, self.dtype, self.pad_multiple),
                                       top)  # [D, top + 1]
            counts[:, top] += sum(int((self.table[s.ids[s.prompt_len:]] == IGNORE).sum()) for s in chunk)
            totals = counts if totals is None else totals + counts
        self.module.train()
        if totals is None:
            return []
        return (totals[:, :top] / totals[:, top:].clamp(min=1)).tolist()

    def run(self, on_epoch=None, on_checkpoint=None, checkpoint_s: float = 600.0) -> TrainState:
        """Train until the epochs are done or the time bound is hit; returns the state.

        ``on_checkpoint`` is called every ``checkpoint_s`` seconds of training so that a killed
        run loses little; an epoch's batches follow from the seed and the epoch number alone, so
        a resumed run continues exactly where the saved state stopped."""
        self.module.train()
        started = time.monotonic() - self.state.seconds
        saved_at = self.state.seconds
        while self.state.epoch < self.epochs:
            batches = _batches(self.train, self.batch_size, random.Random(f"{self.seed}:{self.state.epoch}"))
            done_in_epoch = self.state.step - self.state.epoch * len(batches)  # resumed mid-epoch
            bar = tqdm(batches[done_in_epoch:], desc=f"epoch {self.state.epoch + 1}/{self.epochs}",
                       unit="batch", disable=not self.progress, file=sys.stderr)
            losses = []
            out_of_time = False
            for chunk in bar:
                loss, figures = self.train_step(chunk)
                losses.append(loss)
                bar.set_postfix(loss=f"{losses[-1]:.3f}", **figures)
                self.state.seconds = time.monotonic() - started
                if on_checkpoint is not None and self.state.seconds - saved_at >= checkpoint_s:
                    on_checkpoint()
                    saved_at = self.state.seconds
                if self.max_seconds is not None and self.state.seconds >= self.max_seconds:
                    out_of_time = True
                    break
            bar.close()
            accuracy = self.evaluate()
            if not out_of_time:
                self.state.epoch += 1
            self.state.history.append(dict(epoch=self.state.epoch, loss=sum(losses) / max(1, len(losses)),
                                           held_out_top1=[row[0] for row in accuracy],
                                           accuracy=accuracy, seconds=round(self.state.seconds, 1),
                                           stopped_early=out_of_time))
            if on_epoch is not None:
                on_epoch(self.state.history[-1])
            if out_of_time:
                break
        return self.state


class MedusaTrainer(Trainer):
    """Head d at position t predicts the token at t + d + 2. With the target's full LM head,
    logits over the whole vocabulary at every position are the dominant cost, so a training step
    scores each head at ``positions`` randomly chosen labelled positions of the batch."""

    positions = 512

    def predictions(self, batch, everywhere: bool):
        ids, feats, answer, all_labels = batch
        out = []
        sample = everywhere and self.module.lm_head is None
        gen = torch.Generator().manual_seed(self.state.step)
        for d in range(self.module.num_heads):
            if answer.shape[1] <= d + 2:
                break
            labels = (all_labels if (everywhere and d == 0) else answer)[:, d + 2 :]
            hidden = feats[:, : -(d + 2)]
            if sample:  # [M] labelled positions, a random subset
                where = torch.nonzero(labels != IGNORE)
                pick = torch.randperm(where.shape[0], generator=gen)[: self.positions]
                rows, cols = where[pick].unbind(1)
                hidden, labels = hidden[rows, cols], labels[rows, cols]
            out.append((self.module.head_logits(d, hidden), labels))
        return out


class EagleTrainer(Trainer):
    def __init__(self, module, embedding: nn.Module, *args, unroll: int = 2, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        self.embedding = embedding  # the target's (frozen)
        self.unroll = unroll

    def predictions(self, batch, everywhere: bool):
        """Logits and labels of each unrolled step: step s's input at t is the head's own output
        of step s - 1 at t - 1 (step 0: the target's features at t), or the mask pair for a head
        that drafts in parallel; either way with the attention of a draft chain."""
        from transformers import DynamicCache

        ids, feats, labels, all_labels = batch
        b, t = ids.shape
        with torch.no_grad():
            embedded = self.embedding(ids[:, 1:]).to(feats.dtype)  # [B, T - 1, H] next-token embeddings
        positions = torch.arange(t - 1, device=ids.device).expand(b, -1)
        cache = DynamicCache(config=self.module.config)
        feature = self.module.fuse(feats[:, :-1])  # [B, T - 1, H]
        out = self.module(feature, embedded, positions, None, cache)  # causal over true pairs
        first = all_labels if everywhere else labels
        results = [(self.module.logits(out[:, :-1]), first[:, 2:])]  # pair t predicts t + 2
        neg = torch.finfo(out.dtype).min
        q = torch.arange(t - 1, device=ids.device)
        for s in range(1, self.unroll + 1):
            if t - 1 - s < 2:
                break
            # step s at position t: own output of step s - 1 at t - 1, and the true token t + 1;
            # a head for parallel drafting gets its mask pair instead (neither is known yet)
            if self.module.parallel:
                feature, step_embedded = self.module.mask_pairs((b, t - 1 - s))  # [B, T - 1 - s, H] each
            else:
                feature, step_embedded = out[:, :-1], embedded[:, s:]  # [B, T - 1 - s, H] each
            rows = q[s:]  # positions of this step's pairs
            allowed = []  # columns: the s earlier steps' cached pairs, then this step's
            for j in range(s + 1):  # step j's pair at position p is visible iff p == row - s + j,
                cols = q[j:] if j > 0 else q  # or (true pairs) p <= row - s
                if j == 0:
                    allowed.append(cols[None, :] <= (rows[:, None] - s))
                else:
                    allowed.append(cols[None, :] == (rows[:, None] - s + j))
            mask = torch.cat(allowed, 1)  # [T - 1 - s, cache + T - 1 - s]
            bias = torch.zeros(mask.shape, dtype=out.dtype, device=ids.device).masked_fill(~mask, neg)[None, None]
            out = self.module(feature, step_embedded, positions[:, s:], bias.expand(b, 1, -1, -1), cache)
            results.append((self.module.logits(out[:, :-1]), labels[:, s + 2 :]))
        return results

def _topk_hits(pairs, top: int) -> torch.Tensor:
    """[len(pairs), top + 1]: per position, hits at rank r (columns 0..top-1) and the total."""
    rows = []
    for logits, labels in pairs:
        valid = labels != IGNORE
        ranks = torch.topk(logits[valid], top, dim=-1).indices  # [M, top]
        hit = ranks == labels[valid].unsqueeze(1)  # [M, top]
        rows.append(torch.cat([hit.sum(0).float(), torch.tensor([float(valid.sum())], device=hit.device)]))
    return torch.stack(rows).cpu()
