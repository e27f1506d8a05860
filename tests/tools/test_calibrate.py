"""The calibration microbenchmarks (kernels_cu/bench/calibrate.cu) and
python -m cupaged.tools.calibrate, without a GPU.

* NVRTC: the plain build compiles for sm_80 and sm_90 and the wgmma build
  (CAL_WGMMA) for sm_90a alone, without spills, with the instructions each
  kernel is there to time, and with the blocks per SM the tool launches
  resident at once (its rates assume one wave).
* The CPU backend runs every kernel and each result is checked against a
  NumPy reference written here from the PTX ISA and the kernels' contracts
  (the timings are meaningless there): the chase visits its whole cycle,
  the paged read's checksums are NumPy sums of the same rows, the copy
  copies, the conversions equal NumPy / ml_dtypes rounding step for step,
  mma.sync and wgmma accumulate the products of their operands.
* The CLI: one line and exit 2 without a GPU; ``--cpu`` runs every
  measurement with its own checks and writes the JSON; a wrong reference
  fails a check.
"""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged.tools import archs, calibrate, compile_check, occupancy

PLAIN = ("cal_chase", "cal_copy", "cal_cvt_bf16", "cal_cvt_e4m3", "cal_cvt_f16", "cal_mma_bf16", "cal_mma_f16")
PLAIN += ("cal_paged_read", "cal_read", "cal_gap_first", "cal_gap_second")
WGMMA = ("cal_wgmma_bf16_n32", "cal_wgmma_bf16_n64", "cal_wgmma_bf16_n256", "cal_wgmma_f16_n256")
u32 = np.uint32
T = calibrate.THREADS  # threads a block (its DEFINES)


def _load(defines: dict | None):
    text = _source.assemble(calibrate.STEM, defines)
    return _cpu.load_module(text, _source.variant_name(_source.stem_of(calibrate.STEM), defines))


@pytest.fixture(scope="module")
def mod():
    return _load(calibrate.DEFINES)


@pytest.fixture(scope="module")
def wg_mod():
    return _load(calibrate.WGMMA_DEFINES)


def _dim3(v) -> tuple[int, int, int]:
    v = (v,) if isinstance(v, int) else tuple(v)
    return v + (1,) * (3 - len(v))


def run(mod, name: str, grid, block, args, smem: int = 0) -> None:
    mod.get_function(name).bind(_dim3(grid), _dim3(block), smem, tuple(args))()


# ---------------------------------------------------------------- NVRTC


def test_nvrtc_builds_without_spills():
    """Every kernel compiles for its archs with no spill and no stack; the
    PTX holds the instruction it times; the tool's blocks per SM fit."""
    try:
        from cupaged._runtime import nvrtc

        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
    except Exception as e:  # no cuda-python / NVRTC / headers
        pytest.skip(f"NVRTC unavailable: {e}")
    variants = [(calibrate.STEM, calibrate.DEFINES), (calibrate.STEM, calibrate.WGMMA_DEFINES)]
    results = compile_check.check(variants, ("sm_80", "sm_90"), launches=[], keep_ptx=True)
    assert all(r.compiled for r in results), [r.log for r in results if not r.compiled]
    assert [r for r in results if r.problems] == []
    got = {(r.kernel, r.arch) for r in results if r.is_entry}
    want = {(k, a) for k in PLAIN for a in ("sm_80", "sm_90")} | {(k, "sm_90a") for k in WGMMA}
    assert got == want
    sz = calibrate.Sizes()
    for r in results:
        assert r.stack_frame == 0 and r.spill_stores == 0 and r.spill_loads == 0, (r.kernel, r.arch)
        assert "serialized" not in r.log, r.log  # ptxas would say so if it serialized the wgmma pipeline
        if r.kernel.startswith("cal_wgmma"):
            _, n = calibrate.WGMMA_N[r.kernel]
            per_sm, dyn = 1, 1024 + 2048 + 32 * n
        elif r.kernel == "cal_chase":
            per_sm, dyn = sz.loaders_per_sm + 1, 0  # one SM holds the chaser beside its loaders
        else:
            per_sm, dyn = sz.blocks_per_sm, 0
        occ = occupancy.occupancy(r.arch, calibrate.THREADS, r.registers, r.smem, dyn)
        assert occ.blocks_per_sm >= per_sm, (r.kernel, r.arch, occ)
        assert not archs.launch_problems(r.arch, r.smem, dyn, calibrate.THREADS, r.registers)
    ptx = {r.arch: r.ptx for r in results}
    for arch in ("sm_80", "sm_90"):
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx[arch]
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx[arch]
        assert "cvt.rn.f16x2.f32" in ptx[arch] and "cvt.rn.bf16x2.f32" in ptx[arch]
        assert "%globaltimer" in ptx[arch] and "ld.global.cg" in ptx[arch]
    assert "cvt.rn.f16x2.e4m3x2" in ptx["sm_90"] and "e4m3x2" not in ptx["sm_80"]
    for k in WGMMA:
        dt, n = calibrate.WGMMA_N[k]
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{dt}.{dt}" in ptx["sm_90a"]
    assert "wgmma.wait_group.sync.aligned 1" in ptx["sm_90a"]
    assert "griddepcontrol.wait" in ptx["sm_90"] and "griddepcontrol.launch_dependents" in ptx["sm_90"]
    assert "griddepcontrol" not in ptx["sm_80"]


