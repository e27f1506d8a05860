"""The attention kernels' one argument (cupaged/ops/attention/params.py): the
committed header is the generator's, the compiled kernels take a struct of
the size the NumPy dtype packs, and a launch fills every field."""

from __future__ import annotations

import numpy as np

import cupaged
from cupaged._runtime import get_kernel
from cupaged._runtime.source import kernel_dir
from cupaged.ops.attention import AttentionOptions, launch, params, variants
from cupaged.testing import make_paged_case


def test_header_is_generated():
    assert (kernel_dir() / params.HEADER_PATH).read_text() == params.header()
    assert len(set(params.NAMES)) == len(params.FIELDS)
    assert all(params.DTYPE[n] == np.uint64 for n in params.POINTERS)
    assert params.DTYPE.itemsize == 272  # 256 + the query views' four u32 strides


def test_kernels_take_the_struct():
    like = np.zeros(1, np.float16)
    want = f"x{params.DTYPE.itemsize}"
    for v in (
        variants.select_variant("f16", 64, 64, True, 2),
        variants.select_tensor_core("f16", 64, 64, True, True),
        variants.select_tensor_core("f16", 512, 512, True, True, rot_dim=64),
    ):
        fn = get_kernel(like, v.source, v.kernel, v.defines())
        assert fn.param_codes == (want,) and fn.param_types == (params.STRUCT,), v.kernel


def test_launch_fills_every_field(monkeypatch):
    rng = np.random.default_rng(3)
    case = make_paged_case(
        rng, kv_lens=np.array([30, 7], np.int32), page_size=8, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="f32"
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 8, case.num_pages).upload(case.q)
    seen = []

    class Spy:
        backend = plan.stream.backend

        def launch(self, kernel, grid, block, args, shared_mem=0, dependent=False):
            seen.append(args)
            return plan.stream.launch(kernel, grid, block, args, shared_mem=shared_mem, dependent=dependent)

    out = np.zeros((plan.queries, 4, 64), np.float32)
    lse = np.zeros((plan.queries, 4), np.float32)
    launch.launch_attention(
        Spy(), plan, case.q, case.k_cache, case.v_cache, out, AttentionOptions(0.125, False), lse=lse
    )
    ((arg,),) = seen
    v = arg.value
    assert v["q"] == case.q.ctypes.data and v["k_cache"] == case.k_cache.ctypes.data
    assert v["words"] == plan.words.ctypes.data and v["out"] == out.ctypes.data and v["lse"] == lse.ctypes.data
    assert v["q_rot"] == v["k_rot"] == v["part_out"] == v["part_lse"] == 0
    assert (v["queries"], v["q_begin"], v["q_count"], v["sequences"]) == (2, 0, 2, 2)
    assert (v["table_width"], v["page_size"], v["num_pages"]) == (plan.host.table_width, 8, case.num_pages)
    assert (v["q_heads"], v["kv_heads"], v["head_dim"], v["value_dim"], v["rot_dim"]) == (4, 2, 64, 64, 0)
    assert (v["splits"], v["causal"], v["write_lse"], v["scale"]) == (1, 0, 1, np.float32(0.125))
    assert any(r is case.q for r in arg.refs) and any(r is plan.words for r in arg.refs)
    ref_out, ref_lse = case.reference(False)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
