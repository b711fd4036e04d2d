"""Shared fixtures: tiny randomly initialised Llama models and a tiny byte-level BPE tokenizer.

Everything is built on the fly (no downloads): a tokenizer trained on a few sentences, and
models saved as ordinary HF folders so the loading path is exercised too. float64 keeps
single-token and multi-token forwards numerically equal, so greedy identity is exact.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speclm.models.hf import HFCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🙂 and more unicode ✓",
    "def add(a, b):\n    return a + b\n",
]


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` imported as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_config(vocab_size: int, *, seed_layers: int = 2, max_positions: int = 256) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=seed_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, initializer_range=0.3,
        bos_token_id=None, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False,
    )


def tiny_model(vocab_size: int, seed: int, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(vocab_size, **kw)).to(torch.float64).eval()


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return draft


@pytest.fixture
def cpu_kernel():
    """speclm's small-M CPU kernel (models/small_m.py): skipped without AVX2 or a compiler, and
    a failure (not a skip) where both exist but it does not build."""
    import shutil

    from speclm.models import small_m

    if not small_m._cpu_has_avx2():
        pytest.skip("the kernel needs a CPU with AVX2")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler to build the kernel")
    assert small_m.kernel_available(), "the CPU kernel did not build on a machine with AVX2 and a compiler"
    return torch.ops.speclm


def backend(model: LlamaForCausalLM) -> HFCausalLM:
    return HFCausalLM(model, frozenset({0}))


def _train_tokenizer(vocab_size: int, corpus: list[str]) -> PreTrainedTokenizerFast:
    from tokenizers import ByteLevelBPETokenizer

    raw = ByteLevelBPETokenizer()
    raw.train_from_iterator(corpus, vocab_size=vocab_size, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=raw._tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    tok = _train_tokenizer(300, CORPUS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _save(folder: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """HF folders: target, a related draft, an unrelated draft, a model without a chat
    template, one with another vocabulary, and one with a 48-token context."""
    root = tmp_path_factory.mktemp("models")
    vocab = len(tiny_tokenizer)
    target = tiny_model(vocab, seed=0)
    dirs = {
        "target": _save(root / "target", target, tiny_tokenizer),
        "draft": _save(root / "draft", noisy_copy(target, 0.05, seed=1), tiny_tokenizer),
        "unrelated": _save(root / "unrelated", tiny_model(vocab, seed=2), tiny_tokenizer),
        "short": _save(root / "short", tiny_model(vocab, seed=0, max_positions=48), tiny_tokenizer),
    }
    no_template = copy.deepcopy(tiny_tokenizer)
    no_template.chat_template = None
    dirs["no_template"] = _save(root / "no_template", target, no_template)
    other = _train_tokenizer(290, CORPUS[::-1] + ["a different corpus gives different merges"])
    dirs["other_vocab"] = _save(root / "other_vocab", tiny_model(len(other), seed=3), other)
    return dirs


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models gain nothing from intra-op threads, and on a shared machine the spinning of
    idle threads makes them many times slower; real-model tests keep torch's default, except
    under pytest-xdist, where the workers already share the cores."""
    if request.node.get_closest_marker("real_model") and "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--spec-bench", default=None,
                     help="path to Spec-Bench question.jsonl (default: ../shared/data/spec_bench/)")