# ---------------------------------------------------------------- the chase


def _cycle(rng, lines: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """A next [] buffer holding one random cycle over ``lines`` lines (the
    other words poisoned) and the cycle's lines in order."""
    perm = rng.permutation(lines)
    nxt = np.full(lines * stride, 0xFFFFFFFF, np.uint32)
    for a, b in zip(perm, np.roll(perm, -1)):
        nxt[a * stride] = b * stride
    return nxt, perm


def _walk(nxt: np.ndarray, start: int, steps: int) -> list[int]:
    out, p = [], start
    for _ in range(steps):
        p = int(nxt[p])
        out.append(p)
    return out


@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "loaded"])
def test_chase_visits_the_whole_cycle(mod, loaded):
    """``lines`` hops from a line come back to it having visited every line
    once; warm steps are taken first and not summed. Loaded: the loader
    blocks run beside the chase and stop."""
    rng = np.random.default_rng(7)
    lines, stride = 1000, calibrate.LINE_WORDS
    nxt, perm = _cycle(rng, lines, stride)
    start = int(perm[0]) * stride
    src = rng.integers(0, 1 << 32, size=4 * 512 * 3, dtype=np.uint64).astype(np.uint32)  # 3 chunks of 512 vectors
    for warm, hops in ((0, lines), (3, lines + 5)):
        result, done, load_out = np.zeros(4, np.uint64), np.zeros(1, np.uint32), np.zeros(4, np.uint32)
        grid, block = (3, T) if loaded else (1, 32)
        args = (nxt, u32(start), u32(warm), u32(hops), result, done, src, u32(3), u32(512), u32(2), load_out)
        run(mod, "cal_chase", grid, block, args)
        path = _walk(nxt, start, warm + hops)
        visited = path[warm:]
        if hops == lines:
            assert result[0] == start and sorted(visited) == sorted(int(p) * stride for p in perm)
        assert result[0] == visited[-1] and result[1] == sum(visited)
        assert done[0] == 1 and result[2] > 0 and result[3] > 0
        if loaded:
            assert (load_out[1::2] <= 2).all()


# ---------------------------------------------------------------- reads


