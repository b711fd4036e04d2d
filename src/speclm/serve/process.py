"""Running ``speclm serve`` as a child process on loopback (tests, benchmarks), always stopped.

``serve_process`` picks a free port, waits until ``/health`` answers (or the process dies, with
its log in the error), and on exit sends SIGTERM (the server's graceful shutdown), then SIGKILL
if it does not go in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..child_process import free_port, stop, wait_ready

__all__ = ["ServerProcess", "free_port", "serve_process", "stop", "wait_ready"]

SRC = Path(__file__).resolve().parents[2]  # the folder holding the speclm package


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
