"""When ragged llama.cpp rows are padded to one graph (speclm.models.llamacpp_rows.pad_width).

llama.cpp splits ragged rows into about one graph per distinct row length, and on a CPU a graph
costs about what two more tokens do (benchmarks/llamacpp_pad.py): so rows are padded only when
the padding adds at most two tokens per graph it saves, and prompt chunks never are.
"""

from __future__ import annotations

from speclm.models.llamacpp_rows import PAD_TOKENS_PER_GRAPH, pad_width


def test_equal_rows_need_no_padding():
    assert pad_width([1] * 16) == 0
    assert pad_width([4, 4]) == 0


def test_a_short_row_among_long_ones_is_padded():
    assert PAD_TOKENS_PER_GRAPH == 2
    assert pad_width([3, 3, 3, 2]) == 3  # one padding token saves a graph
    assert pad_width([3] * 15 + [2]) == 3
    assert pad_width([2, 2, 1, 1]) == 2  # two tokens for one graph


def test_rows_that_would_pad_many_tokens_go_ragged():
    assert pad_width([2] * 8 + [1] * 8) == 0  # 8 padding tokens for one graph
    assert pad_width([5] * 4 + [3] * 4) == 0
    assert pad_width([1, 1, 1, 4]) == 0  # 9 tokens for one graph
    assert pad_width([1, 2, 3, 4]) == 4  # 6 tokens for 3 graphs


def test_prompt_chunks_are_never_padded_to_each_other():
    assert pad_width([100, 300]) == 0
    assert pad_width(list(range(20, 36))) == 0
