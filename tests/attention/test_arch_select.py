"""Arch-aware selection of the tensor-core builds (issue #11 part 2): a build
that cannot launch on an arch (shared memory over its opt-in limit: 99 KiB on
sm_86 / sm_89) is never selected there, another is (a smaller prefill tile,
or the per-query kernels for MLA); arch-specific builds (the wgmma MLA
kernel, sm_90a) only on their arch; the NVRTC gate then reports no launch
problem for the selected builds on any arch; the static shared memory the
selection budgets for holds. The CPU backend stands in for an arch
(CUPAGED_CPU_ARCH, cpu_arch_override) and runs what that arch selects."""
from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged._runtime import archs, cpu_arch_override
from cupaged.errors import PagedAttentionError
from cupaged.ops.attention import plan_launches, variants
from cupaged.testing import assert_close, make_mla_case, make_paged_case
from attention_helpers import TC_DTYPES, check, run

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
    tensor-core build; sm_90 the wgmma MLA build, sm_80 the mma.sync one."""
    lim = archs.limits(arch)
    for dt in TC_DTYPES:
        for d in variants.TC_PREFILL_DIMS:
            v = variants.select_tensor_core(dt, d, d, True, True, arch=arch)
            assert v is not None and v.runs_on(arch)
            assert v.smem + variants.TC_STATIC_SMEM_BUDGET <= lim.smem_optin_per_block
            assert v.tile == (variants.PREFILL_TILES[d][-1] if (arch in ("sm_86", "sm_89") and d == 256)
                              else variants.PREFILL_TILES[d][0])
        mla = variants.select_tensor_core(dt, 512, 512, True, True, rot_dim=64, arch=arch)
        want = {"sm_80": "paged_mla_tc", "sm_86": None, "sm_89": None, "sm_90": "paged_mla_wgmma"}[arch]
        assert (mla.kernel if mla else None) == want
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
    assert [L.kernel for L in by["sm_90"]] == ["paged_mla_wgmma"]
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
    case = make_paged_case(rng, kv_lens=np.array([60, 35], np.int32), q_lens=np.array([40, 18]), page_size=16,
                           num_q_heads=4, num_kv_heads=2, head_dim=256, dtype="bf16")

    class Cpu:
        name = "cpu"
        asarray = staticmethod(np.asarray)
        to_numpy = staticmethod(np.asarray)

    with cpu_arch_override(arch):
        for causal in (True, False):
            o, lse, _ = run(Cpu, case, causal, splits=None)
            check(case, o, lse, causal, "bf16", f"{arch} prefill D 256")
        mla = make_mla_case(rng, kv_lens=np.array([30, 21], np.int32), q_lens=np.array([1, 4]), page_size=16,
                            num_heads=16, latent_dim=512, pos_dim=64, dtype="bf16")
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
        assert (a.smem_optin_per_block, a.max_threads_per_block, a.static_smem_limit, a.regs_per_block,
                a.max_regs_per_thread) == (lim.smem_optin_per_block, lim.max_threads_per_block,
                                           lim.static_smem_limit, lim.regs_per_block, lim.max_regs_per_thread)


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
    tc = [(v.source, v.defines()) for v in variants.VARIANTS if v.kernel in ("paged_prefill_tc", "paged_mla_tc",
                                                                            "paged_mla_wgmma")]
    results = compile_check.check(tc, ("sm_80", "sm_86", "sm_90"), jobs=2,
                                  cache_dir=compile_check.default_cache_dir(), manifest=gate_manifest.load(sample=0))
    mine = ("paged_prefill_tc", "paged_mla_tc", "paged_mla_wgmma")
    bad = [(r.variant, r.kernel, r.arch, r.problems) for r in results
           if not r.ok and (r.kernel in mine or any("cannot launch" in p for p in r.problems))]
    assert not bad, bad
    assert {r.arch for r in results if r.kernel == "paged_mla_wgmma"} == {"sm_90a"}
    assert launchcheck.arch_warnings(results, ("sm_80", "sm_86", "sm_90")) == []
    for r in results:
        if r.kernel in ("paged_prefill_tc", "paged_mla_tc", "paged_mla_wgmma"):
            assert r.smem <= variants.TC_STATIC_SMEM_BUDGET, (r.variant, r.arch, r.smem)
