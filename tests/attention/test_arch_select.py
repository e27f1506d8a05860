"""Arch-aware selection of the tensor-core builds (issue #11 part 2): a build
that cannot launch on an arch (shared memory over its opt-in limit: 99 KiB on
sm_86 / sm_89) is never selected there, another is (a smaller prefill tile,
or the per-query kernels for MLA); arch-specific builds (the wgmma MLA
kernel, sm_90a) only on their arch; the NVRTC gate then reports no launch
problem for the selected builds on any arch; the static shared memory the
selection budgets for holds. The CPU backend stands in for an arch
(CUPAGED_CPU_ARCH, cpu_arch_override) and runs what that arch selects."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from attention_helpers import TC_DTYPES, check, run

import cupaged
from cupaged._runtime import archs, cpu, cpu_arch_override, source
from cupaged.errors import PagedAttentionError
from cupaged.ops.attention import plan_launches, variants
from cupaged.ops.attention.kernels import MERGE, SPECS, decode, geometry, prefill_tc, prefill_wgmma, spec
from cupaged.testing import assert_close, make_mla_case, make_paged_case

#: The tensor-core kernels whose builds the gate holds to the arch limits (the mma.sync ones and the wgmma ones).
TC_KERNELS = ("paged_prefill_tc", "paged_prefill_wgmma", "paged_mla_tc", "paged_mla_wgmma", "paged_mla_seesaw")

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")


def _host(q_lens, kv_lens, page=16):
    per = -(-max(kv_lens) // page)
    table = np.arange(len(q_lens) * per).reshape(len(q_lens), per)
    return cupaged.HostPlan.build(table, kv_lens, q_lens, page, len(q_lens) * per)


@pytest.mark.parametrize("arch", ARCHS)
def test_selected_builds_fit_the_arch(arch):
    """Every tensor-core build selected for an arch launches there (threads,
    dynamic shared memory + the static budget within the opt-in limit);
    sm_86 / sm_89 get the 99 KiB prefill tile at D 256 and no MLA
    tensor-core build; sm_90 the wgmma prefill and MLA builds, sm_80 the
    mma.sync ones."""
    lim = archs.limits(arch)
    for dt in TC_DTYPES:
        for d in prefill_tc.DIMS:
            v = variants.select_tensor_core(dt, d, d, True, True, arch=arch)
            assert v is not None and v.runs_on(arch)
            assert v.smem + spec.TC_STATIC_SMEM_BUDGET <= lim.smem_optin_per_block
            if arch == "sm_90":
                assert v.kernel == "paged_prefill_wgmma" and v.tile == prefill_wgmma.WGMMA_TILES[d]
                continue
            assert v.kernel == "paged_prefill_tc" and v.tile == (
                prefill_tc.PREFILL_TILES[d][-1]
                if (arch in ("sm_86", "sm_89") and d == 256)
                else prefill_tc.PREFILL_TILES[d][0]
            )
        mla = variants.select_tensor_core(dt, 512, 512, True, True, rot_dim=64, arch=arch)
        want = {"sm_80": "paged_mla_tc", "sm_86": None, "sm_89": None, "sm_90": "paged_mla_seesaw"}[arch]
        assert (mla.kernel if mla else None) == want
        fp8 = variants.select_tensor_core(dt, 512, 512, True, True, rot_dim=64, kv_dtype="e4m3", arch=arch)
        want = {"sm_80": "paged_mla_tc", "sm_86": None, "sm_89": None, "sm_90": "paged_mla_wgmma"}[arch]
        assert (fp8.kernel if fp8 else None) == want
    # sm_90a names the same device arch as sm_90; without an arch no arch-specific build runs.
    assert variants.select_tensor_core("bf16", 512, 512, True, True, rot_dim=64, arch="sm_90a").target == "sm_90a"
    assert variants.select_tensor_core("bf16", 512, 512, True, True, rot_dim=64).kernel == "paged_mla_tc"


def test_plan_launches_per_arch():
    """plan_launches takes the arch (launch_attention passes the device's):
    MLA decode at 128 heads is one wgmma launch on sm_90 (grid: the two head
    tiles of a query side by side along x), one mma.sync launch on sm_80,
    and the per-query kernel on sm_86; the cache keeps arches apart."""
    host = _host([1] * 4, [300] * 4, page=64)
    by = {a: plan_launches(host, "bf16", 128, 1, 512, 512, 64, True, True, arch=a) for a in ("sm_90", "sm_80", "sm_86")}
    assert [L.kernel for L in by["sm_90"]] == ["paged_mla_seesaw"]
    assert [L.kernel for L in by["sm_80"]] == ["paged_mla_tc"]
    assert [L.kernel for L in by["sm_86"]] == ["paged_attention"]
    for a in ("sm_90", "sm_80"):
        (L,) = by[a]
        assert L.tiles_in_x and L.grid(1, 1) == (4 * 2, 1, 1) and L.min_blocks == 1
    assert plan_launches(host, "bf16", 128, 1, 512, 512, 64, True, True, arch="sm_90") is by["sm_90"]


@pytest.mark.parametrize("arch", ["sm_86", "sm_89"])
def test_small_archs_run_what_they_select(arch, kernels_used):
    """On the CPU standing in for sm_86 / sm_89: D 256 prefill runs the
    99 KiB tile, MLA runs the per-query kernel; both match the float64
    reference."""
    rng = np.random.default_rng(86)
    case = make_paged_case(
        rng,
        kv_lens=np.array([60, 35], np.int32),
        q_lens=np.array([40, 18]),
        page_size=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=256,
        dtype="bf16",
    )

    class Cpu:
        name = "cpu"
        asarray = staticmethod(np.asarray)
        to_numpy = staticmethod(np.asarray)

    with cpu_arch_override(arch):
        for causal in (True, False):
            o, lse, _ = run(Cpu, case, causal, splits=None)
            check(case, o, lse, causal, "bf16", f"{arch} prefill D 256")
        mla = make_mla_case(
            rng,
            kv_lens=np.array([30, 21], np.int32),
            q_lens=np.array([1, 4]),
            page_size=16,
            num_heads=16,
            latent_dim=512,
            pos_dim=64,
            dtype="bf16",
        )
        plan = cupaged.HostPlan.build(mla.page_table, mla.kv_lens, mla.q_lens, 16, mla.num_pages).upload(mla.q)
        o, lse = plan.mla(mla.q, mla.q_pos, mla.latent, mla.k_pos, mla.scale, True, return_lse=True)
    ref_o, ref_lse = mla.reference(True)
    assert_close(o, ref_o, "bf16", f"{arch} mla")
    assert_close(lse, ref_lse, "bf16", f"{arch} mla lse")
    assert set(kernels_used) == {"paged_prefill_tc", "paged_attention"}


def test_cpu_arch_setting(monkeypatch):
    """CUPAGED_CPU_ARCH picks the arch the CPU backend stands in for (default
    sm_90); a name it does not know is a clear error; the override nests."""
    monkeypatch.delenv("CUPAGED_CPU_ARCH", raising=False)
    assert archs.cpu_arch() == "sm_90" == archs.device_arch(np.zeros(1))
    monkeypatch.setenv("CUPAGED_CPU_ARCH", "sm_86")
    assert archs.cpu_arch() == "sm_86"
    with cpu_arch_override("sm_80"):
        assert archs.cpu_arch() == "sm_80"
        with cpu_arch_override("sm_90a"):
            assert archs.cpu_arch() == "sm_90"
        assert archs.cpu_arch() == "sm_80"
    monkeypatch.setenv("CUPAGED_CPU_ARCH", "sm_75")
    with pytest.raises(PagedAttentionError, match="CUPAGED_CPU_ARCH: expected one of sm_70, sm_80"):
        archs.cpu_arch()
    with pytest.raises(PagedAttentionError, match="arch: expected one of"):
        with cpu_arch_override("gfx90a"):
            pass


def test_tools_read_the_runtime_limits():
    """The tools' arch table (gate, occupancy, model) takes its per-block
    limits from the runtime's, which selection reads."""
    from cupaged.tools import archs as tools_archs

    for name, lim in archs.LIMITS.items():
        a = tools_archs.get(name)
        assert (
            a.smem_optin_per_block,
            a.max_threads_per_block,
            a.static_smem_limit,
            a.regs_per_block,
            a.max_regs_per_thread,
        ) == (
            lim.smem_optin_per_block,
            lim.max_threads_per_block,
            lim.static_smem_limit,
            lim.regs_per_block,
            lim.max_regs_per_thread,
        )


def _nvrtc_or_skip():
    try:
        from cupaged._runtime import nvrtc

        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")


def test_gate_finds_no_launch_problem_on_any_arch():
    """The NVRTC gate over the tensor-core builds for sm_80, sm_86 and sm_90
    (sm_90a for the wgmma build): the tensor-core kernels compile with no
    spill, no selected kernel cannot launch on its arch, no warning for
    sm_89; each kernel's static shared memory within TC_STATIC_SMEM_BUDGET.
    The figures come from the gate manifest's rows where the inputs are
    unchanged (tests/runtime/test_compile_check.py samples and checks the
    rows), else from a compile."""
    _nvrtc_or_skip()
    from cupaged.tools import compile_check, gate_manifest, launchcheck

    tc = [(v.source, v.defines()) for v in variants.VARIANTS if v.kernel in TC_KERNELS]
    results = compile_check.check(
        tc,
        ("sm_80", "sm_86", "sm_90"),
        jobs=2,
        cache_dir=compile_check.default_cache_dir(),
        manifest=gate_manifest.load(sample=0),
    )
    bad = [
        (r.variant, r.kernel, r.arch, r.problems)
        for r in results
        if not r.ok and (r.kernel in TC_KERNELS or any("cannot launch" in p for p in r.problems))
    ]
    assert not bad, bad
    for wgmma in ("paged_prefill_wgmma", "paged_mla_wgmma", "paged_mla_seesaw"):
        assert {r.arch for r in results if r.kernel == wgmma} == {"sm_90a"}, wgmma
    assert launchcheck.arch_warnings(results, ("sm_80", "sm_86", "sm_90")) == []
    for r in results:
        if r.kernel in TC_KERNELS:
            assert r.smem <= variants.KERNELS[r.kernel].static_smem_budget, (r.variant, r.arch, r.smem)


# ----------------------------------------------------------------- the kernels' specs
# What each kernel states that its spec (cupaged/ops/attention/kernels/<stem>.py) states too, as C++
# expressions over the kernel's own constants, per build: the kernel reads its geometry from geometry.cuh
# (geometry.header), and its layout must agree with the spec's shared-memory formula.
def _decode_dims(v):
    return v.head_dim or v.dim_cap, decode._vec(v.kv_dtype, bool(v.head_dim or v.vec_loads))


def _decode_facts(v):
    """paged_attention's facts in the CPU backend's geometry (decode.py CPU_GEOMETRY: its lanes a row)."""
    cap, vec = _decode_dims(v)
    return [
        "att::kWarps == geom::decode::kWarps",
        "att::kThreads == geom::decode::kThreads",
        f"att::kCap == {cap}",
        f"att::kVec == {vec}",
        f"att::kLanes == {min(cap // vec, decode.CPU_ROW_LANES)}",
        f"att::kHeads == {v.group_tile}",
    ]


def _decode_gpu_facts(v):
    """paged_attention's facts in the GPU geometry, whose registers and shared memory the spec bounds."""
    cap, vec = _decode_dims(v)
    facts = [
        f"att::kLanes == {min(cap // vec, decode.ROW_LANES)}",
        f"att::kElems == {decode.elems_per_lane(cap, vec)}",
        # decode.max_group_tile: the largest tile within both bounds, or 1
        "att::kHeads == 1 || att::kHeads * (att::kElems + (att::kRotCap ? att::kRotElems : 0))"
        " <= geom::decode::kLaneFloats",
        "att::kHeads == 1 || sizeof(float) * att::kWarps * att::kHeads * att::kCap <= geom::decode::kMergeSmemBytes",
        f"att::kHeads == {v.group_tile}",
    ]
    if v.rot_cap:
        facts.append(f"att::kRotElems == {decode.rot_elems_per_lane(cap, vec, v.rot_cap)}")
    return facts


#: Facts of a kernel with a CPU geometry that hold in its GPU geometry (checked in the CUPAGED_GPU_GEOMETRY build).
GPU_GEOMETRY_FACTS = {"paged_attention": _decode_gpu_facts}


KERNEL_FACTS = {
    "paged_attention": _decode_facts,
    "paged_decode_tc": lambda v: [
        "dtc::kWarps == geom::decode_tc::kWarps",
        "dtc::kThreads == geom::decode_tc::kThreads",
        "dtc::kMinBlocks == geom::decode_tc::kMinBlocks",
        "dtc::kHeadPack == geom::decode_tc::kHeadPack",
        "dtc::kRows == geom::decode_tc::kRows",
        "dtc::kN == geom::decode_tc::kN",
        "dtc::kPitch == dtc::kD + geom::kPitchPad",
        "dtc::kRawKPitch == dtc::kD + geom::decode_tc::kRawKPad",
        f"dtc::kWarps * dtc::kWarpBytes == {v.smem}",
    ],
    "paged_prefill_tc": lambda v: [
        f"tcp::kThreads == {v.threads}",
        f"tcp::kRows == {v.rows}",
        "tcp::kPitch == tcp::kD + geom::kPitchPad",
        f"tcp::kQInRegs == {str(prefill_tc.q_in_registers(v.head_dim, v.tile)).lower()}",
        f"2 * tcp::kRawOff + (tcp::kFp8 ? tcp::kS * tcp::kRawStage : 0) == {v.smem}",
    ],
    "paged_prefill_wgmma": lambda v: [
        "pwg::kThreads == geom::prefill_wgmma::kThreads",
        "pwg::kMinBlocks == geom::prefill_wgmma::kMinBlocks",
        "pwg::kN == geom::prefill_wgmma::kN",
        f"pwg::kRows == {v.rows}",
        f"pwg::kS == {v.tile.stages}",
        f"pwg::kSmemBytes == {v.smem}",
    ],
    "paged_mla_tc": lambda v: [
        "tcm::kWarps == geom::mla_tc::kWarps",
        "tcm::kThreads == geom::mla_tc::kThreads",
        "tcm::kN == geom::mla_tc::kN",
        "tc::kRows == geom::kTcRows",
        "tcm::kPitch == tcm::kK + geom::kPitchPad",
        "tcm::kPPitch == tcm::kN + geom::kPitchPad",
        # mla_tc.cu's carve-up: sQ, sKV, sP (16-bit), then the fp8 ring sRaw [2][kN][kK]
        f"(tc::kRows * tcm::kPitch + tcm::kTileBufs * tcm::kN * tcm::kPitch + tc::kRows * tcm::kPPitch) * 2"
        f" + (kKvScaled ? 2 * tcm::kN * tcm::kK : 0) == {v.smem}",
    ],
    "paged_mla_wgmma": lambda v: [
        "mwg::kThreads == geom::mla_wgmma::kThreads",
        "mwg::kN == geom::mla_wgmma::kN",
        "mwg::kS == geom::mla_wgmma::kS",
        "mwg::kRows == geom::kTcRows",
        f"mwg::kSmemBytes == {v.smem}",
    ],
    "paged_mla_seesaw": lambda v: [
        "mss::kBlockThreads == geom::mla_seesaw::kConsumerThreads + geom::mla_seesaw::kProducerThreads",
        "mss::kN == geom::mla_seesaw::kN",
        "mss::kS == geom::mla_seesaw::kS",
        "mss::kRows == geom::kTcRows",
        f"mss::kSmemBytes == {v.smem}",
    ],
    "paged_prefill_simt": lambda v: [
        "simt::kThreads == geom::prefill_simt::kThreads",
        "simt::kRows == geom::kTcRows",
        "simt::kPitch == simt::kD + geom::prefill_simt::kPad",
        f"simt::kSmemBytes == {v.smem}",
    ],
    MERGE.name: lambda v: ["merge::kThreads == geom::merge::kThreads"],
}
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\(\s*([^,()]+?)\s*,\s*([^()]+?)\s*\)\s*(\w+)\s*\(")


def _launch_bounds(stem):
    """{kernel: (threads, min blocks)} as the .cu text spells them."""
    text = (source.kernel_dir() / f"{stem}.cu").read_text()
    return {name: (a, b) for a, b, name in _LAUNCH_BOUNDS.findall(text)}


def _decode_sample(v) -> bool:
    """paged_attention builds checked (a compile each): f16 at the smallest
    and largest dims, either load width, with and without a rotary part;
    e4m3 where a rotary part leaves one head per block."""
    if v.kv_dtype == "f16":
        return v.head_dim in (64, 256) or v.dim_cap in (64, 1024)
    return v.kv_dtype == "e4m3" and (v.head_dim == 128 or (v.dim_cap == 64 and v.vec_loads == 1))


def _bounds(v, threads):
    """The ``__launch_bounds__`` the spec states for ``v`` built with a block of ``threads``: its block and
    resident blocks unless the spec caps registers for another block (``KernelSpec.launch_bounds``)."""
    k = variants.KERNELS[v.kernel]
    a, b = k.launch_bounds(v)
    return (threads, b) if (a, b) == (k.block_threads(v), k.resident_blocks(v)) else (a, b)


def _spec_builds():
    """One build per distinct geometry of each tensor-core kernel (bf16 q,
    a bf16 or e4m3 cache) and of paged_prefill_simt (f32),
    paged_attention's of ``_decode_sample`` (the largest tile of each), and
    the merge; as (kernel, source, defines, threads, resident blocks, facts): threads the CPU build's
    (``cpu_threads``), and each build with a CPU geometry again with the GPU's."""
    by_geometry = {}
    for v in variants._built():
        if v.kernel == "paged_attention":
            if _decode_sample(v):
                by_geometry[(v.kernel, v.head_dim, v.dim_cap, v.vec_loads, v.rot_cap, v.kv_dtype)] = v
        elif v.kernel == "paged_prefill_simt":  # f32 only
            by_geometry.setdefault((v.kernel, v.head_dim), v)
        elif v.dtype == "bf16" and v.kv_dtype in ("bf16", "e4m3"):
            by_geometry.setdefault((v.kernel, v.head_dim, v.tile, v.latent_dim, v.rope_dim, v.kv_dtype), v)
    out = [
        (v.kernel, v.source, v.defines(), *_bounds(v, v.cpu_threads), KERNEL_FACTS[v.kernel](v))
        for v in by_geometry.values()
    ]
    # a kernel with a CPU geometry (decode.py CPU_GEOMETRY): its GPU block too, as CUPAGED_CPU_GEOMETRY=gpu builds it
    out += [
        (
            v.kernel,
            v.source,
            {**v.defines(), "CUPAGED_GPU_GEOMETRY": 1},
            *_bounds(v, v.threads),
            GPU_GEOMETRY_FACTS.get(v.kernel, lambda v: [])(v),
        )
        for v in by_geometry.values()
        if v.cpu_threads != v.threads
    ]
    return out + [
        (
            MERGE.name,
            MERGE.source,
            MERGE.defines("f16", False),
            MERGE.threads,
            MERGE.min_blocks,
            KERNEL_FACTS[MERGE.name](None),
        )
    ]


def _syntax_check(kernel, stem, defines, threads, blocks, facts):
    """g++ -fsyntax-only over the build's assembled source (geometry.cuh
    included) and a static_assert per fact; the compiler's message or None."""
    a, b = _launch_bounds(stem)[kernel]
    checks = facts + [f"({a}) == {threads}", f"({b}) == {blocks}"]
    text = source.assemble(stem, defines) + "\n" + "".join(f'static_assert({c}, "spec: {c}");\n' for c in checks)
    shim = source.shim_dir()
    r = subprocess.run(
        [
            cpu._compiler()[0],
            "-std=c++20",
            "-fsyntax-only",
            "-w",
            "-DCUPAGED_CPU",
            "-include",
            str(shim / "cupaged_shim.h"),
            "-I",
            str(shim),
            "-x",
            "c++",
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
    )
    return None if r.returncode == 0 else f"{kernel} {defines}: {r.stderr[-1500:]}"


def test_specs_state_what_the_kernels_compile():
    """Each spec's block, resident blocks (the .cu's ``__launch_bounds__``),
    tile and padding constants (geometry.cuh's) and shared-memory bytes are
    what the kernel compiles to, for one build of every geometry: g++ checks
    a static_assert of each on the CPU backend's source."""
    builds = _spec_builds()
    assert {b[0] for b in builds} == set(variants.KERNELS) | {MERGE.name}
    with ThreadPoolExecutor(max(1, min(4, cpu.num_workers()))) as pool:
        bad = [m for m in pool.map(lambda b: _syntax_check(*b), builds) if m]
    assert not bad, "\n".join(bad)


def test_a_wrong_spec_fails_the_check():
    """The check is live: a shared-memory figure or a resident-block count
    one off fails to compile."""
    kernel, stem, defines, threads, blocks, facts = next(b for b in _spec_builds() if b[0] == "paged_decode_tc")
    assert _syntax_check(kernel, stem, defines, threads, blocks, facts) is None
    assert "kWarpBytes" in _syntax_check(
        kernel, stem, defines, threads, blocks, facts[:-1] + [facts[-1].replace("==", "== 16 +")]
    )
    assert f"== {blocks + 1}" in (_syntax_check(kernel, stem, defines, threads, blocks + 1, facts) or "")


def test_each_spec_is_beside_its_kernel():
    """A spec module per kernels_cu/attention/<stem>.cu, of that stem, naming
    the kernel the file defines; SPECS holds every attention kernel with a
    variant in the table, each spec's builds use only its fields (and the
    common ones); RESIDENT_BLOCKS is the specs' min_blocks."""
    mods = geometry.MODULES
    for k in SPECS + (MERGE,):
        stem = k.source.split("/", 1)[1]
        assert stem in mods and (source.kernel_dir() / f"{k.source}.cu").is_file(), k
        defines = (
            MERGE.defines("f16", False)
            if k is MERGE
            else next(v for v in variants._built() if v.kernel == k.name).defines()
        )
        assert source.kernel_names(source.assemble(k.source, defines)) == [k.name], k
        assert set(_launch_bounds(k.source)) == {k.name}, k
        assert mods[stem].GEOMETRY.get("kThreads", k.threads) == k.threads
        assert mods[stem].GEOMETRY.get("kMinBlocks", k.min_blocks) == k.min_blocks
    assert list(variants.KERNELS) == [k.name for k in SPECS]
    common = {"kernel", "dtype", "kv_dtype", "score", "target", "group_tile"}
    for v in variants._built():
        k = variants.KERNELS[v.kernel]
        used = {f for f in vars(v) if getattr(v, f) and f not in common}
        assert used <= set(k.fields), (v, used)
        assert v.target == k.target
    assert variants.RESIDENT_BLOCKS == {k.name: k.min_blocks for k in SPECS if k.min_blocks}
    assert variants.RESIDENT_BLOCKS == {
        "paged_attention": 2,
        "paged_decode_tc": 6,
        "paged_prefill_wgmma": 1,
        "paged_prefill_simt": 2,
        "paged_mla_tc": 1,
        "paged_mla_wgmma": 1,
        "paged_mla_seesaw": 1,
    }
    assert geometry.header().startswith("// geometry.cuh: GENERATED")
