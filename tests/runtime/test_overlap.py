"""checks.no_overlap's test (_overlap) against the bytes each view touches.

Random views of one buffer: head ranges of a fused [rows, heads, dim]
projection (q / k / v: one stride pattern, different counts), column ranges
of a cache row, single-row and single-head views (a dim of count 1 carries
no stride to match), reshaped and sliced views with unequal strides. The
test is exact where it claims to be (one stride pattern) and never misses a
shared byte anywhere (conservative otherwise).
"""

import numpy as np

from cupaged._runtime import checks


def touched(base, a) -> set:
    """Byte offsets (from base's start) of every element of view a."""
    start = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    idx = np.indices(a.shape).reshape(a.ndim, -1).T if a.size else np.zeros((0, a.ndim), int)
    out = set()
    for ix in idx:
        o = start + int(np.dot(ix, a.strides))
        out.update(range(o, o + a.itemsize))
    return out


def random_view(rng, buf):
    rows, width = int(rng.integers(1, 5)), int(rng.integers(2, 13))
    flat = buf[: rows * width].reshape(rows, width) if rows * width <= buf.size else buf[:width].reshape(1, width)
    heads = min(int(rng.integers(1, 4)), width)
    dim = max(1, width // heads)
    kind = rng.integers(0, 3)
    if kind == 0:  # head range of a [rows, heads, dim] split
        grid = flat[:, : heads * dim].reshape(flat.shape[0], heads, dim)
        h0 = int(rng.integers(0, heads))
        h1 = int(rng.integers(h0 + 1, heads + 1))
        r0 = int(rng.integers(0, grid.shape[0]))
        return grid[r0:, h0:h1]
    if kind == 1:  # a column range, as [rows, 1, cols]
        c0 = int(rng.integers(0, width))
        c1 = int(rng.integers(c0 + 1, width + 1))
        return flat[:, None, c0:c1]
    # an unrelated pattern: a strided slice
    step = int(rng.integers(1, 3))
    return flat[::step, None, : int(rng.integers(1, width + 1))]


def test_overlap_never_misses_and_is_exact_for_one_pattern():
    rng = np.random.default_rng(0)
    exact = 0
    for _ in range(3000):
        buf = np.zeros(64, np.float32)
        a, b = random_view(rng, buf), random_view(rng, buf)
        shared = bool(touched(buf, a) & touched(buf, b))
        got = checks._overlap(a, b)
        assert got or not shared, (a.shape, a.strides, b.shape, b.strides)  # never a miss
        one_pattern = all(
            na == 1 or nb == 1 or sa == sb for na, nb, sa, sb in zip(a.shape, b.shape, a.strides, b.strides)
        )
        if one_pattern:
            assert got == shared, (a.shape, a.strides, b.shape, b.strides)
            exact += 1
    assert exact > 1000


def test_fused_qkv_head_ranges_are_disjoint():
    qkv = np.zeros((5, 4 + 2 + 2, 6), np.float16)  # 4 q heads, 2 k, 2 v
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert not checks._overlap(q, k) and not checks._overlap(k, v) and not checks._overlap(q, v)
    assert checks._overlap(qkv[:, :5], k)  # one head shared
