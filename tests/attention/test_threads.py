"""Attention calls from several threads, and grids checked before the
first launch of a step."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError
from cupaged.ops.attention import variants
from cupaged.testing import assert_close, make_paged_case, reference


def test_threads_sharing_one_workspace_get_their_own_results():
    """Two threads run split-KV attention through ONE SplitWorkspace: each
    call's split kernel and merge run as one step (the workspace's lock), so
    every output is right (61-77 of 300 used to be wrong)."""
    rng = np.random.default_rng(40)
    cases = [
        make_paged_case(
            rng,
            kv_lens=np.array([300, 200], np.int32),
            page_size=16,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=32,
            dtype="f32",
        )
        for _ in range(2)
    ]
    plans = [cupaged.HostPlan.build(c.page_table, c.kv_lens, c.q_lens, 16, c.num_pages).upload(c.q) for c in cases]
    refs = [c.reference(True)[0] for c in cases]
    ws = cupaged.SplitWorkspace(2, 4, 32, 4, cases[0].q)
    wrong, errors = [], []

    def run(i):
        try:
            out = np.zeros((2, 4, 32), np.float32)
            for _ in range(60):
                plans[i].attention(
                    cases[i].q, cases[i].k_cache, cases[i].v_cache, cases[i].scale, workspace=ws, out=out
                )
                if not np.allclose(out, refs[i], atol=5e-5, rtol=5e-5):
                    wrong.append(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1, 0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not wrong, f"{len(wrong)} of 240 outputs wrong"


def test_merge_grid_checked_before_the_split_kernel_runs():
    """A head count the merge's grid cannot hold fails before any launch:
    the split kernels must not run for nothing and leave partials behind."""
    hq, d = 65535 * variants.MERGE_HEADS_PER_BLOCK + 1, 8
    rng = np.random.default_rng(41)
    case = make_paged_case(
        rng, kv_lens=np.array([40], np.int32), page_size=16, num_q_heads=hq, num_kv_heads=1, head_dim=d, dtype="f32"
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    ws = cupaged.SplitWorkspace(1, hq, d, 2, case.q)
    ws.partial_out.fill(3.0)
    ws.partial_lse.fill(3.0)
    out = np.full((1, hq, d), 7, np.float32)
    with pytest.raises(
        PagedAttentionError,
        match=rf"q: expected at most {hq - 1} query heads for the split "
        rf"merge, got {hq}",
    ):
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, workspace=ws, out=out)
    assert (ws.partial_out == 3.0).all() and (ws.partial_lse == 3.0).all() and (out == 7).all()
    # without splits the same call runs
    q8 = case.q[:, :8].copy()
    o = plan.attention(q8, case.k_cache, case.v_cache, case.scale)
    ref, _ = reference.paged_attention(
        q8, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, case.scale, True
    )
    assert_close(o, ref, "f32")
