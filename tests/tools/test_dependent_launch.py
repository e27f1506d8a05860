"""The split merge is a programmatic dependent launch (issue #21: the merge's
launch latency hidden behind the split kernels): launched with
``dependent=True`` (on sm_90 and later ``cuLaunchKernelEx`` with
programmatic stream serialization, tests/runtime/test_gpu_backend.py), its
blocks may start while the last split kernel runs, so its code must wait
(``griddepcontrol.wait``) before any global access; every kernel that can
write split partials lets it start early (``griddepcontrol.launch_dependents``).
Read here in the PTX NVRTC makes for sm_90, and for sm_80, where neither
exists. No GPU."""

from __future__ import annotations

import re

import numpy as np
import pytest

import cupaged
import cupaged.ops  # noqa: F401 (registers every variant)
from cupaged._runtime import nvrtc, registry, source
from cupaged.ops import attention
from cupaged.ops.attention.kernels.merge import MERGE, merge_defines
from cupaged.testing import assert_close, make_paged_case


def _nvrtc_missing() -> str:
    try:
        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
    except Exception as e:  # noqa: BLE001 (no cuda-python / NVRTC / headers here)
        return f"NVRTC unavailable: {e}"
    return ""


needs_nvrtc = pytest.mark.skipif(bool(_nvrtc_missing()), reason=_nvrtc_missing() or "-")

# A memory instruction that may touch global memory: every ld / st / atom / red / cp.async / prefetch but those
# of the parameter, shared, local and constant state spaces.
_GLOBAL = re.compile(r"^\s*(@!?%\w+\s+)?(ld|st|atom|red|cp\.async|prefetch)\.(?!param|shared|local|const)")
_BRANCH = re.compile(r"^\s*(@!?%\w+\s+)?(bra|ret|exit)\b")


def _ptx(stem: str, defines: dict, arch: str) -> str:
    c = nvrtc.compile_source(source.assemble(stem, defines), arch)
    assert c.ok, c.log[-2000:]
    return c.ptx


def _body(ptx: str, name: str) -> list[str]:
    """The lines of entry ``name``'s body."""
    start = ptx.index(f".entry {name}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start : end if end > 0 else len(ptx)].splitlines()


@needs_nvrtc
@pytest.mark.parametrize("sinks", [False, True])
def test_the_merge_waits_for_the_split_grid_before_any_global_access(sinks):
    """sm_90: griddepcontrol.wait comes before every global load, store and
    branch of the merge (nothing it reads or writes is touched before the
    split kernels' grid has completed and its memory is visible); sm_80: no
    griddepcontrol at all."""
    defines = merge_defines("bf16", sinks)
    lines = _body(_ptx(MERGE.source, defines, "compute_90"), MERGE.name)
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    assert waits, "the merge does not wait for the grid before it"
    first = next(i for i, line in enumerate(lines) if _GLOBAL.match(line) or _BRANCH.match(line))
    assert waits[0] < first, lines[first]
    assert "griddepcontrol" not in _ptx(MERGE.source, defines, "compute_80")


@needs_nvrtc
def test_every_kernel_that_writes_partials_lets_the_merge_start():
    """Every attention kernel (each can write split partials) triggers its
    dependents on sm_90 (the merge's blocks then start once every block of
    the split grid has begun, not when the last one exits) and never waits
    itself (an ordinary launch); sm_80 builds hold no griddepcontrol."""
    stems = sorted({stem for stem, _ in registry.all_variants() if stem.startswith("attention/")} - {MERGE.source})
    assert len(stems) == 8, stems
    for stem in stems:
        # the cheapest build of the stem to turn into PTX: fp8 caches, the smallest head dim
        defines = min(
            (d for s, d in registry.all_variants() if s == stem),
            key=lambda d: (str(d.get("CP_KV_DTYPE")) != "e4m3", int(d.get("HEAD_DIM", 0) or 0), len(d)),
        )
        text = _ptx(stem, defines, "compute_90a")
        assert "griddepcontrol.launch_dependents" in text, stem
        assert "griddepcontrol.wait" not in text, stem
    decode = next(d for s, d in registry.all_variants() if s == "attention/decode")
    assert "griddepcontrol" not in _ptx("attention/decode", decode, "compute_80")


def test_the_merge_is_launched_dependent_and_the_split_kernels_are_not(monkeypatch):
    """What launch_call asks of the stream: the split kernels ordinary, the
    merge dependent (the CPU stream runs both in order: the result is the
    reference's)."""
    seen = []
    real = attention.launch_call

    class Spy:
        def __init__(self, stream):
            self.stream, self.backend = stream, stream.backend

        def launch(self, kernel, grid, block, args, shared_mem=0, dependent=False):
            seen.append((kernel.name, dependent))
            return self.stream.launch(kernel, grid, block, args, shared_mem=shared_mem, dependent=dependent)

    monkeypatch.setattr(attention, "launch_call", lambda call, stream=None: real(call, Spy(stream or call.plan.stream)))
    rng = np.random.default_rng(5)
    case = make_paged_case(
        rng, kv_lens=np.array([90, 40], np.int32), page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype="f16"
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    ws = cupaged.SplitWorkspace(plan.queries, 8, 64, 3, case.q)
    out = plan.attention(case.q, case.k_cache, case.v_cache, case.scale, True, workspace=ws)
    assert [d for _, d in seen] == [False] * (len(seen) - 1) + [True] and seen[-1][0] == MERGE.name
    assert_close(out, case.reference(True)[0], "f16")  # the CPU stream ran them in order
