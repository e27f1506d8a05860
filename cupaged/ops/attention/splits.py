"""Split-KV: the FP32 workspace of partial results, and the split count.

A query's visible history is cut into ``splits`` chunks, each served by its
own block, which writes an FP32 partial output and LSE; a merge kernel
combines them (docs/layout.md, "Split-KV workspace").
"""

from __future__ import annotations

import math
import threading

import numpy as np

from ... import dtypes
from ..._runtime import (
    array_backend,
    check_not_capturing,
    checks,
    device_arch,
    device_id,
    empty,
    multiprocessor_count,
    stream_for,
)
from ...errors import PagedAttentionError
from ...layout import MAX_HEAD_DIM, MAX_ROPE_DIM, MAX_SPLITS, U32_MAX
from .kernels import DECODE
from .schedule import plan_launches
from .variants import RESIDENT_BLOCKS

#: Tokens per split below which splitting does not pay (see choose_splits).
MIN_TOKENS_PER_SPLIT = 256


class SplitWorkspace:
    """FP32 partial outputs and statistics for split-KV attention.

    ``partial_out`` [splits, queries, heads, value_dim] float32 and
    ``partial_lse`` [splits, queries, heads] float32, on the backend, device
    and stream of ``like``. Reusable by every plan with the same queries,
    heads and value dim on that device and stream (docs/layout.md).

    An attention call holds ``lock`` from its first split kernel to its
    merge, so threads sharing one workspace take turns instead of
    overwriting each other's partials.
    """

    def __init__(self, queries: int, heads: int, value_dim: int, splits: int, like):
        self.queries = checks.host_int("queries", queries, 0, U32_MAX)
        self.heads = checks.host_int("heads", heads, 1, U32_MAX)
        self.value_dim = checks.host_int("value_dim", value_dim, 1, MAX_HEAD_DIM)
        self.splits = checks.host_int("splits", splits, 1, MAX_SPLITS)
        if array_backend(like) is None:
            raise PagedAttentionError(f"like: expected a NumPy or CuPy array, got {type(like).__name__}")
        checks.u32_size("workspace", (self.splits, self.queries, self.heads, self.value_dim))
        self.stream = stream_for(like)
        check_not_capturing(self.stream, "SplitWorkspace")
        self.backend = self.stream.backend
        self.device = device_id(like)
        self.partial_out = empty(like, (self.splits, self.queries, self.heads, self.value_dim), np.float32)
        self.partial_lse = empty(like, (self.splits, self.queries, self.heads), np.float32)
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"SplitWorkspace(queries={self.queries}, heads={self.heads}, value_dim={self.value_dim}, "
            f"splits={self.splits}, backend={self.backend!r})"
        )


def choose_splits(
    plan,
    kv_heads: int,
    like=None,
    *,
    multiprocessors: int | None = None,
    q_heads: int | None = None,
    head_dim: int | None = None,
    value_dim: int | None = None,
    dtype=None,
    rot_dim: int = 0,
    arch: str | None = None,
    window: int | None = None,
    kv_dtype=None,
) -> int:
    """Split count for a plan (HostPlan or DevicePlan) with ``kv_heads``.

    Rule: let ``blocks`` be the unsplit grid's block count and ``slots`` the
    device's resident slots, ``resident x SMs``, where ``resident`` is the
    blocks per SM the kernel that runs is built for (its
    ``__launch_bounds__`` minimum, ``variants.RESIDENT_BLOCKS``; the smallest
    of the step's kernels when it has several launches). If ``blocks`` already
    fills the slots (the grid covers the SMs), or no sequence has more than
    ``MIN_TOKENS_PER_SPLIT`` (256) tokens, return 1. Otherwise return
    ``min(MAX_SPLITS, slots // blocks, ceil(max_kv_len / 256))``: the split
    grid fits the resident slots in one wave (no ragged last wave) and no
    split gets fewer than about 256 tokens.

    ``blocks`` is ``queries * kv_heads`` (one block per query and KV head)
    and ``resident`` that of the per-query kernels (paged_attention's, the
    smaller), unless the shapes are given (``q_heads``, ``head_dim``,
    ``value_dim``, ``dtype``, and ``rot_dim`` for MLA): then both come from
    the launches that will run (``schedule.plan_launches``, 16-byte aligned
    arrays assumed, for the device's ``arch``); the tensor-core prefill and
    MLA kernels serve several queries per block. Host data only; no
    synchronization. The SM count is ``multiprocessors`` when given, else
    that of ``like``'s device, else (default) that of the plan's own words:
    a DevicePlan's device, or for a HostPlan the CPU backend's workers;
    ``arch`` (``"sm_90"``, ...) is that device's unless given (with
    ``multiprocessors`` given and no ``arch``, no arch is assumed).
    ``window``: the attention's sliding window (``DevicePlan.attention``'s),
    which caps the positions a query sees, ``max_kv_len`` above included.
    ``kv_dtype``: the caches' format when it is not ``dtype`` (an fp8
    cache: ``"e4m3"`` / ``"e5m2"``), which may change the kernels that run.
    Every count is range-checked (``kv_heads``, ``multiprocessors``,
    ``q_heads`` >= 1, a multiple of ``kv_heads``; ``head_dim`` /
    ``value_dim`` in 1..MAX_HEAD_DIM; ``rot_dim`` in 0..MAX_ROPE_DIM;
    ``window`` >= 1): PagedAttentionError naming the argument.
    """
    host = getattr(plan, "host", plan)  # a DevicePlan's host plan, or a HostPlan
    if not all(hasattr(host, a) for a in ("queries", "max_kv_len", "q_lens")):
        raise PagedAttentionError(f"plan: expected a HostPlan or DevicePlan, got {type(plan).__name__}")
    kv_heads = checks.host_int("kv_heads", kv_heads, 1, U32_MAX)
    if multiprocessors is not None:
        multiprocessors = checks.host_int("multiprocessors", multiprocessors, 1, U32_MAX)
    if q_heads is not None:
        q_heads = checks.host_int("q_heads", q_heads, 1, U32_MAX)
        if q_heads % kv_heads:
            raise PagedAttentionError(f"q_heads: expected a multiple of kv_heads={kv_heads}, got {q_heads}")
    for name, v in (("head_dim", head_dim), ("value_dim", value_dim)):
        if v is not None:
            checks.host_int(name, v, 1, MAX_HEAD_DIM)
    rot_dim = checks.host_int("rot_dim", rot_dim, 0, MAX_ROPE_DIM)
    if window is not None:
        window = checks.host_int("window", window, 1, U32_MAX)
    if multiprocessors is None:
        device = plan.words if like is None else like
        multiprocessors = multiprocessor_count(device)
        if arch is None:
            arch = device_arch(device)
    if q_heads is None:
        blocks = host.queries * int(kv_heads)
        resident = RESIDENT_BLOCKS[DECODE.name]
    else:
        if head_dim is None or dtype is None:
            raise PagedAttentionError("head_dim, dtype: expected both with q_heads")
        dv = int(head_dim if value_dim is None else value_dim)
        kv = None if kv_dtype is None else dtypes.kv_storage("kv_dtype", dtypes.np_dtype(kv_dtype)).token
        launches = (
            plan_launches(
                host,
                dtypes.token(dtype),
                int(q_heads),
                int(kv_heads),
                int(head_dim),
                dv,
                int(rot_dim),
                True,
                True,
                arch=arch,
                kv_dtype=kv,
            )
            if host.queries
            else ()
        )
        blocks = sum(launch.blocks * launch.head_blocks(int(kv_heads)) for launch in launches)
        resident = min((launch.min_blocks or 1 for launch in launches), default=1)
    slots = max(1, int(resident)) * int(multiprocessors)
    seen = host.max_kv_len if window is None else min(host.max_kv_len, window)
    if blocks == 0 or blocks >= slots or seen <= MIN_TOKENS_PER_SPLIT:
        return 1
    return int(max(1, min(MAX_SPLITS, slots // blocks, math.ceil(seen / MIN_TOKENS_PER_SPLIT))))
