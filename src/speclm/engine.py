"""The speculative decoding loop, as a generator of committed tokens.

Invariant: the target's cache holds every committed token but the last (the *pending* token).
One round:

1. the drafter proposes k tokens continuing the committed tokens (k = 0: plain decoding), as a
   chain or as a token tree;
2. the target runs [pending, d_1 .. d_k] in one forward (a chain at positions n-1 .. n-1+k; a
   tree at n-1 + depth under the tree mask), giving logits [k+1, V] where row 0 judges the first
   draft position and row i + 1 the children of d_{i+1} (or the bonus position);
3. the verifier accepts a path d_1 .. d_a and draws one more token (recovered or bonus);
4. the target's cache keeps the accepted path (a crop for a chain), the drafter is told the
   verdict, and the a+1 tokens are committed; a drafter that asks for it
   (``wants_target_topk``, drafters/base.py) is also handed the target's top-k ids at every
   verified position, taken on the device before the sync.

Plain decoding is the same loop with no drafter, so the baseline shares the sampler, the cache
and the timing code with every speculative method. The loop makes one host sync per round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .cost_model import CostModel
from .draft_length import DraftLengthConfig, DraftLengthPolicy
from .drafters.base import Draft, DraftContext, Drafter, drafter_report, wanted_target_topk
from .errors import SpeclmError
from .models.base import CausalLM
from .sampling import SamplingParams
from .stats import RequestStats
from .verifier import verify


@dataclass
class Step:
    """Tokens committed by one round (EOS included when it ends the request)."""

    tokens: list[int]
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens or context) or None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # honest timing: wait for queued kernels
        torch.cuda.synchronize(device)


def _features(out, layers: tuple[int, ...], rows: list[int] | None) -> torch.Tensor:
    """The drafter's requested hidden layers at ``rows`` (None: all), concatenated: [T, L * H]."""
    hidden = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # [T_fed, L * H]
    return hidden if rows is None else hidden[rows]


def generate_tokens(
    target: CausalLM,
    prompt_ids: torch.Tensor,
    params: SamplingParams,
    *,
    drafter: Drafter | None = None,
    draft_length: DraftLengthConfig | None = None,
    stats: RequestStats | None = None,
    generator: torch.Generator | None = None,
    cost_model: CostModel | None = None,
) -> Iterator[Step]:
    """Generate from ``prompt_ids`` ([n] int64), yielding each round's committed tokens.

    ``stats`` (if given) is filled in as the generation runs, and is complete once the generator
    is exhausted or closed. ``cost_model``: the target's measured verify cost, the adaptive
    draft length's starting point (speclm.cost_model).
    """
    stats = stats if stats is not None else RequestStats()
    config = draft_length or DraftLengthConfig()
    policy = DraftLengthPolicy(config, cost_model) if drafter is not None else None
    feature_layers = getattr(drafter, "feature_layers", None) if drafter is not None else None
    feedback_k = min(wanted_target_topk(drafter), target.vocab_size)  # 0 unless the drafter asks
    gen = generator if generator is not None else params.make_generator(target.device)
    prompt_ids = prompt_ids.detach().to("cpu", torch.long).flatten()
    n = prompt_ids.shape[0]
    if n == 0:
        raise SpeclmError("the prompt is empty")
    if n >= target.max_context:
        raise SpeclmError(f"the prompt has {n} tokens but the model's context is {target.max_context}")

    start = time.perf_counter()
    stats.prompt_tokens = n
    tokens = torch.empty(min(target.max_context, n + params.max_tokens), dtype=torch.long)
    tokens[:n] = prompt_ids
    try:
        target.reset()
        if drafter is not None:
            drafter.reset(prompt_ids)
        if n > 1:  # prefill all but the pending token
            out = target.forward(tokens[: n - 1], 0, return_hidden=feature_layers or False)
            if feature_layers:
                drafter.on_target_features(_features(out, feature_layers, None))
            _sync(target.device)
        stats.prefill_time_s = time.perf_counter() - start
        generated = 0
        while True:
            # -- draft ---------------------------------------------------------------------
            t0 = time.perf_counter()
            budget = min(params.max_tokens - generated, target.max_context - n) - 1
            k_max = min(policy.next_k(getattr(drafter, "probing", False)), budget) if policy is not None else 0
            draft, proposed = Draft.empty(), k_max > 0
            if proposed:
                draft = drafter.propose(DraftContext(tokens[:n], k_max, params, gen))
                if draft.depth > k_max:
                    raise RuntimeError(f"{type(drafter).__name__} proposed a draft of depth "
                                       f"{draft.depth}, more than the {k_max} it was asked for")
                # Dropping a short draft is only lossless when the draft is a function of the
                # context (greedy or prompt lookup). A sampled draft's length depends on its own
                # draws, so dropping it would skew the accepted tokens: verify it anyway.
                if draft.depth < config.draft_min and draft.q_draft is None:
                    draft = Draft.empty()
                _sync(target.device)
            k = draft.num_tokens
            t1 = time.perf_counter()
            # -- verify --------------------------------------------------------------------
            fed = torch.cat([tokens[n - 1 : n], draft.tokens.cpu()])  # [k + 1]
            out = target.forward(fed, n - 1, num_logits=k + 1, tree=draft.tree,
                                 return_hidden=feature_layers or False)
            verdict = verify(out.logits, draft.to(out.logits.device), params, gen)  # logits [k + 1, V]
            # queued before the sync, so a drafter's feedback costs no extra sync: [k + 1, t]
            target_topk = out.logits.topk(feedback_k, dim=-1).indices if feedback_k else None
            result = torch.cat([verdict.num_accepted.view(1), verdict.tokens, verdict.path]).tolist()  # sync
            num_accepted, emitted = result[0], result[1 : result[0] + 2]
            path = result[k + 2 : k + 2 + num_accepted]  # accepted node indices, in order
            target.compact(n, path)  # keeps [0, n) and the accepted nodes' entries
            if feature_layers:  # every round: rows of the pending token and the accepted nodes
                drafter.on_target_features(_features(out, feature_layers, [0] + [i + 1 for i in path]))
            if proposed:
                drafter.on_verified(num_accepted, emitted)
            if target_topk is not None:
                drafter.on_target_topk(fed, target_topk)
            t2 = time.perf_counter()
            stats.draft_time_s += t1 - t0
            stats.target_time_s += t2 - t1
            stats.record_round(k, num_accepted, draft.depth)
            if policy is not None:
                policy.update(draft.depth, num_accepted, t1 - t0, t2 - t1)  # K is a depth (trees)
            # -- commit --------------------------------------------------------------------
            tokens[n : n + len(emitted)] = torch.tensor(emitted)
            n += len(emitted)
            finish = None
            if not params.ignore_eos:
                for i, tok in enumerate(emitted):
                    if tok in target.eos_token_ids:
                        emitted, finish = emitted[: i + 1], "stop"
                        break
            generated += len(emitted)
            stats.generated_tokens = generated
            if finish is None and (generated >= params.max_tokens or n >= tokens.shape[0]):
                finish = "length"
            yield Step(emitted, finish)
            if finish is not None:
                return
    finally:
        close = getattr(drafter, "finish", None)
        if callable(close):  # a drafter's worker threads never outlive the request
            close()
        stats.total_time_s = time.perf_counter() - start
        stats.drafter_report = drafter_report(drafter)
