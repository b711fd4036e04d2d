"""A measured cost model of the target: seconds per forward as a function of the tokens fed.

Whether speculation pays depends on what a verify of ``T = 1 + K`` tokens costs next to a plain
one-token step, and that differs by orders of magnitude between machines and backends: on a GPU
it is nearly flat in T; on a CPU a forward over 8 tokens costs about twice a one-token step
(torch), and llama.cpp's quantized kernels cost about ``1 + 0.3 (T - 1)`` steps. Defaults tuned
on one of them run other models 20-30 % slower than plain decoding. So on first use of a
(model file, backend, dtype, threads, device) combination speclm times forwards of T = 1..32
tokens for at most a few seconds (interleaved, medians of several repetitions, after one
untimed warm-up of each width) and caches the curve under the cache directory
(``$SPECLM_CACHE_DIR/cost/``, default ``~/.cache/speclm/cost``). A cache written by another
version of this measurement, or for another model file (size or modification time changed), is
measured again.

The curve is kept as measured (medians per width) and read by linear interpolation, extrapolated
along the last segment's slope; :meth:`CostModel.summary` also states the least-squares line
``v(T) = v(1) (1 + slope (T - 1))``. :class:`~speclm.draft_length.DraftLengthPolicy` starts from
it (scaled by the live step times, so a busier machine moves the whole curve) instead of
learning the verify cost from scratch, and the server's batched policy takes it as its prior.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .models.small_m import build_name, kernel_in_use

VERSION = 1  # of the measurement: caches of another version are measured again
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # tokens per forward (1 + K)
_PRIORITY = (1, 2, 4, 8, 16, 32, 3, 6, 12, 24)  # the same, in the order they are measured
_CONTEXT = 48  # tokens prefilled before timing (a short prompt's worth)
_NOISY = 3.0  # slowest / fastest plain step beyond which a measurement is not cached


@dataclass
class CostModel:
    """Median seconds of one target forward of ``widths[i]`` tokens (logits for all of them,
    as a verify asks), for the combination ``key`` describes."""

    widths: list[int]
    seconds: list[float]
    key: dict = field(default_factory=dict)
    origin: str = "measured"  # "measured" now, or "cached"
    measure_s: float = 0.0  # wall time the measurement took
    asked: int = 0  # the widest forward asked for (a slow model may have measured fewer)
    noisy: bool = False  # plain steps varied more than _NOISY-fold while measuring: not cached

    @property
    def plain_s(self) -> float:
        """One plain decoding step."""
        return self.verify_s(1)

    def verify_s(self, tokens: int) -> float:
        """Seconds of a forward of ``tokens`` tokens: interpolated between measured widths,
        extrapolated along the last measured slope (never below the widest measurement)."""
        w, s = self.widths, self.seconds
        if tokens <= w[0]:
            return s[0]
        for i in range(1, len(w)):
            if tokens <= w[i]:
                return s[i - 1] + (s[i] - s[i - 1]) * (tokens - w[i - 1]) / (w[i] - w[i - 1])
        if len(w) == 1:
            return s[-1]
        slope = max(0.0, (s[-1] - s[-2]) / (w[-1] - w[-2]))
        return s[-1] + slope * (tokens - w[-1])

    def ratio(self, tokens: int) -> float:
        """v(T): a forward of ``tokens`` tokens in plain steps."""
        return self.verify_s(tokens) / self.plain_s

    def slope(self) -> float:
        """Least-squares ``b`` in v(T) = 1 + b (T - 1): what each drafted token adds to a
        verify, in plain steps (0 on hardware where a verify is free, ~0.3 on llama.cpp's CPU
        kernels)."""
        xs = [t - 1 for t in self.widths]
        ys = [self.ratio(t) - 1 for t in self.widths]
        den = sum(x * x for x in xs)
        return sum(x * y for x, y in zip(xs, ys)) / den if den else 0.0

    def summary(self) -> str:
        shown = [t for t in (2, 4, 8, 16, 32) if t <= max(self.widths[-1], self.asked)]
        ratios = ", ".join(f"v({t}) {self.ratio(t):.2f}" for t in shown)
        how = (f"measured in {self.measure_s:.1f} s" if self.origin == "measured" else "cached")
        how += "; noisy: the machine was busy, measured again next time" if self.noisy else ""
        return (f"verify cost ({how}; {self.key.get('backend', '?')}, {self.key.get('threads', '?')} "
                f"threads): plain step {self.plain_s * 1e3:.2f} ms; {ratios} plain steps; "
                f"~1 + {self.slope():.2f} (T - 1)")

    def to_dict(self) -> dict:
        return asdict(self)


def measure(target, *, max_width: int = WIDTHS[-1], budget_s: float = 3.0, min_reps: int = 5,
            clock: Callable[[], float] = time.perf_counter) -> CostModel:
    """Time forwards of widths up to ``max_width`` on ``target`` (any CausalLM) after a prefill
    of a short context: widths in order of use (1, 2, 4, ...) while half of ``budget_s`` lasts,
    then rounds interleaved over them, at least three, up to ``min_reps`` while the budget lasts. The target's cache is
    left empty. ``clock`` is replaceable for tests (a fake backend advancing a fake clock)."""
    top = max(2, min(max_width, WIDTHS[-1]))
    # in order of use to the fit, so that a slow model measured within the budget keeps the
    # widths that matter (1, 2, then doubling) and extrapolates the rest
    order = list(dict.fromkeys([w for w in _PRIORITY if w <= top] + [top]))
    context = min(_CONTEXT, max(1, target.max_context - top - 1))
    ids = torch.arange(context + top, dtype=torch.long) % max(2, target.vocab_size - 1) + 1
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda *a: None)
    start = clock()
    target.reset()
    target.forward(ids[:context], 0)
    times: dict[int, list[float]] = {}

    def once(width: int) -> float:
        t0 = clock()
        target.forward(ids[context: context + width], context, num_logits=width)
        sync()
        elapsed = clock() - t0
        target.rollback(context)
        return elapsed

    try:
        for w in order:  # warm-up (first calls pay allocations and compiles) and a first timing;
            once(w)  # widths are added while half the budget lasts
            times[w] = [once(w)]
            if len(times) >= 2 and clock() - start > budget_s / 2:
                break
        widths = sorted(times)
        rounds = 1
        # interleaved rounds: at least three timings per width (a median survives one
        # disturbed round), then more while the budget lasts, up to min_reps
        while rounds < 3 or (rounds < min_reps and clock() - start <= budget_s):
            for w in widths:
                times[w].append(once(w))
            rounds += 1
    finally:
        target.reset()
    seconds = [statistics.median(times[w]) for w in widths]
    for i in range(1, len(seconds)):  # a wider forward never costs less (noise at small T)
        seconds[i] = max(seconds[i], seconds[i - 1])
    plain = times[widths[0]]
    noisy = max(plain) > _NOISY * min(plain)  # the machine was busy: use it, do not cache it
    return CostModel(widths, seconds, origin="measured", measure_s=clock() - start, asked=top,
                     noisy=noisy)


def model_file(target, model_path: Path | None) -> Path | None:
    """The file (or folder) a target's speed depends on: llama.cpp's GGUF file, else the
    folder the weights were loaded from."""
    return getattr(getattr(target, "weights", None), "path", None) or model_path


def file_stamp(model_file: Path | None) -> list | None:
    """What identifies a model file's (or folder's) weights: the name, size and modification
    time of each weight file, as JSON keeps them; None for a model without a file."""
    if model_file is None or not Path(model_file).exists():
        return None
    path = Path(model_file).resolve()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") or p.name == "config.json")
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def cost_key(target, model_file: Path | None) -> dict | None:
    """What a measurement holds for: model file (path, size, modification time), backend, the
    attention implementation, dtype, threads, device, the linear layers' kernel (models/small_m.py:
    the build, named by its sources, so a changed kernel is measured afresh) and this
    measurement's version; None for a model without a file (random weights), which is
    measured afresh every time."""
    stamp = file_stamp(model_file)
    if stamp is None:
        return None
    path = Path(model_file).resolve()
    weights = getattr(target, "weights", None)  # llama.cpp: its own thread count
    threads = getattr(weights, "threads", None) or torch.get_num_threads()
    config = getattr(getattr(target, "model", None), "config", None)
    return dict(version=VERSION, model=str(path), files=stamp,
                backend=getattr(target, "backend_name", "torch"),
                attention=getattr(config, "_attn_implementation", None),  # a verify's cost depends on it
                dtype=getattr(target, "numerics", None) or str(target.dtype).removeprefix("torch."),
                threads=threads, device=str(target.device),
                linear=build_name() if kernel_in_use(getattr(target, "model", None)) else "torch")


def cache_path(key: dict, kind: str = "cost") -> Path:
    """Where a figure measured for ``key`` is cached: ``<cache dir>/<kind>/<model>-<hash>.json``."""
    from .models.loading import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / kind / f"{Path(key['model']).name}-{key['backend']}-{digest}.json"


def write_json(path: Path, data: dict) -> None:
    """Write a cache file atomically; a cache that cannot be written is not an error (the
    next process measures again)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass


def load_cached(key: dict, max_width: int) -> CostModel | None:
    """The cached curve for ``key`` if it exists, is of this version and reaches ``max_width``."""
    try:
        data = json.loads(cache_path(key).read_text())
        model = CostModel(data["widths"], data["seconds"], data["key"], "cached", data["measure_s"],
                          data["asked"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if model.key != key or model.asked < min(max_width, WIDTHS[-1]) or not model.seconds:
        return None
    return model


def cost_model(target, model_file: Path | None, *, max_width: int = WIDTHS[-1],
               budget_s: float = 3.0, clock: Callable[[], float] = time.perf_counter) -> CostModel:
    """The target's cost model: cached for this combination, else measured now and cached."""
    key = cost_key(target, model_file)
    if key is not None:
        cached = load_cached(key, max_width)
        if cached is not None:
            return cached
    model = measure(target, max_width=max_width, budget_s=budget_s, clock=clock)
    model.key = key or dict(backend=getattr(target, "backend_name", "torch"),
                            threads=torch.get_num_threads(), device=str(target.device))
    if key is not None and not model.noisy:
        write_json(cache_path(key), model.to_dict())
    return model
