"""Helpers shared by the attention tests: run a case through the public API
and compare with the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged._runtime import archs
from cupaged.ops.attention import variants
from cupaged.testing import as_dtype, assert_close, make_paged_case, reference

DTYPES = ["f32", "f16", "bf16"]


def _to_device(backend, x: np.ndarray):
    if backend.name == "gpu" and as_dtype(x.dtype).name == "bfloat16":
        try:
            return backend.asarray(x)
        except Exception as e:  # CuPy without a bfloat16 dtype
            pytest.skip(f"CuPy cannot hold bfloat16 arrays here: {e}")
    return backend.asarray(x)


def run(backend, case, causal=True, *, splits=None, out=False, return_lse=True, plan=None):
    """Run ``case`` through the public API; returns (out, lse) as NumPy arrays
    (lse None without return_lse) and the device plan."""
    q, k, v = (_to_device(backend, a) for a in (case.q, case.k_cache, case.v_cache))
    if plan is None:
        plan = cupaged.HostPlan.build(
            case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages
        ).upload(q)
    ws = None
    if splits is not None:
        ws = cupaged.SplitWorkspace(plan.queries, q.shape[1], v.shape[3], splits, q)
    kwargs = dict(workspace=ws, return_lse=return_lse)
    if out:
        buf = backend.xp.full((plan.queries, q.shape[1], v.shape[3]), 7, dtype=q.dtype)
        kwargs["out"] = buf
    res = plan.attention(q, k, v, case.scale, causal, **kwargs)
    o, lse = res if return_lse else (res, None)
    if out:
        assert o is kwargs["out"]
    o = backend.to_numpy(o)
    return o, (None if lse is None else backend.to_numpy(lse)), plan


def share_lo(visible: int, splits: int, z: int) -> int:
    """Where split z of a query that sees positions [0, visible) starts (docs/layout.md, "Split-KV")."""
    tile = variants.SPLIT_TILE
    c = (visible + splits - 1) // splits
    c = (c + tile - 1) // tile * tile
    return min(z * c, visible)


def check(case, o, lse, causal, dtype, what=""):
    ref_out, ref_lse = case.reference(causal)
    assert np.isfinite(o.astype(np.float64)).all(), f"{what}: non-finite output"
    assert_close(o, ref_out, dtype, f"{what} out")
    if lse is not None:
        assert lse.dtype == np.float32
        assert_close(lse, ref_lse, dtype, f"{what} lse")


def check_decode_guesses(backend, kernel, rng, lengths, splits_list, dtype, **case_kw):
    """Run decode-kernel cases (``lengths``: (kv_lens, q_lens) pairs) with
    each split count of ``splits_list`` against the reference, counting the
    cold-path markers ``kernel`` runs (CPU backend): a decode kernel guesses
    its query's sequence (its index) and share (a decode step of the plan's
    longest length, docs/layout.md "Split-KV workspace"), and reloads, once a
    warp of every block of a (query, split), the words where the sequence is
    not the index and the page words where, besides, the real share starts
    elsewhere. A decode step of equal lengths takes neither."""
    from cupaged._runtime import get_kernel
    from cupaged.ops.attention import inputs
    from cupaged.tools import counters

    for kv, q_lens in lengths:
        kv_lens, q_lens = np.array(kv, np.int32), np.array(q_lens, np.int32)
        case = make_paged_case(rng, kv_lens=kv_lens, q_lens=q_lens, dtype=dtype, **case_kw)
        q_seq = np.repeat(np.arange(len(q_lens)), q_lens)
        # causal: a query sees its sequence up to its own position (the last of its sequence's new tokens last)
        visible = [int(kv_lens[s]) - int(q_lens[s]) + 1 + int(np.sum(q_seq[:i] == s)) for i, s in enumerate(q_seq)]
        for splits in splits_list:
            _, _, plan = run(backend, case, True, splits=splits)
            la = inputs.attention_call(plan, case.q, case.k_cache, case.v_cache, case.scale, True).launches[0]
            assert la.kernel == kernel
            module = get_kernel(case.q, la.source, la.kernel, la.defines).module
            counters.reset(module)
            o, lse, _ = run(backend, case, True, splits=splits, plan=plan)
            check(case, o, lse, True, dtype, f"kv_lens={kv} q_lens={list(q_lens)} splits={splits}")
            warps = la.head_blocks(case_kw["num_kv_heads"]) * la.block("cpu") // 32  # of a (query, split)'s blocks
            n, want = splits or 1, 0
            for i, s in enumerate(q_seq):
                for z in range(n):
                    wrong_seq = int(s != i)
                    guessed = share_lo(int(kv_lens.max()), n, z)
                    want += warps * (wrong_seq + int(wrong_seq or share_lo(visible[i], n, z) != guessed))
            assert counters.read_all(module)["cold_path"] == want, (kv, list(q_lens), splits)
            if len(set(kv)) == 1 and list(q_seq) == list(range(len(q_seq))):
                assert want == 0  # a decode step of equal lengths: every guess right


# ----------------------------------------------------------------- tensor cores
#
# paged_prefill_tc and paged_mla_tc (f16 / bf16, mma.sync; on the CPU backend
# through the fragment-exact emulation of kernels_cu/ptx.cuh). P is rounded
# to the storage type before O += P V, as in FlashAttention; the dtype
# tolerances cover it.

TC_DTYPES = ["f16", "bf16"]


def check_capture_replay(rng, case, dtype, what):
    """Capture attention with a 2-split workspace on the CPU stream, change
    q's contents, replay: the output must match the reference for the new q."""
    q = case.q.copy()
    heads, dv = q.shape[1], case.v_cache.shape[3]
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, case.page_size, case.num_pages).upload(q)
    out = np.zeros((plan.queries, heads, dv), q.dtype)
    ws = cupaged.SplitWorkspace(plan.queries, heads, dv, 2, q)
    stream = cupaged.stream_for(q)
    stream.begin_capture()
    plan.attention(q, case.k_cache, case.v_cache, case.scale, True, out=out, workspace=ws)
    graph = stream.end_capture()
    q[...] = rng.standard_normal(q.shape).astype(q.dtype)
    graph.launch()
    ref, _ = reference.paged_attention(
        q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, True
    )
    assert_close(out, ref, dtype, what)


