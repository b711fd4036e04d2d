"""B rows of a llama.cpp target in one ``llama_decode``: each row a sequence id of one context.

The batched form of :class:`~speclm.models.llamacpp.LlamaCppLM` for the engine
(:class:`~speclm.models.rows.TargetRows`). One context holds ``num_slots`` sequences, each with
its own KV stream (``kv_unified = False``: a stream per sequence, ``max_context`` cells each), so
a row's cells are always the bottom of its stream and cutting a rejected draft off the top never
leaves a hole (the unified cache's holes give wrong logits for multi-token batches in this
llama.cpp version: see llamacpp.py). A step puts every row's tokens into one batch, tagged with
the row's sequence id, at the row's own positions; llama.cpp runs them as one graph when every
row brings the same number of tokens, in several otherwise (its ``split_equal``: about one graph
per distinct row length). On a CPU an extra graph costs about what two more tokens cost in one
(it reads the weights again; a token's arithmetic is the rest): so ragged rows are right-padded to
the widest row only when the padding adds at most ``PAD_TOKENS_PER_GRAPH`` tokens per graph it
saves (the padding's cells are dropped right after the forward), and fed ragged otherwise. A
prompt's chunks, hundreds of tokens of arithmetic per row, are then never padded to each other.

Slots map to sequence ids indirectly: moving or swapping rows (the engine keeps decoding rows in
the first slots) renames, and never copies a stream. Rows are laid out in the batch in order of
their sequence ids; consecutive ids share a graph (llama.cpp's sequential split), so a slot takes
the lowest free id.

Chains only: llama.cpp splits a batch over separate streams only when no token belongs to two
sequences, and a token tree needs exactly that (see llamacpp.py). Drafters that grow trees run
through one context per row (:class:`~speclm.models.rows.SlotRows`); :func:`make_rows` decides.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import CacheContractError, SpeclmError
from ..tree import TreeMeta
from .rows import RowsOutput

if TYPE_CHECKING:
    from .llamacpp import LlamaCppLM

# pad ragged rows to one graph while the padding adds at most this many tokens per graph saved:
# measured on 2-core Zen 4 and Sapphire Rapids VMs (default model), a graph's fixed cost is ~2
# tokens' worth (benchmarks/llamacpp_pad.py)
PAD_TOKENS_PER_GRAPH = 2


def pad_width(num_fed: list[int]) -> int:
    """The width to right-pad ragged rows to for one graph, or 0 to feed them ragged: padding
    pays while it adds at most ``PAD_TOKENS_PER_GRAPH`` tokens per graph it saves (llama.cpp
    makes about one graph per distinct row length)."""
    widest, real = max(num_fed), sum(num_fed)
    waste = len(num_fed) * widest - real
    return widest if 0 < waste <= PAD_TOKENS_PER_GRAPH * (len(set(num_fed)) - 1) else 0


class LlamaCppRows:
    """``num_slots`` sequences of one llama.cpp context, fed together (see the module docstring)."""

    backend_name = "llamacpp"

    def __init__(self, target: LlamaCppLM, num_slots: int, *, max_tokens: int = 2048) -> None:
        if not 1 <= num_slots <= 256:
            raise SpeclmError(f"the llama.cpp backend batches 1 to 256 rows, got {num_slots}")
        lc = self.lc = target.lc
        self.target = target
        self.vocab_size = target.vocab_size
        self.max_context = target.max_context
        self.device = torch.device("cpu")
        self.eos_token_ids = target.eos_token_ids
        self.num_slots = num_slots
        self.max_tokens = max_tokens  # tokens per llama_decode call (more go in several)
        params = lc.llama_context_default_params()
        params.n_seq_max = num_slots
        params.kv_unified = False  # a KV stream per sequence: no holes, no cross-row masking
        params.n_ctx = self.max_context * num_slots  # llama.cpp gives each stream n_ctx / n_seq_max
        params.n_batch = max_tokens
        params.n_ubatch = min(512, max_tokens)
        params.n_threads = params.n_threads_batch = target.weights.threads
        params.no_perf = True
        params.flash_attn_type = 1  # as the single-row backend (llamacpp.py)
        self.ctx = lc.llama_init_from_model(target.weights.ptr, params)
        if not self.ctx:
            raise SpeclmError(f"llama.cpp could not create a context of {num_slots} x "
                              f"{self.max_context} tokens")
        self.mem = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(max_tokens, 0, 1)
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(max_tokens,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(max_tokens,))
        self._n_seq = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(max_tokens,))
        self._wants = np.ctypeslib.as_array(self.batch.logits, shape=(max_tokens,))
        self._n_seq[:] = 1
        # every token's one sequence id in one array, filled by slices: the batch's per-token
        # pointers are aimed into it (and restored before llama_batch_free frees them)
        self._seq_id = np.zeros(max_tokens, dtype=np.int32)
        self._own_ptrs = [ctypes.cast(self.batch.seq_id[i], ctypes.c_void_p).value for i in range(max_tokens)]
        base, step = self._seq_id.ctypes.data, self._seq_id.itemsize
        for i in range(max_tokens):
            self.batch.seq_id[i] = ctypes.cast(base + i * step, ctypes.POINTER(ctypes.c_int32))
        self._seq: list[int | None] = [None] * num_slots  # slot -> sequence id
        self._length = [0] * num_slots

    def __del__(self) -> None:
        lc = getattr(self, "lc", None)
        if lc is not None and getattr(self, "ctx", None):
            for i, address in enumerate(self._own_ptrs):
                self.batch.seq_id[i] = ctypes.cast(address, ctypes.POINTER(ctypes.c_int32))
            lc.llama_batch_free(self.batch)
            lc.llama_free(self.ctx)
            self.ctx = None

    # -- sequences ---------------------------------------------------------------------------
    def _seq_of(self, slot: int) -> int:
        seq = self._seq[slot]
        if seq is None:
            used = {s for s in self._seq if s is not None}
            seq = self._seq[slot] = min(set(range(self.num_slots)) - used)
        return seq

    def length(self, slot: int) -> int:
        return self._length[slot]

    def computed(self, num_rows: int, width: int) -> int:
        return num_rows * width

    # -- forward -----------------------------------------------------------------------------
    def forward(self, rows: range, token_ids: torch.Tensor, num_fed: list[int], *,
                logits: bool = True, trees: Sequence[TreeMeta | None] | None = None,
                return_hidden: bool | Sequence[int] = False) -> RowsOutput:
        if trees is not None and any(t is not None for t in trees):
            raise SpeclmError("batched llama.cpp rows verify chains; a drafter that grows token "
                              "trees runs one context per row (make_rows)")
        if return_hidden:
            raise SpeclmError("the llama.cpp backend gives no hidden states; drafters that read the "
                              "target's features (eagle, medusa) need --backend torch")
        ids = token_ids.detach().to("cpu", torch.int32).numpy()  # [B, T]
        slots = list(rows)
        for b, slot in enumerate(slots):
            if self._length[slot] + num_fed[b] > self.max_context:
                raise SpeclmError(f"{self._length[slot] + num_fed[b]} positions exceed the llama.cpp "
                                  f"context of {self.max_context}")
        width = ids.shape[1]
        out = torch.empty(len(slots), width, self.vocab_size) if logits else None  # [B, T, V]
        real = sum(num_fed)
        if real > self.max_tokens:  # too many for one call: a row (or a piece of it) at a time
            for b, slot in enumerate(slots):
                for lo in range(0, num_fed[b], self.max_tokens):
                    n = min(self.max_tokens, num_fed[b] - lo)
                    self._run([(b, slot, ids[b, lo: lo + n], n)], logits, out, offset=lo)
            return RowsOutput(out)
        width_fed = pad_width(num_fed)
        if len(slots) * width_fed > self.max_tokens or any(
                self._length[s] + width_fed > self.max_context for s in slots):
            width_fed = 0
        items = [(b, slot, ids[b, : (width_fed or num_fed[b])], num_fed[b])
                 for b, slot in enumerate(slots)]
        self._run(items, logits, out)
        return RowsOutput(out)

    def _run(self, items, logits: bool, out: torch.Tensor | None, offset: int = 0) -> None:
        """One ``llama_decode`` over ``items`` = (b, slot, tokens to feed, how many are real);
        fed tokens past the real ones are padding (their cells are dropped again). Logits of
        every real position (``logits``) land in ``out[b, offset + t]``."""
        items = sorted(items, key=lambda item: self._seq_of(item[1]))  # consecutive ids: one graph
        n, where = 0, []
        for b, slot, tokens, num_real in items:
            t, start, seq = tokens.shape[0], self._length[slot], self._seq_of(slot)
            self._token[n: n + t] = tokens
            self._pos[n: n + t] = np.arange(start, start + t, dtype=np.int32)
            self._seq_id[n: n + t] = seq
            self._wants[n: n + t] = 0
            if logits:
                self._wants[n: n + num_real] = 1
                where.append((b, num_real))
            n += t
        if not logits:
            self._wants[n - 1] = 1  # llama.cpp wants at least one output
        self.batch.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            for _, slot, _, _ in items:  # the contract holds: nothing of this forward stays
                self.lc.llama_memory_seq_rm(self.mem, self._seq_of(slot), self._length[slot], -1)
            raise SpeclmError(f"llama_decode failed (code {rc}"
                              + (": no room left in the KV cache)" if rc == 1 else ")"))
        for _, slot, tokens, num_real in items:
            self._length[slot] += num_real
            if tokens.shape[0] > num_real:  # padding: its cells go at once
                self.lc.llama_memory_seq_rm(self.mem, self._seq_of(slot), self._length[slot], -1)
        if logits:
            total = sum(r for _, r in where)
            ptr = self.lc.llama_get_logits(self.ctx)
            flat = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(total, self.vocab_size)))
            row = 0
            for b, num_real in where:  # outputs come in batch order
                out[b, offset: offset + num_real] = flat[row: row + num_real]
                row += num_real

    # -- the cache ---------------------------------------------------------------------------
    def keep(self, slot: int, start: int, keep: list[int]) -> None:
        if keep != list(range(len(keep))):
            raise CacheContractError(f"cannot keep {keep} of a chain")
        length = start + len(keep)
        if length > self._length[slot]:
            raise CacheContractError(f"slot {slot} holds {self._length[slot]} positions, cannot keep {length}")
        if length < self._length[slot]:
            self.lc.llama_memory_seq_rm(self.mem, self._seq_of(slot), length, -1)
        self._length[slot] = length

    def move(self, src: int, dst: int) -> None:
        if self._seq[dst] is not None and self._length[dst]:
            raise CacheContractError(f"slot {dst} is not free")
        self.release(dst)
        self._seq[dst], self._seq[src] = self._seq[src], None
        self._length[dst], self._length[src] = self._length[src], 0

    def swap(self, a: int, b: int) -> None:
        self._seq[a], self._seq[b] = self._seq[b], self._seq[a]
        self._length[a], self._length[b] = self._length[b], self._length[a]

    def release(self, slot: int) -> None:
        seq = self._seq[slot]
        if seq is not None:
            self.lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self._seq[slot], self._length[slot] = None, 0

    def clear(self) -> None:
        # the cells only: zeroing the 16 streams' buffers as well (data=True) took 0.36 s, paid
        # by every request that left the server idle; masked empty cells are never read
        self.lc.llama_memory_clear(self.mem, False)
        self._seq = [None] * self.num_slots
        self._length = [0] * self.num_slots

    def handle(self, slot: int) -> LlamaCppLM:
        """Drafters read the target's shapes from it; none runs llama.cpp target layers."""
        return self.target
