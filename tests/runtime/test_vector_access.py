"""What the CPU emulation checks that x86 alone would not: vector accesses
aligned to their size (common.cuh's ldv / stv, ptx.cuh's cp_async_16 raise a
KernelError naming the kernel and the source line, as a GPU would fault),
and cp.async copies landing at issue (CUPAGED_CPU_CP_ASYNC=eager) as well as
at their wait (the default), so a pipeline that refills a stage still being
read fails in one of the two modes.

Kernels: tests/runtime/kernels/vector_access.cu.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cupaged
from cupaged._runtime import address, get_kernel
from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged._runtime.structs import StructArg
from cupaged.errors import KernelError, PagedAttentionError
from cupaged.ops import append as append_op

KERNELS = Path(__file__).parent / "kernels" / "vector_access.cu"


def line_of(marker: str) -> int:
    for i, line in enumerate(KERNELS.read_text().splitlines(), start=1):
        if f"// @{marker}" in line:
            return i
    raise AssertionError(marker)


def _module(mode: str, monkeypatch):
    monkeypatch.setenv("CUPAGED_CPU_CP_ASYNC", mode)
    return _cpu.load_module(_source.assemble(KERNELS), f"vector_access_{mode}")


@pytest.fixture(scope="module")
def mod():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUPAGED_CPU_CP_ASYNC", "late")
        return _cpu.load_module(_source.assemble(KERNELS), "vector_access")


def run(mod, name, block, *args):
    mod.get_function(name).bind((1, 1, 1), (block, 1, 1), 0, args)()


def _aligned_bytes(n: int) -> np.ndarray:
    buf = np.zeros(n + 64, np.uint8)
    start = (-buf.ctypes.data) % 64
    return buf[start : start + n]


@pytest.mark.parametrize(
    "kernel, marker, what", [("load16_at", "LOAD16", "load"), ("cp_async_at", "CPASYNC", "cp.async global source")]
)
def test_misaligned_16_byte_read_traps(mod, kernel, marker, what):
    base = _aligned_bytes(32 * 16 + 16)
    base[:] = np.arange(base.size) % 251
    out = np.zeros((32, 4), np.uint32)
    run(mod, kernel, 32, base, np.uint32(16), out)  # aligned: fine
    np.testing.assert_array_equal(out.view(np.uint8).ravel(), base[16 : 16 + 32 * 16])
    for offset in (8, 4, 1):
        with pytest.raises(
            KernelError,
            match=rf"'{kernel}' block \(0,0,0\): thread 0: misaligned 16-byte "
            rf"{what} at address 0x[0-9a-f]+ .* at "
            rf"vector_access.cu:{line_of(marker)}",
        ):
            run(mod, kernel, 32, base, np.uint32(offset), out)


def test_misaligned_16_byte_store_traps(mod):
    base = _aligned_bytes(32 * 16 + 16)
    run(mod, "store16_at", 32, base, np.uint32(0))
    np.testing.assert_array_equal(
        base[: 32 * 16].view(np.uint32).reshape(32, 4), np.repeat(np.arange(32), 4).reshape(32, 4)
    )
    with pytest.raises(KernelError, match=rf"misaligned 16-byte store .* at vector_access.cu:{line_of('STORE16')}"):
        run(mod, "store16_at", 32, base, np.uint32(8))


def test_a_real_kernel_traps_on_a_misaligned_cache():
    """The append kernel built for 16-byte units, handed a cache 8 bytes off
    a 16-byte boundary (the host never does this: it picks the unit from the
    addresses), stops with a KernelError instead of writing through it."""
    n = 4 * 2 * 64 * 4  # [pages 4, page_size 2, 64 words]: 16 units of 16 bytes a row
    k = _aligned_bytes(n + 8)[8:].view(np.uint32).reshape(4, 2, 64)  # 8 bytes off a 16-byte boundary
    new = np.ones((1, 64), np.uint32)
    plan = cupaged.HostPlan.build([[1]], [1], [1], 2, 4).upload(new)
    fn = get_kernel(new, "append", "paged_append", {"CP_VEC_BYTES": 16})
    values = {n: 0 for n in append_op.NAMES}
    values.update(
        new_k=address(new),
        new_v=address(new),
        k_cache=address(k),
        v_cache=address(k),
        words=address(plan.words),
        tokens=1,
        sequences=1,
        table_width=1,
        page_size=2,
        num_pages=4,
        heads=1,
        units_k=16,
        units_v=16,
        src_tok_k=16,
        src_tok_v=16,
        dst_page_k=32,
        dst_slot_k=16,
        dst_page_v=32,
        dst_slot_v=16,
    )
    args = (
        StructArg(np.array(tuple(values[n] for n in append_op.NAMES), dtype=append_op.DTYPE)[()], (new, k, plan.words)),
    )
    with pytest.raises(KernelError, match=r"'paged_append' .*misaligned 16-byte store .* at append.cu:\d+"):
        fn.bind((1, 1, 1), (32, 1, 1), 0, args)()


def test_eager_cp_async_catches_a_broken_pipeline(monkeypatch):
    """ring_sum with one stage issues tile j + 1 into the stage tile j is
    read from. With copies landing at their wait (the default) the bug is
    invisible; with CUPAGED_CPU_CP_ASYNC=eager the sums are wrong. A correct
    two-stage ring gives the right sums in both modes."""
    tiles = 5
    src = (np.arange(tiles * 32 * 4, dtype=np.uint64) * 2654435761 % 2**31).astype(np.uint32).reshape(tiles, 32, 4)
    want = src.astype(np.uint64).sum(axis=(0, 2))[(np.arange(32) + 1) % 32]
    results = {}
    for mode in ("late", "eager"):
        m = _module(mode, monkeypatch)
        for stages in (1, 2):
            out = np.zeros(32, np.uint64)
            run(m, "ring_sum", 32, src, np.uint32(tiles), np.uint32(stages), out)
            results[mode, stages] = np.array_equal(out, want)
    assert results == {("late", 1): True, ("late", 2): True, ("eager", 1): False, ("eager", 2): True}


def test_cp_async_mode_is_checked(monkeypatch):
    monkeypatch.setenv("CUPAGED_CPU_CP_ASYNC", "early")
    with pytest.raises(PagedAttentionError, match="CUPAGED_CPU_CP_ASYNC: expected 'late' or 'eager'"):
        _cpu.cp_async_mode()
