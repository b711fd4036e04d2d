"""A GGUF file's own 4-bit weights on the compiled torch path: no dequantize-requantize.

llama.cpp's Q4_0 and Q4_1 store each row of a weight in blocks of 32 inputs: 32 four-bit codes
q, a float16 scale d and, for Q4_1, a float16 minimum m. The weight is d * (q - 8) (Q4_0) or
d * q + m (Q4_1). PyTorch's int4 kernels (:class:`~.quant_linear.Int4Linear`) compute
(q - 8) * scale + zero per group of inputs, so one block is one group of 32: scale = d and zero =
m + 8 d (Q4_1) or 0 (Q4_0). The layer then computes the file's weights, not a
second rounding of them (``--quantize int4`` rounds the dequantized weights again, in groups of
up to 128, and so runs another model than the file's).

Which tensor of the file backs which ``nn.Linear``: gguf-py's name map for the file's
architecture. A loader may reorder a weight's rows (transformers undoes llama.cpp's rotary row
order in q and k), so rows are matched by value: every row of the layer's float weight must
equal one row of the file's dequantized tensor bit for bit, else the layer is refused with a
one-line error (the model in memory is not this file's).

Q8_0 blocks (32 signed 8-bit codes and a float16 scale d; the default model's embedding, which
its output head is tied to) split exactly into two int4 layers: a code q in [-128, 127] is
16 h + l with h in [-8, 7] and l in [0, 15], so the weight d q is the sum of an int4 layer with
codes h + 8 and scale 16 d and one with codes l and scale d (:class:`SplitQ8Linear`: the bytes
of int8, two int4 kernels, the file's values exactly). Layers stored at other types keep their
dequantized float weights, in the compute dtype.

In float32 on an AVX2 CPU, where PyTorch's int4 kernel is slow (about 0.2 s a token for the
default model on a Zen 3), the layers are instead :class:`~.small_m.BlockLinear`s: speclm's own
kernel on the file's blocks as stored (models/small_m.py). By default it multiplies them as
llama.cpp's CPU kernels do: each activation row quantized to 8 bits per block of 32, then integer
dot products; ``SPECLM_GGUF_ACTIVATIONS=float`` multiplies float activations instead.

On CUDA the same layers use PyTorch's CUDA int4 kernel (bfloat16 scales): written for, never
run on a GPU.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import SpeclmError
from .quant_linear import Int4Linear
from .small_m import ACTIVATIONS, BlockLinear, kernel_available

BLOCK = 32  # inputs per Q4_0 / Q4_1 / Q8_0 block
FOUR_BIT = ("Q4_0", "Q4_1")  # the block types of 4-bit codes
EXACT_TYPES = (*FOUR_BIT, "Q8_0")  # every type this module runs on the file's own codes
ACTIVATIONS_ENV = "SPECLM_GGUF_ACTIVATIONS"  # q8 (default) or float: see block_activations


@dataclass
class KeptBlocks:
    """What :func:`keep_gguf_int4` did: layers on the file's own int4 blocks, layers left float."""

    int4: dict[str, str]  # module name -> the file's type (Q4_0, Q4_1, Q8_0), now on its codes
    dense: dict[str, str]  # module name -> the file's type for layers kept as float weights


class SplitQ8Linear(nn.Module):
    """A Q8_0 layer as the sum of two int4 layers (high and low nibble of each code)."""

    def __init__(self, high: Int4Linear, low: Int4Linear) -> None:
        super().__init__()
        self.high, self.low = high, low
        self.in_features, self.out_features = low.in_features, low.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(x) + self.low(x)


