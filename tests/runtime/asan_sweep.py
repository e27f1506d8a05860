"""Every kernel family on padded and absurd device metadata, meant to run
under the CPU backend's AddressSanitizer build (tests/test_asan_kernels.py):

    CUPAGED_CPU_ASAN=1 LD_PRELOAD=$(g++ -print-file-name=libasan.so) \
        ASAN_OPTIONS=detect_leaks=0 python tests/runtime/asan_sweep.py

Arrays are NumPy buffers sized exactly, so a read or write past any of them
is a heap-buffer-overflow report. Prints one line per family, then "done".
``asan_sweep.py SHARD COUNT`` runs families SHARD, SHARD + COUNT, ... only
(the test runs two shards at once, one a core).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupaged  # noqa: E402
from cupaged._runtime import cpu_arch_override  # noqa: E402
from cupaged.cache import PagedKVCache  # noqa: E402
from cupaged.layout import metadata_offsets  # noqa: E402
from cupaged.ops import layers  # noqa: E402
from cupaged.ops.advance import SlotBuffers, advance_plan, advance_slots  # noqa: E402
from cupaged.ops.append import copy_pages as launch_copy_pages  # noqa: E402
from cupaged.ops.append import launch_write_slots  # noqa: E402
from cupaged.testing import make_mla_case, make_paged_case, reference  # noqa: E402

rng = np.random.default_rng(0)


def garble(plan, keep_seq=False):
    """Absurd lengths, positions, sequence indices and page ids in the words."""
    off = metadata_offsets(plan.queries, plan.sequences)
    w = plan.words
    w[off["kv_len"] : off["q_start"]] = 0xFFFFFFFF
    n = off["kv_len"] - off["q_pos"]
    pos = rng.integers(0, 2**32, n, dtype=np.uint64)
    pos[1::2] = rng.integers(0, plan.table_width * plan.page_size, pos[1::2].size)  # in range: pages are read
    w[off["q_pos"] : off["kv_len"]] = pos
    if not keep_seq:
        w[off["q_seq"]] = 0xFFFFFFFF
    table = rng.integers(0, 2**32, w.size - off["page_table"], dtype=np.uint64)
    table[::3] = plan.pages - 1
    w[off["page_table"] :] = table.astype(np.uint32)


def score_features(heads):
    """Every score variant on (soft cap, window, sinks, ALiBi slopes): arrays of exactly [heads]."""
    return dict(
        soft_cap=3.0,
        window=5,
        sinks=rng.standard_normal(heads).astype(np.float32),
        alibi_slopes=rng.random(heads).astype(np.float32),
    )


def attention(dtype, d, q_lens, heads, kv_heads, splits, features=None, kv_lens=None):
    q_lens = np.array(q_lens)
    kv = (q_lens + 9) if kv_lens is None else np.array(kv_lens)
    case = make_paged_case(
        rng,
        kv_lens=kv.astype(np.int32),
        q_lens=q_lens,
        page_size=4,
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        dtype=dtype,
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, max(case.num_pages, 1)).upload(case.q)
    ws = cupaged.SplitWorkspace(plan.queries, heads, d, splits, case.q) if splits > 1 else None
    out = np.empty((plan.queries, heads, d), case.q.dtype)
    kw = features or {}
    causals = (True, False) if plan.host.causal_ok else (False,)
    plan.attention(
        case.q, case.k_cache, case.v_cache, case.scale, causals[0], out=out, return_lse=True, workspace=ws, **kw
    )
    for causal in causals:
        garble(plan)
        plan.attention(
            case.q, case.k_cache, case.v_cache, case.scale, causal, out=out, return_lse=True, workspace=ws, **kw
        )
        garble(plan, keep_seq=True)
        plan.attention(case.q, case.k_cache, case.v_cache, case.scale, causal, out=out, workspace=ws, **kw)


def mla(dtype, heads, q_lens, features=None):
    case = make_mla_case(
        rng,
        kv_lens=np.array([40, 9], np.int32),
        q_lens=np.array(q_lens),
        page_size=16,
        num_heads=heads,
        latent_dim=512,
        pos_dim=64,
        dtype=dtype,
    )
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    kw = features or {}
    for splits in (1, 3):
        ws = cupaged.SplitWorkspace(plan.queries, heads, 512, splits, case.q) if splits > 1 else None
        plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, True, workspace=ws, return_lse=True, **kw)
        garble(plan)
        plan.mla(case.q, case.q_pos, case.latent, case.k_pos, case.scale, False, workspace=ws, return_lse=True, **kw)


def _fp8(a, fmt):
    return reference.quantize_fp8(a, fmt) if fmt else a


def _view(c, view):
    """An exactly sized buffer holding cache ``c`` in layout ``view``: "hnd" (a
    [pages, Hkv, page_size, D] array, transposed), "misaligned" (one element
    past the buffer's start: element loads), else c itself."""
    if view == "hnd":
        return np.ascontiguousarray(c.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    if view == "misaligned":
        buf = np.empty(c.size + 1, c.dtype)
        out = buf[1:].reshape(c.shape)
        out[...] = c
        return out
    return c


def storage(fmt, view, dtype, d, q_lens, heads, kv_heads, splits, features=None):
    """Attention over an fp8 (``fmt``: e4m3 / e5m2, per-head scales) and / or
    strided cache (``view``: hnd, combined, misaligned), garbled metadata."""
    q_lens = np.array(q_lens)
    case = make_paged_case(
        rng,
        kv_lens=(q_lens + 9).astype(np.int32),
        q_lens=q_lens,
        page_size=4,
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        dtype=dtype,
    )
    k, v = _fp8(case.k_cache, fmt), _fp8(case.v_cache, fmt)
    if view == "combined":
        kv = np.stack([k, v], axis=1)
        k, v = kv[:, 0], kv[:, 1]
    else:
        k, v = _view(k, view), _view(v, view)
    kw = dict(features or {})
    if fmt:
        kw.update(k_scale=rng.random(kv_heads).astype(np.float32), v_scale=rng.random(1).astype(np.float32))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 4, case.num_pages).upload(case.q)
    ws = cupaged.SplitWorkspace(plan.queries, heads, d, splits, case.q) if splits > 1 else None
    out = np.empty((plan.queries, heads, d), case.q.dtype)
    plan.attention(case.q, k, v, case.scale, True, out=out, return_lse=True, workspace=ws, **kw)
    for causal in (True, False):
        garble(plan)
        plan.attention(case.q, k, v, case.scale, causal, out=out, return_lse=True, workspace=ws, **kw)


def mla_storage(fmt, rope):
    """MLA on column views of one [pages, page_size, 1, 576] cache (fp8 or
    bf16), or without a rotary part (P = 0), garbled metadata."""
    case = make_mla_case(
        rng,
        kv_lens=np.array([40, 9], np.int32),
        q_lens=np.array([1, 3]),
        page_size=16,
        num_heads=16,
        latent_dim=512,
        pos_dim=64,
        dtype="bf16",
    )
    c = np.concatenate([_fp8(case.latent, fmt), _fp8(case.k_pos, fmt)], axis=-1)
    latent, k_pos = c[..., :512], (c[..., 512:] if rope else None)
    q_pos = case.q_pos if rope else None
    kw = {}
    if fmt:
        kw = dict(k_scale=np.float32([0.5]), v_scale=np.float32([2.0])) if rope else dict(k_scale=np.float32([0.5]))
    plan = cupaged.HostPlan.build(case.page_table, case.kv_lens, case.q_lens, 16, case.num_pages).upload(case.q)
    for splits in (1, 3):
        ws = cupaged.SplitWorkspace(plan.queries, 16, 512, splits, case.q) if splits > 1 else None
        plan.mla(case.q, q_pos, latent, k_pos, case.scale, True, workspace=ws, return_lse=True, **kw)
        garble(plan)
        plan.mla(case.q, q_pos, latent, k_pos, case.scale, False, workspace=ws, return_lse=True, **kw)


def mla_storage_on(arch, *args):
    with cpu_arch_override(arch):
        mla_storage(*args)


def mla_on(arch, *args):
    with cpu_arch_override(arch):
        mla(*args)


def append_and_pages():
    cache = PagedKVCache(6, 4, 2, 8, "f16")
    a = cache.add_sequence()
    plan, _ = cache.prepare([a], [7])
    new = rng.standard_normal((7, 2, 8)).astype(np.float16)
    cache.append(plan, new, new)
    b = cache.fork(a)
    plan, _ = cache.prepare([a, b], [1, 1])  # copy-on-write of the shared last page
    cache.append(plan, new[:2], new[:2])
    garble(plan)
    plan.append(new[:2], new[:2], cache.k[0], cache.v[0])
    # the rotary builds on the garbled words: positions past the 5-row tables, bad sequences and pages
    cos = np.ones((5, 4), np.float32)
    q = rng.standard_normal((2, 3, 8)).astype(np.float16)
    plan.append(new[:2], new[:2], cache.k[0], cache.v[0], rope=cupaged.Rotary(cos, cos, q))
    wn = np.ones(8, np.float16)
    plan.append(new[:2], new[:2], cache.k[0], cache.v[0], rope=cupaged.Rotary(cos, cos, q, q_norm=wn, k_norm=wn))
    bias = dict(
        q_bias=np.ones((3, 8), np.float16), k_bias=np.ones((2, 8), np.float16), v_bias=np.ones((2, 8), np.float16)
    )
    plan.append(new[:2], new[:2], cache.k[0], cache.v[0], rope=cupaged.Rotary(cos, cos, q, v_norm=wn, **bias))
    k8 = np.zeros(cache.k[0].shape, np.uint8)
    plan.append(new[:2], new[:2], k8, k8.copy(), kv_dtype="e4m3", rope=cupaged.Rotary(cos, cos, q))
    lat = rng.standard_normal((2, 1, 16)).astype(np.float16)
    plan.append(
        lat,
        new[:2, :1],
        np.zeros((6, 4, 1, 16), np.float16),
        np.zeros((6, 4, 1, 8), np.float16),
        rope=cupaged.Rotary(cos, cos, q, side="v", k_norm=np.ones(16, np.float16)),
    )
    advance_plan(plan)


def engine_kernels():
    """Layered page copies, writes by slot mapping and the slot advance, on
    ids, slots and state words no check would let through (the kernels skip
    them: the host checks are bypassed here)."""
    cache = PagedKVCache(6, 4, 2, 8, "f16", layers=3)
    stream = cupaged.stream_for(cache.k)
    bad_pairs = np.array([[0, 5], [2**31, 1], [1, 0xFFFFFFFF], [3, 3]], np.uint32)
    launch_copy_pages(stream, cache.k, cache.v, bad_pairs, len(bad_pairs))
    new = rng.standard_normal((4, 2, 8)).astype(np.float16)
    launch_write_slots(stream, new, new, cache.k[2], cache.v[2], np.array([-5, 24, 2**40, 23], np.int64), 4)
    a = cache.add_sequence()
    plan, _ = cache.prepare([a], [3], reserve=2)
    slots = SlotBuffers(plan.words, 1, stop_ids=[3, 7], ring_rows=2)
    for fill in (0xFFFFFFFF, 1):
        slots.words[:] = fill
        garble(plan)
        advance_slots(plan, slots, np.array([3], np.int64), full_finishes=True)
        advance_slots(plan, slots, np.array([9], np.int64))


def small_ops():
    logits = rng.standard_normal((3, 1001)).astype(np.float32)
    cupaged.argmax_into(logits, np.empty(3, np.int64))
    table = rng.standard_normal((10, 16)).astype(np.float32)
    x = np.empty((4, 16), np.float32)
    layers.embed(np.array([0, 9, -5, 10**12], np.int64), table, x)
    layers.rms_norm(x, table[0], x)
    y = np.empty((4, 10), np.float32)
    layers.linear(x, table, y)
    cos = np.ones((5, 4), np.float32)
    layers.rope(x.reshape(4, 2, 8), np.array([0, 4, 5, 2**31], np.uint32), cos, cos)
    layers.silu_mul(x, np.empty((4, 8), np.float32))


def plan_build_on_absurd_metadata():
    """The device plan builder on query starts, lengths and block ids no check would let through (a strided
    block table of vLLM's kind), then attention over each plan it wrote: every array sized exactly."""
    builder = cupaged.DevicePlanBuilder(9, 4, 3, 4, 7, np.zeros(1, np.float32))
    k = rng.standard_normal((7, 4, 2, 16)).astype(np.float32)
    q = rng.standard_normal((9, 4, 16)).astype(np.float32)
    for n in (0, 1, 4):
        for _ in range(3):
            qsl = rng.integers(-(2**31), 2**31, n + 1).astype(np.int32)
            qsl[: n + 1 : 2] = np.sort(rng.integers(0, 12, len(qsl[: n + 1 : 2])))  # sometimes in range
            lens = rng.integers(-(2**31), 2**31, n).astype(np.int32)
            lens[::2] = rng.integers(0, 14, lens[::2].size)
            table = rng.integers(-(2**31), 2**31, (n, 5)).astype(np.int32)[:, 1:4]
            table[:, ::2] = rng.integers(0, 8, table[:, ::2].shape)
            plan = builder.build(qsl, lens, np.ascontiguousarray(table) if n == 1 else table)
            plan.attention(q, k, k, 0.25)
            plan.attention(q, k, k, 0.25, causal=False)


SHARD, COUNT = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) == 3 else (0, 1)
for i, (name, fn) in enumerate(
    [
        ("attention f32 d64 decode, splits 4", lambda: attention("f32", 64, [1, 1, 1], 4, 2, 4)),
        ("attention f16 d96 prefill", lambda: attention("f16", 96, [5, 1, 7], 2, 1, 1)),
        ("attention f16 d64 tensor-core prefill, splits 3", lambda: attention("f16", 64, [16, 20, 17], 2, 1, 3)),
        ("attention bf16 d128 tensor-core decode, splits 3", lambda: attention("bf16", 128, [1, 1, 2], 8, 2, 3)),
        ("attention f16 d64 tensor-core decode, 3-query sequence", lambda: attention("f16", 64, [1, 3, 1], 4, 1, 1)),
        (
            "attention f16 d64 mixed step (segmented launches), splits 3",
            lambda: attention("f16", 64, [1] * 6 + [40] + [1] * 6 + [33], 8, 2, 3),
        ),
        ("mla bf16 tensor-core, the wgmma seesaw (the CPU as sm_90)", lambda: mla("bf16", 16, [1, 3])),
        ("mla f16 tensor-core, mma.sync (the CPU as sm_80)", lambda: mla_on("sm_80", "f16", 16, [2, 3])),
        # Score variants (soft cap, window, sinks, ALiBi all on) on every family, garbled positions included;
        # a non-causal plan whose queries outnumber their keys, with a sequence without keys.
        (
            "score variants: attention f32 d64 decode, splits 4",
            lambda: attention("f32", 64, [1, 1, 1], 4, 2, 4, score_features(4)),
        ),
        (
            "score variants: attention bf16 d128 tensor-core decode, splits 3",
            lambda: attention("bf16", 128, [1, 1, 2], 8, 2, 3, score_features(8)),
        ),
        (
            "score variants: attention f16 d64 tensor-core prefill, splits 3",
            lambda: attention("f16", 64, [16, 20, 17], 2, 1, 3, score_features(2)),
        ),
        (
            "score variants: attention f32 d64 row-packed prefill (paged_prefill_simt), splits 3",
            lambda: attention("f32", 64, [16, 20, 17], 2, 1, 3, score_features(2)),
        ),
        (
            "score variants: mla bf16 wgmma (sm_90), mla f16 mma.sync (sm_80)",
            lambda: (
                mla("bf16", 16, [1, 3], score_features(16)),
                mla_on("sm_80", "f16", 16, [2, 3], score_features(16)),
            ),
        ),
        (
            "queries outnumbering keys (non-causal), a sequence without keys, f16 d64 tensor-core prefill",
            lambda: attention("f16", 64, [20, 3, 18], 4, 2, 3, score_features(4), kv_lens=[5, 0, 30]),
        ),
        # Cache storage: fp8 caches (per-head scales) and strided views, on the kernels that read them.
        ("fp8 e4m3: attention f16 d64 decode, splits 3", lambda: storage("e4m3", "nhd", "f16", 64, [1, 1, 1], 8, 2, 3)),
        (
            "fp8 e5m2 HND view: attention bf16 d128 prefill, score variants, splits 2",
            lambda: storage("e5m2", "hnd", "bf16", 128, [5, 1, 18], 4, 2, 2, score_features(4)),
        ),
        (
            "combined KV tensor: attention f16 d64 prefill, splits 3",
            lambda: storage(None, "combined", "f16", 64, [16, 1, 7], 4, 1, 3),
        ),
        (
            "misaligned fp8 e4m3 view (element loads): attention f16 d64, splits 2",
            lambda: storage("e4m3", "misaligned", "f16", 64, [3, 1, 2], 4, 2, 2),
        ),
        ("mla on a 576-wide fp8 cache view, and P = 0", lambda: (mla_storage("e4m3", True), mla_storage(None, False))),
        (
            "fp8 e5m2 HND view on paged_attention's runtime dims (d96, GQA 3), splits 3",
            lambda: storage("e5m2", "hnd", "f16", 96, [1, 4, 1], 6, 2, 3),
        ),
        (
            "mla on a 576-wide fp8 cache view per query (the CPU as sm_86: paged_attention, ROT_CAP)",
            lambda: mla_storage_on("sm_86", "e4m3", True),
        ),
        ("append (rotary builds too) + copy_pages + advance_plan", append_and_pages),
        ("layered copy_pages + write_slots + advance_slots", engine_kernels),
        ("argmax + layers", small_ops),
        ("plan_build on absurd device metadata, attention over its plans", plan_build_on_absurd_metadata),
    ]
):
    if i % COUNT != SHARD:
        continue
    fn()
    print("ok", name, flush=True)
print("done")
