"""Running a compiled step's graph without torch.compile's per-call machinery.

Every call of a ``torch.compile``d function pays dynamo's frame hook and cache lookup, the bytecode
that gathers the graph's inputs (the default model's step has ~130: embeddings, norms, every
layer's cache buffers, the ids, positions and mask) and AOTAutograd's wrappers: ~1 ms of Python
on a CPU, 7-9% of a one-token step of the default model on a Zen 3 VM. Once a step's shape is
compiled, that work is the same at every call.

:class:`GraphCapture` is the backend handed to ``torch.compile``: it compiles each graph with the
real backend (inductor, or any registered one) and keeps beside it where each graph input comes
from (dynamo's sources, Python expressions over the step's arguments and closure). A
:class:`DirectGraph` gathers those inputs itself and calls the compiled graph: the same compiled
code, without dynamo's hook, lookup and gathering bytecode around it (AOTAutograd's runtime
wrapper, part of what the backend returned, still runs: ~60 us a step).

It is used only where it is proven to compute what dynamo computes: the step (models/
compiled_step.py) learns a direct graph for a (shape, cache capacity) from a call that dynamo ran
as one graph, with no graph break, and keeps it only if gathering the inputs itself yields the
very objects dynamo passed that graph (the same tensors, equal sizes) and dynamo returned the
graph's own output tensors (:func:`proven`): the same compiled function on the same inputs. The
proof runs nothing, so a failed one leaves no trace in the cache. What dynamo does around the
graph is accounted for: the Python state its bytecode writes back after the graph must be what is
already there (:func:`_leaves_state_as_found`), and torch's global state (grad mode, autocast,
default dtype, ...) is checked at every direct call against the state at the proof. Guards on
Python values inside the model (a kernel switched off after compiling) are not evaluated, as with
``skip_guard_eval_unsafe`` on dynamo's own path. Anything else (a graph break, an input whose
source is not a plain expression, another object in any place) keeps dynamo. CPU only: a CUDA
step runs CUDA graphs, whose replays want dynamo's own bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

DIRECT = True  # read when a step is built; False: every call through dynamo (before/after timings)


class DirectGraph:
    """One compiled graph, callable on the step's arguments without dynamo."""

    def __init__(self, compiled: Callable, sources: list[str], num_outputs: int) -> None:
        self.compiled = compiled
        self.sources = sources  # one Python expression per graph input, over ``L`` (the frame's locals)
        self.num_outputs = num_outputs
        self._gather: Callable[[dict], list] | None = None
        # torch's global state (grad and inference mode, autocast, default dtype, ...) when proven:
        # a direct call under any other state goes back to dynamo, whose guards check it
        self.global_state: Any = None

    def gather(self, frame_locals: dict[str, Any]) -> list:
        """The graph's inputs, in its order, read from the step's arguments and closure."""
        if self._gather is None:
            # one list display over all sources: ~25 us for the default model's 129 inputs
            self._gather = eval("lambda L: [" + ", ".join(self.sources) + "]", {})  # noqa: S307
        return self._gather(frame_locals)

    def __call__(self, frame_locals: dict[str, Any], num_layers: int):
        """The step's return value: the logits, or (logits, hidden states of each asked layer)."""
        outs = self.compiled(*self.gather(frame_locals))
        return outs[0] if num_layers == 0 else (outs[0], tuple(outs[1 : 1 + num_layers]))


def _source_name(source) -> str | None:
    name = getattr(source, "name", None)
    if callable(name):
        name = name()
    return name if isinstance(name, str) and name.startswith("L[") else None


