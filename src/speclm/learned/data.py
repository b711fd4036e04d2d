"""Self-distillation data for trained drafters: the target's own answers and hidden states.

Three resumable stages, each with a progress bar:

1. (optional) prompts the target writes itself (speclm.learned.self_prompts);
2. the target's greedy answers, then (optional) its answers to prompts built on those answers
   (speclm.learned.passage_prompts), every prompt a row of the batched engine, kept in an answer
   store in the speclm cache (speclm.learned.answers) shared by every drafter trained for the
   same target and answer length;
3. the target's features at the drafter's layers over prompt + answer, in bfloat16 shards in the
   drafter's output folder (speclm.learned.features): recorded in the same pass as the answers
   it makes, recomputed by teacher-forced forwards for answers made earlier.

A rerun skips what exists: answers by prompt, features by answer.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .answers import AnswerStore, answer_prompts, answers_folder, text_key
from .features import FeatureShards, record_features
from .passage_prompts import passage_prompts
from .train import Sequence

FEATURES_DIR = "features"


def build_dataset(backend, tokenizer, prompts: list[str], *, target_name: str, fingerprint: float,
                  feature_layers: list[int], max_new_tokens: int, folder: Path, rows: int = 64,
                  deadline: float | None = None, max_feature_bytes: int | None = None,
                  load: bool = True, progress: bool = True, passages: int = 0,
                  seed: int = 0) -> list[Sequence] | None:
    """Answers (up to ``deadline``) and features for ``prompts`` and ``passages`` prompts built on
    their answers: the sequences to train on (None with ``load=False``: the data are made and
    kept, not read back).
    ``backend``: the target as a speclm backend (``LoadedModel.backend``, eager torch)."""
    from ..models.loading import cache_dir

    store = AnswerStore(answers_folder(cache_dir(), target_name, fingerprint, "torch", max_new_tokens))
    shards = FeatureShards(Path(folder) / FEATURES_DIR,
                           dict(target=target_name, fingerprint=fingerprint, layers=list(feature_layers),
                                max_new_tokens=max_new_tokens))

    def answer(todo: list[str]):
        report = answer_prompts(backend, tokenizer, todo, store, max_new_tokens=max_new_tokens, rows=rows,
                                deadline=deadline, features=shards, feature_layers=list(feature_layers),
                                max_feature_bytes=max_feature_bytes, progress=progress)
        if report.requests:
            print(f"speclm: {report.requests} answers, {report.tokens} tokens in {report.seconds / 60:.1f} "
                  f"min ({report.tokens_per_s:.0f} tokens/s, {rows} rows) -> {store.path}", file=sys.stderr)
        if report.stopped_early:
            print("speclm: the data time bound came first; the next run answers the rest", file=sys.stderr)
        return report

    report = answer(prompts)
    if passages and not report.stopped_early:
        by_key = {a.key: a for a in store.answers([text_key(p) for p in prompts])}
        answered = [(p, by_key[text_key(p)]) for p in dict.fromkeys(prompts) if text_key(p) in by_key]
        made = passage_prompts(answered, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                               passages, seed=seed)
        print(f"speclm: {len(made)} prompts built on the target's answers", file=sys.stderr)
        prompts = prompts + made
        more = answer(made)
        report.requests += more.requests
    answers = store.answers([text_key(p) for p in prompts])
    recorded = record_features(backend.model, answers, shards, list(feature_layers),
                               max_bytes=max_feature_bytes, progress=progress)
    if not report.requests and not recorded:
        print(f"speclm: using cached training data ({len(answers)} answers from {store.path}, features "
              f"from {shards.folder})", file=sys.stderr)
    return shards.load({a.key for a in answers}) if load else None