def _host(q_lens):
    q_lens = np.array(q_lens)
    return cupaged.HostPlan.build(np.zeros((len(q_lens), 1), np.int32), np.maximum(q_lens, 1), q_lens, 256, 1)


# ----------------------------------------------------------------- mixed steps (segments)
#
# A chunked-prefill step mixing prefill chunks (tensor cores) with decode
# queries of a small group (CUDA-core kernel) runs as segments: one launch
# per contiguous run of sequences, each on its kernel (schedule.tc_segments).

#: The per-query kernel of f16 / bf16 decodes at D 64 / 128 with aligned
#: arrays (variants.select_variant): the tensor-core decode kernel.
DECODE_TC = "paged_decode_tc"
#: The wgmma prefill kernel that sm_90 selects for tensor-core prefill (sm_90a builds; test_prefill_wgmma.py).
PREFILL_WGMMA = "paged_prefill_wgmma"


def tc_prefill_kernel(arch: str | None = None) -> str:
    """The tensor-core prefill kernel selection picks for a 16-bit chunk on
    ``arch`` (default: the arch the CPU backend stands in for,
    ``cpu_arch()``): paged_prefill_wgmma on sm_90, paged_prefill_tc below."""
    v = variants.select_tensor_core("f16", 64, 64, True, True, arch=arch or archs.cpu_arch())
    assert v is not None
    return v.kernel


#: The tensor-core prefill kernel of the CPU backend's arch (the tests that name the kernel a chunk runs on;
#: test_prefill_tc.py runs paged_prefill_tc as sm_80, test_prefill_wgmma.py paged_prefill_wgmma as sm_90).
TC_PREFILL = tc_prefill_kernel()
#: Six decodes, a chunk of 40, six decodes, a chunk of 33: D T D T at G = 4
#: (decode segments on the per-query kernel, chunks on the tensor-core prefill kernel).
Q_MIXED = [1] * 6 + [40] + [1] * 6 + [33]
MIXED_TC = [(DECODE_TC, 0, 6), (TC_PREFILL, 6, 40), (DECODE_TC, 46, 6), (TC_PREFILL, 52, 33)]


def mla_kernel(kernel16: str, fmt: str | None) -> str:
    """The MLA kernel of a cache format on the arch whose 16-bit MLA kernel is
    ``kernel16`` (the ``mla_arch`` fixture's): sm_90 serves fp8 caches with
    paged_mla_wgmma, 16-bit ones with paged_mla_seesaw; below, paged_mla_tc
    serves both."""
    return "paged_mla_wgmma" if fmt is not None and kernel16 == "paged_mla_seesaw" else kernel16
