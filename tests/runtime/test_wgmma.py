"""The wgmma helpers of kernels_cu/ptx.cuh (sm_90a warpgroup matrix products
with shared-memory matrix descriptors): the CPU emulation against NumPy
float64 with operands laid out in shared memory by this file's own reading
of the PTX ISA (9.7.15.5.1.2 "Shared Memory Matrix Layout": the canonical
layouts in CuTe notation, checked against the ISA's worked examples; the
descriptor format; Swizzle<B, 4, 3> on byte addresses) and fragments placed
and read by the ISA's register tables; and NVRTC for sm_90a (the PTX holds
the real instructions, no spills).

Kernels: tests/runtime/kernels/ptx_wgmma.cu (CP_DTYPE f16 | bf16, WG_N).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged.testing import as_dtype

KERNELS = Path(__file__).parent / "kernels" / "ptx_wgmma.cu"
SWIZZLES = {0: 0, 128: 1, 64: 2, 32: 3}  # swizzle bytes -> descriptor mode (ISA: 1 = 128B, 2 = 64B, 3 = 32B)


# ---------------------------------------------------------------- the ISA, in Python


def cute(coord: tuple, shape: tuple, stride: tuple) -> int:
    """A CuTe layout evaluated at a coordinate (every mode flat, colexicographic)."""
    return sum(c * s for c, s in zip(coord, stride))


def split(i: int, shape: tuple) -> tuple:
    out = []
    for n in shape:
        out.append(i % n)
        i //= n
    return tuple(out)


def canonical(mn: int, k: int, major: str, swizzle_bytes: int, lbo: int, sbo: int, t: int = 8) -> int:
    """Element offset of (mn, k) in the ISA's canonical layout (table
    "Canonical Layouts", 9.7.15.5.1.2.1.3), before the swizzle; LBO and SBO
    in elements; T elements make 16 bytes."""
    s = swizzle_bytes // 16  # 16-byte chunks in one swizzle row (0: none)
    if major == "K":
        if not s:  # ((8,m),(T,2k)) : ((1T,SBO),(1,LBO))
            return cute(split(mn, (8, 1 << 30)), None, (t, sbo)) + cute(split(k, (t, 1 << 30)), None, (1, lbo))
        # ((8,m),(T,2k)) : ((sT,SBO),(1,T))
        return cute(split(mn, (8, 1 << 30)), None, (s * t, sbo)) + cute(split(k, (t, 1 << 30)), None, (1, t))
    if not s:  # ((T,1,m),(8,k)) : ((1,T,SBO),(1T,LBO))
        return cute(split(mn, (t, 1, 1 << 30)), None, (1, t, sbo)) + cute(split(k, (8, 1 << 30)), None, (t, lbo))
    # ((T,s,m),(8,k)) : ((1,T,LBO),(sT,SBO))
    return cute(split(mn, (t, s, 1 << 30)), None, (1, t, lbo)) + cute(split(k, (8, 1 << 30)), None, (s * t, sbo))


def swizzle(addr: int, swizzle_bytes: int) -> int:
    """Swizzle<B, 4, 3> on a byte address: bits 4 .. 4 + B XOR bits 7 .. 7 + B."""
    b = {0: 0, 32: 1, 64: 2, 128: 3}[swizzle_bytes]
    return addr ^ (((addr >> 7) & ((1 << b) - 1)) << 4)


@pytest.mark.parametrize(
    "case",
    [
        # (major, swizzle bytes, T, LBO, SBO (elements), exact layout of the ISA's example)
        ("K", 0, 4, 64, 32, ((8, 2), (4, 4)), ((4, 32), (1, 64))),  # K-major, no swizzle, tf32
        ("K", 32, 4, None, 64, ((8, 2), (4, 4)), ((8, 64), (1, 4))),  # K-major, 32B, tf32
        ("MN", 0, 8, 128, 64, ((8, 1, 2), (8, 2)), ((1, 8, 64), (8, 128))),  # MN-major, no swizzle, bf16
        ("MN", 32, 8, 128, 256, ((8, 2, 2), (8, 2)), ((1, 8, 128), (16, 256))),  # MN-major, 32B, bf16
        ("MN", 64, 8, 256, 512, ((8, 4, 2), (8, 2)), ((1, 8, 256), (32, 512))),  # MN-major, 64B, bf16
    ],
    ids=["K-none-tf32", "K-32B-tf32", "MN-none-bf16", "MN-32B-bf16", "MN-64B-bf16"],
)
def test_canonical_layouts_match_the_isa_examples(case):
    """This file's canonical layouts give the ISA's worked examples' exact
    layouts at every coordinate."""
    major, sw, t, lbo, sbo, shape, stride = case
    n_mn, n_k = int(np.prod(shape[0])), int(np.prod(shape[1]))
    for mn in range(n_mn):
        for k in range(n_k):
            want = cute(split(mn, shape[0]), None, stride[0]) + cute(split(k, shape[1]), None, stride[1])
            assert canonical(mn, k, major, sw, lbo or 0, sbo, t) == want, (mn, k)


def desc_fields(desc: int) -> dict:
    """The ISA's matrix descriptor (9.7.15.5.1.2.2), decoded."""
    return dict(
        start=(desc & 0x3FFF) << 4,
        lbo=((desc >> 16) & 0x3FFF) << 4,
        sbo=((desc >> 32) & 0x3FFF) << 4,
        base=(desc >> 49) & 7,
        swizzle=desc >> 62,
    )


