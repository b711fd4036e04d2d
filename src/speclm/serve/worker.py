"""The engine thread: one loop doing batched steps, fed by the asyncio side through queues.

The loop runs on the server's :class:`~speclm.serve.owner.OwnerThread`, the thread that also
loaded and warmed the model (why: speclm.serve.owner).

Handlers call :meth:`EngineWorker.submit` (which refuses at once when the bounded queue is
full, with a ``Retry-After`` from the drain rate (:mod:`speclm.serve.admission`), or when the
server is stopping) and read :class:`Event` s from the returned handle's asyncio
queue; the thread owns the engine, turns each step's tokens into text (stop strings included)
and hands the events back with ``loop.call_soon_threadsafe``. An exception inside a step fails
the requests of that batch with a 500 error and resets the engine; the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from ..engine import Engine
from ..detokenize import IncrementalDetokenizer
from ..errors import SpeclmError
from ..sampling import SamplingParams
from ..stats import RequestStats
from .admission import Admission
from .metrics import ServerMetrics
from .owner import OwnerThread
from .protocol import APIError

log = logging.getLogger("speclm.serve")


@dataclass
class Event:
    """Text (and tokens) committed for a request since the previous event."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" / "length" on the last event
    stats: RequestStats | None
    error: APIError | None = None  # set on a failure event (the last one)


@dataclass
class RequestHandle:
    request_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    detok: IncrementalDetokenizer | None = None
    delivered: int = 0  # tokens handed out (none past a stop string)


class EngineWorker:
    """Owns an :class:`~speclm.engine.Engine` and the thread that steps it."""

    def __init__(self, engine: Engine, tokenizer, metrics: ServerMetrics, *, max_queue: int = 64,
                 owner: OwnerThread | None = None) -> None:
        """``owner``: the thread that built the engine's model, which then runs the loop too
        (None: a new one)."""
        if max_queue < 0:
            raise SpeclmError(f"max queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.capacity = engine.max_batch + max_queue  # requests admitted at once, queue included
        self._handles: dict[str, RequestHandle] = {}
        self.admission = Admission(engine.max_batch)
        self._inbox: deque[tuple] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._draining = False  # no new requests
        self._stop = False  # fail what is left and exit
        self._hurry = False  # end the grace period now (a second Ctrl-C)
        self._owner = owner
        self._loop: Future | None = None  # the loop running on the owner thread

    # -- asyncio side ----------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               *, retries: int | None = None) -> RequestHandle:
        """Queue a request; raises :class:`APIError` 503 when stopping, 429 when full (with a
        wait from :class:`~speclm.serve.admission.Admission`). ``retries``: how many times the
        client says it tried before (None: it does not say), for the places held for refused
        clients."""
        handle = RequestHandle(request_id, asyncio.get_running_loop())
        with self._lock:
            if self._draining or not self.alive:
                raise APIError(503, "the server is shutting down", type="server_error",
                               code="shutting_down")
            wait = self.admission.admit(len(self._handles), self.capacity, retries)
            if wait is not None:
                raise APIError(429, f"the server is at capacity ({self.engine.max_batch} running, "
                               f"{self.capacity - self.engine.max_batch} queued); retry in "
                               f"{wait:.1f} s", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(math.ceil(wait)),
                                        "retry-after-ms": str(round(wait * 1000))})
            self._handles[request_id] = handle
            self._inbox.append(("add", request_id, prompt_ids, params))
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        """The client went away: free the request's row at the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._loop.done()

    @property
    def load(self) -> int:
        return len(self._handles)

    @property
    def draining(self) -> bool:
        """Shutting down: new requests are refused (503)."""
        return self._draining

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._owner is None:
            self._owner = OwnerThread()
        self._loop = self._owner.submit(self._run)
        self._loop.add_done_callback(_log_failure)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``grace_s`` seconds, then
        fail what is left with 503 and end the thread."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + grace_s
        while self._handles and time.monotonic() < deadline and self.alive and not self._hurry:
            time.sleep(0.05)
        self._stop = True
        self._wake.set()
        if self._loop is not None:
            wait([self._loop], timeout=30)
        if self._owner is not None:
            self._owner.close()

    def hurry(self) -> None:
        """Cut a running :meth:`stop`'s grace period short."""
        self._hurry = True

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            if not engine.has_work and not self._inbox:
                self._wake.wait(timeout=1.0)
            self._wake.clear()
            self._apply_inbox()
            self._update_gauges()
            if self._stop or not engine.has_work:
                continue
            try:
                outputs, report = engine.step()
            except Exception:  # a bug or a device error: fail this batch, keep serving
                log.exception("engine step failed; failing the requests in the batch")
                for seq in engine.reset():
                    self._fail(seq.request_id, _internal_error())
                continue
            self.metrics.record_step(report, engine.speculative)
            self._update_gauges()
            for out in outputs:
                try:
                    self._deliver(out.request_id, out.step.tokens, out.step.finish_reason, out.stats)
                except Exception:  # e.g. detokenization: fail this request only
                    log.exception("could not deliver tokens of request %s", out.request_id)
                    self.engine.abort(out.request_id)
                    self._fail(out.request_id, _internal_error())
        for request_id in list(self._handles):
            self._fail(request_id, APIError(503, "the server shut down before the request "
                                            "finished", type="server_error", code="shutting_down"))
        self.metrics.running.set(0)
        self.metrics.waiting.set(0)

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.engine.running))
        self.metrics.waiting.set(len(self.engine.waiting))

    def _apply_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                item = self._inbox.popleft()
            if item[0] == "abort":
                self.engine.abort(item[1])
                self._release(item[1])
                continue
            _, request_id, prompt_ids, params = item
            handle = self._handles.get(request_id)
            if handle is None:  # aborted before it was added
                continue
            try:
                handle.detok = IncrementalDetokenizer(self.tokenizer, params.stop)
                self.engine.add(request_id, prompt_ids, params)
            except SpeclmError as exc:  # the handler checks first; this is the last line
                self._fail(request_id, APIError(400, str(exc)))
            except Exception:
                log.exception("could not start request %s", request_id)
                self._fail(request_id, _internal_error())

    def _deliver(self, request_id: str, tokens: list[int], finish: str | None, stats: RequestStats) -> None:
        handle = self._handles.get(request_id)
        if handle is None:
            return
        text, kept, finish = handle.detok.feed(tokens, finish)
        handle.delivered += len(kept)
        if finish is not None:
            if handle.detok.stopped:
                self.engine.abort(request_id)  # a stop string ended it: free the row now
            stats.generated_tokens = handle.delivered
            self._release(request_id)
        self._send(handle, Event(text, kept, finish, stats))

    def _release(self, request_id: str) -> RequestHandle | None:
        """The request leaves: its place is free (and counts towards the drain rate)."""
        with self._lock:
            handle = self._handles.pop(request_id, None)
        if handle is not None:
            self.admission.finished()
        return handle

    def _fail(self, request_id: str, error: APIError) -> None:
        handle = self._release(request_id)
        self.metrics.failures.labels(error.code or str(error.status)).inc()
        if handle is not None:
            self._send(handle, Event("", [], None, None, error))

    @staticmethod
    def _send(handle: RequestHandle, event: Event) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _log_failure(loop: Future) -> None:
    if not loop.cancelled() and loop.exception() is not None:
        log.error("the engine loop stopped", exc_info=loop.exception())


def _internal_error() -> APIError:
    return APIError(500, "internal error while generating; the request was cancelled",
                    type="server_error", code="engine_error")
