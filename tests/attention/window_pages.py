"""Pages wholly outside a sliding window are never read, counted for every
kernel family (tests/attention/test_scores.py runs this in a subprocess).

    python tests/attention/window_pages.py

Each case puts one long sequence's pages in a cache allocated with mmap, the
pages no query's window reaches at the end of it, and takes every access
away from those pages (mprotect PROT_NONE) before the launch: a kernel that
touched one of them would kill the process with SIGSEGV. The output is then
checked against the float64 reference (computed before the pages are
protected). Prints one line per case, "ok <case>: read <n> of <m> pages
[<kernels launched>]", then "done".
"""

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupaged  # noqa: E402
from cupaged._runtime import cpu_arch_override  # noqa: E402
from cupaged.ops.attention import launch  # noqa: E402
from cupaged.testing import as_dtype, assert_close, reference  # noqa: E402

OS_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_keep = []  # the mappings (freed at exit)
_used = []  # kernels the launches fetch
_get_kernel = launch.get_kernel
launch.get_kernel = lambda like, source, kernel, defines=None: (
    _used.append(kernel),
    _get_kernel(like, source, kernel, defines),
)[1]


def ran():
    """The attention kernels launched since the last call."""
    names = sorted({k for k in _used if k != "attention_split_merge"})
    _used.clear()
    return ",".join(names)


def mapped(shape, dtype, rng):
    """A standard-normal array of ``shape`` in its own page-aligned mapping."""
    dt = as_dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    buf = mmap.mmap(-1, n + OS_PAGE)
    _keep.append(buf)
    raw = np.frombuffer(buf, np.uint8)
    off = (-raw.ctypes.data) % OS_PAGE
    a = raw[off : off + n].view(dt).reshape(shape)
    a[...] = rng.standard_normal(shape).astype(dt)
    return a


def protect(cache, first_page):
    """No access to cache pages first_page.. (whole OS pages: the page bytes
    are a multiple of the OS page size)."""
    page_bytes = cache[0].nbytes
    assert page_bytes % OS_PAGE == 0, page_bytes
    addr = cache.ctypes.data + first_page * page_bytes
    n = (cache.shape[0] - first_page) * page_bytes
    if n and _libc.mprotect(addr, n, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")


def layout(length, page_size, window, q_len):
    """A page table for one sequence of ``length`` tokens whose pages before
    the first query's window get the highest page ids (protected), in a
    scrambled order; returns (table, pages read at most, pages)."""
    pages = -(-length // page_size)
    first = max(0, length - q_len - window + 1) // page_size  # first page any window reaches
    rng = np.random.default_rng(length)
    inside = rng.permutation(pages - first)  # ids 0 .. pages - first - 1
    outside = (pages - first) + rng.permutation(first)  # the protected ids
    table = np.concatenate([outside, inside]).astype(np.int32)[None, :]
    return table, pages - first, pages


def attention(name, dtype, d, hq, hkv, length, window, page_size, q_len, splits, arch="sm_90"):
    rng = np.random.default_rng(d + q_len)
    table, read, pages = layout(length, page_size, window, q_len)
    k = mapped((pages, page_size, hkv, d), dtype, rng)
    v = mapped((pages, page_size, hkv, d), dtype, rng)
    q = rng.standard_normal((q_len, hq, d)).astype(as_dtype(dtype))
    kv_lens, q_lens = np.array([length]), np.array([q_len])
    scale = d**-0.5
    sinks = rng.standard_normal(hq).astype(np.float32)
    ref_o, ref_l = reference.scored_attention(q, k, v, table, kv_lens, q_lens, scale, True, window=window, sinks=sinks)
    plan = cupaged.HostPlan.build(table, kv_lens, q_lens, page_size, pages).upload(q)
    ws = cupaged.SplitWorkspace(q_len, hq, d, splits, q) if splits > 1 else None
    protect(k, read)
    protect(v, read)
    with cpu_arch_override(arch):
        o, lse = plan.attention(q, k, v, scale, True, window=window, sinks=sinks, workspace=ws, return_lse=True)
    assert_close(o, ref_o, dtype, name)
    assert_close(lse, ref_l, dtype, name)
    print(f"ok {name}: read {read} of {pages} pages [{ran()}]", flush=True)


def mla(name, dtype, r, p, heads, length, window, page_size, q_len, arch):
    rng = np.random.default_rng(r + q_len)
    table, read, pages = layout(length, page_size, window, q_len)
    latent = mapped((pages, page_size, 1, r), dtype, rng)
    k_pos = mapped((pages, page_size, 1, p), dtype, rng)
    q = rng.standard_normal((q_len, heads, r)).astype(as_dtype(dtype))
    q_pos = rng.standard_normal((q_len, heads, p)).astype(as_dtype(dtype))
    kv_lens, q_lens = np.array([length]), np.array([q_len])
    scale = (r + p) ** -0.5
    qa, keys, values = reference.mla_as_attention(q, q_pos, latent, k_pos)
    ref_o, ref_l = reference.scored_attention(qa, keys, values, table, kv_lens, q_lens, scale, True, window=window)
    with cpu_arch_override(arch):
        plan = cupaged.HostPlan.build(table, kv_lens, q_lens, page_size, pages).upload(q)
        protect(latent, read)
        protect(k_pos, read)
        o, lse = plan.mla(q, q_pos, latent, k_pos, scale, True, window=window, return_lse=True)
    assert_close(o, ref_o, dtype, name)
    assert_close(lse, ref_l, dtype, name)
    print(f"ok {name}: read {read} of {pages} pages [{ran()}]", flush=True)


# A window of 4k over a 32k context on the per-query kernels (1/8 of the pages), 1k over 8k on the
# row-packed ones (whose rows see different windows: the block reads the union), with and without splits.
for args in [
    ("paged_attention f32 decode 4k of 32k", "f32", 64, 8, 2, 32768, 4096, 8, 1, 1),
    ("paged_attention f32 decode 4k of 32k, 7 splits", "f32", 64, 8, 2, 32768, 4096, 8, 1, 7),
    ("paged_decode_tc bf16 decode 4k of 32k, 5 splits", "bf16", 128, 8, 2, 32768, 4096, 8, 1, 5),
    ("paged_prefill_wgmma f16 (the CPU as sm_90) chunk of 64, 1k of 8k", "f16", 64, 8, 2, 8192, 1024, 16, 64, 1),
    ("paged_prefill_wgmma f16 (sm_90) chunk of 64, 1k of 8k, 3 splits", "f16", 64, 8, 2, 8192, 1024, 16, 64, 3),
    (
        "paged_prefill_tc f16 (the CPU as sm_80) chunk of 64, 1k of 8k, 3 splits",
        "f16",
        64,
        8,
        2,
        8192,
        1024,
        16,
        64,
        3,
        "sm_80",
    ),
    ("paged_prefill_simt f32 chunk of 64, 1k of 8k, 3 splits", "f32", 64, 8, 2, 8192, 1024, 16, 64, 3),
]:
    attention(*args)
for args in [
    ("paged_mla_seesaw bf16 (the CPU as sm_90) 1k of 8k", "bf16", 512, 64, 16, 8192, 1024, 32, 2, "sm_90"),
    ("paged_mla_tc f16 (the CPU as sm_80) 1k of 8k", "f16", 512, 64, 16, 8192, 1024, 32, 2, "sm_80"),
    ("paged_attention MLA f32 (rotary part) 1k of 8k", "f32", 64, 16, 4, 8192, 1024, 64, 1, "sm_90"),
]:
    mla(*args)
print("done")