def decode_q8(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's raw rows [N, bytes] as codes [N, K] (int8) and scale [N, K/32] (float32):
    the weight is codes * scale."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, 2 + BLOCK)  # [N, K/32, 34]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return blocks[..., 2:].copy().view(np.int8).reshape(n, -1), scale


def decode_q4(data: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 tensor's raw rows [N, bytes] as codes [N, K] (uint8, 0..15), scale and
    minimum [N, K/32] (float32): the weight is codes * scale + minimum exactly as llama.cpp and
    gguf-py dequantize it."""
    head = {"Q4_0": 2, "Q4_1": 4}[type_name]  # bytes of float16 fields before the 16 code bytes
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, head + BLOCK // 2)  # [N, K/32, bytes]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    packed = blocks[..., head:]  # [N, K/32, 16]: low nibbles are inputs 0-15, high 16-31
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)  # [N, K]
    if type_name == "Q4_1":
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:  # d * (q - 8) = d * q - 8 d
        minimum = -8 * scale
    return codes, scale, minimum


def pack_q4(codes):
    """4-bit codes [N, K] (uint8 in 0..15; a NumPy array or a tensor, returned alike) packed two
    to a byte [N, K/2] in the order of a Q4_0/Q4_1 block, the inverse of :func:`decode_q4`: byte j
    of each block of 32 inputs holds input j in its low nibble and input j + 16 in its high one."""
    n = codes.shape[0]
    grouped = codes.reshape(n, -1, BLOCK)  # [N, K/32, 32]
    return (grouped[..., : BLOCK // 2] | grouped[..., BLOCK // 2:] << 4).reshape(n, -1)


def _row_order(weight: torch.Tensor, dequantized: np.ndarray) -> np.ndarray | None:
    """Indices into ``dequantized``'s rows (float32) giving ``weight`` [N, K] bit for bit once
    rounded to ``weight``'s dtype (float32, or bfloat16 for a model already cast), or None."""
    if tuple(weight.shape) != dequantized.shape:
        return None
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[weight.element_size()]
    mine = weight.detach().cpu().contiguous().view(bits).numpy()
    theirs = torch.from_numpy(dequantized).to(weight.dtype).view(bits).numpy()
    if np.array_equal(mine, theirs):
        return np.arange(weight.shape[0])
    where = {row.tobytes(): i for i, row in enumerate(theirs)}
    order = [where.get(row.tobytes(), -1) for row in mine]
    return None if -1 in order or len(set(order)) != len(order) else np.asarray(order)


def _name_map(reader):
    import gguf

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0] == gguf.GGUFValueType.STRING else int(value[0])

    arch_name = field("general.architecture")
    arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
    blocks = field(f"{arch_name}.block_count")
    if arch is None or blocks is None:
        raise SpeclmError(f"the GGUF file's architecture {arch_name!r} is unknown to gguf-py; "
                          "use --quantize int4 instead")
    return gguf.get_tensor_name_map(arch, blocks)


def _from_blocks(data: np.ndarray, type_name: str, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> nn.Module | None:
    """The layer computing a Q4_0/Q4_1/Q8_0 tensor's weights, its rows in the order of ``weight``
    (the weights loaded from it): a :class:`~.small_m.BlockLinear` on the file's blocks for
    float32 on a CPU where speclm's kernel runs, else int4 layers; None when the weights are not
    that tensor's."""
    if type_name == "Q8_0":
        q8, scale = decode_q8(data)
        grouped = q8.reshape(q8.shape[0], -1, BLOCK)
        dequantized = scale[..., None] * grouped.astype(np.float32)  # as gguf-py rounds it
    else:
        codes, scale, minimum = decode_q4(data, type_name)
        grouped = codes.reshape(codes.shape[0], -1, BLOCK).astype(np.float32)  # [N, K/32, 32]
        if type_name == "Q4_0":  # d * (q - 8), rounded as gguf-py and llama.cpp round it
            dequantized = scale[..., None] * (grouped - 8)
        else:
            dequantized = grouped * scale[..., None] + minimum[..., None]
    order = _row_order(weight, dequantized.reshape(weight.shape[0], -1))
    if order is None:
        return None
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and kernel_available():
        # float32 on an AVX2 CPU: speclm's kernel runs the file's blocks as they are stored
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a[order]))  # noqa: E731
        activations = block_activations()
        if type_name == "Q8_0":
            return BlockLinear(as_tensor(q8.view(np.uint8)), as_tensor(scale), None, 8, bias, activations)
        own_minimum = as_tensor(minimum) if type_name == "Q4_1" else None  # Q4_0: d * (q - 8)
        return BlockLinear(as_tensor(pack_q4(codes)), as_tensor(scale), own_minimum, 4, bias, activations)

    def int4(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, bias) -> Int4Linear:
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a[order])).to(weight.device)  # noqa: E731
        return Int4Linear(as_tensor(codes.astype(np.int32)), as_tensor(scale), as_tensor(minimum),
                          bias, weight.dtype)

    if type_name != "Q8_0":
        return int4(codes, scale, minimum, bias)
    high = q8.astype(np.int32) >> 4  # floor(q / 16) in [-8, 7]; q = 16 high + low
    low = q8.astype(np.int32) - 16 * high  # [0, 15]
    zero = np.zeros_like(scale)
    return SplitQ8Linear(int4(high + 8, 16 * scale, -128 * scale, bias), int4(low, scale, zero, None))


