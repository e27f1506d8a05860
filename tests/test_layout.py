"""Each fact once: the metadata words, the shared limits and the dtype table
are defined in Python and reach the kernels only through generated headers."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from cupaged import PagedAttentionError, dtypes, layout
from cupaged._runtime.source import kernel_dir
from cupaged.plan import HostPlan
from cupaged.tools import gen_headers


def test_generated_headers_are_current():
    """The committed generated headers are what their generators write
    (``python -m cupaged.tools.gen_headers`` rewrites them)."""
    assert gen_headers.stale() == []
    assert gen_headers.main(["--check"]) == 0


def test_kernels_use_no_literal_word_offsets():
    """No kernel spells a metadata word offset (16 + ..., 17 + ...) or a
    limit mirrored from Python; they come from plan_words.cuh."""
    pattern = re.compile(
        r"words\s*\[\s*1[67]\s*\+|words\s*\+\s*1[67]\s*\+"
        r"|=\s*(?:16u?|64u?);\s*//.*(?:SPLIT|MAX_SPLITS)"
    )
    for path in kernel_dir().rglob("*.cu*"):
        if path.name == "plan_words.cuh" or "shim" in path.parts:
            continue
        text = path.read_text()
        assert not pattern.search(text), f"{path.name}: a literal metadata offset or mirrored constant"
        assert "in attention.py" not in text and "in plan.py" not in text, (
            f"{path.name}: a constant mirrored by comment"
        )


def test_header_matches_the_words_a_plan_writes():
    """plan_words.cuh's offsets locate the arrays HostPlan.build writes."""
    table = np.array([[4, 1, -1], [0, 2, 3]])
    host = HostPlan.build(table, [20, 35], [3, 1], 16, 5)
    off = layout.metadata_offsets(host.queries, host.sequences)
    w = host.words
    assert w[layout.W_MAGIC] == layout.MAGIC
    assert list(w[layout.W_OFFSETS : layout.W_OFFSETS + 5]) == [off[a] for a in layout.ARRAYS]
    assert list(w[off["q_seq"] : off["q_pos"]]) == [0, 0, 0, 1]
    assert list(w[off["q_pos"] : off["kv_len"]]) == [17, 18, 19, 34]
    assert list(w[off["kv_len"] : off["q_start"]]) == [20, 35]
    assert list(w[off["page_table"] :]) == [4, 1, layout.NO_PAGE, 0, 2, 3]
    assert len(w) == layout.metadata_words(4, 2, 3)
    text = layout.plan_words_header()
    # The header's formulas, evaluated for these sizes, give the same offsets.
    q, s = host.queries, host.sequences
    hw = layout.HEADER_WORDS
    assert f"#define CP_HEADER_WORDS {hw}u" in text
    assert (hw, hw + q, hw + 2 * q, hw + 2 * q + s, hw + 1 + 2 * q + 2 * s) == tuple(off[a] for a in layout.ARRAYS)
    for name in ("q_seq", "q_pos", "kv_len", "q_start", "page_table"):
        assert f"unsigned long long {name}(" in text


def test_dtype_table():
    assert dtypes.TOKENS == ("f32", "f16", "bf16", "e4m3", "e5m2")
    assert dtypes.QUERY_TOKENS == ("f32", "f16", "bf16") and dtypes.FP8_TOKENS == ("e4m3", "e5m2")
    for d in dtypes.TABLE:
        assert dtypes.lookup(d.token) is d and dtypes.lookup(d.name) is d and dtypes.lookup(d.np_dtype) is d
        assert dtypes.token(d.np_dtype) == d.token and dtypes.np_dtype(d.token) == d.np_dtype
    assert dtypes.np_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert dtypes.lookup(np.int8) is None and dtypes.lookup("f64") is None
    assert set(dtypes.TC_TOKENS) == {"f16", "bf16", "e4m3", "e5m2"}
    assert dtypes.lookup("fp8") is dtypes.lookup("fp8_e4m3") is dtypes.lookup(ml_dtypes.float8_e4m3fn)
    assert dtypes.lookup("fp8_e5m2").token == "e5m2" and dtypes.lookup(np.uint8) is None
    with pytest.raises(PagedAttentionError, match="x: expected dtype float32, float16 or bfloat16, got int32"):
        dtypes.row("x", np.int32)
    with pytest.raises(
        PagedAttentionError,
        match="dtype: expected float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got 'int8'",
    ):
        dtypes.row("dtype", "int8", kv=True)
    with pytest.raises(PagedAttentionError, match="x: expected dtype float32, float16 or bfloat16, got float8_e4m3fn"):
        dtypes.row("x", ml_dtypes.float8_e4m3fn)
    # raw uint8 storage names its format
    assert dtypes.kv_storage("k", np.uint8, "fp8_e5m2").token == "e5m2"
    assert dtypes.kv_storage("k", ml_dtypes.float8_e4m3fn).token == "e4m3"
    with pytest.raises(PagedAttentionError, match="k: uint8 is raw fp8 storage: name its format with kv_dtype="):
        dtypes.kv_storage("k", np.uint8)
    with pytest.raises(
        PagedAttentionError,
        match=r"k: expected dtype float8_e5m2 or uint8 \(raw fp8 storage\) for "
        "kv_dtype='e5m2', got float16",
    ):
        dtypes.kv_storage("k", np.float16, "e5m2")
    with pytest.raises(PagedAttentionError, match="kv_dtype: expected one of 'f32'"):
        dtypes.kv_storage("k", np.uint8, "int4")
    # The kernels map every token to a C type.
    common = (kernel_dir() / "common.cuh").read_text() + (kernel_dir() / "fp8.cuh").read_text()
    for t in dtypes.TOKENS:
        assert f"cp_type_{t}" in common
