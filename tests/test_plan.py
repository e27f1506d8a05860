"""HostPlan / DevicePlan / SplitWorkspace: layout and every input error.

Each bad input must raise PagedAttentionError naming the argument, before any
launch, and leave preallocated outputs untouched.
"""

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import HostPlan, PagedAttentionError, SplitWorkspace, layout
from cupaged.layout import HEADER_WORDS, MAGIC, metadata_offsets

BF16 = ml_dtypes.bfloat16


def small_plan(page_size=4, num_pages=6):
    # seq 0: 6 tokens, 2 new; seq 1: 3 tokens, 1 new; seq 2: idle (q_len 0)
    table = [[5, 2, -1], [0, -1, -1], [1, 3, 4]]
    return HostPlan.build(table, [6, 3, 9], [2, 1, 0], page_size, num_pages)


def test_words_follow_layout():
    p = small_plan()
    w = p.words
    assert w.dtype == np.uint32
    assert (p.queries, p.sequences, p.table_width, p.page_size, p.pages) == (3, 3, 3, 4, 6)
    off = metadata_offsets(3, 3)
    assert w[0] == MAGIC and list(w[1:6]) == [3, 3, 3, 4, 6]
    assert list(w[6:11]) == [off[k] for k in ("q_seq", "q_pos", "kv_len", "q_start", "page_table")]
    assert off["q_seq"] == HEADER_WORDS
    assert list(w[off["q_seq"] : off["q_pos"]]) == [0, 0, 1]
    # absolute positions: kv_len - q_len + i
    assert list(w[off["q_pos"] : off["kv_len"]]) == [4, 5, 2]
    assert list(w[off["kv_len"] : off["q_start"]]) == [6, 3, 9]
    assert list(w[off["q_start"] : off["page_table"]]) == [0, 2, 3, 3]
    table = w[off["page_table"] :].reshape(3, 3)
    assert table[0].tolist() == [5, 2, 0xFFFFFFFF]
    assert table[2].tolist() == [1, 3, 4]
    assert len(w) == off["page_table"] + 9


def test_write_slots_and_duplicates():
    p = small_plan()
    pages, offsets = p.write_slots()
    assert pages.tolist() == [2, 2, 0] and offsets.tolist() == [0, 1, 2]
    p.validate_writes()
    # two sequences sharing page 3 and writing the same offset
    shared = HostPlan.build([[3], [3]], [2, 2], [1, 1], 4, 4)
    with pytest.raises(PagedAttentionError, match="both write page 3 offset 1"):
        shared.validate_writes()
    # sharing for reading only is fine
    HostPlan.build([[3, 0], [3, 1]], [5, 5], [1, 1], 4, 4).validate_writes()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_size=0), "page_size: expected an int in 1..256, got 0"),
        (dict(page_size=257), "page_size"),
        (dict(page_size=4.0), "page_size"),
        (dict(num_pages=0), "num_pages"),
        (dict(page_table=[1, 2]), "page_table: expected a 2-D array"),
        (dict(page_table=[[0.5, 1.0]]), "page_table: expected an integer array"),
        (dict(kv_lens=[3, 3]), r"kv_lens: expected shape \[1\]"),
        (dict(q_lens=[[1]]), "q_lens: expected a 1-D array"),
        (dict(kv_lens=[9]), r"kv_lens\[0\]: expected 0..8"),
        (dict(kv_lens=[-1], q_lens=[0]), r"kv_lens\[0\]"),
        (
            dict(q_lens=[2**31]),
            r"q_lens\[0\]: expected 0..2147418112 \(more than kv_lens\[0\]=5 for non-causal "
            r"attention only\), got 2147483648",
        ),
        (dict(q_lens=[-1]), r"q_lens\[0\]"),
        (dict(page_table=[[0, -1]]), r"page_table\[0, 1\]: expected a page id in 0..3"),
        (dict(page_table=[[0, 4]]), r"page_table\[0, 1\]: expected a page id in 0..3 .* got 4"),
        (
            dict(page_table=np.zeros((1, 0), np.int64), kv_lens=[0], q_lens=[0]),
            r"page_table: expected at least one column, got shape \[1, 0\]",
        ),
    ],
)
def test_build_rejects(kwargs, match):
    args = dict(page_table=[[0, 1]], kv_lens=[5], q_lens=[1], page_size=4, num_pages=4)
    args.update(kwargs)
    with pytest.raises(PagedAttentionError, match=match):
        HostPlan.build(**args)


