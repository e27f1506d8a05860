"""The model's primitives on kernels whose speed is known
(``perf_model.validate``, docs/performance.md "Validation"): a vectorized
copy reproduces the copy bandwidth (times the DRAM efficiency of long
runs), an mma.sync loop the mma.sync rate. Consistency checks: both rates
are inputs of the model; what they pin is that its composition (bytes in
flight against Little's law, issue per scheduler, the serial chain, the
tail) costs a kernel that only copies, or only multiplies, nothing more.
NVRTC and a disassembler needed (skipped with the reason otherwise)."""

import pytest

from cupaged.tools import archs, perf_model, sass


def _nvrtc_or_skip():
    try:
        from cupaged._runtime import nvrtc

        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    if not sass.available():
        pytest.skip("nvdisasm / cuobjdump not installed: " + sass.INSTALL_HINT)


def test_copy_and_mma_loop_reproduce_their_rates():
    _nvrtc_or_skip()
    checks = {c.name: c for c in perf_model.validate("sm_90")}
    a = archs.get("sm_90")
    copy = checks["copy"]
    assert copy.binding == "HBM" and copy.ok, copy
    eff = a.figures["dram_eff_long"]
    assert copy.modeled_opt == pytest.approx(eff.opt * a.copy_bw / 1e12, rel=0.03)
    mma = checks["mma.sync loop"]
    assert mma.binding == "tensor" and mma.ok, mma
    assert mma.modeled_opt == pytest.approx(a.figures["mma_sync_flops"].opt / 1e12, rel=0.03)
    assert all(c.kind == "consistency" for c in checks.values())
    text = perf_model.validation_text(list(checks.values()))
    assert "consistency" in text and "NO" not in text.split()
