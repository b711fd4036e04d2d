"""One thread for all of a server's model work: loading, compiling, warming up and every step.

PyTorch's CPU kernels (speclm's own too, through ``at::parallel_for``), inductor's generated
code and llama.cpp's threads run on OpenMP, and GNU OpenMP keeps a pool of worker threads for
every thread that opens a parallel region. A server that loaded its model on the main thread
and stepped it on an engine thread owned two pools; with more OpenMP threads than cores, libgomp
stops spinning at its barriers and puts threads to sleep, so each of the hundreds of parallel
regions in a step paid a wake-up: on a 2-vCPU VM a compiled GGUF step of the default model took
25 ms on the engine thread against 9 ms on the thread that had loaded the model
(docs/serving.md, "One thread owns the model"). So a server does everything that touches the
model on one :class:`OwnerThread`, and the asyncio side only talks to it through queues.

The thread also runs in a copy of its creator's context: PyTorch keeps its compiler settings
(``torch._dynamo.config`` and friends) in context variables, which a plain new thread would
not see.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class OwnerThread:
    """A daemon thread that runs the callables handed to it, one after another."""

    def __init__(self, name: str = "speclm-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._serve,), name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)``; the future holds its result or its exception."""
        if not self.alive:
            raise RuntimeError("the model's thread has stopped")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the owner thread and wait for it (at once when already on it)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """End the thread once the jobs queued so far have run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
