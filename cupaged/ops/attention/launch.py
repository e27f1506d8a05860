"""The attention launch: one launch per segment of a checked call's record
(``inputs.Call``), then the split merge. Everything it needs comes in the
record; nothing here checks, allocates, synchronizes or reads device data
on the host.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ... import dtypes
from ..._runtime import Stream, get_kernel
from ..._runtime.arrays import Array
from . import params
from .inputs import CacheRead, Call, unchecked
from .kernels.merge import MERGE, MERGE_HEADS_PER_BLOCK, THREADS, merge_defines
from .options import LOG2E, AttentionOptions
from .schedule import Launch
from .splits import SplitWorkspace

__all__ = ["LOG2E", "launch_call", "launch_attention", "launches_for"]


def launch_call(call: Call, stream: Stream | None = None) -> None:
    """Issue a checked call's launches (``call.launches``, one per segment,
    each taking one ``AttentionParams`` struct of ``call.values`` and its
    query range), then, with a split workspace, the merge; on ``stream``
    (None: the plan's). The merge is a dependent launch (Stream.launch): with
    CUPAGED_PDL=1 on sm_90 and later its blocks start while the last split
    launch runs (each split kernel lets them, ptx::launch_dependents) and
    wait in the kernel for its completion, so its launch latency hides
    behind that grid."""
    if not call.launches:
        return
    stream = call.plan.stream if stream is None else stream
    q = call.refs[0]
    split = call.splits > 1
    values, sinks = dict(call.values), call.opts.sinks
    ws = call.workspace if split else None  # the split partials' workspace (None: unsplit)
    kernels = [get_kernel(q, launch.source, launch.kernel, launch.defines) for launch in call.launches]
    merge = (
        get_kernel(q, MERGE.source, MERGE.name, merge_defines(dtypes.token(q.dtype), sinks is not None))
        if split
        else None
    )
    hkv = values["kv_heads"]
    assert ws is not None or not split, "a split call has a workspace (inputs.record)"
    # A workspace is held from the first split kernel to the merge: threads
    # sharing one run one step after the other (on the GPU, also in stream order).
    with ws.lock if ws is not None else contextlib.nullcontext():
        for launch, kernel in zip(call.launches, kernels):
            values["q_begin"], values["q_count"] = launch.q_begin, launch.q_count
            args = params.pack(values, call.refs)
            stream.launch(
                kernel, launch.grid(hkv, call.splits), (launch.block(stream.backend),), (args,), shared_mem=launch.smem
            )
        if ws is not None:
            u32, queries, hq, lse = np.uint32, values["queries"], values["q_heads"], call.lse
            stream.launch(
                merge,
                (queries, -(-hq // MERGE_HEADS_PER_BLOCK)),
                (THREADS,),
                (
                    ws.partial_out,
                    ws.partial_lse,
                    call.out,
                    call.out if lse is None else lse,
                    u32(queries),
                    u32(hq),
                    u32(values["value_dim"]),
                    u32(call.splits),
                    u32(lse is not None),
                    sinks if sinks is not None else np.uint64(0),
                ),
                dependent=True,  # it waits for the split kernels' grid in code (merge.cu)
            )


def launches_for(
    plan: Any,
    q: Array,
    k_cache: Array,
    v_cache: Array,
    out: Array,
    opts: AttentionOptions,
    *,
    q_rot: Array | None = None,
    k_rot: Array | None = None,
    read: CacheRead | None = None,
) -> tuple[Launch, ...]:
    """The launches (``schedule.Launch``, one per segment) that
    ``launch_attention`` issues for these arrays (``inputs.record`` chooses
    them)."""
    return unchecked(plan, q, k_cache, v_cache, out, opts, q_rot=q_rot, k_rot=k_rot, read=read).launches


def launch_attention(
    stream: Stream | None,
    plan: Any,
    q: Array,
    k_cache: Array,
    v_cache: Array,
    out: Array,
    opts: AttentionOptions,
    *,
    q_rot: Array | None = None,
    k_rot: Array | None = None,
    lse: Array | None = None,
    workspace: SplitWorkspace | None = None,
    read: CacheRead | None = None,
) -> None:
    """Launch paged attention for ``plan`` on arrays that come unchecked
    (the layer under ``DevicePlan.attention``, which checks and calls
    ``launch_call`` with its record; ``opts``: ``AttentionOptions``).

    q [queries, Hq, D]; k_cache [pages, page_size, Hkv, D];
    v_cache [pages, page_size, Hkv, Dv]; out [queries, Hq, Dv] (q's dtype);
    lse float32 [queries, Hq] or None; workspace: None, or an object with
    ``splits``, ``partial_out`` float32 [splits, queries, Hq, Dv] and
    ``partial_lse`` float32 [splits, queries, Hq] (splits > 1 launches the
    split kernel, then the merge).

    q_rot [queries, Hq, P] and k_rot [pages, page_size, 1, P]: the MLA
    rotary parts (both or neither); score = scale * (q.k + q_rot.k_rot).
    With them the caches must be one array (the latent cache, Hkv = 1,
    v_cache is k_cache) and P <= 256.

    ``read``: the caches' format and dequantization scales
    (``inputs.CacheRead``; None: the caches have q's dtype, no scales).
    Caches may be any views whose innermost dim is contiguous: their
    strides travel in AttentionParams. For MLA (v_cache is k_cache)
    ``read.k_scale`` scales the latent (K and V) and ``read.v_scale``
    k_rot.
    """
    launch_call(
        unchecked(
            plan, q, k_cache, v_cache, out, opts, q_rot=q_rot, k_rot=k_rot, lse=lse, workspace=workspace, read=read
        ),
        stream,
    )
