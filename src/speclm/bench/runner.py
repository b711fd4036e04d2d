"""Runs every method on every prompt (and turn), interleaved, and returns one row per request.

Per prompt, plain decoding runs first on each turn (the oracle replays its tokens and the
greedy identity check compares against them); the other methods follow in an order that rotates
from prompt to prompt, so no method is always first or last. Multi-turn conversations are played
turn by turn, each method with its own earlier answers as history. Each method runs once on a
short warm-up request before timing starts. A peer that fails is recorded, not fatal.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch
from tqdm import tqdm

from ..api import LLM, Speculation
from ..draft_length import DraftLengthConfig
from ..errors import SpeclmError
from ..sampling import PositionNoise, SamplingParams, warp_probs
from .methods import LLAMACPP_PEERS, MethodSpec
from .oracle import OracleDrafter
from .peers import HFPeer


class EnginePool:
    """One :class:`LLM` per engine (backend, compile, quantize, dtype) the methods ask for,
    loaded on first use; every engine reads the same model with the same tokenizer."""

    def __init__(self, model: str, device: str, defaults: tuple, gguf_file: str | None = None) -> None:
        self.model, self.device, self.gguf_file = model, device, gguf_file
        self.flags = defaults  # the command's own (backend may be auto): each method resolves
        self.defaults = self._normal(defaults)  # its engine from these and its own options
        self._llms: dict[tuple, LLM] = {}

    @classmethod
    def around(cls, llm: LLM) -> EnginePool:
        """A pool whose default engine is an already loaded (eager torch) LLM."""
        pool = cls(str(llm.model_path), str(llm.target.device), ("torch", 0, None, None))
        pool._llms[pool.defaults] = llm
        return pool

    def _normal(self, engine: tuple) -> tuple:
        """Fill in what ``auto`` and the unset options mean, so equal engines share one LLM."""
        from ..models.loading import choose_backend, find_gguf, resolve_device
        from ..models.random_init import is_random

        backend, compile_, quantize, dtype = engine
        compile_, dtype = int(compile_ or 0), (None if dtype in (None, "auto") else str(dtype))
        if backend in (None, "auto"):
            gguf = None if is_random(self.model) else find_gguf(self.model, self.gguf_file)
            backend = choose_backend("auto", gguf, resolve_device(self.device), dtype_given=dtype is not None,
                                     fast=bool(compile_ or quantize))
        return (backend, compile_, quantize, dtype)

    def get(self, engine: tuple | None = None) -> LLM:
        engine = self.defaults if engine is None else engine
        if engine not in self._llms:
            backend, compile_, quantize, dtype = engine
            self._llms[engine] = LLM(self.model, device=self.device, dtype=dtype, gguf_file=self.gguf_file,
                                     backend=backend, compile=bool(compile_), quantize=quantize)
        return self._llms[engine]

    def engine_of(self, spec: MethodSpec) -> tuple:
        """The engine a method runs on; peers: transformers' peers on eager torch, llama.cpp's
        on their own llama.cpp (keyed by that backend, so they pair with its plain row)."""
        if spec.name in LLAMACPP_PEERS:
            return ("llamacpp", 0, None, None)
        if spec.is_peer:
            return ("torch", 0, None, self.defaults[3])
        return self._normal(spec.engine(self.flags))

    def gguf(self):
        from ..models.loading import find_gguf

        path = find_gguf(self.model, self.gguf_file)
        if path is None:
            raise SpeclmError("llama.cpp peers need a GGUF model")
        return path


def build_setups(pool: EnginePool, specs: list[MethodSpec]) -> dict[str, object]:
    """label -> a Speculation (speclm methods), False (plain), a peer, or the error string of
    a peer that could not be set up (reported on every row, not fatal)."""
    setups: dict[str, object] = {}
    for spec in specs:
        o = spec.options
        if spec.name in ("plain", "oracle") or spec.drafter is not None:
            llm = pool.get(pool.engine_of(spec))
        if spec.name == "plain":
            setups[spec.label] = False
        elif spec.drafter is not None:
            setups[spec.label] = llm.make_speculation(spec.drafter, o["k"], adaptive_draft=bool(o["adaptive"]))
        elif spec.name == "oracle":
            drafter = OracleDrafter(o["a"], llm.target.vocab_size, seed=o["seed"])
            setups[spec.label] = Speculation(drafter, DraftLengthConfig(o["k"]), spec.label)
        else:
            try:
                if spec.name in LLAMACPP_PEERS:
                    from .llama_server import LlamaServerPeer
                    from .llamacpp_peers import LlamaCppLookupPeer, LlamaCppPlainPeer

                    peer = {"llamacpp": LlamaCppPlainPeer, "llamacpp-lookup": LlamaCppLookupPeer,
                            "llama-server": LlamaServerPeer}[spec.name]
                    setups[spec.label] = peer(spec, pool.gguf(),
                                              pool.get(pool.engine_of(spec)).target.eos_token_ids)
                else:
                    setups[spec.label] = HFPeer(spec, pool.get(pool.engine_of(spec)))
            except Exception as exc:
                setups[spec.label] = f"setup failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return setups


def plain_label(engine: tuple) -> str:
    """The method spec of plain decoding on ``engine`` (backend, compile, quantize, dtype)."""
    backend, compile_, quantize, dtype = engine
    options = [f"backend={backend}"] + (["compile=1"] if compile_ else []) + \
        ([f"quantize={quantize}"] if quantize else []) + ([f"dtype={dtype}"] if dtype else [])
    return "plain:" + ",".join(options)


def reference_plains(pool: EnginePool, specs: list[MethodSpec], setups: dict[str, object],
                     log: Callable[[str], None]) -> list[MethodSpec]:
    """Plain decoding on every engine that runs a method but has no plain method of its own
    (every speedup, bound and identity check is against plain decoding on the method's own
    engine, never another's), each one announced through ``log``. With no plain at all, the
    plain of the command's own engine comes first."""
    from .methods import parse_method

    have = {pool.engine_of(s) for s in specs if s.name == "plain"}
    added = []
    if not have:  # the command's own engine, under the plain name
        added.append(MethodSpec("plain", "plain", {}))
        have.add(pool.defaults)
    wanted: dict[tuple, list[str]] = {}
    for s in specs:
        if s.name != "plain" and not isinstance(setups.get(s.label), str):
            wanted.setdefault(pool.engine_of(s), []).append(s.label)
    for eng, labels in wanted.items():
        if eng not in have:
            spec = parse_method(plain_label(eng))
            log(f"bench: added {spec.label} (plain decoding on that engine), the reference of "
                + ", ".join(labels))
            added.append(spec)
    return added


def bench_prompt(llm: LLM, messages: list[dict]) -> list[dict] | str:
    """What a turn sends: the chat messages, or, for a model without a chat template (a base
    model such as Gemma-3-270M), the conversation as plain text ending where the answer starts."""
    if getattr(llm.tokenizer, "chat_template", None):
        return messages
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"


def _run_one(llm: LLM, setup, messages: list[dict], params: SamplingParams) -> dict:
    prompt = bench_prompt(llm, messages)
    if _is_peer(setup):
        prompt_ids = llm.encode(prompt)
        ids, elapsed, *counts = setup.run(prompt_ids, params)  # a peer may add its draft counts
        text = llm.tokenizer.decode(ids, skip_special_tokens=True)
        return dict(token_ids=ids, text=text, tokens=len(ids), prompt_tokens=len(prompt_ids),
                    time_s=elapsed, tok_s=len(ids) / elapsed if elapsed > 0 else 0.0, **(counts or [{}])[0])
    graphs = getattr(llm.target, "compiled_graphs", 0)  # the fast path: none may compile in here
    if isinstance(prompt, str):
        out = llm.generate(prompt, params, speculative=setup)[0]
    else:
        out = llm.chat(prompt, params, speculative=setup)
    s = out.stats
    row = dict(token_ids=out.token_ids, text=out.text, tokens=s.generated_tokens,
               prompt_tokens=s.prompt_tokens, time_s=s.total_time_s, tok_s=s.tokens_per_s,
               prefill_s=s.prefill_time_s)
    compiled = getattr(llm.target, "compiled_graphs", 0) - graphs
    if compiled > 0:  # its time includes a compile
        row["compiled"] = compiled
    if s.drafter_report is not None:
        row["drafter_report"] = s.drafter_report
    if setup is not False:
        row.update(forwards=s.target_forwards, drafted=s.drafted_tokens, accepted=s.accepted_tokens,
                   draft_s=s.draft_time_s, target_s=s.target_time_s,
                   judged_per_position=s.judged_per_position,
                   accepted_per_position=s.accepted_per_position)
    else:
        row.update(forwards=s.target_forwards, target_s=s.target_time_s)
    return row


def _is_peer(setup) -> bool:
    return hasattr(setup, "run") and hasattr(setup, "spec")


_WIDTHS = tuple(range(1, 17))  # ways to compute one position: alone, or as the last row of a verify


def diagnose_mismatch(llm: LLM, messages: list[dict], plain_ids: list[int], ids: list[int],
                      memo: dict | None = None, params: SamplingParams | None = None) -> dict:
    """Why a greedy (or seeded sampled: ``params``) output differs from plain decoding: the
    first differing position and the target's gap there between plain's token and the other
    (greedy: their logits; seeded: their scores log p - log E in the exponential race with the
    position's draws, speclm.sampling.PositionNoise).

    Whether a gap is a numerical near-tie is measured, not set per backend: the position's
    logits are computed as plain decoding computes them (one row after the context) and as a
    verify does (the last of 2 .. 16 rows fed together: kernels are chosen by the number of
    rows, so every verify width counts). Kernels that round one row and
    several rows differently (llama.cpp's quantized kernels, bfloat16) disagree by some amount
    here; if one of those ways prefers the other token, or the gap is within how far they
    disagree, it is a near-tie of the kernels. Otherwise the target clearly prefers plain's
    token, and the speculative output is a bug."""
    at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), None)
    if at is None:  # one is a prefix of the other: the stopping rule differed, never a tie
        return dict(position=min(len(ids), len(plain_ids)), margin=None,
                    verdict=f"BUG: lengths differ ({len(ids)} vs plain's {len(plain_ids)})")
    prefix = torch.tensor(llm.encode(bench_prompt(llm, messages)) + plain_ids[:at], dtype=torch.long)
    target, ours, theirs = llm.target, plain_ids[at], ids[at]
    key = (tuple(prefix.tolist()), ours, theirs)  # rows that part at the same tokens share it
    if memo is not None and key in memo:
        return memo[key]
    keyed = params is not None and not params.greedy
    noise = PositionNoise(params.seed, target.vocab_size).row(at) if keyed else None
    gaps = []  # logit[plain's token] - logit[the other], per way of computing the position
    # each way from a fresh cache: how the context is batched changes its cached keys and values
    for width in sorted({min(w, prefix.shape[0]) for w in _WIDTHS}):
        cut = prefix.shape[0] - width
        target.reset()
        if cut:
            target.forward(prefix[:cut], 0)
        logits = target.forward(prefix[cut:], cut).logits[-1].double()  # [V]
        if keyed:  # the race's scores log p - log E take the logits' place
            logits = warp_probs(logits.view(1, -1), params)[0].double().log() - noise.double().log()
        gaps.append(float(logits[ours] - logits[theirs]))
    target.reset()
    margin, spread = gaps[0], max(gaps) - min(gaps)
    numerics = getattr(target, "numerics", None) or str(target.dtype).removeprefix("torch.")
    what = "in its seeded draw's score" if keyed else "logits"
    if min(gaps) <= 0 or margin <= spread:
        verdict = (f"numerical near-tie ({'seeded draw score' if keyed else 'logit'} gap {margin:.2g}; "
                   f"one-row and several-row forwards of this position differ by up to {spread:.2g} "
                   f"in {numerics})")
    else:
        verdict = (f"BUG: the target prefers plain's token by {margin:.3g} {what}, however the "
                   f"position is computed (they differ by {spread:.2g})")
    found = dict(position=at, margin=margin, spread=spread, verdict=verdict)
    if memo is not None:
        memo[key] = found
    return found


