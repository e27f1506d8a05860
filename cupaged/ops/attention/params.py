"""The one argument of the attention kernels, defined once.

``FIELDS`` is the table: the C struct ``AttentionParams`` that
``paged_attention``, ``paged_prefill_tc`` and ``paged_mla_tc`` take by value
is generated from it into
``kernels_cu/attention/params.cuh`` (``python -m cupaged.tools.gen_headers``;
a test checks the committed header), and ``DTYPE`` packs the same bytes on
the host (``pack``). Shapes and meanings: docs/layout.md.
"""

from __future__ import annotations

import numpy as np

from ..._runtime.structs import Field, StructArg, c_struct, struct_dtype

#: kernels_cu-relative path of the generated header.
HEADER_PATH = "attention/params.cuh"
#: Name of the C struct.
STRUCT = "AttentionParams"

# scalar_t is the storage of q and out (CP_DTYPE), kv_t of the caches
# (CP_KV_DTYPE): kernels_cu/common.cuh.
FIELDS: tuple[Field, ...] = (
    Field("q", "const scalar_t*", "[queries, Hq, D]"),
    Field("k_cache", "const kv_t*", "[pages, page_size, Hkv, D]"),
    Field("v_cache", "const kv_t*", "[pages, page_size, Hkv, Dv] (the K cache itself with a rotary part)"),
    Field("q_rot", "const scalar_t*", "[queries, Hq, P], read only with a rotary part (MLA)"),
    Field("k_rot", "const kv_t*", "[pages, page_size, 1, P], read only with a rotary part"),
    Field("words", "const u32*", "plan metadata (docs/layout.md): lengths, positions, page ids"),
    Field("out", "scalar_t*", "[queries, Hq, Dv] (splits == 1)"),
    Field("lse", "float*", "[queries, Hq] natural-log LSE, when write_lse"),
    Field("part_out", "float*", "[splits, queries, Hq, Dv] split partials (splits > 1)"),
    Field("part_lse", "float*", "[splits, queries, Hq] their LSE (splits > 1)"),
    Field("queries", "u32", "the plan's packed queries"),
    Field("q_begin", "u32", "this launch serves queries [q_begin, q_begin + q_count)"),
    Field("q_count", "u32", "(clamped to the plan's queries)"),
    Field("sequences", "u32", "the plan's static sizes, which locate the metadata arrays"),
    Field("table_width", "u32", ""),
    Field("page_size", "u32", ""),
    Field("num_pages", "u32", "page ids >= num_pages are never read"),
    Field("q_heads", "u32", "Hq"),
    Field("kv_heads", "u32", "Hkv"),
    Field("head_dim", "u32", "D"),
    Field("value_dim", "u32", "Dv"),
    Field("rot_dim", "u32", "P, 0 without a rotary part"),
    Field("splits", "u32", "splits of the visible history (1: none)"),
    Field("kv_len_hint", "u32", "the plan's longest kv length (host): a split's first page guessed (never trusted)"),
    Field("causal", "u32", "1: the query at position p sees positions 0 .. p"),
    Field("write_lse", "u32", "1: write lse (when splits == 1)"),
    Field("scale", "float", "score = scale * q.k"),
    # Score variants (variant.cuh): read only by the variants whose feature is on.
    Field("soft_cap", "float", "CP_SOFT_CAP: cap * log2(e); logit = cap * tanh(logit / cap)"),
    Field("inv_soft_cap", "float", "CP_SOFT_CAP: 1 / (cap * log2(e))"),
    Field("window", "u32", "CP_WINDOW: the query at p sees positions >= p - window + 1"),
    Field("sinks", "const float*", "CP_SINKS: [Hq] per-head sink logits (natural units)"),
    Field("alibi_slopes", "const float*", "CP_ALIBI: [Hq] slopes; logit += slope * (k_pos - q_pos)"),
    Field("head_bias", "const float*", "CP_SCORE=head_bias: [Hq] logit += bias[h] (a score's runtime data)"),
    # Cache storage (docs/layout.md, "Cache views"): element strides of
    # kv_t (any view whose innermost dim is contiguous), and the
    # dequantization scales of an fp8 cache (null for 16/32-bit caches).
    Field("k_stride_page", "u64", "k_cache strides: page, slot, head"),
    Field("v_stride_page", "u64", "v_cache strides"),
    Field("rot_stride_page", "u64", "k_rot strides: page, slot (one head)"),
    Field("k_stride_slot", "u32", ""),
    Field("k_stride_head", "u32", ""),
    Field("v_stride_slot", "u32", ""),
    Field("v_stride_head", "u32", ""),
    Field("rot_stride_slot", "u32", ""),
    Field("k_scale_stride", "u32", "1: a K scale per KV head, 0: one"),
    Field("v_scale_stride", "u32", "1: a V scale per KV head, 0: one"),
    # Query views (docs/layout.md, "Query views"): element strides of q and
    # q_rot, whose last dim is contiguous (a column slice of a fused QKV
    # projection passes as is).
    Field("q_stride_token", "u32", "q strides: token, head"),
    Field("q_stride_head", "u32", ""),
    Field("q_rot_stride_token", "u32", "q_rot strides: token, head"),
    Field("q_rot_stride_head", "u32", ""),
    Field("k_scale", "const float*", "fp8 caches: K dequantization scale(s) (kKvScaled)"),
    Field("v_scale", "const float*", "fp8 caches: V dequantization scale(s)"),
)

#: The NumPy structured dtype of AttentionParams (C alignment, pointers as uint64).
DTYPE = struct_dtype(FIELDS)
NAMES = tuple(f.name for f in FIELDS)
POINTERS = tuple(f.name for f in FIELDS if f.pointer)


def header() -> str:
    """The text of ``kernels_cu/attention/params.cuh``."""
    return f"""\
// params.cuh: GENERATED by `python -m cupaged.tools.gen_headers` from cupaged/ops/attention/params.py; do not edit.
// The one argument every attention kernel takes by value (paged_attention,
// paged_prefill_tc, paged_mla_tc). Shapes and meanings: docs/layout.md. Sizes are the plan's static ones; nothing in
// `words` is trusted for memory safety.
#pragma once
#include "../common.cuh"

{c_struct(STRUCT, FIELDS)}"""


def pack(values: dict, refs) -> StructArg:
    """AttentionParams holding ``values`` (every field by name: pointer
    fields as integer addresses), with ``refs`` (the arrays addressed) kept
    alive by the argument. One small host allocation, nothing on the device."""
    return StructArg(np.array(tuple(values[n] for n in NAMES), dtype=DTYPE)[()], refs)