def test_entries_past_length_are_ignored():
    p = HostPlan.build([[2, -7, 10**12]], [3], [1], 4, 4)
    assert p.words[-3:].tolist() == [2, 0xFFFFFFFF, 0xFFFFFFFF]


def test_build_rejects_device_arrays_and_huge_tables():
    class FakeCupy:  # looks like a CuPy array to the backend check
        __module__ = "cupy._core.core"
        data = device = None

    FakeCupy.__module__ = "cupy._core.core"
    with pytest.raises(PagedAttentionError, match="page_table: expected host data"):
        HostPlan.build(FakeCupy(), [1], [1], 4, 4)
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), shape=(2**16 + 1, 2**16), strides=(0, 0))
    with pytest.raises(PagedAttentionError, match="exceed 32-bit indexing"):
        HostPlan.build(huge, np.zeros(2**16 + 1, np.int64), np.zeros(2**16 + 1, np.int64), 4, 4)


def test_build_rejects_lengths_past_what_the_kernels_index():
    """A length the 32-bit words cannot hold (2^32 + 5 would wrap to 5) or
    that reaches past the kernels' 31-bit positions is an error, however wide
    the table."""
    wide = np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), shape=(1, 2**24 + 1), strides=(0, 0))
    for n in (2**32 + 5, layout.MAX_VISIBLE_LEN + 1):
        with pytest.raises(PagedAttentionError, match=rf"kv_lens\[0\]: expected at most {layout.MAX_VISIBLE_LEN}"):
            HostPlan.build(wide, [n], [1], 256, 1)
    ok = HostPlan.build([[0] * 4], [1000], [1], 256, 1)
    assert ok.words[layout.metadata_offsets(1, 1)["kv_len"]] == 1000


def test_choose_splits_with_its_documented_defaults():
    """choose_splits(plan, kv_heads): the plan's own device gives the SM count
    (a HostPlan, or a DevicePlan of the CPU backend: its workers)."""
    from cupaged._runtime import multiprocessor_count

    long = HostPlan.build([[0] * 64], [4096], [1], 64, 1)
    sms = multiprocessor_count(np.zeros(1))
    expect = cupaged.choose_splits(long, 8, multiprocessors=sms)
    assert cupaged.choose_splits(long, 8) == expect
    assert cupaged.choose_splits(long.upload(np.zeros(1, np.float32)), 8) == expect


CHOOSE_SPLITS_BAD = [
    (dict(kv_heads=0), r"kv_heads: expected an int in 1\.\.4294967295, got 0"),
    (dict(kv_heads=-1), r"kv_heads: expected an int in 1\.\.4294967295, got -1"),
    (dict(kv_heads=2.0), r"kv_heads: expected an int in 1\.\.4294967295, got 2\.0"),
    (dict(kv_heads=True), r"kv_heads: expected an int"),
    (dict(kv_heads=2**32), r"kv_heads: expected an int in 1\.\.4294967295, got 4294967296"),
    (dict(multiprocessors=0), r"multiprocessors: expected an int in 1\.\.4294967295, got 0"),
    (dict(multiprocessors=-132), r"multiprocessors: expected an int in 1\.\.4294967295, got -132"),
    (dict(multiprocessors=1.5), r"multiprocessors: expected an int"),
    (dict(q_heads=0, head_dim=128, dtype=BF16), r"q_heads: expected an int in 1\.\.4294967295, got 0"),
    (dict(q_heads=-8, head_dim=128, dtype=BF16), r"q_heads: expected an int in 1\.\.4294967295, got -8"),
    (dict(q_heads=12, head_dim=128, dtype=BF16), r"q_heads: expected a multiple of kv_heads=8, got 12"),
    (dict(q_heads=32, head_dim=0, dtype=BF16), rf"head_dim: expected an int in 1\.\.{layout.MAX_HEAD_DIM}, got 0"),
    (dict(q_heads=32, head_dim=-64, dtype=BF16), r"head_dim: expected an int in 1\.\..*, got -64"),
    (dict(q_heads=32, head_dim=128, value_dim=0, dtype=BF16), r"value_dim: expected an int in 1\.\..*, got 0"),
    (dict(q_heads=32, head_dim=128, value_dim=layout.MAX_HEAD_DIM + 1, dtype=BF16), r"value_dim: expected an int"),
    (
        dict(q_heads=32, head_dim=128, dtype=BF16, rot_dim=-1),
        rf"rot_dim: expected an int in 0\.\.{layout.MAX_ROPE_DIM}, got -1",
    ),
    (dict(q_heads=32, head_dim=128, dtype=BF16, rot_dim=layout.MAX_ROPE_DIM + 1), r"rot_dim: expected an int"),
    (dict(window=0), r"window: expected an int in 1\.\.4294967295, got 0"),
    (dict(window=-5), r"window: expected an int in 1\.\.4294967295, got -5"),
]


