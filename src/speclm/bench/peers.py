"""Peers: Hugging Face transformers' own ``generate`` on the same model object and prompts."""

from __future__ import annotations

import time

import torch

from ..models.loading import load_model
from ..sampling import SamplingParams
from .methods import MethodSpec


class HFPeer:
    """Runs one peer method; the assistant model (if any) is loaded once.

    transformers reads the draft length from the *assistant's* generation config (and by default
    grows it and stops drafting below a confidence of 0.4), so K is pinned there: constant K,
    no confidence cut-off, the same K as speclm's methods get.
    """

    _ASSIST_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule",
                      "assistant_confidence_threshold")

    def __init__(self, spec: MethodSpec, llm) -> None:
        self.spec = spec
        self.model = llm.target.model
        self.eos = sorted(llm.target.eos_token_ids)
        self.extra: dict = {}
        self.assistant = None  # the model whose generation_config holds K
        opts = spec.options
        if spec.name == "hf-lookup":
            self.extra = dict(prompt_lookup_num_tokens=opts["k"])
        elif spec.name == "hf-assisted":
            loaded = load_model(opts["path"], device=str(llm.target.device), dtype=llm.target.dtype)
            self.assistant = loaded.backend.model
            self.extra = dict(assistant_model=self.assistant)
        elif spec.name == "hf-early-exit":
            layers = opts["layers"] or max(1, llm.target.num_layers // 3)
            self.assistant = self.model  # early exit drafts with the target's own first layers
            self.extra = dict(assistant_early_exit=layers)
        self.k = opts.get("k")

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], float]:
        """Generate; return the new token ids and the wall time of ``generate``."""
        from transformers.utils import logging as hf_logging

        device = self.model.device
        input_ids = torch.tensor([prompt_ids], device=device)
        sampling = (dict(do_sample=True, temperature=params.temperature, top_k=params.top_k or None,
                         top_p=params.top_p) if not params.greedy
                    else dict(do_sample=False, temperature=None, top_k=None, top_p=None))
        # neutralise whatever else the model's generation_config asks for: same rules as speclm
        neutral = dict(repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)  # transformers samples from the global generator
        config = self.assistant.generation_config if self.assistant is not None else None
        saved = {f: getattr(config, f, None) for f in self._ASSIST_FIELDS} if config else {}
        layers = self.model.config.num_hidden_layers
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # assisted generation warns about its own internals
        try:
            if config is not None:
                config.num_assistant_tokens = self.k
                config.num_assistant_tokens_schedule = "constant"
                config.assistant_confidence_threshold = 0.0
            start = time.perf_counter()
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=params.max_tokens,
                eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None,
                **sampling, **neutral, **self.extra,
            )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
        finally:
            hf_logging.set_verbosity(level)
            for f, value in saved.items():
                setattr(config, f, value)
            self.model.config.num_hidden_layers = layers  # early exit edits it in place
        return out[0, len(prompt_ids):].tolist(), elapsed
