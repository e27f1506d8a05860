"""Paged attention (``kernels_cu/attention/``): decode and chunked
prefill over a paged K/V cache, optionally split over the visible history
with a merge. Layout, positions, metadata words and LSE: ``docs/layout.md``.

``inputs.attention_call`` / ``inputs.mla_call`` check one call and return
its record (``inputs.Call``: formats, strides, alignment, the kernel of each
segment of the step (``tc_segments``) and the grids, computed once);
``launch.launch_call`` issues one launch per segment (at most MAX_SEGMENTS), then
the split merge with a workspace. It allocates nothing, never
synchronizes and never reads device data on the host: grid and arguments
depend only on shapes, the plan's static sizes and array addresses, so it
is safe inside stream capture and a captured graph replays with whatever
lengths the device metadata holds.

Files: ``options.py`` (``AttentionOptions`` and the one row of each option: check, params
fields, compile-time column, reference hook, docs), ``inputs.py`` (every input check, the call's
record), ``variants.py``
(``Variant``: every compile-time choice; what is built and what runs),
``schedule.py`` (segments, ``Launch`` records), ``splits.py`` (the split
workspace and count), ``params.py`` (the kernels' one argument struct),
``launch.py``.

CUDA-core kernel ``paged_attention`` (``kernels_cu/attention/decode.cu``): one 128-thread block per
(query, KV head, tile of query heads of that KV head's group, split); a
tile serves up to ``GROUP_TILE`` query heads, so every K/V row is read once
per group when the group fits one tile (``Hq / Hkv <= 8`` on the fast
paths). Each warp owns a slice of the tokens of every block step and loads
several K and V rows before using them (16-byte loads where the dims and
addresses allow), keeping an online softmax per row group in FP32.

Caches are any views whose innermost dim is contiguous (strides in
``AttentionParams``), in q's dtype or fp8 (e4m3 / e5m2 under f16 / bf16 q,
with ``k_scale`` / ``v_scale`` folded into the score scale and the output):
docs/layout.md, "Cache views and fp8 caches". Queries too are any such
views (``att::q_at``; docs/layout.md, "Query views"). ``launch.launches_for``
says which kernels a call runs.

Memory traffic per (query, KV head, tile): read the visible K and V rows,
``L * (D + Dv) * itemsize`` bytes; write ``G * Dv`` outputs. With a
workspace of ``S > 1`` splits the partials add ``S * G * (Dv + 1) * 4``
bytes written and read again by the merge.

Tensor-core decode kernel ``paged_decode_tc`` (``kernels_cu/attention/decode_tc.cu``; f16 /
bf16, D == Dv in ``DECODE_TC_DIMS``, aligned arrays: ``select_variant``
picks it over ``paged_attention`` by one rule): one block per query, pack
of KV heads (``Launch.pack``: up to 4, 64 threads a KV head), tile of up to
16 query heads and split; the tile's heads are the M dimension of
``mma.sync`` m16n8k16, two columns of warps (one warp a KV head) take
alternate 16-token tiles through two-stage ``cp.async`` rings their warps
fill together (a token's rows of the pack's heads at a time: one run of an
NHD cache), and each head's warps meet at the end. Memory traffic as
``paged_attention``'s, with registers for 6 one-head blocks per SM.

Row-packed tensor-core kernels (f16 / bf16, ``select_tensor_core``; ``prefill_tc.cu``, ``mla_tc.cu``,
``mla_wgmma.cu``, ``mla_seesaw.cu``), chosen per arch (``plan_launches(..., arch=)``: a build
that cannot launch on the device's arch, or targets another, is never
chosen; ``Variant.runs_on``):

* ``paged_prefill_tc`` (D == Dv in ``TC_PREFILL_DIMS``, a step packed as
  ``tc_schedule_ok`` asks): one block per 128 (query, head) rows (``128 // G``
  queries x the ``G`` heads of one KV head's group) and split, the tile of
  ``PREFILL_TILES`` (warps x m-tiles of 16 rows, K/V tile tokens, ring
  stages, resident blocks); K/V tiles go through a ``cp.async`` ring and
  S = Q K^T, O += P V run on ``mma.sync`` m16n8k16 (FlashAttention-2
  style). K/V are read once per block instead of once per query: about
  ``ceil(q_len * G / 128) * L * (D + Dv) * itemsize`` bytes per sequence and
  KV head.
* ``paged_prefill_simt`` (``prefill_simt.cu``; f32, D == Dv in 64 / 128,
  the same segments): the same row-packed blocks, 64 rows and a two-stage
  ring of 32-token tiles, on CUDA cores: each thread a 4-row micro-tile of
  scores (its own tokens) and of outputs (its own dims), so no thread
  recomputes another's exponentials; same K/V traffic per block. D = 128
  needs 108.5 KiB of shared memory: on sm_86 / sm_89 it runs per query.
* MLA (R, P in ``TC_MLA_DIMS``): one 256-thread block per 64 (query, head)
  rows and split, the heads in the M dimension, so each latent row is read
  once per 64 heads (``L * (R + P) * itemsize`` bytes per block); the head
  tile is the fastest grid index, so the two head tiles of H = 128 share
  their latent rows in L2. On sm_90 (sm_90a, ``wgmma.mma_async``)
  ``paged_mla_seesaw`` over 16-bit caches (a producer warpgroup and two
  consumer warpgroups in FlashMLA's seesaw schedule, 384 threads) and
  ``paged_mla_wgmma`` over fp8 caches (two warpgroups in lockstep);
  ``paged_mla_tc`` (``mma.sync``) elsewhere where it fits; none on sm_86 /
  sm_89 (99 KiB), where MLA runs per query.

All six take the one ``AttentionParams`` struct (``params.py``), call the
one variant hook (``variant.cuh``: score and visibility) and keep the one
online-softmax state (``softmax_state.cuh``), write the same split partials
(so ``attention_split_merge`` serves them) and read lengths and positions
from the device words; their grids depend only on shapes.

Segments (``tc_segments``): a launch covers the packed queries
``[q_begin, q_begin + q_count)`` (kernel arguments). A step the tensor-core
kernels suit as a whole (``tc_schedule_ok``) is one tensor-core launch; one
with no sequence that suits them, one CUDA-core launch. A mixed step (prefill
chunks among decodes of a small group) runs as up to MAX_SEGMENTS launches
over contiguous runs of sequences, each on its kernel: every launch writes
outputs and partials at global query indices, so one merge follows them all.
The segmentation is host plan data (cached per plan), so grids and arguments
still depend only on shapes and the plan's static sizes.
"""

