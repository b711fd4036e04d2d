"""Running ``speclm serve`` as a child process on loopback (tests, benchmarks), always stopped.

``serve_process`` picks a free port, waits until ``/health`` answers (or the process dies, with
its log in the error), and on exit sends SIGTERM (the server's graceful shutdown), then SIGKILL
if it does not go in time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

SRC = Path(__file__).resolve().parents[2]  # the folder holding the speclm package


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve_process(args: list[str], log_dir: Path, *, ready_timeout: float = 120.0,
                  threads: int | None = 1) -> Iterator[ServerProcess]:
    """Run ``python -m speclm serve ARGS --port FREE`` until /health answers; stop it after.

    ``threads`` sets OMP_NUM_THREADS (one is fastest for tiny test models on a busy machine;
    None keeps PyTorch's default)."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "speclm", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log)
    try:
        wait_ready(proc, f"{server.url}/health", server.output, ready_timeout)
        yield server
    finally:
        stop(proc)


def wait_ready(proc: subprocess.Popen, url: str, output, timeout: float) -> None:
    """Poll ``url`` until it answers 200; AssertionError with ``output()`` (the server's log) if
    the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{output()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"server not ready after {timeout} s:\n{output()}")
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
