"""Randomly initialised models of real shapes, for measuring the engine on any architecture.

``random:llama-3-8b`` (a preset) or ``random:/path/config.json`` builds the stock transformers
model for that config with random weights drawn from an explicit generator, on the target device,
without downloading anything. The tokenizer is the default model's; ids beyond its vocabulary
decode to nothing, which is harmless for the oracle benchmark (it compares token ids).

The LM head is drawn wider than usual (std 0.2) so that logits are spread out: with the usual
0.02 a random model's top two logits nearly tie at every step, and rounding differences between
a one-token and a multi-token forward would flip greedy choices.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import SpeclmError

PREFIX = "random:"
_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False)
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0),
}


def is_random(model: str | None) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def random_config(model: str):
    """The transformers config named by ``random:PRESET`` or ``random:CONFIG.json``."""
    from transformers import AutoConfig

    name = model[len(PREFIX):]
    if name in PRESETS:
        fields = dict(PRESETS[name])
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise SpeclmError(f"{model!r}: not a preset ({', '.join(PRESETS)}) or a config.json file")
        try:
            fields = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpeclmError(f"{model!r}: cannot read the config: {exc}") from None
    model_type = fields.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as exc:
        raise SpeclmError(f"{model!r}: not a usable model config ({exc})") from None


def random_model(model: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A stock ``AutoModelForCausalLM`` with the config of ``model`` and random weights."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = random_config(model)
    with no_init_weights(), torch.device(device):  # allocate only; weights are drawn below
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    head = hf_model.get_output_embeddings().weight
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.2 if param is head else 0.02, generator=gen)
            elif name.endswith("bias"):
                param.zero_()
    return hf_model.eval()
