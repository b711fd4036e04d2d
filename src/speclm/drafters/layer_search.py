"""Choosing the layers to skip for self-speculation, by measurement, once per model.

Which layers a model can do without differs from model to model, and what pays off depends on the
machine (on a CPU a multi-token verify costs about twice a one-token step, so the draft must be
cheap *and* right). The search therefore measures, in two stages, on a few calibration prompts
from speclm's own prompt set:

1. **Order the layers** by how little each one changes the residual stream on the target's own
   continuations: block influence, 1 - cos(layer input, layer output), averaged over positions
   (ShortGPT, Men et al. 2024); one forward per prompt. Then measure the teacher-forced top-1
   agreement of a few prefixes of that order with the target (the subset drafting on top of the
   target's cache for the prompt, as it does when it drafts), to see how far skipping can go.
2. **Time the candidates**: each prefix's speedup is predicted from its agreement and measured
   forward times (a one-token step, a (K + 1)-token verify, a one-token draft step: Leviathan et
   al.'s expected tokens per round over the round's cost), and the ``num_candidates`` most
   promising prefixes with agreement above ``floor`` drive real speculative generation on the
   same prompts, interleaved with plain decoding (plain, layer skip, layer skip, plain, each
   side keeping its faster run, because one burst of load on a shared machine can halve a run's
   speed); the measured decode speedup (median over prompts) decides.

The choice, with every measured figure, is cached as JSON under the speclm cache directory, keyed
by the model folder, dtype and device type, so the minutes are spent once per model and machine.
The winner may still be slower than plain decoding (on this project's 2-core CPU it is); the
cached figures say so, and ``--drafter auto`` uses them to leave it out.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..models.hf import HFCausalLM
from ..models.layer_subset import LayerSubset, decoder_layers
from ..models.loading import cache_dir

SEARCH_VERSION = 4  # bump when the procedure changes: older cached choices are then ignored


@dataclass
class SkipChoice:
    skip: list[int]  # the chosen layers to skip
    speedup: float  # measured decode speedup over plain decoding (median over prompts)
    alpha: float  # acceptance of the chosen set on the calibration prompts
    k: int  # draft length used while timing
    num_layers: int
    seconds: float  # how long the search took
    order: list[int] = field(default_factory=list)  # layers in the order they are given up
    influence: list[float] = field(default_factory=list)  # block influence of each layer
    agreement: dict = field(default_factory=dict)  # skipped count -> top-1 agreement
    predicted: dict = field(default_factory=dict)  # skipped count -> speedup predicted from costs
    step_costs_ms: dict = field(default_factory=dict)  # measured forward times behind the prediction
    candidates: list[dict] = field(default_factory=list)  # every timed candidate and its figures
    version: int = SEARCH_VERSION


def cache_file(model_path: Path, target: HFCausalLM) -> Path:
    """Where the choice for this model folder, dtype and device type is kept."""
    path = Path(model_path).resolve()
    config = (path / "config.json").read_bytes() if (path / "config.json").is_file() else b""
    key = hashlib.sha256(b"|".join([str(path).encode(), config, str(target.dtype).encode(),
                                    target.device.type.encode()])).hexdigest()[:12]
    return cache_dir() / "layerskip" / f"{path.name}-{key}.json"


def load_choice(path: Path) -> SkipChoice | None:
    """A cached choice, or None when there is none (or it is from an older search)."""
    try:
        data = json.loads(Path(path).read_text())
        choice = SkipChoice(**data)
    except (OSError, ValueError, TypeError):
        return None
    return choice if choice.version == SEARCH_VERSION else None


def save_choice(path: Path, choice: SkipChoice) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(choice), indent=1))
    tmp.replace(path)  # atomic: readers never see half a file


def calibration_prompts(tokenizer, num: int, max_len: int) -> list[torch.Tensor]:
    """``num`` prompts from speclm's default set, one per category, as token ids [n]."""
    from ..prompts import encode_user_turn, load_prompts, spread

    return [torch.tensor(encode_user_turn(tokenizer, row["turns"][0], max_len), dtype=torch.long)
            for row in spread(load_prompts(), num)]


