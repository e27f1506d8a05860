"""Step plans: HostPlan (host work, once per schedule) and DevicePlan
(uploaded metadata; its methods check and launch, nothing else).

The layout of page tables, positions and metadata words is defined in
``docs/layout.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from . import layout
from ._runtime import CPU, Stream, check_not_capturing, checks, empty, stream_for, zeros
from .errors import PagedAttentionError
from .layout import MAX_PAGE_SIZE, MAX_SPLITS, MAX_VISIBLE_LEN, U32_MAX, metadata_offsets
from .ops import append as append_op
from .ops import attention as attention_op
from .ops import plan_build as plan_build_op
from .ops.attention import SplitWorkspace, choose_splits
from .ops.attention.options import MISSING, document

if TYPE_CHECKING:
    from .cache import PagedKVCache, Sequence

__all__ = [
    "HostPlan",
    "DevicePlan",
    "DevicePlanBuilder",
    "SplitWorkspace",
    "choose_splits",
    "MAX_SPLITS",
    "metadata_offsets",
]


@dataclass(frozen=True, eq=False)
class HostPlan:
    """The host side of one step's schedule. Build with ``HostPlan.build``.

    Attributes: ``queries``, ``sequences``, ``table_width``, ``page_size``,
    ``pages`` (num_pages), ``max_kv_len``, ``words`` (uint32 metadata the
    kernels read, docs/layout.md), and the validated host copies
    ``page_table`` [sequences, table_width], ``kv_lens`` [sequences],
    ``q_lens`` [sequences], ``q_seq`` [queries], ``q_pos`` [queries] (int64).
    """

    queries: int
    sequences: int
    table_width: int
    page_size: int
    pages: int
    max_kv_len: int
    words: np.ndarray = field(repr=False)
    page_table: np.ndarray = field(repr=False)
    kv_lens: np.ndarray = field(repr=False)
    q_lens: np.ndarray = field(repr=False)
    q_seq: np.ndarray = field(repr=False)
    q_pos: np.ndarray = field(repr=False)
    #: True for the decode slots of ``HostPlan.slots``: their device words are
    #: maintained by their owner (``DecodeBatch``), not described by the host
    #: copies above (all padded).
    stable: bool = False
    #: False when some sequence has more queries than keys (q_len > kv_len,
    #: kv_len 0 included): its first queries sit at negative positions, and
    #: the plan serves non-causal attention only (docs/layout.md);
    #: ``non_causal_sequence`` is the first such sequence (-1 when none).
    causal_ok: bool = True
    non_causal_sequence: int = -1

    @classmethod
    def slots(cls, slots: int, table_width: int, page_size: int, num_pages: int) -> "HostPlan":
        """A decode plan on stable buffers: ``slots`` sequences of one query
        each (q_seq, q_start fixed) and a page table ``table_width`` columns
        wide, every slot padded (kv_len 0, no page). Its owner joins a
        sequence to slot s by writing that slot's kv_len, q_pos and table row
        into the uploaded words with stream-ordered copies, and pads it again
        the same way, so one capture of a step over this plan serves any set
        of sequences (docs/layout.md, "Decode graphs"). Its writes are not
        checked on the host (``validate_writes`` returns at once): the owner
        guarantees that slots write only pages their sequence holds alone."""
        slots = checks.host_int("slots", slots, 1, U32_MAX)
        table_width = checks.host_int("table_width", table_width, 1, U32_MAX)
        page_size = checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        num_pages = checks.host_int("num_pages", num_pages, 1, U32_MAX - 1)
        checks.u32_size("page_table", (slots, table_width))
        n_words = layout.metadata_words(slots, slots, table_width)
        checks.u32_size("metadata words", (n_words,))
        off = metadata_offsets(slots, slots)
        words = np.zeros(n_words, np.uint32)
        words[layout.W_MAGIC : layout.W_NUM_PAGES + 1] = (layout.MAGIC, slots, slots, table_width, page_size, num_pages)
        words[layout.W_OFFSETS : layout.W_OFFSETS + len(layout.ARRAYS)] = [off[a] for a in layout.ARRAYS]
        seq = np.arange(slots, dtype=np.int64)
        words[off["q_seq"] : off["q_pos"]] = seq
        words[off["q_start"] : off["page_table"]] = np.arange(slots + 1)
        words[off["page_table"] :] = layout.NO_PAGE
        return cls(
            queries=slots,
            sequences=slots,
            table_width=table_width,
            page_size=page_size,
            pages=num_pages,
            max_kv_len=0,
            words=words,
            page_table=np.full((slots, table_width), -1, np.int64),
            kv_lens=np.zeros(slots, np.int64),
            q_lens=np.ones(slots, np.int64),
            q_seq=seq,
            q_pos=np.zeros(slots, np.int64),
            stable=True,
        )

    @classmethod
    def build(cls, page_table, kv_lens, q_lens, page_size: int, num_pages: int) -> "HostPlan":
        """Validate one step's schedule and lay out its metadata words.

        page_table [sequences, table_width] int: entry [s, j] is the page of
        tokens j*page_size .. (j+1)*page_size-1 of sequence s; entries past a
        sequence's length are ignored (may be -1).
        kv_lens [sequences]: tokens visible this step, new tokens included.
        q_lens [sequences]: new queries this step, 0 <= q_lens <= kv_lens;
        query i of sequence s sits at position kv_lens[s] - q_lens[s] + i.
        A sequence may have more queries than keys (q_lens > kv_lens, the
        first q_lens - kv_lens queries then at negative positions): the plan
        is then for non-causal attention only (``causal_ok`` False;
        cross-attention style; a sequence without keys gives its queries
        output 0, lse -inf) and writes no K/V. A sequence with q_lens 0 sits
        the step out under either rule.
        """
        page_size = checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        num_pages = checks.host_int("num_pages", num_pages, 1, U32_MAX - 1)
        table = checks.host_int_array("page_table", page_table, 2)
        kv = checks.host_int_array("kv_lens", kv_lens, 1)
        ql = checks.host_int_array("q_lens", q_lens, 1)
        sequences, width = table.shape
        if kv.shape[0] != sequences:
            raise PagedAttentionError(
                f"kv_lens: expected shape [{sequences}] (one per page_table row), got {checks.shape_str(kv.shape)}"
            )
        if ql.shape[0] != sequences:
            raise PagedAttentionError(
                f"q_lens: expected shape [{sequences}] (one per page_table row), got {checks.shape_str(ql.shape)}"
            )
        if width < 1:
            raise PagedAttentionError(
                f"page_table: expected at least one column, got shape {checks.shape_str(table.shape)}"
            )
        capacity = width * page_size
        for s in range(sequences):
            if kv[s] > MAX_VISIBLE_LEN:
                raise PagedAttentionError(
                    f"kv_lens[{s}]: expected at most {MAX_VISIBLE_LEN} (positions the kernels index), got {kv[s]}"
                )
            if kv[s] < 0 or kv[s] > capacity:
                raise PagedAttentionError(
                    f"kv_lens[{s}]: expected 0..{capacity} (table_width {width} x page_size {page_size}), got {kv[s]}"
                )
            if ql[s] < 0 or ql[s] > MAX_VISIBLE_LEN:
                raise PagedAttentionError(
                    f"q_lens[{s}]: expected 0..{MAX_VISIBLE_LEN} (more than kv_lens[{s}]="
                    f"{kv[s]} for non-causal attention only), got {ql[s]}"
                )
        used = -(-kv // page_size)  # pages inside each sequence's length
        inside = np.arange(width)[None, :] < used[:, None]
        bad = inside & ((table < 0) | (table >= num_pages))
        if bad.any():
            s, j = (int(x) for x in np.argwhere(bad)[0])
            raise PagedAttentionError(
                f"page_table[{s}, {j}]: expected a page id in 0..{num_pages - 1} (inside kv_lens[{s}]={kv[s]}), "
                f"got {table[s, j]}"
            )
        queries = int(ql.sum())
        checks.u32_size("page_table", table.shape)
        checks.u32_size("queries", (queries,))
        q_start = np.zeros(sequences + 1, np.int64)
        np.cumsum(ql, out=q_start[1:])
        q_seq = np.repeat(np.arange(sequences, dtype=np.int64), ql)
        q_pos = (kv - ql)[q_seq] + (np.arange(queries, dtype=np.int64) - q_start[q_seq])
        off = metadata_offsets(queries, sequences)
        n_words = layout.metadata_words(queries, sequences, width)
        checks.u32_size("metadata words", (n_words,))
        words = np.zeros(n_words, np.uint32)
        words[layout.W_MAGIC : layout.W_NUM_PAGES + 1] = (layout.MAGIC, queries, sequences, width, page_size, num_pages)
        words[layout.W_OFFSETS : layout.W_OFFSETS + len(layout.ARRAYS)] = [off[a] for a in layout.ARRAYS]
        words[off["q_seq"] : off["q_pos"]] = q_seq
        words[off["q_pos"] : off["kv_len"]] = q_pos & 0xFFFFFFFF  # signed 32-bit: negative when q_len > kv_len
        words[off["kv_len"] : off["q_start"]] = kv
        words[off["q_start"] : off["page_table"]] = q_start
        valid = (table >= 0) & (table < num_pages)
        words[off["page_table"] :] = np.where(valid, table, U32_MAX).reshape(-1)
        cross = np.nonzero(ql > kv)[0]  # causal queries at negative positions: a caller bug (forgot to append)
        return cls(
            queries=queries,
            sequences=sequences,
            table_width=width,
            page_size=page_size,
            pages=num_pages,
            max_kv_len=int(kv.max()) if sequences else 0,
            words=words,
            page_table=table,
            kv_lens=kv,
            q_lens=ql,
            q_seq=q_seq,
            q_pos=q_pos,
            causal_ok=not len(cross),
            non_causal_sequence=int(cross[0]) if len(cross) else -1,
        )

    def write_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(page [queries], offset [queries]) each query's new K/V goes to."""
        pages = self.page_table[self.q_seq, self.q_pos // self.page_size]
        return pages, self.q_pos % self.page_size

    def validate_writes(self) -> None:
        """Reject schedules whose appends would collide or leave the cache:
        two queries writing one slot, a slot past the table, a page id out of
        range. (Build already guarantees the last two; checked again here.)
        Plans of ``HostPlan.slots`` are checked by their owner instead."""
        if self.queries == 0 or self.stable:
            return
        if (self.q_pos < 0).any():
            i = int(np.argmax(self.q_pos < 0))
            s = int(self.q_seq[i])
            raise PagedAttentionError(
                f"query {i}: sits at position {self.q_pos[i]} (sequence {s} has q_lens={self.q_lens[s]} > "
                f"kv_lens={self.kv_lens[s]}), which has no cache slot; expected q_lens <= kv_lens to write K/V"
            )
        cols = self.q_pos // self.page_size
        if (cols >= self.table_width).any():
            i = int(np.argmax(cols >= self.table_width))
            raise PagedAttentionError(f"query {i}: position {self.q_pos[i]} is past the page table's capacity")
        pages, offsets = self.write_slots()
        if ((pages < 0) | (pages >= self.pages)).any():
            i = int(np.argmax((pages < 0) | (pages >= self.pages)))
            raise PagedAttentionError(f"query {i}: writes to page {pages[i]}, expected 0..{self.pages - 1}")
        slots = pages * self.page_size + offsets
        uniq, first, counts = np.unique(slots, return_index=True, return_counts=True)
        if (counts > 1).any():
            slot = uniq[counts > 1][0]
            who = np.nonzero(slots == slot)[0][:2]
            raise PagedAttentionError(
                f"queries {who[0]} and {who[1]} (sequences {self.q_seq[who[0]]} and {self.q_seq[who[1]]}) both "
                f"write page {slot // self.page_size} offset {slot % self.page_size}; a shared page must be "
                f"copied before it is written"
            )

    def upload(self, like) -> "DevicePlan":
        """Copy the metadata words to the backend, device and stream of
        ``like`` (a NumPy or CuPy array). One small async upload; no sync."""
        stream = stream_for(like)
        check_not_capturing(stream, "plan.upload")
        if stream.backend == CPU:
            words = self.words.copy()
        else:
            words = empty(like, self.words.shape, np.uint32)
            stream.copy_from_host(words, self.words)
        return DevicePlan(self, words, stream)


class DevicePlan:
    """A HostPlan uploaded to one backend, device and stream. Reusable while
    the schedule is unchanged; ops launch on the stream of the upload."""

    #: The PagedKVCache whose ``prepare`` made the plan (or that took it over:
    #: a DecodeBatch's slot plan); unset otherwise: read with ``getattr(plan, "_cache", None)``.
    _cache: PagedKVCache

    def __init__(self, host: HostPlan, words, stream: Stream):
        self.host = host
        self.words = words
        self.stream = stream
        self.backend = stream.backend
        self.device = stream.device
        #: None, or a callable that raises PagedAttentionError once the plan
        #: is stale (plans of ``PagedKVCache.prepare``); every op calls it first.
        self.guard: Callable[[], None] | None = None
        #: The sequences of a ``PagedKVCache.prepare`` plan, in row order (else None).
        self.seqs: tuple[Sequence, ...] | None = None

    def __getattr__(self, name):  # queries, sequences, page_size, ... from the host plan
        if name in ("queries", "sequences", "table_width", "page_size", "pages", "max_kv_len"):
            return getattr(self.host, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        h = self.host
        return (
            f"DevicePlan(queries={h.queries}, sequences={h.sequences}, table_width={h.table_width}, "
            f"page_size={h.page_size}, pages={h.pages}, backend={self.backend!r}, device={self.device})"
        )

    def _fresh(self) -> None:
        if self.guard is not None:
            self.guard()

    def check_fresh(self) -> None:
        """Raise PagedAttentionError if the plan is stale (see ``guard``)."""
        self._fresh()

    @document
    def attention(
        self,
        q,
        k_cache,
        v_cache=None,
        scale: float | None = None,
        causal: bool = True,
        *,
        workspace: SplitWorkspace | None = None,
        out=None,
        lse=None,
        return_lse: bool = False,
        **options,
    ):
        """Paged attention for the plan's packed queries.

        q [queries, Hq, D] (any view whose last dim is contiguous: a
        column slice of a fused QKV projection passes as is; docs/layout.md,
        "Query views"); k_cache [pages, page_size, Hkv, D];
        v_cache [pages, page_size, Hkv, Dv]; Hq % Hkv == 0 and query head h
        reads KV head h // (Hq // Hkv). Or ``k_cache`` a layer of the page
        manager, ``cache.layer(i)`` (its K, V and storage options), v_cache
        left out and ``scale=`` by keyword. ``causal``: the query at absolute
        position p sees positions 0..p of its sequence; otherwise all
        kv_lens[s] (a plan with q_lens > kv_lens is non-causal only).
        ``scale`` multiplies q.k before the softmax.

        Options (keywords; ``AttentionOptions``, one row each in
        ``cupaged/ops/attention/options.py``; docs/layout.md, "Score variants
        and visibility"; each score option a compile-time choice of the
        kernels, none costs anything when off):

        {options}

        Caches (docs/layout.md, "Cache views and fp8 caches") may be any views
        whose innermost dim is contiguous: an HND cache
        ``[pages, Hkv, page_size, D].transpose(0, 2, 1, 3)``, the halves
        ``kv[:, 0]`` / ``kv[:, 1]`` of a combined ``[pages, 2, page_size, Hkv,
        D]`` tensor. An fp8 cache (ml_dtypes float8_e4m3fn / float8_e5m2
        arrays, or uint8 storage with ``kv_dtype``) takes float16 / bfloat16
        q. The storage options are those of ``append`` and
        ``PagedKVCache.kv_args(layer)``.

        Returns out [queries, Hq, Dv] in q's dtype, or (out, lse) with
        ``return_lse`` (or a given ``lse``): lse float32 [queries, Hq], natural
        log of the sum of exp(logit) over the visible positions (and the
        sink). ``out``/``lse``: preallocated outputs written in place (must
        not overlap any input). ``workspace``: a SplitWorkspace to split the
        visible history over ``workspace.splits`` blocks and merge (no host
        sync).
        """
        self._fresh()
        return attention_op.attention(
            self,
            q,
            k_cache,
            v_cache,
            scale,
            causal,
            workspace=workspace,
            out=out,
            lse=lse,
            return_lse=return_lse,
            **options,
        )

    @document
    def mla(
        self,
        q,
        q_rot=MISSING,
        latent=None,
        k_rot=MISSING,
        scale: float | None = None,
        causal: bool = True,
        *,
        workspace: SplitWorkspace | None = None,
        out=None,
        lse=None,
        return_lse: bool = False,
        **options,
    ):
        """DeepSeek-style multi-head latent attention, absorbed form.

        q [queries, H, R]: the absorbed query (q_nope times the key
        up-projection); q_rot [queries, H, P]: its rotary part (both any
        views whose last dim is contiguous, e.g. the two column ranges of
        one [queries, H, R + P] query);
        latent [pages, page_size, 1, R]: the normalized latent cache (one
        shared head); k_rot [pages, page_size, 1, P]: the rotated positional
        cache. score = scale * (q . latent + q_rot . k_rot); the values are
        the latent rows. Returns [queries, H, R] in q's dtype (and float32 lse
        [queries, H] with ``return_lse``). ``q_pos`` / ``k_pos``: q_rot's and
        k_rot's names before (keywords, deprecated; positions keep working).

        ``scale`` comes from the original model's QK head dimensions (e.g.
        1/sqrt(128 + 64) for DeepSeek-V3), not from R. The caller applies the
        value and output projections to the current queries only. Both caches
        are written by ``append`` (heads = 1, D = R, Dv = P); ``latent`` may
        be a layer of the page manager, ``cache.layer(i)`` (K the latent, V
        k_rot), k_rot left out and ``scale=`` by keyword. Causal masking,
        chunked prefill, split workspaces, outputs and the options work as in
        ``attention`` (the per-head arrays [H]):

        {options}

        Without a rotary part (P = 0) pass q_rot = k_rot = None, or
        zero-width arrays (q_rot [queries, H, 0], k_rot [pages, page_size, 1,
        0]: FlashInfer's spelling), which mean the same. The caches
        may be views (``latent = c[..., :R]``, ``k_rot = c[..., R:]`` of one
        [pages, page_size, 1, R + P] cache) and fp8 as in ``attention``:
        ``k_scale`` dequantizes the latent, ``v_scale`` k_rot (append's K and
        V).
        """
        self._fresh()
        return attention_op.mla(
            self,
            q,
            q_rot,
            latent,
            k_rot,
            scale,
            causal,
            workspace=workspace,
            out=out,
            lse=lse,
            return_lse=return_lse,
            **options,
        )

    def append(
        self, new_k, new_v, k_cache, v_cache=None, *, kv_dtype=None, k_scale=None, v_scale=None, rope=None
    ) -> None:
        """Write new_k [queries, Hkv, D] and new_v [queries, Hkv, Dv] into the
        cache slot of each query's absolute position (page
        page_table[s, p // page_size], offset p % page_size), in place, in one
        kernel. Serves MLA caches too (Hkv = 1, D = R, Dv = P; new_v and
        v_cache None without a rotary part). Caches may be views whose
        innermost dim is contiguous; an fp8 cache (``kv_dtype`` for uint8
        storage) gets the rows quantized with ``k_scale`` / ``v_scale``;
        ``k_cache`` may be a layer of the page manager, ``cache.layer(i)`` (its
        caches and scales), v_cache then left out. ``rope`` (a
        ``cupaged.Rotary``): RoPE fused into the same launch, K rotated into
        the cache and the queries ``rope.q`` [queries, Hq, D] in place. See
        ``cupaged.ops.append.append``."""
        self._fresh()
        append_op.append(
            self, new_k, new_v, k_cache, v_cache, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, rope=rope
        )


class DevicePlanBuilder:
    """Plans built on the device (``cupaged.ops.plan_build``), for engines
    whose step metadata lives on the device (vLLM's CUDA build): one words
    buffer of a fixed capacity, allocated here once on the backend and
    device of ``like``, and ``build`` (one launch, no sync, no allocation)
    writing a step's plan into it. docs/layout.md, "Plans built on the device".

    Capacity: up to ``queries`` packed queries and ``sequences`` sequences a
    step, page tables ``table_width`` columns wide, caches of ``num_pages``
    pages of ``page_size`` tokens. A plan of Q queries (Q <= ``queries``)
    has ``sequences + 1`` rows: the step's sequences, padding rows (kv_len 0,
    no query, no page) and the last row, the padding sequence, which holds
    the queries past the step's (kv_len 0: they read nothing, write nothing
    by ``write_slots`` with slot -1, and their attention output is 0). Its
    words are exactly ``HostPlan.build(table, kv_lens, q_lens, page_size,
    num_pages).upload(like).words`` for the step so padded (table rows -1,
    kv_lens 0, q_lens 0 but the last, Q minus the step's queries).

    The plan's host side (``plan.host``) knows only the sizes: its kernel
    choice is that of a decode batch of Q one-query sequences (the
    per-query kernels, as ``HostPlan.slots``), so the launches depend on Q
    alone and a CUDA graph captured over a plan of Q queries replays any
    step of Q (padded) queries; ``causal_ok`` is True (the device cannot tell
    the host otherwise: a sequence with more queries than keys sets a status
    bit) and appends through ``plan.append`` are not checked on the host
    (``stable``): write K/V with ``write_slots`` and the engine's slot mapping.

    ``status`` uint32 [1]: bits the device found wrong in a step's values
    (``cupaged.ops.plan_build.STATUS_BITS``), sticky; ``errors()`` /
    ``check()`` read it (a synchronization: for tests and debugging, never
    per step).
    """

    def __init__(self, queries: int, sequences: int, table_width: int, page_size: int, num_pages: int, like):
        self.queries = checks.host_int("queries", queries, 0, U32_MAX)
        self.sequences = checks.host_int("sequences", sequences, 0, U32_MAX - 1)
        self.table_width = checks.host_int("table_width", table_width, 1, U32_MAX)
        self.page_size = checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        self.num_pages = checks.host_int("num_pages", num_pages, 1, U32_MAX - 1)
        #: Rows of every plan: the sequences and the padding sequence.
        self.rows = self.sequences + 1
        checks.u32_size("page_table", (self.rows, self.table_width))
        n_words = layout.metadata_words(self.queries, self.rows, self.table_width)
        checks.u32_size("metadata words", (n_words,))
        stream = stream_for(like)
        check_not_capturing(stream, "DevicePlanBuilder")
        #: uint32 [metadata_words(queries, rows, table_width)]: a plan of Q queries uses its first
        #: metadata_words(Q, rows, table_width) words.
        self.words = zeros(like, n_words, np.uint32)
        self.status = zeros(like, 1, np.uint32)
        self._plans: dict[tuple, DevicePlan] = {}

    def __repr__(self) -> str:
        return (
            f"DevicePlanBuilder(queries={self.queries}, sequences={self.sequences}, table_width={self.table_width}, "
            f"page_size={self.page_size}, num_pages={self.num_pages})"
        )

    def _host(self, queries: int) -> HostPlan:
        """The host side of a plan of ``queries`` queries: sizes, and the
        schedule of a decode batch (see the class docstring)."""
        rows, width = self.rows, self.table_width
        return HostPlan(
            queries=queries,
            sequences=rows,
            table_width=width,
            page_size=self.page_size,
            pages=self.num_pages,
            max_kv_len=min(width * self.page_size, MAX_VISIBLE_LEN),
            words=np.zeros(0, np.uint32),  # the words live on the device only
            page_table=np.full((rows, width), -1, np.int64),
            kv_lens=np.zeros(rows, np.int64),
            q_lens=np.ones(queries, np.int64),  # the schedule's view: one query a sequence
            q_seq=np.arange(queries, dtype=np.int64),
            q_pos=np.zeros(queries, np.int64),
            stable=True,
        )

    def build(self, query_start_loc, seq_lens, block_table, queries: int | None = None) -> DevicePlan:
        """Stream work (one launch on the current stream of the builder's
        device): the plan of one step from device arrays (or NumPy arrays on
        the CPU backend) query_start_loc int32 [num_seqs + 1] (the step's
        queries of sequence s are query_start_loc[s] - query_start_loc[0] ..
        query_start_loc[s + 1] - query_start_loc[0] - 1), seq_lens int32
        [num_seqs] (kv lengths, this step's tokens included), block_table
        int32 [num_seqs, cols] (cols <= table_width; rows may be strided),
        num_seqs <= ``sequences``. ``queries``: the plan's queries Q (default
        the capacity), >= the step's (else the step is padded out on the
        device, a status bit). Returns the DevicePlan of Q queries over the
        builder's words (one object per Q and stream, reused: a later build
        overwrites the words of every plan of this builder)."""
        q = self.queries if queries is None else checks.host_int("queries", queries, 0, self.queries)
        stream = stream_for(self.words)
        key = (q, stream.backend, stream.device, getattr(stream, "ptr", None))
        plan = self._plans.get(key)
        if plan is None:
            view = self.words[: layout.metadata_words(q, self.rows, self.table_width)]
            plan = DevicePlan(self._host(q), view, stream)
        plan_build_op.build_plan_words(
            plan.words,
            self.status,
            query_start_loc,
            seq_lens,
            block_table,
            queries=q,
            sequences=self.rows,
            table_width=self.table_width,
            page_size=self.page_size,
            num_pages=self.num_pages,
        )
        self._plans[key] = plan
        return plan

    def errors(self) -> int:
        """The status bits since the last call (reads the device: a
        synchronization), then clears them."""
        stream = stream_for(self.status)
        if stream.backend == CPU:
            bits = int(self.status[0])
        else:
            stream.synchronize()
            bits = int(self.status.get()[0])
        stream.memset_d32(self.status, 0)
        return bits

    def check(self) -> None:
        """Raise PagedAttentionError naming what the device found wrong in
        the steps built since the last check (``errors()``; a sync)."""
        bits = self.errors()
        if bits:
            found = "; ".join(m for b, m in plan_build_op.STATUS_BITS.items() if bits & b)
            raise PagedAttentionError(f"device plan metadata: {found}")
