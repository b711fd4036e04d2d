"""A draft's output layer over part of the vocabulary (the quantized self-draft's ``vocab=N``).

An output layer reads one weight row per vocabulary entry at every forward. For a small model
with a large vocabulary that is most of what a forward reads: Gemma-3-270M's 262,144 x 640 head
holds 168M of its 268M parameters. A draft only proposes; the verifier judges every drafted
token against the target's full distribution, so a draft whose logits cover N tokens (the rest
-inf, q_draft = 0 there) stays lossless: where the target's token lies outside the N, the draft
is rejected there and the target's own token is emitted (recovered or bonus), as for any miss.
What it costs is acceptance at those positions, and what it buys is a forward that reads N rows
instead of V.

Which N tokens: those the target itself predicts most. :func:`target_prior` runs the target over
speclm's own prompts (``data/*.jsonl``: a few thousand tokens of requests and short texts, none
from a benchmark) and adds up its predicted distribution at every position, a soft count of
what it writes: the mass spreads over every plausible next token, not only the one in the text.
The ranking (:func:`prior_ranking`) is by that mass, and where it is nil, by the tokenizer's own
order (:func:`ranked_vocabulary`: single-character pieces first, which SentencePiece vocabularies
list after the merges, then BPE merge order, most frequent first). It is computed once per model
file (seconds to a minute on a CPU) and cached under ``<cache dir>/vocab/``. The end-of-sequence
ids are always kept. docs/benchmarks.md has the coverage and the acceptance it gives.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from ..errors import SpeclmError

WORD_MARKS = ("\u2581", "\u0120")  # SentencePiece's and byte-level BPE's word-start markers
PRIOR_TOKENS = 2048  # positions of speclm's own prompts the target's prior is summed over
PRIOR_VERSION = 1  # of the ranking's method: part of its cache key
_RANKINGS: dict[tuple[Path, int], torch.Tensor] = {}  # this process's rankings, by (cache file, max_tokens)


def ranked_vocabulary(tokenizer, vocab_size: int) -> torch.Tensor:
    """Every id of a ``vocab_size`` vocabulary, the likeliest to be used first, without data:
    single-character pieces (a word-start marker aside), then by id (BPE merge order); ids the
    tokenizer does not name (padded embedding rows) last. A tokenizer that cannot name its
    pieces: by id."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    except (AttributeError, TypeError, ValueError):
        return torch.arange(vocab_size)

    def rank(i: int) -> tuple[int, int]:
        piece = pieces[i] if i < len(pieces) else None
        if piece is None:
            return (2, i)
        for mark in WORD_MARKS:
            piece = piece.replace(mark, "")
        return (0 if len(piece) <= 1 else 1, i)

    return torch.tensor(sorted(range(vocab_size), key=rank))


def shipped_texts(max_tokens: int, tokenizer) -> list[list[int]]:
    """speclm's own prompts (the bench's default set, then the distillation prompts), tokenized,
    up to ``max_tokens`` tokens in all."""
    from ..prompts import DEFAULT_PROMPTS, load_prompts

    out, total = [], 0
    for path in (DEFAULT_PROMPTS, DEFAULT_PROMPTS.with_name("distill_prompts.jsonl")):
        for row in load_prompts(path):
            for turn in row["turns"]:
                ids = list(tokenizer(turn)["input_ids"])[: max_tokens - total]
                if len(ids) > 1:
                    out.append(ids)
                    total += len(ids)
                if total >= max_tokens:
                    return out
    return out