def run_bench(
    pool: EnginePool | LLM,
    specs: list[MethodSpec],
    prompts: list[dict],
    params: SamplingParams,
    *,
    warmup: bool = True,
    progress: bool = True,
    baseline: str | None = None,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> list[dict]:
    """Rows of every (prompt, turn, method). Each row's ``speedup`` and identity check are
    against plain decoding on the same engine (``reference``); ``vs_baseline`` compares its
    tok/s with the ``baseline`` method's on the same request (default: the first plain)."""
    if isinstance(pool, LLM):
        pool = EnginePool.around(pool)
    setups = build_setups(pool, specs)
    added = reference_plains(pool, specs, setups, log)
    given_plain = next((s.label for s in specs if s.name == "plain"), None)
    specs = added + specs
    setups.update(build_setups(pool, added))
    engine = {s.label: pool.engine_of(s) for s in specs}
    plains = {}  # engine -> the label of its plain method (the first one given)
    for s in specs:
        if s.name == "plain":
            plains.setdefault(engine[s.label], s.label)
    first_plain = given_plain or next(s.label for s in specs if s.name == "plain")
    # a method whose setup failed has no engine of its own to compare with: the first plain
    reference = {s.label: plains.get(engine[s.label], first_plain) for s in specs}
    # llama-server's speculation is checked against the same server's plain decoding where the
    # run has one: the server batches a prompt its own way, so its plain output is its own
    own_plain = [s.label for s in specs if s.name == "llama-server" and s.options["spec"] == "none"]
    for s in specs:
        if own_plain and s.name == "llama-server" and s.label != own_plain[0]:
            reference[s.label] = own_plain[0]
    baseline = baseline or first_plain
    if baseline not in reference:
        raise SpeclmError(f"--baseline {baseline!r} is not one of the methods")
    # plain methods first (in order), then the rest rotating from prompt to prompt
    plain_labels = [s.label for s in specs if s.name == "plain"] + own_plain[:1]  # references first
    others = [s.label for s in specs if s.label not in plain_labels]
    llm_of = {label: pool.get(engine[label] if not isinstance(setups[label], str) else engine[first_plain])
              for label in setups}
    # the fast path compiles each verify width up front (for every cache size), not inside a request
    for label, setup in setups.items():
        if isinstance(setup, Speculation) or setup is False:
            llm_of[label].warmup(setup or None)
        if isinstance(setup, Speculation) and setup.draft_length.adaptive:  # measured (or read
            llm_of[label].cost_model(1 + setup.widest)  # from the cache) untimed
    if warmup:
        short = dataclasses.replace(params, max_tokens=8)
        for label, setup in setups.items():
            if not isinstance(setup, str) and not isinstance(getattr(setup, "drafter", None), OracleDrafter):
                try:
                    _run_one(llm_of[label], setup, [{"role": "user", "content": "Say hello."}], short)
                except Exception as exc:  # reported again, per request, in the results
                    log(f"warm-up of {label} failed: {exc}")
    rows: list[dict] = []
    total = sum(len(p["turns"]) for p in prompts)
    bar = tqdm(total=total, desc="bench", unit="turn", disable=not progress, file=sys.stderr)
    for i, prompt in enumerate(prompts):
        order = others[i % len(others):] + others[: i % len(others)] if others else []
        history = {label: [] for label in setups}
        failed: dict[str, str] = {}  # a failed turn ends that method's conversation
        for turn, text in enumerate(prompt["turns"]):
            done: dict[str, dict] = {}
            diagnosed: dict = {}  # the mismatch diagnoses of this turn, shared by its methods
            for label in plain_labels + order:
                setup, llm = setups[label], llm_of[label]
                ref_row = done.get(reference[label])
                messages = history[label] + [{"role": "user", "content": text}]
                try:
                    if isinstance(setup, str):
                        raise SpeclmError(setup)
                    if label in failed:
                        raise SpeclmError(f"skipped: turn {failed[label]} failed")
                    if ref_row is not None and ref_row.get("error"):
                        raise SpeclmError(f"plain decoding failed: {ref_row['error']}")
                    if isinstance(getattr(setup, "drafter", None), OracleDrafter):
                        setup.drafter.set_continuation(len(llm.encode(bench_prompt(llm, messages))),
                                                      ref_row["token_ids"])
                    row = _run_one(llm, setup, messages, params)
                except Exception as exc:
                    # a user-level problem (a prompt longer than the context) or a peer's failure
                    # is recorded; anything else in speclm's own methods is a bug and propagates
                    if not _is_peer(setup) and not isinstance(exc, SpeclmError):
                        raise
                    row = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    failed.setdefault(label, str(turn))
                row.update(prompt_id=prompt["id"], category=prompt["category"], turn=turn, method=label,
                           reference=reference[label])
                if isinstance(getattr(setup, "drafter", None), OracleDrafter):
                    row["oracle_diverged"] = setup.drafter.diverged
                done[label] = row
                if row.get("error") is None:
                    ref_row = ref_row or row
                    row["speedup"] = row["tok_s"] / ref_row["tok_s"] if ref_row.get("tok_s") else None
                    # greedy identity holds within one engine; across kernels only up to ties
                    same = engine[reference[label]] == engine[label]
                    # a seeded request's tokens are speclm's keyed draws, with or without
                    # speculation (a peer's sampler draws its own way)
                    checked = same and (params.greedy or (params.seed is not None and not _is_peer(setup)))
                    row["identical"] = (row["token_ids"] == ref_row["token_ids"]) if checked else None
                    if row["identical"] is False:
                        row["mismatch"] = diagnose_mismatch(llm, messages, ref_row["token_ids"],
                                                            row["token_ids"], diagnosed, params)
                        if _is_peer(setup):  # measured on speclm's target; not speclm's to fix
                            row["mismatch"] = {**row["mismatch"], "verdict": "a peer's own decoding: "
                                               + row["mismatch"]["verdict"].removeprefix("BUG: ")}
                    history[label] = messages + [{"role": "assistant", "content": row["text"]}]
                rows.append(row)
            base = done.get(baseline)
            for label, row in done.items():
                if row.get("error") is None and base is not None and base.get("tok_s"):
                    row["vs_baseline"] = row["tok_s"] / base["tok_s"]
            bar.update(1)
    bar.close()
    return rows
