"""Starting ``speclm serve`` as a real process on loopback for tests, and always stopping it."""

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

import speclm

SRC = Path(speclm.__file__).resolve().parents[1]


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
                  threads: int = 1) -> Iterator[ServerProcess]:
    """Run ``python -m speclm serve ARGS --port FREE`` until /health answers; kill it after."""
    port = free_port()
    log = log_dir / f"server-{port}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(threads)}  # tiny models: one thread is fastest on a busy machine
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "speclm", "serve", "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning", *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, log)
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{server.output()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready after {ready_timeout} s:\n{server.output()}")
            time.sleep(0.2)
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode
