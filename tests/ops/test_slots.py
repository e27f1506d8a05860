"""cupaged.write_slots and cupaged.copy_pages: vLLM's reshape_and_cache and
copy_blocks semantics, ported from vLLM's tests/kernels/test_cache.py
(test_reshape_and_cache_flash, test_concat_and_cache_mla, test_copy_blocks,
test_copy_blocks_mla) at its tolerance: its non-fp8 cases compare with
torch.testing.assert_close, and a copy that is right is bit-exact, so we
compare bytes (NaN payloads and -0.0 included) against a NumPy reference.

vLLM's grid: 42 tokens, 8 heads, head sizes 64/80/120/256, block sizes
8/16/32, 1024 and 10000 blocks, half/bfloat16/float, 256 mappings each
copied to two destinations. On the CPU backend the block counts (and with
them the mappings) are scaled down to keep the suite small; a GPU run uses
vLLM's own. Every bad input raises PagedAttentionError naming the argument
before anything is launched.
"""

import random

import numpy as np
import pytest

import cupaged
from cupaged import PagedAttentionError, stream_for
from cupaged.testing import as_dtype

DTYPES = ["f16", "bf16", "f32"]
HEAD_SIZES = [64, 80, 120, 256]
BLOCK_SIZES = [8, 16, 32]
NUM_TOKENS = 42
NUM_HEADS = 8


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def num_blocks(backend, i):
    return (1024, 10000)[i] if backend.name == "gpu" else (48, 160)[i]


def randn(rng, shape, dtype):
    x = rng.standard_normal(shape)
    x.reshape(-1)[:2] = [np.nan, -0.0]
    return x.astype(as_dtype(dtype))


def dev(backend, x):
    try:
        return backend.asarray(x)
    except Exception as e:  # CuPy without bfloat16
        pytest.skip(f"cannot hold {x.dtype} on {backend.name}: {e}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("blocks", [0, 1])
def test_reshape_and_cache_flash(xp_backend, dtype, block_size, head_size, blocks):
    """vLLM test_reshape_and_cache_flash: random distinct slots, [blocks,
    block_size, heads, head_size] caches, every token's row at its slot."""
    random.seed(0)
    rng = np.random.default_rng(0)
    nb = num_blocks(xp_backend, blocks)
    slots = np.array(random.sample(range(nb * block_size), NUM_TOKENS), np.int64)
    key = randn(rng, (NUM_TOKENS, NUM_HEADS, head_size), dtype)
    value = randn(rng, (NUM_TOKENS, NUM_HEADS, head_size), dtype)
    k = randn(rng, (nb, block_size, NUM_HEADS, head_size), dtype)
    v = randn(rng, (nb, block_size, NUM_HEADS, head_size), dtype)
    exp_k, exp_v = k.copy(), v.copy()
    for i, s in enumerate(slots):
        exp_k[s // block_size, s % block_size] = key[i]
        exp_v[s // block_size, s % block_size] = value[i]
    kd, vd = dev(xp_backend, k), dev(xp_backend, v)
    cupaged.write_slots(dev(xp_backend, key), dev(xp_backend, value), kd, vd, slots)
    np.testing.assert_array_equal(bits(host(kd)), bits(exp_k))
    np.testing.assert_array_equal(bits(host(vd)), bits(exp_v))
    if xp_backend.name == "gpu":  # a device slot mapping (the engine's persistent buffer) works too
        kd2 = dev(xp_backend, k)
        cupaged.write_slots(
            dev(xp_backend, key),
            dev(xp_backend, value),
            kd2,
            dev(xp_backend, v),
            xp_backend.asarray(slots),
            validate=True,
        )
        np.testing.assert_array_equal(bits(host(kd2)), bits(exp_k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_and_cache_mla(xp_backend, dtype):
    """vLLM test_concat_and_cache_mla: kv_lora_rank 512 + rope 64, 42 tokens,
    block size 16, 8 blocks; cupaged keeps the latent and rotary parts as two
    caches ([pages, 16, 1, 512] and [pages, 16, 1, 64])."""
    random.seed(0)
    rng = np.random.default_rng(1)
    slots = np.array(random.sample(range(8 * 16), NUM_TOKENS), np.int64)
    kv_c = randn(rng, (NUM_TOKENS, 1, 512), dtype)
    k_pe = randn(rng, (NUM_TOKENS, 1, 64), dtype)
    latent = np.zeros((8, 16, 1, 512), as_dtype(dtype))
    k_pos = np.zeros((8, 16, 1, 64), as_dtype(dtype))
    exp_l, exp_p = latent.copy(), k_pos.copy()
    for i, s in enumerate(slots):
        exp_l[s // 16, s % 16] = kv_c[i]
        exp_p[s // 16, s % 16] = k_pe[i]
    ld, pd = dev(xp_backend, latent), dev(xp_backend, k_pos)
    cupaged.write_slots(dev(xp_backend, kv_c), dev(xp_backend, k_pe), ld, pd, slots)
    np.testing.assert_array_equal(bits(host(ld)), bits(exp_l))
    np.testing.assert_array_equal(bits(host(pd)), bits(exp_p))


def test_padding_slots_are_skipped():
    """-1 (vLLM's padded token) writes nothing; the others land."""
    rng = np.random.default_rng(2)
    k = randn(rng, (4, 4, 2, 8), "f32")
    v = randn(rng, (4, 4, 2, 3), "f32")
    before_k, before_v = k.copy(), v.copy()
    nk, nv = randn(rng, (3, 2, 8), "f32"), randn(rng, (3, 2, 3), "f32")
    cupaged.write_slots(nk, nv, k, v, [-1, 15, -1])
    before_k[3, 3], before_v[3, 3] = nk[1], nv[1]
    np.testing.assert_array_equal(bits(k), bits(before_k))
    np.testing.assert_array_equal(bits(v), bits(before_v))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("layers", [1, 3])
def test_copy_blocks(xp_backend, dtype, block_size, head_size, layers):
    """vLLM test_copy_blocks: each source block copied to two destinations
    (none of them a source), in K and V; with layer-major 5-D caches every
    layer in one launch (vLLM tests 1 layer, we add 3)."""
    random.seed(0)
    rng = np.random.default_rng(3)
    nb = num_blocks(xp_backend, 0)
    mappings = 256 if xp_backend.name == "gpu" else 12
    src_blocks = random.sample(range(nb), mappings)
    rest = list(set(range(nb)) - set(src_blocks))
    dst_blocks = random.sample(rest, 2 * mappings)
    src = [s for s in src_blocks for _ in range(2)]
    dst = dst_blocks
    shape = (layers, nb, block_size, NUM_HEADS, head_size)
    k, v = randn(rng, shape, dtype), randn(rng, shape, dtype)
    exp_k, exp_v = k.copy(), v.copy()
    for s, d in zip(src, dst):
        exp_k[:, d] = exp_k[:, s]
        exp_v[:, d] = exp_v[:, s]
    kd, vd = dev(xp_backend, k), dev(xp_backend, v)
    stream = stream_for(kd)
    launches = []
    launch = stream.launch
    try:
        stream.launch = lambda *a, **kw: (launches.append(a[0]), launch(*a, **kw))[1]
        cupaged.copy_pages(kd, vd, src, dst)
    finally:
        del stream.launch
    assert len(launches) == 1
    np.testing.assert_array_equal(bits(host(kd)), bits(exp_k))
    np.testing.assert_array_equal(bits(host(vd)), bits(exp_v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_mla(xp_backend, dtype):
    """vLLM test_copy_blocks_mla: 8 blocks of 16, entries 512 + 64, two
    sources to two destinations each; one latent and one rotary cache."""
    random.seed(0)
    rng = np.random.default_rng(4)
    src_blocks = random.sample(range(8), 2)
    dst = random.sample(list(set(range(8)) - set(src_blocks)), 4)
    src = [src_blocks[0], src_blocks[0], src_blocks[1], src_blocks[1]]
    lat, pos = randn(rng, (8, 16, 1, 512), dtype), randn(rng, (8, 16, 1, 64), dtype)
    exp_l, exp_p = lat.copy(), pos.copy()
    for s, d in zip(src, dst):
        exp_l[d], exp_p[d] = exp_l[s], exp_p[s]
    ld, pd = dev(xp_backend, lat), dev(xp_backend, pos)
    cupaged.copy_pages(ld, pd, src, dst)
    np.testing.assert_array_equal(bits(host(ld)), bits(exp_l))
    np.testing.assert_array_equal(bits(host(pd)), bits(exp_p))


def test_input_errors_write_nothing():
    rng = np.random.default_rng(5)
    k = randn(rng, (4, 4, 2, 8), "f16")
    v = randn(rng, (4, 4, 2, 8), "f16")
    nk = randn(rng, (3, 2, 8), "f16")
    snap = bits(k).copy(), bits(v).copy()
    cases = [
        (
            lambda: cupaged.write_slots(nk, nk, k, v, [0, 16, 1]),
            r"slot_mapping\[1\]: expected -1 \(skip\) or a slot in 0..15 \(pages x page_size\), got 16",
        ),
        (lambda: cupaged.write_slots(nk, nk, k, v, [0, -2, 1]), r"slot_mapping\[1\]: expected -1"),
        (
            lambda: cupaged.write_slots(nk, nk, k, v, [3, 7, 3]),
            "slot_mapping: tokens 0 and 2 both write slot 3; expected each slot at most once",
        ),
        (lambda: cupaged.write_slots(nk, nk, k, v, [0, 1]), r"slot_mapping: expected shape \[3\], got \[2\]"),
        (lambda: cupaged.write_slots(nk, nk, k, v, [0.0, 1.0, 2.0]), "slot_mapping: expected an integer array"),
        (
            lambda: cupaged.write_slots(nk.astype(np.float32), nk, k, v, [0, 1, 2]),
            "new_k: expected dtype float16 like k_cache, got float32",
        ),
        (lambda: cupaged.write_slots(nk[:, :1].copy(), nk, k, v, [0, 1, 2]), r"new_k: expected shape \[3, 2, 8\]"),
        (lambda: cupaged.write_slots(nk, nk, k[None], v[None], [0, 1, 2]), "k_cache: expected a 4-D array"),
        (lambda: cupaged.write_slots(k[0, :3], nk, k, v, [0, 1, 2]), "new_k: expected memory disjoint from k_cache"),
        (lambda: cupaged.copy_pages(k, v, [0, 1], [2]), r"dst: expected shape \[2\], got \[1\]"),
        (lambda: cupaged.copy_pages(k, v, [0, 4], [2, 3]), r"src\[1\]: expected a page id in 0..3, got 4"),
        (lambda: cupaged.copy_pages(k, v, [0, 1], [2, 2]), "dst: entries 0 and 1 both name page 2"),
        (lambda: cupaged.copy_pages(k, v, [0, 1], [1, 2]), r"dst\[0\]: page 1 is also a source"),
        (lambda: cupaged.copy_pages(k, v[:, :2].copy(), [0], [1]), "v_cache: expected shape"),
        (lambda: cupaged.copy_pages(k, v.astype(np.float32), [0], [1]), "v_cache: expected dtype float16"),
        (lambda: cupaged.copy_pages(k[..., 0], v[..., 0], [0], [1]), "k_cache: expected a 4-D or 5-D array"),
    ]
    for call, msg in cases:
        with pytest.raises(PagedAttentionError, match=msg):
            call()
        np.testing.assert_array_equal(bits(k), snap[0])
        np.testing.assert_array_equal(bits(v), snap[1])


def test_value_dim_may_differ_and_empty_calls():
    rng = np.random.default_rng(6)
    k = np.zeros((3, 2, 1, 8), np.float32)
    v = np.zeros((3, 2, 1, 5), np.float32)
    nk, nv = randn(rng, (2, 1, 8), "f32"), randn(rng, (2, 1, 5), "f32")
    cupaged.write_slots(nk, nv, k, v, [5, 0])
    np.testing.assert_array_equal(bits(k[2, 1]), bits(nk[0]))
    np.testing.assert_array_equal(bits(v[0, 0]), bits(nv[1]))
    cupaged.write_slots(nk[:0], nv[:0], k, v, [])
    cupaged.copy_pages(k, v, [], [])
