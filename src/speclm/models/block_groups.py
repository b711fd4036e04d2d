"""One kernel call for the GGUF block layers that read the same input, in a compiled step.

A decoder layer's query, key and value projections read the same normed hidden state, and so do
its MLP's gate and up projections. Run as the model is written, a compiled one-token step calls
``speclm::registered_blocks`` seven times a layer (210 calls for the default model), and each call
pays its own dispatch from the graph's Python wrapper, its own output allocation, its own 8-bit
quantization of the same activations and its own fork and join of the threads: about 6-10 us that
a 10-100 us product does not hide. :class:`GroupBlockCalls` is an inductor graph pass (PyTorch's
``post_grad_custom_pre_pass`` hook) that rewrites every set of such calls on one input into one
``speclm::registered_blocks_group`` call (four calls a layer), which quantizes the input once,
runs all the layers' weight rows in one parallel loop and writes one output whose column slices
(views, no copies) are the layers' outputs. Each output has the bits of its own call
(the same per-row arithmetic), so the rewrite changes speed, never results; the model's code is
not touched (no forked model file), and eager forwards run one call per layer as before.

Only 8-bit-activation calls are grouped (the default; ``SPECLM_GGUF_ACTIVATIONS=float`` keeps
one call per layer). ``GROUPING = False`` before a model is compiled turns the pass off, for a
before/after in one process (``benchmarks/step_cost.py --groups on,off``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

GROUPING = True  # read when a graph is compiled


def _input_key(node: Any) -> Any:
    """What a call reads: a reshape of a tensor counts as that tensor and the shape (each
    projection reshapes the hidden state itself, so q, k and v see three equal views)."""
    if (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default)):
        return ("view", node.args[0], tuple(node.args[1]))
    return node


def _block_rows(node: torch.fx.Node) -> int:
    """The output columns of one ``registered_blocks`` call (its layer's weight rows)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return int(val.shape[-1])
    from . import small_m

    return small_m._block_rows[node.args[1]]


def group_block_calls(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place: every two or more 8-bit-activation ``registered_blocks`` calls
    on the same input become one ``registered_blocks_group`` call. Returns the calls removed."""
    ops = getattr(torch.ops, "speclm", None)
    if ops is None or not hasattr(ops, "registered_blocks_group"):
        return 0
    single, group = ops.registered_blocks.default, ops.registered_blocks_group.default
    calls: dict[Any, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is single and node.args[2] is True:
            calls.setdefault(_input_key(node.args[0]), []).append(node)
    removed = 0
    for nodes in calls.values():
        if len(nodes) < 2:
            continue
        first = nodes[0]  # the first call's input is defined before every call of the set
        with graph.inserting_before(first):
            grouped = graph.call_function(group, (first.args[0], [n.args[1] for n in nodes]))
            vals = [n.meta.get("val") for n in nodes]
            if all(isinstance(v, torch.Tensor) for v in vals):  # [M, N_0 + N_1 + ...]
                grouped.meta["val"] = vals[0].new_empty(vals[0].shape[0], sum(v.shape[-1] for v in vals))
            column = 0
            for node in nodes:  # each layer's columns of the one output: a view, no copy
                width = _block_rows(node)
                out = graph.call_function(torch.ops.aten.slice.Tensor, (grouped, 1, column, column + width))
                out.meta.update(node.meta)
                node.replace_all_uses_with(out)
                column += width
        for node in nodes:
            source = node.args[0]
            graph.erase_node(node)
            if isinstance(source, torch.fx.Node) and source is not first.args[0] and not source.users:
                graph.erase_node(source)  # another call's reshape of the same input, now unused
        removed += len(nodes) - 1
    return removed


class GroupBlockCalls(CustomGraphPass):
    """:func:`group_block_calls` as inductor's ``post_grad_custom_pre_pass`` (keyed by this file
    and :data:`GROUPING`, so inductor's on-disk graph cache tells the two apart)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        if GROUPING:
            group_block_calls(graph)

    def uuid(self) -> Any:
        return (get_hash_for_files((__file__,)), GROUPING)
