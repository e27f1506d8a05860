"""The CPU-side execution counters of kernels_cu/ptx.cuh, read through
cupaged.tools.counters, against hand counts for the small test kernels of
tests/runtime/kernels/ptx_mma.cu; and the one-block probe of a real
attention launch."""

from pathlib import Path

import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged.testing import as_dtype
from cupaged.tools import counters

KERNELS = Path(__file__).parents[1] / "runtime" / "kernels" / "ptx_mma.cu"


@pytest.fixture(scope="module")
def mod():
    return _cpu.load_module(_source.assemble(KERNELS, {"CP_DTYPE": "bf16"}), "ptx_mma_bf16")


def _run(mod, name, block, *args):
    counters.reset(mod)
    mod.get_function(name).bind((1, 1, 1), (block, 1, 1), 0, args)()
    return counters.read(mod)


def test_names_and_reset(mod):
    assert counters.names(mod) == counters.NAMES_FALLBACK
    counters.reset(mod)
    assert set(counters.read(mod).values()) == {0}


def test_one_mma(mod):
    """mma_direct: one warp, one mma.sync, fragments from global memory."""
    a = np.ones((16, 16), as_dtype("bf16"))
    b = np.ones((16, 8), as_dtype("bf16"))
    c = np.zeros((16, 8), np.float32)
    got = _run(mod, "mma_direct", 32, a, b, c)
    assert got == {"mma_16816": 1, "ldmatrix_x4": 0, "ldmatrix_x4_trans": 0, "cp_async_16": 0, "cp_async_16_zero": 0}


@pytest.mark.parametrize("k_dim", [16, 64, 128])
@pytest.mark.parametrize("b_is_nk", [0, 1])
def test_gemm_hand_counts(mod, k_dim, b_is_nk):
    """mma_gemm, C [64 x 32] = A [64 x K] B with 4 warps. Per warp and
    16-wide k step: one ldmatrix.x4 for A, two for B (n 0-15, 16-31; .trans
    when B is [K][N]), four mma (n tiles of 8). cp.async: A 64 rows x K/8
    chunks (rows past a_rows zero-filled), B K x 4 or 32 x K/8 chunks."""
    rng = np.random.default_rng(0)
    a_rows = 40
    a = rng.standard_normal((64, k_dim)).astype(as_dtype("bf16"))
    b = rng.standard_normal((k_dim, 32)).astype(as_dtype("bf16"))
    c = np.zeros((64, 32), np.float32)
    got = _run(
        mod,
        "mma_gemm",
        128,
        a,
        np.ascontiguousarray(b.T) if b_is_nk else b,
        c,
        np.uint32(k_dim),
        np.uint32(a_rows),
        np.uint32(b_is_nk),
    )
    steps = k_dim // 16
    want = {
        "mma_16816": 4 * steps * 4,
        "ldmatrix_x4": 4 * steps * (1 + (2 if b_is_nk else 0)),
        "ldmatrix_x4_trans": 0 if b_is_nk else 4 * steps * 2,
        "cp_async_16": a_rows * (k_dim // 8) + (32 * (k_dim // 8) if b_is_nk else k_dim * 4),
        "cp_async_16_zero": (64 - a_rows) * (k_dim // 8),
    }
    assert got == want


def test_cp_async_groups(mod):
    """cp_async_groups: each of 32 threads copies once and zero-fills once."""
    src = np.arange(32 * 4, dtype=np.uint32)
    out = np.zeros((32, 12), np.uint32)
    got = _run(mod, "cp_async_groups", 32, src, out)
    assert got["cp_async_16"] == 32 and got["cp_async_16_zero"] == 32 and got["mma_16816"] == 0


def test_probe_of_an_attention_launch():
    """A one-block probe of the mma.sync prefill kernel (D 128, bf16, sm_80; a probe for another arch's
    plan than the CPU's fails):
    per K/V token the block copies one K and one V row (2 x 256 bytes = 32
    cp.async of 16 bytes) and its rows (128 with the D = 128 tile) x 1 token
    of S = Q K^T and of P V take rows x 128 x 2 FLOP each:
    2 x rows x 128 x 2 / 4096 = rows / 8 mma."""
    from cupaged import HostPlan
    from cupaged.ops.attention import plan_launches

    kv = 4096
    host = HostPlan.build(np.arange(kv // 16).reshape(1, -1), [kv], [kv], 16, kv // 16)
    launches = plan_launches(host, "bf16", 32, 8, 128, 128, 0, True, True, arch="sm_80")
    assert launches[0].kernel == "paged_prefill_tc"
    with pytest.raises(counters.ProbeError, match="selects paged_prefill_wgmma"):  # the CPU as sm_90
        counters.probe(launches[0], dtype="bf16", hq=32, hkv=8, d=128, dv=128, rot=0, page_size=16, use_cache=False)
    p = counters.probe(
        launches[0], dtype="bf16", hq=32, hkv=8, d=128, dv=128, rot=0, page_size=16, use_cache=False, arch="sm_80"
    )
    assert p.slope["cp_async_16"] == pytest.approx(32)
    from cupaged.ops.attention.kernels import prefill_tc

    assert p.slope["mma_16816"] == pytest.approx(prefill_tc.PREFILL_TILES[128][0].rows / 8)
    assert p.slope["cp_async_16_zero"] == 0