from __future__ import annotations

import warnings

from . import inputs
from .inputs import attention_call, mla_call
from .launch import launch_attention, launch_call
from .options import ROWS, SCORES, AttentionOptions, KVLayer
from .schedule import MAX_SEGMENTS, block_passes, plan_launches, tc_schedule_ok, tc_segments, unsplit_blocks
from .splits import MIN_TOKENS_PER_SPLIT, SplitWorkspace, choose_splits
from .variants import VARIANTS, select_tensor_core, select_variant

__all__ = [
    "attention",
    "mla",
    "AttentionOptions",
    "KVLayer",
    "ROWS",
    "SCORES",
    "SplitWorkspace",
    "choose_splits",
    "MIN_TOKENS_PER_SPLIT",
    "launch_attention",
    "MAX_SEGMENTS",
    "block_passes",
    "plan_launches",
    "tc_schedule_ok",
    "tc_segments",
    "unsplit_blocks",
    "VARIANTS",
    "select_tensor_core",
    "select_variant",
]


def attention(plan, q, k_cache, v_cache, scale, causal=True, **kwargs):
    """``DevicePlan.attention`` (its docstring has the shapes and options): check, then launch."""
    call = attention_call(plan, q, k_cache, v_cache, scale, causal, **kwargs)
    launch_call(call)
    return call.result()


def mla(plan, q, *args, **kwargs):
    """``DevicePlan.mla`` (its docstring has the shapes and options): check, then launch.
    q_rot and k_rot None, or both zero-width: MLA without a rotary part (P = 0)."""
    call = mla_call(plan, q, *args, **kwargs)
    launch_call(call)
    return call.result()


def __getattr__(name):
    if name == "checks":  # the module's name before inputs.py (one release)
        warnings.warn(
            "cupaged.ops.attention.checks is now cupaged.ops.attention.inputs", DeprecationWarning, stacklevel=2
        )
        return inputs
    raise AttributeError(name)
