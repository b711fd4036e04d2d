"""Peers on llama.cpp: its own plain decoding, and llama-cpp-python's own prompt lookup.

``llamacpp``: the loop llama.cpp's own tools run (``llama_decode`` one token at a time, the next
token picked by llama.cpp's greedy sampler in C), with no Python touching the logits: the speed of
plain decoding in llama.cpp itself. ``llamacpp-lookup``: llama-cpp-python's high-level ``Llama``
with its ``LlamaPromptLookupDecoding`` draft model, as a user of that package would run it. Both
load the same GGUF file as speclm's llama.cpp backend, with the same threads, and return token ids
so the greedy identity check applies to them too.
"""

from __future__ import annotations

import time

from ..errors import SpeclmError
from ..models.llamacpp import LlamaCppModel, amx_kernels_built, import_llama_cpp
from ..sampling import SamplingParams
from .methods import MethodSpec


class LlamaCppPlainPeer:
    def __init__(self, spec: MethodSpec, gguf, eos_token_ids: frozenset[int], n_ctx: int = 4096) -> None:
        lc = self.lc = import_llama_cpp()
        self.spec = spec
        self.weights = LlamaCppModel(gguf)
        self.eos = eos_token_ids
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = 512
        params.n_threads = params.n_threads_batch = self.weights.threads
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.weights.ptr, params)
        self.n_ctx = n_ctx
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        self.sampler = chain

    def run(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
        if not params.greedy:
            raise SpeclmError("the llamacpp peer runs greedy decoding only")
        if len(prompt_ids) + params.max_tokens > self.n_ctx:
            raise SpeclmError(f"prompt + budget exceed the peer's context of {self.n_ctx}")
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        out: list[int] = []
        start = time.perf_counter()
        # prefill all but the last prompt token, then decode from it: the same batches as
        # speclm's engine, so the two plain decodings see identical numerics
        for lo in range(0, len(prompt_ids) - 1, 512):
            chunk = prompt_ids[lo: min(lo + 512, len(prompt_ids) - 1)]
            piece = (lc.llama_token * len(chunk))(*chunk)
            if lc.llama_decode(self.ctx, lc.llama_batch_get_one(piece, len(chunk))) != 0:
                raise SpeclmError("llama_decode failed")
        token = (lc.llama_token * 1)(prompt_ids[-1])
        if lc.llama_decode(self.ctx, lc.llama_batch_get_one(token, 1)) != 0:
            raise SpeclmError("llama_decode failed")
        while len(out) < params.max_tokens:
            tok = lc.llama_sampler_sample(self.sampler, self.ctx, -1)
            out.append(int(tok))
            if tok in self.eos and not params.ignore_eos:
                break
            token[0] = tok
            if lc.llama_decode(self.ctx, lc.llama_batch_get_one(token, 1)) != 0:
                raise SpeclmError("llama_decode failed")
        return out, time.perf_counter() - start

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.lc.llama_sampler_free(self.sampler)
            self.lc.llama_free(self.ctx)
            self.ctx = None


class LlamaCppLookupPeer:
    def __init__(self, spec: MethodSpec, gguf, eos_token_ids: frozenset[int], n_ctx: int = 4096) -> None:
        lc = import_llama_cpp()
        if amx_kernels_built(lc):  # llama-cpp-python's Llama loads every weight into them
            raise SpeclmError("the llamacpp-lookup peer cannot run on this llama-cpp-python build: its AMX "
                              "kernels crash on this CPU; rebuild it with scripts/build-llama-cpp.sh")
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.spec = spec
        self.eos = eos_token_ids
        # n_batch = n_ctx: with the default 512, prompts longer than 256 tokens fail inside
        # llama-cpp-python's speculative path (a logits buffer sized by n_batch)
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=512,
                         n_threads=LlamaCppModel.default_threads(),
                         n_threads_batch=LlamaCppModel.default_threads(), verbose=False,
                         draft_model=LlamaPromptLookupDecoding(max_ngram_size=spec.options["ngram"],
                                                               num_pred_tokens=spec.options["k"]))

    def run(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
        if not params.greedy:
            raise SpeclmError("the llamacpp-lookup peer runs greedy decoding only")
        self.llm.reset()
        out: list[int] = []
        start = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) >= params.max_tokens or (tok in self.eos and not params.ignore_eos):
                break
        return out, time.perf_counter() - start
