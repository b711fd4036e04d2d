"""llama.cpp backend: a GGUF model run by llama.cpp's kernels behind the ``CausalLM`` interface.

Through llama-cpp-python's low-level API (ctypes over ``libllama``): one batch per forward, with
logits requested only for the rows the verifier reads, copied out once per call. The KV cache is
llama.cpp's own; rollback removes positions from it (``llama_memory_seq_rm``), which is free.

Token trees map onto llama.cpp's sequence ids: every committed cell belongs to sequence 0, and
tree node i gets sequence ``1 + i``, which holds the committed cells, the node's ancestors and the
node itself (a ``seq_cp`` from its nearest cached ancestor, then the node's own row lists the
sequences of all its descendants fed in the same batch). A cell is visible to a row exactly when
they share a sequence and the cell's position is not later, so each node attends to the context
and its ancestors only: the tree mask. After verification the accepted path joins sequence 0 and
every node sequence is dropped. The rejected nodes' cells are not freed but *parked* in a
sequence nobody attends to: llama.cpp refills free cells below its head, and a multi-token batch
scattered over such holes gives wrong logits (flash attention, this version), so the cache is kept
without holes below the top (re-prefilled from the committed tokens when too many cells are parked).
tests/test_llamacpp.py checks both cases against recomputation from scratch.

llama.cpp returns no intermediate hidden states, so drafters that read the target's features
(EAGLE, Medusa) and drafters built from the target's layers (layer skipping) need the torch
backend; everything else runs here unchanged.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import CacheContractError, SpeclmError
from ..tree import TreeMeta
from .base import ForwardOutput
from .kv_cache import check_forward, check_rollback

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'speclm[llamacpp]' (or: pip install llama-cpp-python)"
MAX_TREE_NODES = 62  # sequence ids 1..62 for tree nodes, 0 for the committed tokens
PARKED = MAX_TREE_NODES + 1  # the sequence that holds rejected tree nodes' cells (see compact)


_LOG = {"verbose": False, "errors": []}  # llama.cpp's log: shown only when verbose
_log_callback = None  # the installed ctypes callback (kept alive here)


def set_native_logging(verbose: bool) -> None:
    """Whether llama.cpp's own log lines (model loader, context and KV cache set-up, per-tensor
    details) reach stderr. Off by default: they are pages of internals (``load: control-looking
    token ...``, ``llama_kv_cache_iswa: ...``) that a user of speclm did not ask for; error
    lines are still kept (the last few) for the message of a failed load."""
    _LOG["verbose"] = verbose


def _install_log_callback(lc) -> None:
    """Route every llama.cpp / ggml log line through :data:`_LOG` (one process-wide callback).
    Set again at every import: llama-cpp-python's own ``Llama`` (the bench's peers) installs
    its callback over ours."""
    global _log_callback
    if _log_callback is None:
        @lc.llama_log_callback
        def callback(level: int, text: bytes, user_data) -> None:
            line = text.decode("utf-8", "replace")
            if _LOG["verbose"]:
                sys.stderr.write(line)
                sys.stderr.flush()
            elif level == 3 and line.strip():  # GGML_LOG_LEVEL_ERROR
                _LOG["errors"] = (_LOG["errors"] + [line.strip()])[-3:]

        _log_callback = callback
    lc.llama_log_set(_log_callback, ctypes.c_void_p(0))


def import_llama_cpp():
    """The ``llama_cpp`` module, quiet unless :func:`set_native_logging`; a one-line error
    saying how to install it if missing."""
    try:
        import llama_cpp
        from llama_cpp import _logger  # noqa: F401  (installs its own callback on import)
    except ImportError:
        raise SpeclmError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from None
    _install_log_callback(llama_cpp)  # replaces llama-cpp-python's, which prints by level
    return llama_cpp


def last_native_error() -> str:
    """The last error line llama.cpp logged (for one-line messages), or empty."""
    return _LOG["errors"][-1] if _LOG["errors"] else ""


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


_AMX_SYMBOL = "_Z28ggml_backend_amx_buffer_typev"  # ggml_backend_amx_buffer_type() (C++)


@functools.cache
def amx_kernels_built(lc) -> bool:
    """Whether this llama-cpp-python's CPU backend holds ggml's AMX kernels: pip's own build of
    the package compiles with ``-march=native``, which turns them on for Sapphire Rapids and
    newer CPUs, and on such a CPU they crash in ``llama_decode`` on the default model's Q4_1
    weights (scripts/build-llama-cpp.sh builds without them)."""
    for so in sorted((Path(lc.__file__).parent / "lib").glob("libggml*.so*")):
        try:
            if hasattr(ctypes.CDLL(str(so)), _AMX_SYMBOL):
                return True
        except OSError:
            continue
    return False


@functools.cache
def _warn_amx_once() -> None:
    log.warning("speclm: this llama-cpp-python was built with ggml's AMX kernels, which crash on "
                "this CPU; running without them (and without weight repacking). Rebuild it without "
                "them: scripts/build-llama-cpp.sh")


class LlamaCppModel:
    """The loaded weights (``llama_model``), shared by every context made from them."""

    def __init__(self, gguf: Path, threads: int | None = None) -> None:
        lc = self.lc = import_llama_cpp()
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        if amx_kernels_built(lc):
            # weights in plain CPU buffers never reach the AMX kernels (nor the repacked
            # layouts, which the same switch turns off): slower on some files, but no crash
            params.use_extra_bufts = False
            _warn_amx_once()
        self.ptr = lc.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.ptr:
            detail = last_native_error()
            raise SpeclmError(f"llama.cpp cannot load {str(gguf)!r} (not a GGUF model it supports"
                              + (f": {detail})" if detail else ")"))
        self.path = gguf
        self.threads = threads or self.default_threads()
        vocab = lc.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(lc.llama_vocab_n_tokens(vocab))
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.ptr))

    @staticmethod
    def default_threads() -> int:
        """As many threads as torch uses (the physical cores, unless the user set it)."""
        return torch.get_num_threads()

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lc.llama_model_free(self.ptr)
            self.ptr = None


class LlamaCppLM:
    """One sequence's llama.cpp context over a :class:`LlamaCppModel`."""

    backend_name = "llamacpp"
    supports_trees = True
    returns_hidden = False  # llama.cpp exposes no per-layer hidden states
    # llama.cpp computes one row (a plain step) with other kernels than several (a verify or a
    # prefill): the last-row logits of an 8-row forward differ from the same position's one-row
    # logits by a median 0.57 (max 1.8) on the default model, and the argmax differs at ~2.6%
    # of positions (benchmarks/llamacpp_divergence.py; neither flash attention nor the KV cache
    # type removes it), so greedy outputs of differently batched runs agree only up to such
    # near-ties; the bench measures the divergence at each mismatch (diagnose_mismatch)
    numerics = "llama.cpp quantized kernels"
    num_layers = 0  # no layer access: layer skipping and feature drafters need the torch backend

    def __init__(self, model: LlamaCppModel, eos_token_ids: frozenset[int], *,
                 max_context: int | None = None, max_batch: int = 512) -> None:
        lc = self.lc = model.lc
        self.weights = model
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # of the logits; the weights keep the GGUF's quantization
        self.vocab_size = model.vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_context = int(max_context or model.n_ctx_train or 4096)
        self.max_batch = max_batch
        params = lc.llama_context_default_params()
        params.n_ctx = self.max_context
        params.n_batch = params.n_ubatch = max_batch
        params.n_seq_max = PARKED + 1
        params.kv_unified = True  # one cache shared by all sequences: tree nodes share the context
        params.n_threads = params.n_threads_batch = model.threads
        params.no_perf = True
        # flash attention on: the plain attention path of this llama.cpp version gives wrong rows
        # for batches of 4+ tokens when another sequence holds cells at overlapping positions
        # (parked tree nodes); flash attention is right there, and as fast on this CPU
        params.flash_attn_type = 1
        self.ctx = lc.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise SpeclmError(f"llama.cpp could not create a context of {self.max_context} tokens")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(max_batch, 0, PARKED + 1)
        # numpy views on the batch's arrays: filled by slices, no per-token ctypes calls
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(max_batch,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(max_batch,))
        self._n_seq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(max_batch,))
        self._wants = np.ctypeslib.as_array(self.batch.logits, shape=(max_batch,))
        self._seqs = [np.ctypeslib.as_array(self.batch.seq_id[i], shape=(PARKED + 1,))
                      for i in range(max_batch)]
        self._length = 0
        self._tree_seqs = 0  # node sequences in use since the last commit (1 .. this)
        self._tokens: list[int] = []  # the token at each cache slot (to re-prefill after parking)
        self._parked = 0  # cells held by the parked sequence
        self.max_parked = max(256, self.max_context // 8)

    def __del__(self) -> None:
        lc = getattr(self, "lc", None)
        if lc is not None and getattr(self, "ctx", None):
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            self.ctx = None

    @property
    def cache_length(self) -> int:
        return self._length

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        token_ids: torch.Tensor,
        start_pos: int,
        num_logits: int = 1,
        return_hidden: bool | Sequence[int] = False,
        tree: TreeMeta | None = None,
    ) -> ForwardOutput:
        if return_hidden:
            raise SpeclmError("the llama.cpp backend gives no hidden states; drafters that read the "
                              "target's features (eagle, medusa) need --backend torch")
        ids = token_ids.detach().to("cpu", torch.int32).numpy()  # [T]
        num_new = ids.shape[0]
        check_forward(self._length, start_pos, num_new, num_logits)
        if start_pos + num_new > self.max_context:
            raise SpeclmError(f"{start_pos + num_new} positions exceed the llama.cpp context of "
                              f"{self.max_context}")
        if tree is not None:
            self._fill_tree(ids, start_pos, tree, num_logits)
        else:
            if self._tree_seqs:
                raise CacheContractError("a chain forward after a tree: compact or roll back first")
            # long prompts go in pieces of max_batch; only the last piece asks for logits
            lo = 0
            try:
                while num_new - lo > self.max_batch:
                    self._fill_chain(ids[lo: lo + self.max_batch], start_pos + lo, 0)
                    self._decode(self.max_batch)
                    lo += self.max_batch
                if num_logits > num_new - lo:
                    raise ValueError(f"num_logits {num_logits} exceeds the batch of {self.max_batch}")
                self._fill_chain(ids[lo:], start_pos + lo, num_logits)
                self._decode(num_new - lo)
            except BaseException:
                self.lc.llama_memory_seq_rm(self.mem, 0, start_pos, -1)  # the contract holds
                raise
        self._length += num_new
        self._tokens.extend(ids.tolist())
        ptr = self.lc.llama_get_logits(self.ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(num_logits, self.vocab_size))
        return ForwardOutput(logits=torch.from_numpy(logits.copy()))  # [num_logits, V]

    def _fill_chain(self, ids: np.ndarray, start: int, num_logits: int) -> None:
        t = ids.shape[0]
        self._token[:t] = ids
        self._pos[:t] = np.arange(start, start + t, dtype=np.int32)
        self._n_seq[:t] = 1
        for row in self._seqs[:t]:
            row[0] = 0
        self._wants[:t] = 0
        if num_logits:
            self._wants[t - num_logits: t] = 1

    def _fill_tree(self, ids: np.ndarray, start: int, tree: TreeMeta, num_logits: int) -> None:
        """Rows = the last T of [pending, node_0 .. node_{k-1}] (see the module docstring)."""
        k, t = tree.num_nodes, ids.shape[0]
        if k > MAX_TREE_NODES:
            raise SpeclmError(f"the llama.cpp backend takes trees of at most {MAX_TREE_NODES} nodes, got {k}")
        if t > self.max_batch:
            raise SpeclmError(f"a tree forward of {t} rows exceeds the batch of {self.max_batch}")
        root = start + t - 1 - k  # the pending token's slot (= position)
        if not 0 <= root <= start:
            raise ValueError(f"{t} tokens cannot be the last rows of a tree of {k} nodes")
        first = k - t if root < start else 0  # the first node fed now
        parents = tree.parents.tolist()
        depth = tree.depth.tolist()
        # each fed node's sequence starts as a copy of its nearest cached ancestor's
        for i in range(first, k):
            a = parents[i]
            while a >= first:
                a = parents[a]
            self.lc.llama_memory_seq_cp(self.mem, 1 + a if a >= 0 else 0, 1 + i, -1, -1)
        # row r's sequences: its own plus its fed descendants' (pending: 0 plus every fed node)
        members: dict[int, list[int]] = {i: [1 + i] for i in range(first, k)}
        for i in range(first, k):
            a = parents[i]
            while a >= first:
                members[a].append(1 + i)
                a = parents[a]
        rows = ([(-1, [0] + [1 + i for i in range(first, k)])] if root == start else []) + \
               [(i, members[i]) for i in range(first, k)]
        for r, (node, seqs) in enumerate(rows):
            self._pos[r] = root + (depth[node] if node >= 0 else 0)
            self._n_seq[r] = len(seqs)
            self._seqs[r][: len(seqs)] = seqs
        self._token[:t] = ids
        self._wants[:t] = 0
        self._wants[t - num_logits: t] = 1
        self._tree_seqs = max(self._tree_seqs, k)
        self._decode(t)

    def _decode(self, t: int) -> None:
        self.batch.n_tokens = t
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise SpeclmError(f"llama_decode failed (code {rc}"
                              + (": no room left in the KV cache)" if rc == 1 else ")"))

    # -- cache ---------------------------------------------------------------------------------
    def _drop_tree(self) -> None:
        for s in range(1, self._tree_seqs + 1):
            self.lc.llama_memory_seq_rm(self.mem, s, -1, -1)
        self._tree_seqs = 0

    def rollback(self, length: int) -> None:
        check_rollback(self._length, length)
        self._drop_tree()  # freed cells are all above the kept ones: no holes
        self.lc.llama_memory_seq_rm(self.mem, 0, length, -1)
        self._length = length
        del self._tokens[length:]

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep [0, start) and the tree nodes ``keep`` (the accepted path, in order)."""
        if not self._tree_seqs:  # a chain: keep must be its first len(keep) nodes
            if keep != list(range(len(keep))):
                raise CacheContractError(f"cannot keep {keep} of a chain")
            self.rollback(start + len(keep))
            return
        for s in range(1, self._tree_seqs + 1):  # park every node's cell (see the module docstring)
            self.lc.llama_memory_seq_cp(self.mem, s, PARKED, start, -1)
        if keep:
            # the last accepted node's sequence holds the context and exactly its ancestors
            self.lc.llama_memory_seq_cp(self.mem, 1 + keep[-1], 0, start, -1)
        self._parked += self._length - start - len(keep)
        self._drop_tree()
        self._tokens[start:] = [self._tokens[start + i] for i in keep]
        self._length = start + len(keep)
        if self._parked > self.max_parked:
            self._reprefill()

    def _reprefill(self) -> None:
        """Drop every cell and run the committed tokens again (rare: see max_parked)."""
        tokens = torch.tensor(self._tokens, dtype=torch.long)
        self.reset()
        if tokens.numel():
            self.forward(tokens, 0)

    def reset(self) -> None:
        self.lc.llama_memory_clear(self.mem, False)  # the cells; their stale data is never read
        self._length = 0
        self._tree_seqs = 0
        self._tokens = []
        self._parked = 0

    def batched_rows(self, num_slots: int):
        """``num_slots`` rows fed together in one context (speclm.models.llamacpp_rows): the
        engine's batched form of this backend, for chains."""
        from .llamacpp_rows import LlamaCppRows

        return LlamaCppRows(self, num_slots)

    def fork(self) -> LlamaCppLM:
        return LlamaCppLM(self.weights, self.eos_token_ids, max_context=self.max_context,
                          max_batch=self.max_batch)