@pytest.mark.parametrize("kwargs, match", CHOOSE_SPLITS_BAD)
def test_choose_splits_checks_every_count(kwargs, match):
    """Issue #19 item 7: choose_splits(plan, kv_heads=0 or -1) returned 1;
    every count argument is range-checked, PagedAttentionError naming it
    (with or without the SM count given)."""
    long = HostPlan.build([[0] * 64], [4096], [1], 64, 1)
    kw = dict(kwargs)
    kv_heads = kw.pop("kv_heads", 8)
    for extra in ({}, dict(multiprocessors=132)):
        with pytest.raises(PagedAttentionError, match=match):
            cupaged.choose_splits(long, kv_heads, **{**extra, **kw})


def test_choose_splits_plan_argument():
    with pytest.raises(PagedAttentionError, match="plan: expected a HostPlan or DevicePlan, got list"):
        cupaged.choose_splits([4096], 8, multiprocessors=132)


@pytest.mark.parametrize(
    "args, match",
    [
        ((-1, 4, 8, 2), r"queries: expected an int in 0\.\.4294967295, got -1"),
        ((3, 0, 8, 2), r"heads: expected an int in 1\.\.4294967295, got 0"),
        ((3, -4, 8, 2), r"heads: expected an int in 1\.\.4294967295, got -4"),
        ((3, 4, 0, 2), rf"value_dim: expected an int in 1\.\.{layout.MAX_HEAD_DIM}, got 0"),
        ((3, 4, layout.MAX_HEAD_DIM + 1, 2), r"value_dim: expected an int"),
        ((3, 4, 8, -2), r"splits: expected an int in 1\.\."),
        ((3.0, 4, 8, 2), r"queries: expected an int"),
        ((3, 4, 8, True), r"splits: expected an int"),
    ],
)
def test_split_workspace_checks_every_count(args, match):
    with pytest.raises(PagedAttentionError, match=match):
        SplitWorkspace(*args, np.zeros(1, np.float32))