class GraphCapture:
    """A torch.compile backend: compiles with ``inner`` and records, per graph, a
    :class:`DirectGraph` (or None where an input has no plain source or the frame changes Python
    state, :func:`_leaves_state_as_found`). While ``observing``, each
    call of a compiled graph through dynamo is kept in ``calls`` as (its record, the inputs dynamo
    passed, the outputs it returned), so the step sees which graphs one call ran (more than one:
    a graph break) and with what."""

    def __init__(self, inner: Callable, name: str) -> None:
        self.inner = inner
        self.observing = False
        self.calls: list[tuple[DirectGraph | None, tuple, Sequence]] = []
        self.compiler_name = getattr(inner, "compiler_name", None) or name  # dynamo's name for the backend
        if hasattr(inner, "get_compiler_config"):
            self.get_compiler_config = inner.get_compiler_config

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
        plan = _inputs_and_outputs(gm) if _leaves_state_as_found() else None  # before the backend runs
        compiled = self.inner(gm, example_inputs)
        record = None if plan is None else DirectGraph(compiled, *plan)

        def run(*args):
            outs = compiled(*args)
            if self.observing:
                self.calls.append((record, args, outs))
            return outs

        return run


def _inputs_and_outputs(gm: torch.fx.GraphModule) -> tuple[list[str], int] | None:
    """The graph's inputs as source expressions and its output count (None: an input has none)."""
    sources = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            arg = node.meta.get("grapharg")
            name = _source_name(getattr(arg, "source", None)) if arg is not None else None
            if name is None:
                return None
            sources.append(name)
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    outs = output.args[0]
    return sources, len(outs) if isinstance(outs, (tuple, list)) else 1


_MISSING = object()


def _leaves_state_as_found() -> bool:
    """Whether the frame dynamo is compiling changes no Python state, so that skipping the
    bytecode it runs after the graph changes nothing. Attribute writes that put back the value an
    attribute has now are allowed: transformers' output capture sets and resets its context
    variables inside the forward, and dynamo writes their resting values back after every call.
    Anything else (another value, a list or dict changed, hooks) keeps the graph with dynamo, as
    does a PyTorch whose tracer does not expose its side effects this way."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.variables.base import AttributeMutationNew

        side_effects = InstructionTranslator.current_tx().output.side_effects
        if side_effects.tensor_hooks or side_effects.save_for_backward:
            return False
        for var in side_effects._get_modified_vars():
            writes = side_effects.store_attr_mutations.get(var, {})
            if isinstance(var.mutation_type, AttributeMutationNew):
                # an object made in the frame: reachable afterwards only through what the step
                # returns (its own tensors, checked by the proof) or through existing state
                # (a write to that is checked here)
                continue
            target = getattr(var, "value", _MISSING)
            if target is _MISSING or not writes:  # a container changed in place, or unknown
                return False
            for name, value in writes.items():
                if not value.is_python_constant():
                    return False
                final, now = value.as_python_constant(), getattr(target, name, _MISSING)
                if not (final is now or (type(final) is type(now) and final == now)):
                    return False
        return True
    except Exception:  # another tracer's internals: not provable here
        return False


def proven(graph: DirectGraph | None, frame_locals: dict[str, Any], dynamo_inputs: tuple,
           graph_outputs: Sequence, returned, num_layers: int) -> bool:
    """Whether ``graph`` called directly computes exactly what dynamo's call just did: gathering
    from ``frame_locals`` yields the very objects dynamo passed it (the same tensors, equal ints),
    and dynamo returned the graph's own outputs in the step's structure. Nothing runs: the proof
    has no side effects."""
    if graph is None or graph.num_outputs != 1 + num_layers or len(graph.sources) != len(dynamo_inputs):
        return False
    try:
        mine = graph.gather(frame_locals)
    except Exception:  # a source that does not evaluate outside dynamo: not callable directly
        return False
    for a, b in zip(mine, dynamo_inputs):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if a is not b:
                return False
        elif type(a) is not type(b) or a != b:
            return False
    if num_layers == 0:
        same = returned is graph_outputs[0]
    else:
        logits, hidden = returned
        same = (logits is graph_outputs[0] and len(hidden) == num_layers
                and all(h is o for h, o in zip(hidden, graph_outputs[1:])))
    if same and graph.global_state is None:
        graph.global_state = torch._C._dynamo.guards.GlobalStateGuard()
    return same
