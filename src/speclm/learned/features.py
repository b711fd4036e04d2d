"""The target's hidden states over its own answers, in bfloat16 shards that a run can resume.

A trained drafter reads the target's features (hidden states at its feature layers) at every
position of prompt + answer. They are recomputed from the stored answers by teacher-forced
forwards of the transformers model, several answers per forward (right-padded: attention is
causal, so padding after a row's end changes none of its positions), and written as shards of
about ``shard_tokens`` positions: ``shard-00000.pt`` ... Each shard is written to a temporary
name and renamed, and the folder's ``index.json`` (which answer keys each shard holds) is
rewritten after it, so an interrupted run loses at most the shard in progress. ``max_bytes``
bounds the folder: recording stops, with a message, before a shard would pass it.

Features for 3 layers of a 576-wide model are 3.5 KB per position in bfloat16: 2M answer
positions (with their prompts, ~3M) take about 10 GB, so the bound matters.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SpeclmError
from .answers import Answer
from .train import Sequence

INDEX_FILE = "index.json"


class FeatureShards:
    """A folder of feature shards for one target and feature-layer set."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        index = self.folder / INDEX_FILE
        self.shards: dict[str, list[str]] = {}
        if index.is_file():
            saved = json.loads(index.read_text())
            if saved.get("meta") != meta:
                raise SpeclmError(f"{self.folder} holds features of another target or layer set; "
                                  "remove it or use another --out")
            self.shards = saved["shards"]
        self.keys = {k for keys in self.shards.values() for k in keys}
        self.nbytes = sum((self.folder / name).stat().st_size for name in self.shards)  # on disk

    def write(self, sequences: list[tuple[str, Sequence]]) -> None:
        name = f"shard-{len(self.shards):05d}.pt"
        tmp = self.folder / (name + ".tmp")
        torch.save(dict(keys=[k for k, _ in sequences], ids=[s.ids for _, s in sequences],
                        prompt_len=[s.prompt_len for _, s in sequences],
                        features=[s.features for _, s in sequences],
                        target_next=[s.target_next for _, s in sequences]), tmp)
        tmp.replace(self.folder / name)
        self.nbytes += (self.folder / name).stat().st_size
        self.shards[name] = [k for k, _ in sequences]
        self.keys.update(self.shards[name])
        index = self.folder / (INDEX_FILE + ".tmp")
        index.write_text(json.dumps(dict(meta=self.meta, shards=self.shards)))
        index.replace(self.folder / INDEX_FILE)

    def load(self, keys: set[str] | None = None) -> list[Sequence]:
        """Every stored sequence (of ``keys`` only, if given), in shard order."""
        out = []
        for name in self.shards:
            shard = torch.load(self.folder / name, weights_only=True)
            for k, ids, plen, feats, nxt in zip(shard["keys"], shard["ids"], shard["prompt_len"],
                                                shard["features"], shard["target_next"]):
                if keys is None or k in keys:
                    out.append(Sequence(ids, int(plen), feats, nxt, k))
        return out


@torch.inference_mode()
def batch_features(model, batch: list[Answer], layers: list[int],
                   dtype: torch.dtype = torch.bfloat16) -> list[Sequence]:
    """One teacher-forced forward over ``batch`` (right-padded): each answer's features at
    ``layers`` ([T, len(layers) * H] in ``dtype``; index -1: the last layer after the final norm)
    and the target's greedy choice after each position ([T] int32)."""
    wanted = [i % (model.config.num_hidden_layers + 1) for i in layers]
    width = max(len(a.ids) for a in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, T], right-padded with token 0
    for b, a in enumerate(batch):
        ids[b, : len(a.ids)] = torch.tensor(a.ids)
    out = model(input_ids=ids.to(model.device), use_cache=False, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in wanted], dim=-1)  # [B, T, L * H]
    chosen = out.logits.argmax(-1).to("cpu", torch.int32)  # [B, T]
    return [Sequence(ids[b, : len(a.ids)].clone(), a.prompt_len,
                     feats[b, : len(a.ids)].to("cpu", dtype), chosen[b, : len(a.ids)].clone())
            for b, a in enumerate(batch)]


def record_features(model, answers: list[Answer], shards: FeatureShards, layers: list[int], *,
                    batch_tokens: int = 2048, shard_tokens: int = 65536, max_bytes: int | None = None,
                    progress: bool = True) -> int:
    """Features for the ``answers`` the shards lack; returns how many were recorded. Answers
    are sorted by length so a forward pads little."""
    todo = sorted((a for a in answers if a.key not in shards.keys), key=lambda a: len(a.ids))
    if not todo:
        return 0
    per_token = 2 * model.config.hidden_size * len(layers) + 12  # bf16 features, ids, labels
    bar = tqdm(total=sum(len(a.ids) for a in todo), desc="target features", unit="tok", unit_scale=True,
               disable=not progress, file=sys.stderr)
    pending: list[tuple[str, Sequence]] = []
    pending_tokens = done = 0
    start = time.monotonic()
    i = 0
    try:
        while i < len(todo):
            batch = [todo[i]]
            while i + len(batch) < len(todo) and (len(batch) + 1) * len(todo[i + len(batch)].ids) <= batch_tokens:
                batch.append(todo[i + len(batch)])
            tokens = sum(len(a.ids) for a in batch)
            if max_bytes is not None and shards.nbytes + (pending_tokens + tokens) * per_token > max_bytes:
                print(f"speclm: stopped recording features at the disk bound ({max_bytes / 2**30:.1f} GiB); "
                      f"{len(todo) - i} answers left without them", file=sys.stderr)
                break
            for a, seq in zip(batch, batch_features(model, batch, layers)):
                pending.append((a.key, seq))
            i += len(batch)
            pending_tokens += tokens
            bar.update(tokens)
            if pending_tokens >= shard_tokens:
                shards.write(pending)
                done += len(pending)
                pending, pending_tokens = [], 0
    finally:
        if pending:
            shards.write(pending)
            done += len(pending)
        bar.close()
    if progress:
        print(f"speclm: features for {done} answers in {time.monotonic() - start:.0f} s", file=sys.stderr)
    return done
