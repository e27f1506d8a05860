"""NVRTC writes its log, PTX and cubin into buffers cupaged passes: they
must be fresh objects, never CPython's shared one-byte b" " (an empty log has
size 1), or every b" " of the process turns into NUL."""

from pathlib import Path

import pytest

from cupaged._runtime import nvrtc as _nvrtc
from cupaged._runtime import source as _source

V4 = Path(__file__).parent / "kernels" / "gate_v4.cu"


def test_empty_log_leaves_shared_bytes_alone():
    try:
        _nvrtc.nvrtc_module()
    except Exception as e:  # noqa: BLE001 -- no NVRTC in this environment
        pytest.skip(f"NVRTC not available: {e}")
    c = _nvrtc.compile_source(_source.assemble(V4, {"GATE_SCALE": "2.0f"}), "compute_90")
    assert c.ok, c.log
    k = 1
    assert b" " * k == bytes([32]) and (b" " * 3) == bytes([32, 32, 32]) and b"" * k == bytes()
