"""How long a client refused with 429 should wait: ``Retry-After`` from the queue's drain rate.

A constant ``Retry-After`` sends every refused client back at the same moment: they race for the
one row that frees next, the rest are refused again, and some lose every race (with 24 clients
against 8 places and ``Retry-After: 1``, a few gave up after 60 tries while others got in again
and again). Instead each refusal takes the next place in a *virtual line* and is told to come back
when the requests ahead of it (one for the row it needs, plus every refused client told to come
back earlier and not yet back) are expected to have drained, at the rate requests have been
finishing lately. Refused clients are so spread over the expected drain time, in the order they
were refused, and a client that honours ``Retry-After`` is expected to find a free place when it
returns. The line forgets a place once it is past due (its client came back or gave up).

A constant wait is not the only way to starve: a client whose request just finished comes
straight back and takes the place it freed, ahead of everyone refused. So places that refused
clients are due back for are held for them: a new request takes only a place no refused client
is due back for, while a retry (the official openai clients say so in ``x-stainless-retry-count``)
takes any free place. Admitted requests are served first come, first served (the engine's queue
is FIFO). Places are held only for clients that send that header (on every try), since only
they can say they are back; others still get a spread-out ``Retry-After``, but no held place.
The header is the client's word: it keeps honest clients from starving each other, it is no
defence against a client that lies (rate limiting belongs in front of the server).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

MAX_RETRY_AFTER_S = 60  # the official openai clients ignore longer waits and use their own backoff
_PAST_DUE_S = 2.0  # a place is forgotten this long after its client was due back
_MIN_WAIT_S = 0.25
_EARLY_S = 0.25  # a place is held for a refused client from this long before it is due
_RECENT_S = 120.0  # finishes older than this say nothing about the rate now


class Admission:
    """Drain-rate bookkeeping and the virtual line of refused clients (thread-safe)."""

    def __init__(self, rows: int, *, window: int = 32, clock: Callable[[], float] = time.monotonic) -> None:
        self.rows = max(1, rows)  # requests decoded at once: the fallback rate's scale
        self._clock = clock
        self._finishes: deque[float] = deque(maxlen=window)  # when recent requests left
        self._due: deque[float] = deque()  # when each refused client is due back, ascending
        self._held: deque[float] = deque()  # the same, for clients whose place is held
        self._lock = threading.Lock()

    def finished(self) -> None:
        """A request left the server (finished, failed or aborted): its place is free."""
        with self._lock:
            self._finishes.append(self._clock())

    def drain_rate(self) -> float | None:
        """Requests leaving per second lately, or None before two have left."""
        with self._lock:
            return self._rate(self._clock())

    def admit(self, load: int, capacity: int, retries: int | None) -> float | None:
        """Admit a request (returns None) or refuse it (returns how many seconds it should wait:
        sent as ``retry-after-ms``, which the openai clients prefer, and rounded up to whole
        seconds as ``Retry-After``).

        ``load``: requests admitted now; ``capacity``: the most at once; ``retries``: the
        request's ``x-stainless-retry-count`` (the official openai clients send it on every
        try: 0 first, then 1, 2, ...), None when absent. Places are held only for clients that
        send it, since only they say when they are back: such a retry may take a held place,
        anything else only a place nobody is due back for. The held places are at most
        ``capacity`` and never more than the free places, so a flood of refusals cannot lock
        newcomers out for longer than one drain."""
        with self._lock:
            now = self._clock()
            self._forget(now)
            free = capacity - load
            reserved = sum(1 for due in self._held if due <= now + _EARLY_S)
            if retries and reserved:  # it is back: the earliest due client, as far as we can tell
                self._held.popleft()
                reserved -= 1
            if free > (0 if retries else reserved):
                return None
            rate = self._rate(now)
            ahead = 1 + len(self._due)  # the place it needs, then everyone refused before it
            wait = ahead / rate if rate else 1.0 + len(self._due) // self.rows
            wait = min(max(_MIN_WAIT_S, wait), MAX_RETRY_AFTER_S)
            due = min(max(now + wait, self._due[-1] if self._due else 0.0), now + MAX_RETRY_AFTER_S)
            self._due.append(due)
            if retries is not None and len(self._held) < capacity:
                self._held.append(due)
            return due - now

    @property
    def waiting(self) -> int:
        """Refused clients expected back."""
        with self._lock:
            self._forget(self._clock())
            return len(self._due)

    def _forget(self, now: float) -> None:
        for line in (self._due, self._held):
            while line and line[0] + _PAST_DUE_S < now:
                line.popleft()

    def _rate(self, now: float) -> float | None:
        while self._finishes and self._finishes[0] + _RECENT_S < now:
            self._finishes.popleft()
        if len(self._finishes) < 2:
            return None
        # the span runs to now, so a server that stopped finishing requests reads as slow
        span = max(now, self._finishes[-1]) - self._finishes[0]
        return (len(self._finishes) - 1) / span if span > 0 else None