class Operand:
    """A [MN x 16 ksteps] operand's shared-memory image in one of the
    canonical layouts: k-step ks of it is the canonical layout at byte
    koff[ks] (from a 1024-byte boundary), with LBO / SBO chosen so that
    every swizzle pattern starts on its boundary."""

    def __init__(self, mn: int, ksteps: int, major: str, swizzle_bytes: int):
        self.mn, self.ksteps, self.major, self.sw = mn, ksteps, major, swizzle_bytes
        s = swizzle_bytes // 16
        k = 16 * ksteps
        if major == "K":
            if not s:  # core matrices 8 rows x 16 B; along K for one k-step, then 8-row groups
                self.lbo, self.sbo = 128, 256
                self.koff = [ks * (mn // 8) * 256 for ks in range(ksteps)]
            else:  # rows of s*16 bytes (s*8 elements of K); 8-row groups, then column blocks
                per_row = s * 8  # elements of K in a row
                self.lbo, self.sbo = 16, 8 * s * 16  # LBO unused ("assumed 1")
                col = mn * s * 16  # one column block
                self.koff = [(16 * ks // per_row) * col + (16 * ks % per_row) * 2 for ks in range(ksteps)]
        else:
            if not s:  # core matrices 8 MN x 8 K rows; MN groups, then K groups
                self.sbo, self.lbo = 128, (mn // 8) * 128
                self.koff = [ks * 2 * self.lbo for ks in range(ksteps)]
            else:  # atoms of s*8 MN elements x 8 K rows; K rows of all k-steps, then MN atoms
                self.sbo = 8 * s * 16
                self.lbo = k * s * 16
                self.koff = [ks * 16 * s * 16 for ks in range(ksteps)]
        top = max(self.byte(i, kk, off) for off in self.koff for i in range(mn) for kk in range(16)) + 2
        self.size = -(-top // 1024) * 1024

    def byte(self, mn: int, kk: int, koff: int) -> int:
        return swizzle(koff + 2 * canonical(mn, kk, self.major, self.sw, self.lbo // 2, self.sbo // 2), self.sw)

    def image(self, m: np.ndarray) -> np.ndarray:
        """m [MN x 16 ksteps] (16-bit) -> the image as uint32 words."""
        img = np.zeros(self.size // 2, np.uint16)
        bits = m.view(np.uint16)
        seen = set()
        for ks in range(self.ksteps):
            for i in range(self.mn):
                for kk in range(16):
                    a = self.byte(i, kk, self.koff[ks])
                    assert a % 2 == 0 and a not in seen
                    seen.add(a)
                    img[a // 2] = bits[i, 16 * ks + kk]
        return img.view(np.uint32)


def a_registers(a: np.ndarray) -> np.ndarray:
    """A [64 x 16] as each thread's 4 registers (ISA: warp w4 rows 16 w4..;
    the mma.m16n8k16 A fragment), uint32 [128, 4]."""
    bits = a.view(np.uint16).astype(np.uint32)
    regs = np.zeros((128, 4), np.uint32)
    for tid in range(128):
        w4, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        for r in range(4):
            row = 16 * w4 + g + 8 * (r & 1)
            col = 2 * t + 8 * (r >> 1)
            regs[tid, r] = bits[row, col] | bits[row, col + 1] << 16
    return regs


def d_index(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of register j of thread tid in the ISA's D fragment of
    m64nNk16 (f32), each [128, N / 2]."""
    tid = np.arange(128)[:, None]
    j = np.arange(n // 2)[None, :]
    w4, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    row = 16 * w4 + g + 8 * ((j % 4) >> 1)
    col = 8 * (j // 4) + 2 * t + (j % 2)
    return row, col


# ---------------------------------------------------------------- running the emulation


@pytest.fixture(
    scope="module", params=[(dt, n) for dt in ("f16", "bf16") for n in (32, 64, 256)], ids=lambda p: f"{p[0]}-n{p[1]}"
)
def mod(request):
    dt, n = request.param
    return dt, n, _cpu.load_module(_source.assemble(KERNELS, {"CP_DTYPE": dt, "WG_N": n}), f"ptx_wgmma_{dt}_{n}")


def run(
    mod,
    a: np.ndarray,
    b: np.ndarray,
    a_major: str,
    b_major: str,
    a_sw: int,
    b_sw: int,
    rs: bool,
    d0: np.ndarray | None = None,
):
    """D [64 x N] = A [64 x K] B [K x N] (+ d0) through the kernel; returns
    (D, raw registers read before the wait)."""
    dt, n, m = mod
    ksteps = a.shape[1] // 16
    ao = Operand(64, ksteps, a_major, a_sw)
    bo = Operand(n, ksteps, b_major, b_sw)
    a_img = ao.image(np.ascontiguousarray(a))
    b_img = bo.image(np.ascontiguousarray(b.T))
    row, col = d_index(n)
    d = np.zeros((128, n // 2), np.float32) if d0 is None else d0[row, col].astype(np.float32)
    d_in = d.copy()
    early = np.full_like(d, np.nan)
    regs = a_registers(np.ascontiguousarray(a[:, :16])) if rs else np.zeros((128, 4), np.uint32)
    mode = int(rs) | (a_major == "MN") << 1 | (b_major == "MN") << 2
    u32 = np.uint32
    smem = 1024 + ao.size + bo.size
    m.get_function("wgmma_gemm").bind(
        (1, 1, 1),
        (128, 1, 1),
        smem,
        (
            a_img,
            u32(a_img.size),
            b_img,
            u32(b_img.size),
            u32(ao.size),
            np.array(ao.koff, np.uint32),
            np.array(bo.koff, np.uint32),
            u32(ksteps),
            u32(ao.lbo),
            u32(ao.sbo),
            u32(SWIZZLES[a_sw]),
            u32(bo.lbo),
            u32(bo.sbo),
            u32(SWIZZLES[b_sw]),
            u32(mode),
            u32(d0 is not None),
            d,
            regs,
            early,
        ),
    )()
    out = np.zeros((64, n), np.float32)
    out[row, col] = d
    assert (early == d_in).all(), "the product landed before its wait_group (CPU emulation runs it at the wait)"
    return out


LAYOUTS = [(major, sw) for major in ("K", "MN") for sw in (0, 32, 64, 128)]


@pytest.mark.parametrize("a_layout", LAYOUTS + [("regs", 0)], ids=lambda l: f"A-{l[0]}-{l[1]}")
def test_one_hot_products_pin_every_layout(mod, a_layout):
    """A one-hot A and B: D holds A[i, k] B[k, j] at exactly (i, j), for
    every major-ness and swizzle of A (or A from registers) and B."""
    dt, n, _ = mod
    rng = np.random.default_rng([n, len(a_layout[0]), a_layout[1]])
    for b_major, b_sw in LAYOUTS:
        i, k, j = int(rng.integers(64)), int(rng.integers(16)), int(rng.integers(n))
        a = np.zeros((64, 16), as_dtype(dt))
        b = np.zeros((16, n), as_dtype(dt))
        a[i, k], b[k, j] = 3, 5
        a[(i + 1) % 64, (k + 3) % 16] = 1  # meets no nonzero of B
        b[(k + 5) % 16, (j + 1) % n] = 1  # meets no nonzero of A
        rs = a_layout[0] == "regs"
        d = run(mod, a, b, "K" if rs else a_layout[0], b_major, a_layout[1], b_sw, rs)
        want = np.zeros((64, n))
        want[i, j] = 15
        np.testing.assert_array_equal(d, want, err_msg=f"A {a_layout}, B {(b_major, b_sw)}, (i,k,j)={(i, k, j)}")


@pytest.mark.parametrize(
    "layout", list(itertools.product(LAYOUTS, LAYOUTS))[::3], ids=lambda p: f"A-{p[0][0]}{p[0][1]}-B-{p[1][0]}{p[1][1]}"
)
def test_chained_k_steps_against_float64(mod, layout):
    """D = A [64 x 64] B [64 x N] + D0 over four k-steps (descriptors moved
    along K as the layouts place it), against NumPy float64."""
    dt, n, _ = mod
    (am, asw), (bm, bsw) = layout
    rng = np.random.default_rng([n, asw, bsw, len(am), len(bm)])
    a = rng.standard_normal((64, 64)).astype(as_dtype(dt))
    b = rng.standard_normal((64, n)).astype(as_dtype(dt))
    d0 = rng.standard_normal((64, n)).astype(np.float32)
    d = run(mod, a, b, am, bm, asw, bsw, False, d0)
    want = a.astype(np.float64) @ b.astype(np.float64) + d0
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-4)


def test_registers_a_and_overwrite(mod):
    """A from registers (RS), B N-major and 128B-swizzled (the MLA kernel's
    P V), with accumulate off: D = A B, whatever D held."""
    dt, n, _ = mod
    rng = np.random.default_rng(n)
    a = rng.standard_normal((64, 16)).astype(as_dtype(dt))
    b = rng.standard_normal((16, n)).astype(as_dtype(dt))
    d = run(mod, a, b, "K", "MN", 0, 128, True, d0=None)
    np.testing.assert_allclose(d, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_descriptor_fields(mod):
    """wgmma_desc packs the ISA's fields: (x & 0x3FFFF) >> 4 for the start
    address, LBO and SBO; the swizzle mode in bits 62-63; base offset 0."""
    _, _, m = mod
    out = np.zeros(2, np.uint64)
    u32 = np.uint32
    m.get_function("wgmma_desc_fields").bind(
        (1, 1, 1), (1, 1, 1), 4096, (out, u32(2080), u32(8192), u32(1024), u32(1))
    )()
    f0, f1 = desc_fields(int(out[0])), desc_fields(int(out[1]))
    assert (f0["start"] - f1["start"], f0["lbo"], f0["sbo"], f0["base"], f0["swizzle"]) == (2080, 8192, 1024, 0, 1)
    assert f1["start"] % 1024 == 0 and (f1["lbo"], f1["sbo"], f1["swizzle"]) == (0, 0, 0)


# ---------------------------------------------------------------- NVRTC


def test_nvrtc_emits_wgmma_for_sm90a():
    """The helpers compile for sm_90a into wgmma.mma_async (SS and RS,
    N = 32, 64, 256), fence, commit_group and wait_group, without spills."""
    try:
        from cupaged._runtime import nvrtc as _nvrtc

        _nvrtc.nvrtc_version()
        _nvrtc.find_header_dir()
    except Exception as e:  # no cuda-python / NVRTC / headers here
        pytest.skip(f"NVRTC unavailable: {e}")
    for dt in ("f16", "bf16"):
        for n in (32, 64, 256):
            text = _source.assemble(KERNELS, {"CP_DTYPE": dt, "WG_N": n})
            c = _nvrtc.compile_source(text, "sm_90a", name="ptx_wgmma.cu")
            assert c.ok, c.log
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dt}.{dt}" in c.ptx
            assert "wgmma.fence.sync.aligned" in c.ptx and "wgmma.commit_group.sync.aligned" in c.ptx
            assert "wgmma.wait_group.sync.aligned" in c.ptx
            rep = _nvrtc.parse_ptxas(c.log)["wgmma_gemm"]
            assert rep.spill_stores == 0 and rep.spill_loads == 0, c.log
