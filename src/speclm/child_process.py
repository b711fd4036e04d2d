"""Server processes speclm starts on loopback (``speclm serve`` in tests and benchmarks, the
``llama-server`` peer): a free port, waiting until the server answers, stopping it for sure.
Standard library only, so the bench's peers need no server extras."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, output: Callable[[], str], timeout: float, *,
               name: str = "server", error: type[Exception] = AssertionError) -> None:
    """Poll ``url`` until it answers 200; ``error`` with ``output()`` (the end of the server's log)
    if the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise error(f"{name} exited with {proc.returncode}: {output()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise error(f"{name} did not answer within {timeout:.0f} s: {output()}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode
