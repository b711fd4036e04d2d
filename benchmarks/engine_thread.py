"""An engine's step on the thread that loaded its model, against a step on a second thread.

A server used to load its model on the main thread and step it on an engine thread; with
OpenMP's pool per thread that made every step pay barrier wake-ups (speclm.serve.owner). This
builds a server-shaped engine (16 slots, prompt lookup) and decodes one request of 64 tokens
three times, either stepping on a second thread (MODE=split: the old server) or loading and
stepping on one thread (MODE=owner: the server now), and prints milliseconds per step.

    MODE=split python benchmarks/engine_thread.py; MODE=owner python benchmarks/engine_thread.py
    MODEL=path.gguf BACKEND=torch|llamacpp COMPILE=1 MODE=... python benchmarks/engine_thread.py
"""
import os
import threading
import time

from speclm.api import LLM
from speclm.engine import Engine
from speclm.models.rows import make_rows
from speclm.sampling import SamplingParams


def build():
    """The model (MODEL, BACKEND, COMPILE) and a 16-slot engine with prompt lookup, warmed up."""
    kw = {"backend": os.environ.get("BACKEND", "torch")}
    if os.environ.get("COMPILE"):
        kw.update(compile=True, quantize="gguf")
    llm = LLM(os.environ.get("MODEL", "default"), None, **kw)
    drafters = llm.row_drafters("ngram", None, max_batch=16)
    rows = make_rows(llm.target, 16)
    drafters.factory(rows.handle(0))
    warmup = getattr(rows, "warmup", None)  # the compiled rows' graphs
    if warmup is not None:
        warmup(drafters.draft_length.draft_max)
    engine = Engine(rows, drafter_factory=drafters.factory, draft_length=drafters.draft_length,
                    drafter_name="ngram")
    return llm, engine


def run(llm, engine, tag: str, n: int = 64) -> None:
    ids = llm.encode("The history of the printing press in Europe began")
    t0, steps, tokens = time.perf_counter(), 0, 0
    engine.add(tag, list(ids), SamplingParams(max_tokens=n, temperature=0.0))
    while engine.has_work:
        outputs, _ = engine.step()
        steps += 1
        tokens += sum(len(o.step.tokens) for o in outputs)
    ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"{tag}: {tokens} tokens, {steps} steps, {ms:.1f} ms/step", flush=True)


def main() -> None:
    if os.environ.get("MODE", "owner") == "split":  # the old server: load here, step on another thread
        llm, engine = build()
        run(llm, engine, "warm")
        work = lambda: [run(llm, engine, "split") for _ in range(3)]  # noqa: E731
    else:  # the server now: load and step on one (non-main) thread

        def work():
            llm, engine = build()
            run(llm, engine, "warm")
            for _ in range(3):
                run(llm, engine, "owner")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
