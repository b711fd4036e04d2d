"""The ``llama-server`` peer: llama.cpp's own C++ server and its own speculation, one request at a time.

A user who wants llama.cpp's fastest speculation runs ``llama-server`` with ``--spec-type`` (its
n-gram drafters) or ``--model-draft``: the whole loop in C++, no Python between steps. This peer
starts that binary on the same GGUF with the same threads, context and batch sizes as the other
llama.cpp rows, sends each prompt as token ids (templated by speclm, so every row sees the same
input) and times the request from the client, prompt processing included, as speclm's rows are.

It talks to the server's native ``/completion`` endpoint rather than ``/v1/completions``: both run
the same slot and sampler code, but only the native one returns the generated token ids, which the
bench's greedy identity check needs. The binary is built once from the llama.cpp sources vendored in
the llama-cpp-python sdist of the installed version (``scripts/build-llama-server.sh``), or named by
``$SPECLM_LLAMA_SERVER``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from ..child_process import free_port, stop, wait_ready
from ..errors import SpeclmError
from ..models.llamacpp import LlamaCppModel
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from .methods import MethodSpec

# --spec-type -> (its draft-length flag, its minimum-draft flag, its lookup n-gram flag)
SPEC_FLAGS: dict[str, tuple[str | None, str | None, str | None]] = {
    "none": (None, None, None),
    "ngram-simple": ("--spec-ngram-simple-size-m", None, "--spec-ngram-simple-size-n"),
    "ngram-map-k": ("--spec-ngram-map-k-size-m", None, "--spec-ngram-map-k-size-n"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-m", None, "--spec-ngram-map-k4v-size-n"),
    "ngram-mod": ("--spec-ngram-mod-n-max", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-match"),
    "ngram-cache": (None, None, None),
    "draft-simple": ("--spec-draft-n-max", "--spec-draft-n-min", None),
}
_START_TIMEOUT_S = 120.0


def server_binary() -> Path:
    """The llama-server to run: ``$SPECLM_LLAMA_SERVER``, or the one scripts/build-llama-server.sh
    cached for the installed llama-cpp-python version."""
    named = os.environ.get("SPECLM_LLAMA_SERVER")
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SpeclmError(f"SPECLM_LLAMA_SERVER={named} is not an executable file")
        return path
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("llama_cpp_python")
    except PackageNotFoundError:
        raise SpeclmError("the llama-server peer needs llama-cpp-python (scripts/build-llama-cpp.sh)") from None
    cache = Path(os.environ.get("SPECLM_LLAMA_SERVER_CACHE",
                                Path.home() / ".cache" / "speclm" / "llama-server" / release))
    path = cache / "llama-server"
    if not path.is_file():
        raise SpeclmError(f"llama-server {release} is not built: run scripts/build-llama-server.sh "
                          "(once, several minutes) or set SPECLM_LLAMA_SERVER to a llama-server binary")
    return path


def server_args(options: dict) -> list[str]:
    """The speculation flags of one ``llama-server:...`` method (``spec``, ``k``, ``kmin``,
    ``ngram``, ``draft``); options a type has no flag for are refused in one line."""
    kind = options["spec"]
    if kind not in SPEC_FLAGS:
        raise SpeclmError(f"llama-server: unknown spec={kind!r}; choose one of {', '.join(SPEC_FLAGS)}")
    length, minimum, ngram = SPEC_FLAGS[kind]
    args = [] if kind == "none" else ["--spec-type", kind]
    for key, flag in (("k", length), ("kmin", minimum), ("ngram", ngram)):
        if options.get(key):
            if flag is None:
                raise SpeclmError(f"llama-server: spec={kind} takes no {key}=")
            args += [flag, str(options[key])]
    if kind == "ngram-mod" and not options.get("kmin"):  # its own minimum (48) exceeds short drafts
        args += ["--spec-ngram-mod-n-min", "1"]
    if (kind == "draft-simple") != bool(options.get("draft")):
        raise SpeclmError("llama-server: spec=draft-simple and draft=PATH (a draft GGUF) go together")
    if options.get("draft"):
        args += ["--model-draft", str(Path(options["draft"]).expanduser())]
    return args


class LlamaServerProcess:
    """A running ``llama-server`` on a free loopback port: ``parallel`` slots of ``n_ctx`` tokens each
    (continuous batching across them), the same threads and batch sizes as speclm's llama.cpp rows,
    plus ``extra`` flags (its speculation). Stopped by ``close()``; a server that dies or does not
    answer within two minutes raises ``SpeclmError`` with the end of its log."""

    def __init__(self, gguf, extra: list[str] = (), *, parallel: int = 1, n_ctx: int = 4096) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        threads = LlamaCppModel.default_threads()
        command = [str(server_binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                   "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx * parallel),
                   "-b", "512", "-ub", "512", "-np", str(parallel), "--no-webui", *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_ready(self.proc, f"{self.url}/health", self._log_tail, _START_TIMEOUT_S,
                       name="llama-server", error=SpeclmError)
        except SpeclmError:
            self.close()
            raise

    def _log_tail(self) -> str:
        self.log.flush()
        lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:])[:300]

    def close(self) -> None:
        if getattr(self, "proc", None) is not None:
            stop(self.proc, timeout=10)
        if getattr(self, "log", None) is not None:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
            self.log = None

    def __enter__(self) -> LlamaServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class LlamaServerPeer:
    """One ``llama-server`` process (one slot) for one bench method, started at setup and stopped
    with the peer."""

    def __init__(self, spec: MethodSpec, gguf, eos_token_ids: frozenset[int], n_ctx: int = 4096) -> None:
        self.spec = spec  # eos_token_ids: unused (the server stops on the GGUF's own end tokens)
        self.n_ctx = n_ctx
        self.server = LlamaServerProcess(gguf, server_args(spec.options), n_ctx=n_ctx)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], float, dict]:
        """Token ids, wall seconds, and the server's own draft counts (``drafted``, ``accepted``)."""
        if not params.greedy:
            raise SpeclmError("the llama-server peer runs greedy decoding only")
        if len(prompt_ids) + params.max_tokens > self.n_ctx:
            raise SpeclmError(f"prompt + budget exceed the peer's context of {self.n_ctx}")
        body = dict(prompt=list(prompt_ids), n_predict=params.max_tokens, temperature=0.0, top_k=1,
                    samplers=["top_k"], ignore_eos=params.ignore_eos, cache_prompt=False,
                    return_tokens=True, stream=False)
        request = urllib.request.Request(f"{self.server.url}/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise SpeclmError(f"llama-server answered {exc.code}: {exc.read()[:200]!r}") from None
        elapsed = time.perf_counter() - start
        ids = [int(t) for t in reply["tokens"]]  # the end token included, as in speclm's rows
        timings = reply.get("timings", {})
        counts = {"drafted": int(timings.get("draft_n", 0)), "accepted": int(timings.get("draft_n_accepted", 0))}
        return ids, elapsed, counts

    def close(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