def test_choose_splits_rule():
    """Splits fill the device's resident slots (blocks per SM the kernel is
    built for x SMs) in one wave: slots // blocks, at most MAX_SPLITS and
    one split per 256 tokens; none when the grid already fills the slots.
    Without shapes the per-query kernels' floor (paged_attention's 2) counts."""
    from cupaged.ops.attention.variants import RESIDENT_BLOCKS

    per_sm = RESIDENT_BLOCKS["paged_attention"]
    long = HostPlan.build([[0] * 64], [4096], [1], 64, 1)
    # 1 query x 8 kv heads = 8 blocks; 2 x 132 slots -> 264 // 8 = 33, but 4096 / 256 = 16
    assert cupaged.choose_splits(long, 8, multiprocessors=132) == min(per_sm * 132 // 8, 16) == 16
    assert cupaged.choose_splits(long, 1, multiprocessors=1000) == 16
    short = HostPlan.build([[0] * 4], [200], [1], 64, 1)
    assert cupaged.choose_splits(short, 8, multiprocessors=132) == 1
    many = HostPlan.build([[0] * 64] * 64, [4096] * 64, [1] * 64, 64, 1)
    assert cupaged.choose_splits(many, 8, multiprocessors=132) == 1  # 512 blocks fill 264 slots
    assert cupaged.choose_splits(many, 1, multiprocessors=132) == per_sm * 132 // 64 == 4


def test_choose_splits_from_the_kernel_that_runs():
    """With shapes, the blocks and the resident slots are those of the
    launches that will run: paged_decode_tc (6 blocks per SM) at batch 1,
    ctx 32k, 32/8 heads gets MAX_SPLITS (512 blocks in 792 slots, one
    wave); at batch 64 (512 blocks) none; f32 runs paged_attention (2 per SM)."""
    from cupaged.ops.attention.variants import RESIDENT_BLOCKS

    b1 = HostPlan.build(np.arange(2048).reshape(1, 2048), [32768], [1], 16, 2048)
    split = cupaged.choose_splits(b1, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype=BF16)
    # paged_decode_tc: 2 blocks of four KV heads, one resident a SM (six one-head blocks' registers)
    assert split == min(cupaged.MAX_SPLITS, RESIDENT_BLOCKS["paged_decode_tc"] // 4 * 132 // 2) == 64
    assert (
        cupaged.choose_splits(b1, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype=np.float32)
        == RESIDENT_BLOCKS["paged_attention"] * 132 // 8
        == 33
    )
    for arch in ("sm_80", "sm_90"):  # the decode kernel runs on either: the same answer
        assert cupaged.choose_splits(b1, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype=BF16, arch=arch) == 64
    b64 = HostPlan.build(np.arange(64 * 256).reshape(64, 256), [4096] * 64, [1] * 64, 16, 64 * 256)
    assert cupaged.choose_splits(b64, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype=BF16) == 1
    b16 = HostPlan.build(np.arange(16 * 256).reshape(16, 256), [4096] * 16, [1] * 16, 16, 16 * 256)
    # 32 blocks of four KV heads, 132 slots (one a SM): 4 splits (128 blocks, one wave)
    assert cupaged.choose_splits(b16, 8, multiprocessors=132, q_heads=32, head_dim=128, dtype=BF16) == 4


def test_choose_splits_counts_the_grid_of_the_kernel_that_runs():
    # MLA decode, 64 queries x 16 heads: the tensor-core kernel serves 4 queries x 16 heads per block,
    # so the unsplit grid is 16 blocks, not 64; it is built for RESIDENT_BLOCKS["paged_mla_tc"] blocks per SM.
    from cupaged.ops.attention.variants import RESIDENT_BLOCKS

    plan = HostPlan.build(np.arange(64 * 64).reshape(64, 64) % 4096, [4000] * 64, [1] * 64, 64, 4096)
    from cupaged.ops.attention import unsplit_blocks

    assert unsplit_blocks(plan, 16, 1, 512, 512, "bf16", rot_dim=64) == 16
    assert cupaged.choose_splits(plan, 1, multiprocessors=132, q_heads=16, head_dim=512, dtype=BF16, rot_dim=64) == min(
        RESIDENT_BLOCKS["paged_mla_tc"] * 132 // 16, 16
    )
    assert cupaged.choose_splits(plan, 1, multiprocessors=132) == RESIDENT_BLOCKS["paged_attention"] * 132 // 64
    # f32 stays on the CUDA-core kernel: one block per query and tile of 2 heads (R = 512)
    assert unsplit_blocks(plan, 16, 1, 512, 512, np.float32, rot_dim=64) == 64 * 8
    with pytest.raises(PagedAttentionError, match="head_dim, dtype"):
        cupaged.choose_splits(plan, 1, multiprocessors=132, q_heads=16)


def test_choose_splits_mla_no_splits_when_the_grid_covers_the_sms():
    """MLA at H 128 (two head tiles of 64 a query): batch 64 and 128 fill the
    SMs at the kernel's resident blocks, so no split (issue #11), whichever
    MLA kernel the arch runs (paged_mla_tc, or paged_mla_wgmma on sm_90)."""
    from cupaged.ops.attention.variants import RESIDENT_BLOCKS

    for batch in (64, 128):
        plan = HostPlan.build(np.arange(batch * 64).reshape(batch, 64), [4096] * batch, [1] * batch, 64, batch * 64)
        blocks = unsplit_blocks_of(plan)
        slots = RESIDENT_BLOCKS["paged_mla_tc"] * 132
        assert max(1, slots // blocks if blocks < slots else 1) == 1
        for arch in (None, "sm_80", "sm_90"):
            assert (
                cupaged.choose_splits(
                    plan, 1, multiprocessors=132, q_heads=128, head_dim=512, dtype=BF16, rot_dim=64, arch=arch
                )
                == 1
            ), (batch, arch)


def unsplit_blocks_of(plan):
    from cupaged.ops.attention import unsplit_blocks

    return unsplit_blocks(plan, 128, 1, 512, 512, "bf16", rot_dim=64)


# ---------------------------------------------------------------------------
# DevicePlan.attention input errors (nothing launched, nothing written)


def _case(dtype=np.float32, hq=4, hkv=2, d=8, dv=8):
    plan = small_plan().upload(np.zeros(1, np.float32))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, hq, d)).astype(dtype)
    k = rng.standard_normal((6, 4, hkv, d)).astype(dtype)
    v = rng.standard_normal((6, 4, hkv, dv)).astype(dtype)
    out = np.full((3, hq, dv), 7, dtype)
    return plan, q, k, v, out


def _bad(plan, q, k, v, out, match, **kw):
    before = out.copy()
    scale = kw.pop("scale", 0.5)
    with pytest.raises(PagedAttentionError, match=match):
        plan.attention(q, k, v, scale, out=out, **kw)
    np.testing.assert_array_equal(out.view(np.uint8), before.view(np.uint8))


def test_attention_rank_errors():
    plan, q, k, v, out = _case()
    _bad(plan, q[0], k, v, out, "q: expected a 3-D array")
    _bad(plan, q, k[0], v, out, "k_cache: expected a 4-D array")
    _bad(plan, q, k, v[..., 0], out, "v_cache: expected a 4-D array")
    _bad(plan, q, k, v, out[0], "out: expected a 3-D array")


def test_attention_dtype_and_layout_errors():
    plan, q, k, v, out = _case()
    _bad(plan, q.astype(np.int32), k, v, out, "q: expected dtype float32, float16 or bfloat16, got int32")
    _bad(plan, q, k.astype(np.float16), v, out, "k_cache: expected dtype float32 like q, got float16")
    _bad(plan, q, k, v.astype(BF16), out, "v_cache: expected dtype float32 like q, got bfloat16")
    _bad(plan, q, k, v, out.astype(np.float16), "out: expected dtype float32 like q")
    qf = np.asfortranarray(q)  # its last dim strided (a head-major view, e.g., passes: any row view does)
    _bad(plan, qf, k, v, out, "q: expected a contiguous innermost dim")
    _bad(plan, q.tolist(), k, v, out, "q: expected a NumPy or CuPy array")


def test_attention_shape_errors():
    plan, q, k, v, out = _case(hq=3, hkv=2)
    _bad(plan, q, k, v, out, "q: expected a head count that is a multiple of the caches' 2 KV heads, got Hq=3")
    plan, q, k, v, out = _case()
    _bad(plan, q[:, :, :4].copy(), k, v, out, "k_cache: expected head dim D=4 like q")
    _bad(plan, q, k, v, out[:, :, :4].copy(), r"out: expected shape \[3, 4, 8\], got \[3, 4, 4\]")
    _bad(plan, q[:2].copy(), k, v, out, r"q: expected 3 rows \(plan.queries\)")
    _bad(plan, q, k[:5].copy(), v, out, r"k_cache: expected shape \[6, 4, ...\]")
    _bad(plan, q, k, v[:, :2].copy(), out, r"v_cache: expected shape \[6, 4, ...\]")
    _bad(plan, q, k, v[:, :, :1].copy(), out, r"v_cache: expected shape \[6, 4, 2, Dv\] like k_cache")
    plan, q, k, v, out = _case(d=1025)
    _bad(plan, q, k, v, out, "D: expected a head dim in 1..1024, got 1025")


@pytest.mark.parametrize(
    "scale", [0.0, -1.0, float("nan"), float("inf"), "x", "0.5", True, np.bool_(True), None, np.array([0.5])]
)
def test_attention_scale_errors(scale):
    plan, q, k, v, out = _case()
    _bad(plan, q, k, v, out, "scale: expected a finite float > 0", scale=scale)


@pytest.mark.parametrize("causal", ["no", "yes", 1, 0, None, np.array([True])])
def test_attention_causal_must_be_a_bool(causal):
    """causal="no" used to mean True: only a bool is taken."""
    plan, q, k, v, out = _case()
    _bad(plan, q, k, v, out, "causal: expected True or False", causal=causal)


def test_attention_takes_numpy_scalars():
    plan, q, k, v, out = _case()
    plan.attention(q, k, v, np.float32(0.5), np.bool_(False), out=out)
    plan.attention(q, k, v, 1, True, out=out)


def test_attention_overlap_and_backend_errors():
    plan, q, k, v, out = _case(d=8, dv=8)
    _bad(plan, q, k, v, q, "out: expected memory disjoint from q")
    flat = np.zeros(6 * 4 * 2 * 8 + 3 * 4 * 8, np.float32)
    kk = flat[: 6 * 4 * 2 * 8].reshape(6, 4, 2, 8)
    oo = flat[-3 * 4 * 8 - 8 : -8].reshape(3, 4, 8)
    _bad(plan, q, kk, v, oo, "out: expected memory disjoint from k_cache")
    lse = np.zeros((3, 4), np.float64)
    _bad(plan, q, k, v, out, "lse: expected a C-contiguous float32 array", lse=lse)


def test_attention_u32_errors():
    plan, q, k, v, out = _case()
    big = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(3, 2**20, 2**12), strides=(2**34, 2**14, 4))
    _bad(plan, big, k, v, out, "q: .* elements exceed 32-bit indexing")


