"""The warm-up's progress: compiling a backend's steps ahead of requests is one time, but minutes
on a slow CPU, so it is shown graph by graph."""

from __future__ import annotations

import sys

from tqdm import tqdm


def compile_bar(graphs: list, what: str) -> tqdm:
    """A progress bar on stderr over the graphs a warm-up compiles: a graph's compile time
    varies several-fold between CPUs and cache states, so the remaining time comes from the
    graphs already compiled rather than from a fixed guess."""
    return tqdm(graphs, file=sys.stderr, unit="graph", desc=f"speclm: compiling {what}")