@torch.no_grad()
def target_prior(model: nn.Module, texts: list[list[int]], progress: bool = False) -> torch.Tensor:
    """The sum over every position of ``texts`` of ``model``'s predicted distribution [V]
    (float64): a soft count of the tokens the model writes. ``model``: a transformers causal LM."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    total = None
    for ids in tqdm(texts, desc="draft vocabulary (once per model)", unit="text", disable=not progress,
                    leave=False):
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]  # [T, V]
        mass = logits.float().softmax(-1).sum(0).double().cpu()  # [V]
        total = mass if total is None else total + mass
    return total


def prior_ranking(model: nn.Module, tokenizer, vocab_size: int, path: Path | None = None, *,
                  max_tokens: int = PRIOR_TOKENS, progress: bool = False) -> torch.Tensor:
    """Every id, the tokens ``model`` predicts most on speclm's own prompts first
    (:func:`target_prior`), then the rest in :func:`ranked_vocabulary`'s order [V]. Cached in
    the file ``path`` (named by the caller for the model file and ``max_tokens``; None: computed
    every time) and in this process."""
    memo = None if path is None else (path, max_tokens)
    if memo in _RANKINGS:  # a server asks at every request it admits
        return _RANKINGS[memo]
    if path is not None and path.exists():
        try:
            ranking = torch.load(path, weights_only=True).long()
            if ranking.shape == (vocab_size,):
                _RANKINGS[memo] = ranking
                return ranking
        except (OSError, RuntimeError, ValueError):
            pass
    fallback = ranked_vocabulary(tokenizer, vocab_size)
    prior = target_prior(model, shipped_texts(max_tokens, tokenizer), progress)
    if prior is None or prior.numel() < vocab_size:
        return fallback
    ranking = fallback[torch.argsort(-prior[:vocab_size][fallback], stable=True)]
    if path is not None:
        _RANKINGS[memo] = ranking
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(ranking.to(torch.int32), tmp)
            os.replace(tmp, path)
        except OSError:
            pass
    return ranking


def draft_vocabulary(ranking: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The first ``size`` ids of ``ranking`` (every id of the vocabulary, likeliest first) with
    ``always`` (end-of-sequence ids) among them, ascending [size]."""
    vocab_size = ranking.numel()
    if not 0 < size < vocab_size:
        raise SpeclmError(f"a draft vocabulary takes 1 to {vocab_size - 1} of the target's {vocab_size} tokens "
                          f"(quant: vocab=0 keeps them all), got {size}")
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[torch.tensor([i for i in always if 0 <= i < vocab_size], dtype=torch.long)] = True
    rest = ranking[~chosen[ranking]][: max(size - int(chosen.sum()), 0)]
    chosen[rest] = True
    return chosen.nonzero().flatten()


class SubsetHead(nn.Module):
    """An output layer over ``ids`` (N of a V-token vocabulary) whose logits come back V wide,
    -inf outside ``ids``: a drop-in ``lm_head`` for a draft (nothing downstream changes).
    ``layer`` maps [..., H] to [..., N] (a float or quantized linear over the rows ``ids``)."""

    def __init__(self, layer: nn.Module, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("ids", ids.to(torch.long))  # [N], ascending
        self.in_features, self.out_features = int(getattr(layer, "in_features", 0)), int(vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.layer(x)  # [..., N]
        full = part.new_full((*part.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return full.index_copy(-1, self.ids, part)

    def extra_repr(self) -> str:
        return f"{self.ids.numel()} of {self.out_features} tokens"


def restrict_head(model: nn.Module, source: nn.Module, ids: torch.Tensor, make_layer) -> SubsetHead:
    """Give ``model`` an output layer over ``ids`` only: the rows ``ids`` of ``source``'s float
    output weights (the full-precision model's), through ``make_layer`` (an ``nn.Linear`` of
    those rows -> the layer to run, e.g. quantized). Returns the new head."""
    head = source.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise SpeclmError(f"{type(source).__name__}'s output layer has no float weight to take rows from")
    rows = weight.detach()[ids.to(weight.device)]  # [N, H]
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    with torch.no_grad():
        linear.weight.copy_(rows)
        bias = getattr(head, "bias", None)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach()[ids.to(bias.device)].clone())
    subset = SubsetHead(make_layer(linear), ids.to(weight.device), int(weight.shape[0]))
    model.set_output_embeddings(subset)
    return subset