def test_workspace_errors():
    plan, q, k, v, out = _case()
    like = np.zeros(1, np.float32)
    _bad(
        plan,
        q,
        k,
        v,
        out,
        r"workspace: expected queries, heads, value_dim = \(3, 4, 8\), got \(3, 4, 16\)",
        workspace=SplitWorkspace(3, 4, 16, 2, like),
    )
    _bad(plan, q, k, v, out, "workspace: expected a SplitWorkspace", workspace=object())
    with pytest.raises(PagedAttentionError, match=f"splits: expected an int in 1..{cupaged.MAX_SPLITS}"):
        SplitWorkspace(3, 4, 8, cupaged.MAX_SPLITS + 1, like)
    with pytest.raises(PagedAttentionError, match="splits"):
        SplitWorkspace(3, 4, 8, 0, like)
    with pytest.raises(PagedAttentionError, match="like: expected a NumPy or CuPy array"):
        SplitWorkspace(3, 4, 8, 2, [1.0])


# ---------------------------------------------------------------------------
# DevicePlan.mla input errors


def _mla_case(h=4, r=16, p=8):
    plan = small_plan().upload(np.zeros(1, np.float32))
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, h, r)).astype(np.float32)
    qp = rng.standard_normal((3, h, p)).astype(np.float32)
    lat = rng.standard_normal((6, 4, 1, r)).astype(np.float32)
    kp = rng.standard_normal((6, 4, 1, p)).astype(np.float32)
    out = np.full((3, h, r), 7, np.float32)
    return plan, q, qp, lat, kp, out


