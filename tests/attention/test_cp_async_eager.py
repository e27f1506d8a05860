"""Every tensor-core kernel (paged_decode_tc, paged_prefill_tc,
paged_prefill_wgmma, paged_mla_tc, paged_mla_seesaw)
with cp.async copies landing at issue (CUPAGED_CPU_CP_ASYNC=eager), the
earliest point a GPU allows, against the float64 reference. The rest of the
suite runs them with copies landing at the wait that covers them, the
latest point: a pipeline that refills a shared-memory stage while it is
still being read, or reads a stage before its copies are covered, fails in
one of the two modes (tests/runtime/test_vector_access.py shows a broken
ring failing here and passing there).

CPU backend only: the mode is a build flag of the CPU modules.
"""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import check, run

import cupaged
from cupaged._runtime import cpu as _cpu
from cupaged._runtime import cpu_arch_override, dispatch
from cupaged.testing import assert_close, make_mla_case, make_paged_case, reference

pytestmark = pytest.mark.slow


class _Cpu:
    name = "cpu"
    asarray = staticmethod(np.asarray)
    to_numpy = staticmethod(np.asarray)
    xp = np


@pytest.fixture
def eager(monkeypatch, kernels_used):
    """Kernels built with copies landing at issue for this test (a fresh
    in-process kernel table, so no late-mode module is reused)."""
    monkeypatch.setenv("CUPAGED_CPU_CP_ASYNC", "eager")
    monkeypatch.setattr(dispatch, "_kernels", {})
    assert _cpu.cp_async_mode() == "eager"
    return kernels_used


@pytest.mark.parametrize(
    "dtype, d, hq, hkv, page_size, q_lens",
    [
        ("bf16", 128, 32, 8, 16, [1, 1, 1, 1]),  # the benchmark's GQA 4 decode
        ("f16", 64, 8, 1, 3, [1, 2, 1]),  # GQA 8, page size 3, a 2-query sequence
    ],
)
def test_decode_tc_eager(eager, dtype, d, hq, hkv, page_size, q_lens):
    rng = np.random.default_rng([d, hq, page_size])
    q_lens = np.array(q_lens, np.int32)
    case = make_paged_case(
        rng,
        kv_lens=np.array([130, 47, 16, 75][: len(q_lens)], np.int32),
        q_lens=q_lens,
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype=dtype,
    )
    for causal in (True, False):
        for splits in (None, 3):
            o, lse, _ = run(_Cpu, case, causal, splits=splits)
            check(case, o, lse, causal, dtype, f"eager decode_tc causal={causal} splits={splits}")
    assert "paged_decode_tc" in eager


@pytest.mark.parametrize("arch, kernel", [("sm_80", "paged_prefill_tc"), ("sm_90", "paged_prefill_wgmma")])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_tc_eager(eager, d, arch, kernel):
    rng = np.random.default_rng(d)
    case = make_paged_case(
        rng,
        kv_lens=np.array([95, 41, 130], np.int32),
        q_lens=np.array([80, 16, 33]),
        page_size=16,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=d,
        dtype="bf16",
    )
    with cpu_arch_override(arch):
        for causal in (True, False):
            for splits in (None, 3):
                o, lse, _ = run(_Cpu, case, causal, splits=splits)
                check(case, o, lse, causal, "bf16", f"eager {kernel} causal={causal} splits={splits}")
    assert kernel in eager


@pytest.mark.parametrize("arch, kernel", [("sm_80", "paged_mla_tc"), ("sm_90", "paged_mla_seesaw")])
def test_mla_tc_eager(eager, arch, kernel):
    rng = np.random.default_rng(5)
    case = make_mla_case(
        rng,
        kv_lens=np.array([70, 33], np.int32),
        q_lens=np.array([1, 20]),
        page_size=16,
        num_heads=16,
        latent_dim=512,
        pos_dim=64,
        dtype="bf16",
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    for splits in (None, 2):
        ws = None if splits is None else cupaged.SplitWorkspace(plan.queries, 16, 512, splits, case.q)
        with cpu_arch_override(arch):
            o, lse = plan.mla(
                case.q, case.q_pos, case.latent, case.k_pos, case.scale, True, workspace=ws, return_lse=True
            )
        ref_o, ref_lse = reference.paged_mla(
            case.q, case.q_pos, case.latent, case.k_pos, case.page_table, case.kv_lens, case.q_lens, case.scale, True
        )
        assert_close(o, ref_o, "bf16", f"eager mla out splits={splits}")
        assert_close(lse, ref_lse, "bf16", f"eager mla lse splits={splits}")
    assert kernel in eager
