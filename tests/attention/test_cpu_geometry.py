"""paged_attention's CPU geometry (decode.py CPU_GEOMETRY: one warp a block on the CPU backend, four on a GPU)
and CUPAGED_CPU_GEOMETRY=gpu, which builds and launches the GPU's block shape on the CPU: both against the
float64 reference over decode, GQA tiles, splits and the runtime-dim builds, so the four-warp code (the
cross-warp merge through shared memory) runs in the suite as the GPU runs it.

CPU backend only: the geometry is a build choice of the CPU modules."""

from __future__ import annotations

import numpy as np
import pytest
from attention_helpers import check, run

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import dispatch
from cupaged.errors import PagedAttentionError
from cupaged.ops import attention
from cupaged.ops.attention.kernels import decode, geometry, prefill_simt
from cupaged.testing import make_paged_case


class _Cpu:
    name = "cpu"
    asarray = staticmethod(np.asarray)
    to_numpy = staticmethod(np.asarray)
    xp = np


@pytest.fixture(params=["cpu", "gpu"])
def geometry_mode(request, monkeypatch):
    """The geometry for this test (a fresh in-process kernel table, so no module of the other is reused) and the
    blocks paged_attention launches with."""
    monkeypatch.setenv("CUPAGED_CPU_GEOMETRY", request.param)
    monkeypatch.setattr(dispatch, "_kernels", {})
    assert _cpu.geometry_mode() == request.param
    blocks = []
    real = attention.launch_call

    class Spy:
        def __init__(self, stream):
            self.stream, self.backend = stream, stream.backend

        def launch(self, kernel, grid, block, args, shared_mem=0, dependent=False):
            blocks.append((kernel.name, block[0]))
            return self.stream.launch(kernel, grid, block, args, shared_mem=shared_mem, dependent=dependent)

    monkeypatch.setattr(attention, "launch_call", lambda call, stream=None: real(call, Spy(stream or call.plan.stream)))
    return request.param, blocks


@pytest.mark.parametrize(
    "d, dv, hq, hkv, page_size",
    [
        (64, 64, 9, 3, 16),  # SmolLM2's decode: GROUP_TILE 3
        (128, 128, 8, 1, 5),  # GQA 8, page size 5
        (40, 40, 4, 2, 7),  # D 40: the runtime-dim build (element loads)
        (64, 32, 2, 2, 16),  # D 64, Dv 32: the runtime-dim build with 16-byte loads
    ],
)
def test_decode_in_either_geometry(geometry_mode, d, dv, hq, hkv, page_size):
    mode, blocks = geometry_mode
    want_threads = decode.THREADS if mode == "gpu" else decode.CPU_GEOMETRY["kThreads"]
    rng = np.random.default_rng([d, hq, page_size])
    case = make_paged_case(
        rng,
        kv_lens=np.array([130, 1, 47, 16], np.int32),
        q_lens=np.ones(4, np.int32),
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        head_dim_v=dv,
        dtype="f32",
    )
    for splits in (None, 3):
        o, lse, _ = run(_Cpu, case, True, splits=splits)
        check(case, o, lse, True, "f32", f"geometry {want_threads} threads, splits={splits}")
    seen = {b for name, b in blocks if name == decode.DECODE.name}
    assert seen == {want_threads}, blocks


@pytest.mark.parametrize("d, hq, hkv, page_size", [(64, 9, 3, 16), (128, 4, 1, 5)])
def test_prefill_simt_in_either_geometry(geometry_mode, d, hq, hkv, page_size):
    """paged_prefill_simt (prefill_simt.py CPU_GEOMETRY: one warp, two lanes a row group; the GPU's four warps of
    eight) over causal chunks whose tiles cross the diagonal (the per-row select) and a poisoned cache."""
    mode, blocks = geometry_mode
    want_threads = prefill_simt.THREADS if mode == "gpu" else prefill_simt.CPU_GEOMETRY["kThreads"]
    rng = np.random.default_rng([d, hq, page_size, 7])
    case = make_paged_case(
        rng,
        kv_lens=np.array([150, 37, 64], np.int32),
        q_lens=np.array([150, 20, 33], np.int32),
        page_size=page_size,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        dtype="f32",
    )
    o, lse, _ = run(_Cpu, case, True)
    check(case, o, lse, True, "f32", f"prefill_simt geometry {want_threads} threads")
    seen = {b for name, b in blocks if name == prefill_simt.PREFILL_SIMT.name}
    assert seen == {want_threads}, blocks


def test_the_geometry_header_holds_both_and_the_spec_says_which():
    text = geometry.header()
    cpu, gpu = decode.CPU_GEOMETRY, decode.GEOMETRY
    branch = "#if defined(CUPAGED_CPU) && !defined(CUPAGED_GPU_GEOMETRY)"
    assert branch in text
    inside = text.split(branch, 1)[1].split("#endif", 1)[0]
    cpu_part, gpu_part = inside.split("#else")
    for name, value in cpu.items():
        assert f"constexpr u32 {name} = {value};" in cpu_part
        assert f"constexpr u32 {name} = {gpu[name]};" in gpu_part
    assert cpu["kThreads"] == 32 * cpu["kWarps"] < decode.THREADS


def test_an_unknown_geometry_is_refused(monkeypatch):
    monkeypatch.setenv("CUPAGED_CPU_GEOMETRY", "tpu")
    with pytest.raises(PagedAttentionError, match="CUPAGED_CPU_GEOMETRY: expected 'cpu' or 'gpu', got 'tpu'"):
        _cpu.geometry_mode()