def block_activations() -> str:
    """How :class:`~.small_m.BlockLinear` layers multiply: ``SPECLM_GGUF_ACTIVATIONS`` (``q8``,
    the default: 8-bit activations and integer dot products, as llama.cpp computes these blocks;
    ``float``: float activations times the decoded weights)."""
    value = os.environ.get(ACTIVATIONS_ENV, ACTIVATIONS[0])
    if value not in ACTIVATIONS:
        raise SpeclmError(f"{ACTIVATIONS_ENV}={value!r}: use one of {', '.join(ACTIVATIONS)}")
    return value


def stores_4bit(gguf_path: Path | str) -> bool:
    """Whether the GGUF file stores any weight as Q4_0 or Q4_1. Reads the file's header once per
    version of the file: a server's drafter factory asks at every request it admits, and parsing
    the default model's header takes seconds."""
    try:
        stat = Path(gguf_path).stat()
    except OSError:
        return False
    return _stores_4bit(str(Path(gguf_path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _stores_4bit(path: str, mtime_ns: int, size: int) -> bool:
    from gguf import GGUFReader

    try:
        return any(t.tensor_type.name in FOUR_BIT for t in GGUFReader(path).tensors)
    except (OSError, ValueError):
        return False


def keep_gguf_int4(model: nn.Module, gguf_path: Path | str) -> KeptBlocks:
    """Swap (in place) every ``nn.Linear`` of ``model`` whose weight the GGUF file stores as Q4_0,
    Q4_1 or Q8_0 for int4 layers on the file's own codes, scales and minimums.

    ``model`` must hold the file's dequantized weights (in float32, as speclm loads a GGUF, or
    cast to bfloat16/float16 from there); its layers are matched to the file's tensors by name
    and then row by row, by value. The int4 layers compute in the model's dtype.
    Raises :class:`SpeclmError` when no layer is stored at those types or a layer's weights are
    not the file's."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as exc:
        raise SpeclmError(f"cannot read GGUF file {gguf_path}: {exc}") from None
    names = _name_map(reader)
    tensors = {t.name: t for t in reader.tensors}
    kept = KeptBlocks({}, {})
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        tensor = tensors.get(f"{names.get_name(name)}.weight")
        if tensor is None and name.endswith("lm_head"):  # a head tied to the embeddings
            tensor = tensors.get("token_embd.weight")
        if tensor is None:
            raise SpeclmError(f"layer {name} has no tensor in {Path(gguf_path).name}; is this model "
                              "loaded from that file?")
        type_name = tensor.tensor_type.name
        if type_name not in EXACT_TYPES:
            kept.dense[name] = type_name
            continue
        layer = _from_blocks(tensor.data, type_name, linear.weight.detach(), linear.bias)
        if layer is None:
            raise SpeclmError(f"layer {name}'s weights are not {Path(gguf_path).name}'s {tensor.name} "
                              f"({type_name}); load the model from that file")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        kept.int4[name] = type_name
    if not kept.int4:
        types = ", ".join(sorted(set(kept.dense.values()))) or "none"
        raise SpeclmError(f"{Path(gguf_path).name} stores no layer as Q4_0, Q4_1 or Q8_0 (its types: "
                          f"{types}); --quantize gguf keeps those blocks, use --quantize int4 or int8 instead")
    return kept