def _bad_mla(plan, q, qp, lat, kp, out, match, **kw):
    before = out.copy()
    with pytest.raises(PagedAttentionError, match=match):
        plan.mla(q, qp, lat, kp, kw.pop("scale", 0.1), out=out, **kw)
    np.testing.assert_array_equal(out, before)


def test_mla_errors():
    plan, q, qp, lat, kp, out = _mla_case()
    _bad_mla(plan, q, qp, np.repeat(lat, 2, axis=2), kp, out, r"latent: expected one shared head")
    _bad_mla(plan, q, qp, lat, np.repeat(kp, 2, axis=2), out, r"k_rot: expected one shared head")
    _bad_mla(plan, q, qp[:, :2].copy(), lat, kp, out, r"q_rot: expected shape \[3, 4, P\] like q")
    _bad_mla(plan, q, qp, lat, kp[..., :4].copy(), out, "k_rot: expected rotary dim P=8 like q_rot")
    # zero-width q_rot / k_rot are P = 0 like None (issue #19 item 12, tests/attention/test_mla.py); beside a
    # real rotary part they are refused
    _bad_mla(
        plan,
        q,
        qp[..., :0].copy(),
        lat,
        kp,
        out,
        r"q_rot, k_rot: expected both or neither .*got q_rot shape \[3, 4, 0\] and k_rot shape",
    )
    _bad_mla(
        plan,
        q,
        qp,
        lat,
        kp[..., :0].copy(),
        out,
        r"q_rot, k_rot: expected both or neither .*got q_rot shape \[3, 4, 8\] and k_rot shape",
    )
    plan2, q2, qp2, lat2, kp2, out2 = _mla_case(p=257)
    _bad_mla(plan2, q2, qp2, lat2, kp2, out2, "q_rot: expected a rotary dim P in 1..256, got 257")
    _bad_mla(plan, q, qp, lat[..., :8].copy(), kp, out, "latent: expected R=16 like q")
    _bad_mla(plan, q, qp, lat, kp, out[..., :8].copy(), r"out: expected shape \[3, 4, 16\]")
    _bad_mla(plan, q, qp.astype(np.float16), lat, kp, out, "q_rot: expected dtype float32 like q")
    _bad_mla(plan, q, qp, lat, kp, out, "scale", scale=float("nan"))
    _bad_mla(plan, q[:1].copy(), qp[:1].copy(), lat, kp, out, r"q: expected 3 rows")
    _bad_mla(plan, q, qp, lat[:5].copy(), kp, out, r"latent: expected shape \[6, 4, ...\]")
