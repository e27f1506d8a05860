"""The gate's launch check (cupaged.tools.launchcheck through
compile_check.check): a selected variant that cannot launch on a compiled
arch fails; archs not compiled (sm_86 / sm_89) are reported as warnings."""

from pathlib import Path

import pytest

from cupaged.tools import compile_check, launchcheck

SMEM = Path(__file__).parents[1] / "runtime" / "kernels" / "gate_smem.cu"


def _nvrtc_or_skip():
    try:
        from cupaged._runtime import nvrtc

        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")


def _selected(dynamic: int, threads: int = 128):
    return [launchcheck.Selected(str(SMEM), (), "reverse_blocks", threads, dynamic, "synthetic probe")]


def test_over_limit_selection_fails_the_gate():
    """200 KiB of dynamic shared memory: over sm_80's 163 KiB opt-in limit,
    under sm_90's 227 KiB."""
    _nvrtc_or_skip()
    results = compile_check.check([(SMEM, {})], ("sm_80", "sm_90"), launches=_selected(200 * 1024))
    by = {r.arch: r for r in results if r.kernel == "reverse_blocks"}
    assert not by["sm_80"].ok and "cannot launch on sm_80" in by["sm_80"].problems[0]
    assert "opt-in limit" in by["sm_80"].problems[0] and "synthetic probe" in by["sm_80"].problems[0]
    assert by["sm_90"].ok
    # within every limit: no problem; not selected at all: no problem
    assert all(r.ok for r in compile_check.check([(SMEM, {})], ("sm_80",), launches=_selected(100 * 1024)))
    assert all(r.ok for r in compile_check.check([(SMEM, {})], ("sm_80",), launches=[]))
    # too many threads fails everywhere
    bad = compile_check.check([(SMEM, {})], ("sm_90",), launches=_selected(0, threads=2048))
    assert not bad[0].ok and "threads" in bad[0].problems[0]


def test_archs_not_compiled_are_warnings():
    _nvrtc_or_skip()
    results = compile_check.check([(SMEM, {})], ("sm_80",), launches=_selected(100 * 1024))
    assert all(r.ok for r in results)
    warn = launchcheck.arch_warnings(results, ("sm_80",), selected=_selected(100 * 1024))
    assert len(warn) == 2 and warn[0].startswith("sm_86:") and warn[1].startswith("sm_89:")
    assert "101376 B opt-in limit" in warn[0]
    assert launchcheck.arch_warnings(results, ("sm_80", "sm_86", "sm_89"), selected=_selected(100 * 1024)) == []


def test_package_selection_is_probed():
    """The probe grid reaches the tensor-core kernels and their dynamic
    shared memory (whatever the kernels' names and sizes are today)."""
    sel = launchcheck.selected_launches()
    assert sel and all(s.threads >= 32 for s in sel)
    assert any(s.dynamic_smem > 48 * 1024 for s in sel)  # an opt-in launch is selected somewhere
