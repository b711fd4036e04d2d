"""Self-distillation data for trained drafters: the target's own answers and hidden states.

The target answers the prompts greedily (speclm's built-in training prompts, disjoint from
Spec-Bench, and/or the user's), then one teacher-forced pass per sequence records its hidden
states at the drafter's feature layers. The answers are cached in the speclm cache (shared by
every drafter trained for the same target and prompts), the features in the output folder; both
are keyed by what made them, so a resumed or repeated run does not regenerate them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .train import Sequence

CACHE_FILE = "data-cache.pt"


def _key(target_name: str, fingerprint: float, prompts: list[str], max_new_tokens: int,
         feature_layers: list[int]) -> str:
    text = json.dumps([2, target_name, fingerprint, prompts, max_new_tokens, feature_layers])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.inference_mode()
def hidden_features(model, ids: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states at ``layers`` for every position of ``ids`` ([T]):
    [T, len(layers) * H] float16 on the CPU (index -1: the last layer after the final norm), and
    its greedy choice after each position: [T] int32."""
    wanted = [i % (model.config.num_hidden_layers + 1) for i in layers]
    out = model(input_ids=ids.view(1, -1).to(model.device), use_cache=False,
                output_hidden_states=wanted, logits_to_keep=0)
    features = torch.cat([out.hidden_states[i][0] for i in wanted], dim=-1).to("cpu", torch.float16)
    return features, out.logits[0].argmax(-1).to("cpu", torch.int32)


def build_dataset(model, tokenizer, eos_ids: list[int], prompts: list[str], *, target_name: str,
                  fingerprint: float, feature_layers: list[int], max_new_tokens: int,
                  folder: Path, batch_size: int = 8, progress: bool = True) -> list[Sequence]:
    """Answers + features for ``prompts``, from ``folder``'s cache when it matches."""
    from ..distill.data import target_answers
    from ..models.loading import cache_dir

    key = _key(target_name, fingerprint, prompts, max_new_tokens, feature_layers)
    path = folder / CACHE_FILE
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if cached.get("key") == key:
            print(f"speclm: using cached training data ({len(cached['ids'])} sequences) from {path}",
                  file=sys.stderr)
            return [Sequence(i, int(p), f, n) for i, p, f, n in
                    zip(cached["ids"], cached["prompt_len"], cached["features"], cached["target_next"])]
    answers_key = hashlib.sha256(json.dumps([target_name, fingerprint, prompts, max_new_tokens, []]).encode())
    answers_path = cache_dir() / "answers" / f"{answers_key.hexdigest()[:16]}.pt"
    if answers_path.is_file():
        answers = torch.load(answers_path, weights_only=True)
        pairs = list(zip(answers["ids"], answers["prompt_len"]))
    else:
        examples = target_answers(model, tokenizer, prompts, eos_ids, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, progress=progress)
        pairs = [(e.ids, e.prompt_len) for e in examples]
        answers_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(ids=[i for i, _ in pairs], prompt_len=[p for _, p in pairs]), answers_path)
    sequences = [Sequence(ids, int(plen), *hidden_features(model, ids, feature_layers))
                 for ids, plen in tqdm(pairs, desc="target features", unit="seq", disable=not progress,
                                       file=sys.stderr)]
    torch.save(dict(key=key, ids=[s.ids for s in sequences], prompt_len=[s.prompt_len for s in sequences],
                    features=[s.features for s in sequences], target_next=[s.target_next for s in sequences]),
               path)
    return sequences