@torch.inference_mode()
def block_influence(target: HFCausalLM, sequences: list[torch.Tensor], starts: list[int]) -> list[float]:
    """Per layer: mean over positions ``start..`` of 1 - cos(input, output) of that layer."""
    layers = decoder_layers(target.model)
    sums = [0.0] * len(layers)
    count = 0
    current: dict[str, int] = {}

    def hook(index: int):
        def record(module, args, kwargs, output):
            h_in = (args[0] if args else kwargs["hidden_states"])[0, current["start"] :]  # [T', H]
            h_out = (output[0] if isinstance(output, tuple) else output)[0, current["start"] :]
            cos = torch.nn.functional.cosine_similarity(h_in.float(), h_out.float(), dim=-1)  # [T']
            sums[index] += float((1 - cos).sum())
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for seq, start in zip(sequences, starts):
            current["start"] = start
            target.model(input_ids=seq.view(1, -1).to(target.device), use_cache=False)
            count += seq.shape[0] - start
    finally:
        for handle in handles:
            handle.remove()
    return [value / max(1, count) for value in sums]


class _Agreement:
    """Teacher-forced top-1 agreement of a layer subset with the target's own continuations.

    Each prompt sits in the cache of its own fork of the target (the same weights); the subset
    runs the pending token and the continuation on top of it, exactly as a draft of that length
    would (the target's states for the prompt, its own for the drafted tokens), and its argmax
    at each position is compared with the token the target chose there.
    """

    def __init__(self, target: HFCausalLM, prompts: list[torch.Tensor], continuations: list[list[int]]):
        self.cases = []
        for prompt, cont in zip(prompts, continuations):
            fork = target.fork()
            if prompt.shape[0] > 1:
                fork.forward(prompt[:-1], 0)
            fed = torch.cat([prompt[-1:], torch.tensor(cont[:-1], dtype=torch.long)])  # [T]
            self.cases.append((fork, prompt.shape[0] - 1, fed, torch.tensor(cont, dtype=torch.long)))
        self.total = sum(len(c) for c in continuations)

    def __call__(self, skip: list[int]) -> float:
        if not skip:
            return 1.0
        hits = 0
        for fork, start, fed, wanted in self.cases:
            subset = LayerSubset(fork, skip)
            logits = subset.forward(fed, start, num_logits=fed.shape[0])  # [T, V]
            subset.discard()
            hits += int((logits.argmax(-1).cpu() == wanted).sum())
        return hits / max(1, self.total)