@pytest.mark.parametrize(
    "seqs, tokens, hkv, row_bytes, page", [(3, 37, 2, 64, 8), (2, 70, 8, 256, 16)], ids=["d32-partial", "d128-h8"]
)
def test_paged_read_checksums(mod, seqs, tokens, hkv, row_bytes, page):
    """sums [s][h] is the sum (mod 2^32) of the u32 words of head h's rows of
    sequence s's tokens, located through its page-table row: pages
    permuted, spare pages never read, a last page partly read."""
    rng = np.random.default_rng([seqs, tokens])
    pps = -(-tokens // page)
    pages = seqs * pps + 4
    words = row_bytes // 4
    cache = rng.integers(0, 1 << 32, size=(pages, page, hkv, words), dtype=np.uint64).astype(np.uint32)
    table = rng.permutation(pages)[: seqs * pps].astype(np.uint32).reshape(seqs, pps)
    sums = np.zeros(seqs * hkv, np.uint32)
    row_log2, page_log2 = int(np.log2(row_bytes // 16)), int(np.log2(page))
    args = (cache, table, u32(pps), u32(tokens), u32(hkv), u32(row_log2), u32(page_log2), sums)
    run(mod, "cal_paged_read", (seqs, hkv), T, args)
    want = np.zeros((seqs, hkv), np.uint64)
    for s in range(seqs):
        t = np.arange(tokens)
        rows = cache[table[s, t // page], t % page]  # [tokens, hkv, words]
        want[s] = rows.astype(np.uint64).sum(axis=(0, 2))
    np.testing.assert_array_equal(sums.reshape(seqs, hkv), (want % (1 << 32)).astype(np.uint32))


def test_read_and_copy(mod):
    """cal_read: block b sums the vectors of its grid-stride share, passes
    times; cal_copy copies n vectors and nothing past them."""
    rng = np.random.default_rng(8)
    n, grid, passes = 8 * T * 3 + 37, 3, 2
    src = rng.integers(0, 1 << 32, size=4 * n, dtype=np.uint64).astype(np.uint32)
    sums = np.zeros(grid, np.uint32)
    run(mod, "cal_read", grid, T, (src, np.uint64(n), u32(passes), sums))
    block_of = (np.arange(n) // T) % grid
    per_vec = src.reshape(n, 4).astype(np.uint64).sum(axis=1)
    want = np.array([passes * per_vec[block_of == b].sum() % (1 << 32) for b in range(grid)], np.uint32)
    np.testing.assert_array_equal(sums, want)
    dst = np.full(4 * n + 8, 0xDEADBEEF, np.uint32)
    run(mod, "cal_copy", grid, T, (src, dst, np.uint64(n)))
    np.testing.assert_array_equal(dst[: 4 * n], src)
    assert (dst[4 * n :] == 0xDEADBEEF).all()


# ---------------------------------------------------------------- conversions


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | hi.astype(np.uint32) << 16


def _step(op: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's step, by NumPy / ml_dtypes rounding (round to nearest even)."""
    if op == "e4m3":

        def dec(v):
            lo = (v & 0xFF).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
            hi = ((v >> 8) & 0xFF).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16).view(np.uint16)
            return _pack(lo, hi)

        return dec(x), dec(y)
    t = np.float16 if op == "f16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):  # f16 overflows to infinity, as the kernel's does
        rx, ry = (v.view(np.float32).astype(t).view(np.uint16) for v in (x, y))
    return _pack(rx, ry), _pack(ry, rx)


def _cvt_inputs(op: str, n: int, rng) -> np.ndarray:
    if op == "e4m3":  # every non-NaN code pair in the low half, random high halves
        codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint32)
        pairs = (codes[:, None] | codes[None, :] << 8).reshape(-1)
        pairs = np.resize(rng.permutation(pairs), n)
        return pairs | rng.integers(0, 1 << 16, size=n).astype(np.uint32) << 16
    special = np.array(
        [1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, 65520.0, 2.0**-20, -(2.0**-24), -0.0, np.inf, -3.0e38, 1 + 2.0**-8],
        np.float32,
    )
    if op == "bf16":  # no infinity: an f32 read from an infinite bf16 and a nonzero low half is a NaN
        special = special[np.abs(special) < 1e38]
    vals = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, size=n))).astype(np.float32)
    vals[: len(special)] = special
    return vals.view(np.uint32)


@pytest.mark.parametrize("op", ["f16", "bf16", "e4m3"])
def test_conversions_match_numpy(mod, op):
    """Each chain, after 1 and after 3 steps, holds what NumPy's rounding
    (ml_dtypes for bf16 and e4m3) gives step by step: ties, overflow to
    infinity (f16), subnormals, signed zero, every non-NaN e4m3 code pair."""
    rng = np.random.default_rng(len(op))
    blocks, chains = 2, calibrate.CVT_CHAINS
    n = blocks * T * chains * 2
    src = _cvt_inputs(op, n, rng)
    for iters in (1, 3):
        out, clk = np.zeros(n, np.uint32), np.zeros(2 * blocks, np.uint64)
        run(mod, f"cal_cvt_{op}", blocks, T, (src, u32(iters), out, clk))
        x, y = src[0::2], src[1::2]
        for _ in range(iters):
            x, y = _step(op, x, y)
        np.testing.assert_array_equal(out[0::2], x, err_msg=f"{op}, {iters} steps, x chains")
        np.testing.assert_array_equal(out[1::2], y, err_msg=f"{op}, {iters} steps, y chains")
        assert (clk[1::2] > 0).all()


# ---------------------------------------------------------------- tensor cores


def _bits(vals: np.ndarray, dt: str) -> np.ndarray:
    return np.asarray(vals, np.float16 if dt == "f16" else ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize("dt", ["f16", "bf16"])
def test_mma_accumulates_iters_products(mod, dt):
    """Every accumulator of every chain and warp holds iters x its element
    of A B, A [16 x 16] and B [16 x 8] placed by the PTX ISA's m16n8k16
    fragment tables from each lane's registers."""
    rng = np.random.default_rng(9)
    vals = rng.integers(-3, 4, size=(32, 6, 2))
    seed = _pack(_bits(vals[..., 0], dt), _bits(vals[..., 1], dt)).reshape(-1)
    a, b = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for h in range(2):  # a0: row g, cols 2t..; a1: row g+8; a2: row g, cols 2t+8..; a3: row g+8, cols 2t+8..
            a[g, 2 * t + h], a[g + 8, 2 * t + h] = vals[lane, 0, h], vals[lane, 1, h]
            a[g, 2 * t + 8 + h], a[g + 8, 2 * t + 8 + h] = vals[lane, 2, h], vals[lane, 3, h]
            b[2 * t + h, g], b[2 * t + 8 + h, g] = vals[lane, 4, h], vals[lane, 5, h]  # b0: rows 2t.., b1: 2t+8..
    c = a @ b
    iters, threads = 3, 64
    chains = calibrate.MMA_CHAINS
    out, clk = np.full(threads * chains * 4, np.nan, np.float32), np.zeros(2, np.uint64)
    run(mod, f"cal_mma_{dt}", 1, threads, (seed, u32(iters), out, clk))
    got = out.reshape(threads // 32, 32, chains, 4)
    for lane in range(32):
        g, t = divmod(lane, 4)
        want = iters * np.array([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]])
        np.testing.assert_array_equal(
            got[:, lane], np.broadcast_to(want, (threads // 32, chains, 4)), err_msg=f"{lane}"
        )


@pytest.mark.parametrize("kernel", WGMMA)
def test_wgmma_accumulates_iters_groups(wg_mod, kernel):
    """Each thread's accumulators hold iters x WG_PER_GROUP x its part of A B^T, A
    [64 x 16] and B [N x 16] read from the shared-memory image the kernel
    fills (seed words repeating) in the ISA's K-major, no-swizzle canonical
    layout (LBO 128 B, SBO 256 B), D placed by the ISA's m64nNk16 fragment."""
    dt, n = calibrate.WGMMA_N[kernel]
    rng = np.random.default_rng(n)
    vals = rng.integers(-2, 3, size=(64, 2))
    seed = _pack(_bits(vals[:, 0], dt), _bits(vals[:, 1], dt))
    image = (
        np.tile(seed, (2048 + 32 * n) // 256).view(np.uint16).view(np.float16 if dt == "f16" else ml_dtypes.bfloat16)
    )

    def element(base: int, mn: int, k: int) -> float:  # ((8, m), (8, 2)) : ((16 B, SBO), (2 B, LBO))
        return float(image[(base + (mn % 8) * 16 + (mn // 8) * 256 + (k % 8) * 2 + (k // 8) * 128) // 2])

    a = np.array([[element(0, m, k) for k in range(16)] for m in range(64)])
    b = np.array([[element(2048, j, k) for k in range(16)] for j in range(n)])
    iters = 2
    d = iters * calibrate.WG_PER_GROUP * (a @ b.T)
    out, clk = np.full(T * n // 2, np.nan, np.float32), np.zeros(2, np.uint64)
    run(wg_mod, kernel, 1, T, (seed, u32(iters), out, clk), 1024 + 2048 + 32 * n)
    got = out.reshape(T, n // 2)
    for tid in range(T):
        w4, lane = divmod(tid % 128, 32)
        g, t = divmod(lane, 4)
        j = np.arange(n // 2)
        want = d[16 * w4 + g + 8 * ((j % 4) >> 1), 8 * (j // 4) + 2 * t + (j % 2)]
        np.testing.assert_array_equal(got[tid], want, err_msg=f"thread {tid}")


# ---------------------------------------------------------------- the tool


def test_cli_without_gpu_exits_2_with_one_line():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present")
    except Exception:
        pass
    r = subprocess.run([sys.executable, "-m", "cupaged.tools.calibrate"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("calibrate: no usable GPU ("), r.stderr


def test_cli_cpu_run_checks_every_kernel(tmp_path, capsys):
    """--cpu: every measurement runs through the tool's own launches and
    NumPy checks (they pass), the table names each figure beside its model
    constant, the JSON holds every figure with its unit."""
    path = tmp_path / "cal.json"
    assert calibrate.main(["--cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["backend"] == "cpu" and doc["arch"] == "sm_90" and doc["failed_checks"] == [] and doc["errors"] == []
    figs = {f["key"]: f for f in doc["figures"]}
    want = {"clock_tensor", "mma_sync_f16", "mma_sync_bf16", "cvt_f16", "cvt_bf16", "cvt_e4m3"}
    want |= {"wgmma_bf16_n32", "wgmma_bf16_n64", "wgmma_bf16_n256", "wgmma_f16_n256"}
    want |= {"dram_latency_idle", "dram_latency_loaded", "l2_latency", "paged_read", "contiguous_read"}
    want |= {"copy_kernel", "memcpy", "l2_read", "little_bytes_per_sm"}
    want |= {"launch_gap_stream", "launch_gap_graph", "launch_dependent_graph"}
    assert want <= set(figs)
    for f in doc["figures"]:
        assert f["checked"] and f["unit"] and f["measured"] is not None, f
        # a launch's cost is a difference of two timings: on the CPU it may come out below 0
        assert f["measured"] >= 0 or f["key"].startswith("launch_"), f
    assert figs["mma_sync_bf16"]["constant"] == "mma_sync_flops" and figs["mma_sync_bf16"]["model"]
    assert "MEASURED" in out and "MODELED" in out and "CHECK FAILED" not in out
    assert "every kernel's output matched its NumPy reference" in out


def test_a_wrong_reference_fails_the_check(monkeypatch):
    """The tool's checks can fail: against a reference of zeros the mma
    figures are marked unchecked."""
    monkeypatch.setattr(calibrate, "mma_reference", lambda vals: np.zeros((32, 4)))
    be = calibrate.Backend(gpu=False)
    figs = calibrate.measure_mma(be, calibrate.Sizes.tiny(), archs.get("sm_90"))
    assert {f.key: f.checked for f in figs if f.key.startswith("mma_sync_")} == dict.fromkeys(
        ("mma_sync_f16", "mma_sync_bf16", "mma_sync_per_clk"), False
    )
