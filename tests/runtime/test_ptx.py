"""The inline-PTX helpers of kernels_cu/ptx.cuh (mma.sync m16n8k16, ldmatrix,
cp.async, pack2): on the CPU backend against NumPy float64, and through NVRTC
for sm_80 / sm_90 (the PTX must hold the real instructions).

Kernels live in tests/runtime/kernels/ptx_mma.cu; CP_DTYPE picks f16 or bf16 inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged.testing import as_dtype

KERNELS = Path(__file__).parent / "kernels" / "ptx_mma.cu"
DTYPES = ["f16", "bf16"]


@pytest.fixture(scope="module", params=DTYPES)
def mod(request):
    dt = request.param
    return dt, _cpu.load_module(_source.assemble(KERNELS, {"CP_DTYPE": dt}), f"ptx_mma_{dt}")


def run(mod, name, grid, block, *args):
    mod.get_function(name).bind((grid, 1, 1), (block, 1, 1), 0, args)()


def _rand(rng, shape, dt):
    return rng.standard_normal(shape).astype(as_dtype(dt))


def _product(a, b, c=None):
    out = a.astype(np.float64) @ b.astype(np.float64)
    return out if c is None else out + c


def test_mma_16x8x16(mod):
    """One mma from fragments loaded with the PTX ISA layouts; D = A B + C."""
    dt, m = mod
    rng = np.random.default_rng(1)
    a, b = _rand(rng, (16, 16), dt), _rand(rng, (16, 8), dt)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    want = _product(a, b, c.astype(np.float64))
    run(m, "mma_direct", 1, 32, a, b, c)
    # 16-bit products are exact in f32; only the 16 additions round.
    np.testing.assert_allclose(c, want, rtol=1e-6, atol=1e-5)


def test_mma_layout_is_not_symmetric(mod):
    """A one-hot A and B pin every fragment position: C[i, j] = A[i, k] B[k, j]
    for one (i, k, j) at a time, so a swapped row, column or half shows."""
    dt, m = mod
    rng = np.random.default_rng(2)
    for _ in range(6):
        i, k, j = rng.integers(0, 16), rng.integers(0, 16), rng.integers(0, 8)
        a = np.zeros((16, 16), as_dtype(dt))
        b = np.zeros((16, 8), as_dtype(dt))
        a[i, k], b[k, j] = 3, 5
        a[(i + 3) % 16, (k + 5) % 16] = 1  # a second entry that meets no nonzero of B
        c = np.zeros((16, 8), np.float32)
        run(m, "mma_direct", 1, 32, a, b, c)
        want = np.zeros((16, 8))
        want[i, j] = 15
        np.testing.assert_array_equal(c, want)


@pytest.mark.parametrize("b_is_nk", [0, 1], ids=["ldmatrix-trans", "ldmatrix"])
@pytest.mark.parametrize("k_dim", [16, 128])
def test_gemm_64x32(mod, k_dim, b_is_nk):
    """A 64 x 32 x K product through cp.async, ldmatrix (both forms) and mma."""
    dt, m = mod
    rng = np.random.default_rng(k_dim + b_is_nk)
    a, b = _rand(rng, (64, k_dim), dt), _rand(rng, (k_dim, 32), dt)
    c = np.full((64, 32), np.nan, np.float32)
    run(
        m,
        "mma_gemm",
        1,
        128,
        a,
        np.ascontiguousarray(b.T) if b_is_nk else b,
        c,
        np.uint32(k_dim),
        np.uint32(64),
        np.uint32(b_is_nk),
    )
    np.testing.assert_allclose(c, _product(a, b), rtol=1e-5, atol=1e-5 * np.sqrt(k_dim))


def test_cp_async_zero_fill(mod):
    """Rows of A past a_rows are zero-filled by cp.async, never read: they
    hold NaN in memory and give exact zero rows of C."""
    dt, m = mod
    rng = np.random.default_rng(7)
    a, b = _rand(rng, (64, 64), dt), _rand(rng, (64, 32), dt)
    a[37:] = np.nan
    c = np.full((64, 32), np.nan, np.float32)
    run(m, "mma_gemm", 1, 128, a, b, c, np.uint32(64), np.uint32(37), np.uint32(0))
    np.testing.assert_allclose(c[:37], _product(a[:37], b), rtol=1e-5, atol=1e-4)
    assert (c[37:] == 0).all()


def test_cp_async_groups_land_at_their_wait(mod):
    """On the CPU a committed group lands at the wait_group that covers it:
    wait 1 lands the older group only, wait 0 the rest (zero fill)."""
    _, m = mod
    src = (np.arange(32 * 4, dtype=np.uint64) * 2654435761 % 2**32).astype(np.uint32)
    out = np.zeros((32, 12), np.uint32)
    run(m, "cp_async_groups", 1, 32, src.astype(np.uint32), out)
    np.testing.assert_array_equal(out[:, 4:8], src.reshape(32, 4))
    assert (out[:, 8:] == 0).all()
    # Before any wait nothing has landed on the CPU (a GPU may land copies
    # early; the kernel must not rely on either): unless copies land at issue
    # (CUPAGED_CPU_CP_ASYNC=eager), where the first group has landed already.
    if _cpu.cp_async_mode() == "eager":
        np.testing.assert_array_equal(out[:, :4], src.reshape(32, 4))
    else:
        assert (out[:, :4] == 0).all()


def test_pack2_rounds_to_nearest_even(mod):
    dt, m = mod
    rng = np.random.default_rng(3)
    x = np.concatenate(
        [rng.standard_normal(60).astype(np.float32) * 100, np.array([0.0, -0.0, 1e-8, 65520.0], np.float32)]
    )
    out = np.zeros(32, np.uint32)
    run(m, "pack_pairs", 1, 32, x, out, np.uint32(32))
    with np.errstate(over="ignore"):  # 65520 rounds to f16 inf, as on the GPU
        bits = x.astype(as_dtype(dt)).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(out, bits[0::2] | (bits[1::2] << 16))


# ---------------------------------------------------------------- NVRTC


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_emits_tensor_core_ptx(arch):
    """The helpers compile with NVRTC for real GPUs into the instructions
    they stand for (no GPU needed)."""
    try:
        from cupaged._runtime import nvrtc as _nvrtc

        _nvrtc.nvrtc_version()
        _nvrtc.find_header_dir()
    except Exception as e:  # no cuda-python / NVRTC / headers here
        pytest.skip(f"NVRTC unavailable: {e}")
    for dt in DTYPES:
        text = _source.assemble(KERNELS, {"CP_DTYPE": dt})
        c = _nvrtc.compile_source(text, arch, name="ptx_mma.cu")
        assert c.ok, c.log
        kind = "f16.f16" if dt == "f16" else "bf16.bf16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.f32" in c.ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in c.ptx
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in c.ptx
        assert "cp.async.cg.shared.global" in c.ptx and "cp.async.wait_group" in c.ptx
        reports = _nvrtc.parse_ptxas(c.log)
        for name in ("mma_direct", "mma_gemm"):
            assert reports[name].spill_stores == 0, c.log