def _expected_tokens(alpha: float, k: int) -> float:
    """Tokens per round with i.i.d. acceptance alpha and k draft tokens."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _step_costs(case, skips: list[list[int]], k: int, reps: int = 5) -> dict:
    """Best-of-``reps`` seconds of a one-token target step ("plain"), a (k + 1)-token verify ("verify"),
    and a one-token draft step per layer set (keys listed in "draft")."""
    fork, start, fed, _ = case

    def best_time(call) -> float:  # the fastest of a few (after a warm-up): robust to load bursts
        call()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return min(times)

    def target_step(tokens: torch.Tensor) -> None:
        fork.forward(tokens, start, num_logits=tokens.shape[0])
        fork.rollback(start)

    costs: dict = {"plain": best_time(lambda: target_step(fed[:1])),
                   "verify": best_time(lambda: target_step(fed[: k + 1])), "draft": []}
    for skip in skips:
        subset = LayerSubset(fork, skip)

        def draft_step() -> None:
            subset.forward(fed[:1], start)
            subset.discard()

        key = f"draft_skip{len(skip)}"
        costs[key] = best_time(draft_step)
        costs["draft"].append(key)
    return costs


def _decode_rate(stats) -> float:
    decode = stats.total_time_s - stats.prefill_time_s
    return stats.generated_tokens / decode if decode > 0 else 0.0


def search_skip(
    target: HFCausalLM,
    tokenizer,
    *,
    k: int = 3,
    num_prompts: int = 3,
    max_tokens: int = 32,
    floor: float = 0.3,
    max_fraction: float = 0.6,
    num_candidates: int = 2,
    max_seconds: float = 240.0,
    progress: bool = True,
) -> SkipChoice:
    """Search the layers to skip (see the module docstring). No candidate is timed after
    ``max_seconds``, so the search stays within a few minutes (more on a busy machine)."""
    from ..draft_length import DraftLengthConfig
    from ..engine import generate_tokens
    from ..sampling import SamplingParams
    from ..stats import RequestStats
    from .layer_skip import LayerSkipDrafter

    start = time.perf_counter()
    num_layers = len(decoder_layers(target.model))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = calibration_prompts(tokenizer, num_prompts,
                                  max_len=max(2, min(192, target.max_context - max_tokens - 2)))

    def run(prompt: torch.Tensor, skip: list[int] | None):
        stats = RequestStats()
        drafter = LayerSkipDrafter(target, skip) if skip else None
        out = [t for step in generate_tokens(target, prompt, params, drafter=drafter,
                                             draft_length=DraftLengthConfig(k), stats=stats)
               for t in step.tokens]
        return out, stats

    max_skip = max(1, min(num_layers - 1, round(num_layers * max_fraction)))
    sizes = sorted({max(1, round(max_skip * j / 6)) for j in range(1, 7)})  # agreement checkpoints
    bar = tqdm(total=len(prompts) * (1 + 4 * num_candidates) + len(sizes), desc="layer search",
               unit="step", disable=not progress, file=sys.stderr)
    plain = []
    for prompt in prompts:  # also warms the model up
        plain.append(run(prompt, None))
        bar.update(1)
    conts = [out for out, _ in plain]

    # 1. the order in which layers are given up, and how far that can go
    influence = block_influence(target, [torch.cat([p, torch.tensor(c)]) for p, c in zip(prompts, conts)],
                                [p.shape[0] - 1 for p in prompts])
    order = sorted(range(num_layers), key=lambda i: influence[i])[:max_skip]
    agreement_of = _Agreement(target, prompts, conts)
    agreement: dict[int, float] = {}
    for size in sizes:
        agreement[size] = agreement_of(order[:size])
        bar.update(1)
        if agreement[size] < floor:
            break

    # 2. predict each prefix's speedup from measured step costs (Leviathan et al.: expected
    #    tokens per round over the round's cost), then time the most promising ones for real
    costs = _step_costs(agreement_of.cases[0], [order[:size] for size in agreement], k)
    predicted = {size: _expected_tokens(a, k) * costs["plain"] / (costs["verify"] + k * costs[size_key])
                 for (size, a), size_key in zip(agreement.items(), costs["draft"])}
    ranked = sorted((size for size, a in agreement.items() if a >= floor), key=lambda size: -predicted[size])
    picks = (ranked or [min(agreement)])[:num_candidates]
    bar.total = bar.n + 4 * len(prompts) * len(picks)
    bar.refresh()
    candidates = []
    for size in picks:
        skip = sorted(order[:size])
        ratios, accepted, drafted, identical = [], 0, 0, True
        for i, prompt in enumerate(prompts):
            # plain, spec, spec, plain (then the mirror order): on a shared machine a burst of
            # load can halve one run's speed, so each side keeps the faster of its two runs
            rates = {"plain": [], "spec": []}
            for which in (["plain", "spec", "spec", "plain"] if i % 2 == 0 else ["spec", "plain", "plain", "spec"]):
                out, stats = run(prompt, skip if which == "spec" else None)
                rates[which].append(_decode_rate(stats))
                if which == "spec":
                    accepted += stats.accepted_tokens
                    drafted += stats.drafted_tokens
                    identical &= out == conts[i]
                bar.update(1)
            ratios.append(max(rates["spec"]) / max(max(rates["plain"]), 1e-9))
        candidates.append(dict(skip=skip, kept=num_layers - len(skip), agreement=agreement[size],
                               predicted=predicted[size], speedup=statistics.median(ratios),
                               alpha=accepted / max(1, drafted), identical=identical))
        if len(candidates) >= 2 and time.perf_counter() - start > max_seconds:
            break
    bar.close()
    best = max(candidates, key=lambda c: c["speedup"])
    return SkipChoice(skip=best["skip"], speedup=best["speedup"], alpha=best["alpha"], k=k,
                      num_layers=num_layers, seconds=time.perf_counter() - start, order=order,
                      influence=[round(v, 5) for v in influence],
                      agreement={str(size): a for size, a in agreement.items()},
                      predicted={str(size): round(p, 3) for size, p in predicted.items()},
                      step_costs_ms={key: round(value * 1e3, 2) for key, value in costs.items() if key != "draft"},
                      candidates=candidates)


def choose_skip(target: HFCausalLM, tokenizer, model_path: Path | None, *, refresh: bool = False,
                progress: bool = True, **search) -> tuple[SkipChoice, str]:
    """The cached choice for this model, or a new search (then cached). Returns (choice, origin)
    with origin "cached" or "searched"; without a model folder nothing is cached."""
    path = cache_file(model_path, target) if model_path is not None else None
    if path is not None and not refresh:
        choice = load_choice(path)
        if choice is not None and choice.num_layers == len(decoder_layers(target.model)):
            return choice, "cached"
    if progress:
        print("speclm: searching which layers to skip for this model (once; cached"
              + (f" in {path}" if path else "") + ")", file=sys.stderr)
    choice = search_skip(target, tokenizer, progress=progress, **search)
    if path is not None:
        try:
            save_choice(path, choice)
        except OSError as exc:
            print(f"speclm: could not cache the layer choice at {path}: {exc.strerror}", file=sys.stderr)
    return choice, "searched"
