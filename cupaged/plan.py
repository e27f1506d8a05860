"""Step plans: HostPlan (host work, once per schedule) and DevicePlan
(uploaded metadata; its methods check and launch, nothing else).

The layout of page tables, positions and metadata words is defined in
``docs/layout.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import _backend, _checks
from .errors import PagedAttentionError
from .stream import Stream, check_not_capturing, stream_for

U32_MAX = _checks.U32_MAX
MAGIC = 0x31475043  # "CPG1"
HEADER_WORDS = 16
MAX_PAGE_SIZE = 256
MAX_HEAD_DIM = 1024
#: Largest MLA rotary dim P.
MAX_ROPE_DIM = 256
#: Most splits of the visible history a SplitWorkspace may hold.
MAX_SPLITS = 64
#: Tokens per split below which splitting does not pay (see choose_splits).
MIN_TOKENS_PER_SPLIT = 256


def metadata_offsets(queries: int, sequences: int) -> dict[str, int]:
    """Word offsets of the metadata arrays (docs/layout.md)."""
    q_seq = HEADER_WORDS
    q_pos = q_seq + queries
    kv_len = q_pos + queries
    q_start = kv_len + sequences
    page_table = q_start + sequences + 1
    return dict(q_seq=q_seq, q_pos=q_pos, kv_len=kv_len, q_start=q_start, page_table=page_table)


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

    @classmethod
    def build(cls, page_table, kv_lens, q_lens, page_size: int, num_pages: int) -> "HostPlan":
        """Validate one step's schedule and lay out its metadata words.

        page_table [sequences, table_width] int: entry [s, j] is the page of
        tokens j*page_size .. (j+1)*page_size-1 of sequence s; entries past a
        sequence's length are ignored (may be -1).
        kv_lens [sequences]: tokens visible this step, new tokens included.
        q_lens [sequences]: new queries this step, 0 <= q_lens <= kv_lens;
        query i of sequence s sits at position kv_lens[s] - q_lens[s] + i.
        """
        page_size = _checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        num_pages = _checks.host_int("num_pages", num_pages, 1, U32_MAX - 1)
        table = _checks.host_int_array("page_table", page_table, 2)
        kv = _checks.host_int_array("kv_lens", kv_lens, 1)
        ql = _checks.host_int_array("q_lens", q_lens, 1)
        sequences, width = table.shape
        if kv.shape[0] != sequences:
            raise PagedAttentionError(
                f"kv_lens: expected shape [{sequences}] (one per page_table row), got {_checks.shape_str(kv.shape)}")
        if ql.shape[0] != sequences:
            raise PagedAttentionError(
                f"q_lens: expected shape [{sequences}] (one per page_table row), got {_checks.shape_str(ql.shape)}")
        capacity = width * page_size
        for s in range(sequences):
            if kv[s] < 0 or kv[s] > capacity:
                raise PagedAttentionError(
                    f"kv_lens[{s}]: expected 0..{capacity} (table_width {width} x page_size {page_size}), got {kv[s]}")
            if ql[s] < 0 or ql[s] > kv[s]:
                raise PagedAttentionError(f"q_lens[{s}]: expected 0..kv_lens[{s}]={kv[s]}, got {ql[s]}")
        used = -(-kv // page_size)  # pages inside each sequence's length
        inside = np.arange(width)[None, :] < used[:, None]
        bad = inside & ((table < 0) | (table >= num_pages))
        if bad.any():
            s, j = (int(x) for x in np.argwhere(bad)[0])
            raise PagedAttentionError(
                f"page_table[{s}, {j}]: expected a page id in 0..{num_pages - 1} (inside kv_lens[{s}]={kv[s]}), "
                f"got {table[s, j]}")
        queries = int(ql.sum())
        _checks.u32_size("page_table", table.shape)
        _checks.u32_size("queries", (queries,))
        q_start = np.zeros(sequences + 1, np.int64)
        np.cumsum(ql, out=q_start[1:])
        q_seq = np.repeat(np.arange(sequences, dtype=np.int64), ql)
        q_pos = (kv - ql)[q_seq] + (np.arange(queries, dtype=np.int64) - q_start[q_seq])
        off = metadata_offsets(queries, sequences)
        n_words = off["page_table"] + sequences * width
        _checks.u32_size("metadata words", (n_words,))
        words = np.zeros(n_words, np.uint32)
        words[:6] = (MAGIC, queries, sequences, width, page_size, num_pages)
        words[6:11] = (off["q_seq"], off["q_pos"], off["kv_len"], off["q_start"], off["page_table"])
        words[off["q_seq"]:off["q_pos"]] = q_seq
        words[off["q_pos"]:off["kv_len"]] = q_pos
        words[off["kv_len"]:off["q_start"]] = kv
        words[off["q_start"]:off["page_table"]] = q_start
        valid = (table >= 0) & (table < num_pages)
        words[off["page_table"]:] = np.where(valid, table, U32_MAX).reshape(-1)
        return cls(queries=queries, sequences=sequences, table_width=width, page_size=page_size,
                   pages=num_pages, max_kv_len=int(kv.max()) if sequences else 0, words=words,
                   page_table=table, kv_lens=kv, q_lens=ql, q_seq=q_seq, q_pos=q_pos)

    def write_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(page [queries], offset [queries]) each query's new K/V goes to."""
        pages = self.page_table[self.q_seq, self.q_pos // self.page_size]
        return pages, self.q_pos % self.page_size

    def validate_writes(self) -> None:
        """Reject schedules whose appends would collide or leave the cache:
        two queries writing one slot, a slot past the table, a page id out of
        range. (Build already guarantees the last two; checked again here.)"""
        if self.queries == 0:
            return
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
                f"copied before it is written")

    def upload(self, like) -> "DevicePlan":
        """Copy the metadata words to the backend, device and stream of
        ``like`` (a NumPy or CuPy array). One small async upload; no sync."""
        stream = stream_for(like)
        check_not_capturing(stream, "plan.upload")
        if stream.backend == _backend.CPU:
            words = self.words.copy()
        else:
            words = _backend.empty(like, self.words.shape, np.uint32)
            stream.copy_from_host(words, self.words)
        return DevicePlan(self, words, stream)


class SplitWorkspace:
    """FP32 partial outputs and statistics for split-KV attention.

    ``partial_out`` [splits, queries, heads, value_dim] float32 and
    ``partial_lse`` [splits, queries, heads] float32, on the backend, device
    and stream of ``like``. Reusable by every plan with the same queries,
    heads and value dim on that device and stream (docs/layout.md).
    """

    def __init__(self, queries: int, heads: int, value_dim: int, splits: int, like):
        self.queries = _checks.host_int("queries", queries, 0, U32_MAX)
        self.heads = _checks.host_int("heads", heads, 1, U32_MAX)
        self.value_dim = _checks.host_int("value_dim", value_dim, 1, MAX_HEAD_DIM)
        self.splits = _checks.host_int("splits", splits, 1, MAX_SPLITS)
        if _backend.array_backend(like) is None:
            raise PagedAttentionError(f"like: expected a NumPy or CuPy array, got {type(like).__name__}")
        _checks.u32_size("workspace", (self.splits, self.queries, self.heads, self.value_dim))
        self.stream = stream_for(like)
        check_not_capturing(self.stream, "SplitWorkspace")
        self.backend = self.stream.backend
        self.device = _backend.device_id(like)
        self.partial_out = _backend.empty(like, (self.splits, self.queries, self.heads, self.value_dim), np.float32)
        self.partial_lse = _backend.empty(like, (self.splits, self.queries, self.heads), np.float32)

    def __repr__(self) -> str:
        return (f"SplitWorkspace(queries={self.queries}, heads={self.heads}, value_dim={self.value_dim}, "
                f"splits={self.splits}, backend={self.backend!r})")


def multiprocessor_count(like) -> int:
    """SMs of ``like``'s GPU, or the CPU backend's worker count."""
    if _backend.array_backend(like) == _backend.GPU:
        import cupy
        rt = cupy.cuda.runtime   # one attribute query (Device.attributes reads them all)
        return int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, int(like.device.id)))
    import os
    return int(os.environ.get("CUPAGED_CPU_WORKERS") or os.cpu_count() or 1)


def choose_splits(plan, kv_heads: int, like=None, *, multiprocessors: int | None = None,
                  q_heads: int | None = None, head_dim: int | None = None, value_dim: int | None = None,
                  dtype=None, rot_dim: int = 0) -> int:
    """Split count for a plan (HostPlan or DevicePlan) with ``kv_heads``.

    Rule: let ``blocks`` be the unsplit grid's block count. If that is at
    least twice the multiprocessor count, or no sequence has more than
    ``MIN_TOKENS_PER_SPLIT`` (256) tokens, return 1. Otherwise return
    ``min(MAX_SPLITS, ceil(2 * SMs / blocks), ceil(max_kv_len / 256))``, so
    the grid roughly fills the device twice and no split gets fewer than
    about 256 tokens.

    ``blocks`` is ``queries * kv_heads`` (one block per query and KV head),
    unless the shapes are given (``q_heads``, ``head_dim``, ``value_dim``,
    ``dtype``, and ``rot_dim`` for MLA): then it is the grid of the kernel
    that will run (``cupaged.attention.unsplit_blocks``), which for the
    tensor-core kernels serves several queries per block. Host data only;
    no synchronization. ``like`` gives the device (SM count) unless
    ``multiprocessors`` is passed.
    """
    host = plan.host if isinstance(plan, DevicePlan) else plan
    if multiprocessors is None:
        if like is None:
            raise PagedAttentionError("like: expected an array (or pass multiprocessors=)")
        multiprocessors = multiprocessor_count(like)
    if q_heads is None:
        blocks = host.queries * int(kv_heads)
    else:
        if head_dim is None or dtype is None:
            raise PagedAttentionError("head_dim, dtype: expected both with q_heads")
        from .attention import unsplit_blocks
        blocks = unsplit_blocks(host, int(q_heads), int(kv_heads), int(head_dim),
                                int(head_dim if value_dim is None else value_dim), dtype, int(rot_dim))
    target = 2 * int(multiprocessors)
    if blocks == 0 or blocks >= target or host.max_kv_len <= MIN_TOKENS_PER_SPLIT:
        return 1
    return int(max(1, min(MAX_SPLITS, math.ceil(target / blocks),
                          math.ceil(host.max_kv_len / MIN_TOKENS_PER_SPLIT))))


class DevicePlan:
    """A HostPlan uploaded to one backend, device and stream. Reusable while
    the schedule is unchanged; ops launch on the stream of the upload."""

    def __init__(self, host: HostPlan, words, stream: Stream):
        self.host = host
        self.words = words
        self.stream = stream
        self.backend = stream.backend
        self.device = stream.device

    def __getattr__(self, name):  # queries, sequences, page_size, ... from the host plan
        if name in ("queries", "sequences", "table_width", "page_size", "pages", "max_kv_len"):
            return getattr(self.host, name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        h = self.host
        return (f"DevicePlan(queries={h.queries}, sequences={h.sequences}, table_width={h.table_width}, "
                f"page_size={h.page_size}, pages={h.pages}, backend={self.backend!r}, device={self.device})")

    # -- checks shared by attention / mla / append -------------------------
    def _check_backend(self, **arrays) -> None:
        backend = _backend.backend_of(**arrays)
        name = next(k for k, v in arrays.items() if v is not None)
        if backend != self.backend:
            raise PagedAttentionError(
                f"{name}: expected an array of the plan's {self.backend} backend, got the {backend} backend")
        for n, a in arrays.items():
            if a is not None and _backend.device_id(a) != self.device:
                raise PagedAttentionError(
                    f"{n}: expected an array on the plan's device {self.device}, got device {_backend.device_id(a)}")
        if backend == _backend.GPU and stream_for(arrays[name]) is not self.stream:
            raise PagedAttentionError(
                f"{name}: CuPy's current stream is not the stream this plan was uploaded on; "
                f"upload the plan on the stream you launch on")

    def _check_cache(self, name: str, cache, heads: int | None = None) -> None:
        _checks.float_array(name, cache, 4)
        _checks.u32_size(name, cache.shape[1:])
        exp = (self.host.pages, self.host.page_size)
        if tuple(cache.shape[:2]) != exp:
            raise PagedAttentionError(
                f"{name}: expected shape [{exp[0]}, {exp[1]}, ...] (plan.pages, plan.page_size, ...), "
                f"got {_checks.shape_str(cache.shape)}")
        if heads is not None and cache.shape[2] != heads:
            raise PagedAttentionError(f"{name}: expected {heads} head(s) in dim 2, got shape "
                                      f"{_checks.shape_str(cache.shape)}")

    def _check_workspace(self, workspace, heads: int, value_dim: int):
        if workspace is None:
            return None
        if not isinstance(workspace, SplitWorkspace):
            raise PagedAttentionError(f"workspace: expected a SplitWorkspace, got {type(workspace).__name__}")
        exp = (self.host.queries, heads, value_dim)
        got = (workspace.queries, workspace.heads, workspace.value_dim)
        if got != exp:
            raise PagedAttentionError(
                f"workspace: expected queries, heads, value_dim = {exp}, got {got}")
        if workspace.backend != self.backend or workspace.device != self.device:
            raise PagedAttentionError(
                f"workspace: expected the plan's {self.backend} backend, device {self.device}; got "
                f"{workspace.backend} backend, device {workspace.device}")
        if workspace.stream is not self.stream:
            raise PagedAttentionError("workspace: expected the plan's stream, got a workspace made on another stream")
        if not 1 <= workspace.splits <= MAX_SPLITS:
            raise PagedAttentionError(f"workspace: expected 1..{MAX_SPLITS} splits, got {workspace.splits}")
        return workspace

    def _outputs(self, q, out, lse, return_lse: bool, heads: int, value_dim: int, inputs: dict):
        shape = (self.host.queries, heads, value_dim)
        _checks.u32_size("out", shape)
        if out is None:
            check_not_capturing(self.stream, "out")
            out = _backend.empty(q, shape, q.dtype)
        else:
            self._check_backend(out=out)
            _checks.float_array("out", out, 3)
            _checks.same_dtype("q", q, out=out)
            _checks.shape_is("out", out, shape)
            _checks.no_overlap("out", out, **inputs)
        if lse is None and return_lse:
            check_not_capturing(self.stream, "lse")
            lse = _backend.empty(q, shape[:2], np.float32)
        elif lse is not None:
            self._check_backend(lse=lse)
            if str(lse.dtype) != "float32" or not lse.flags.c_contiguous:
                raise PagedAttentionError(f"lse: expected a C-contiguous float32 array, got {lse.dtype}")
            _checks.shape_is("lse", lse, shape[:2])
            _checks.no_overlap("lse", lse, out=out, **inputs)
        return out, lse

    # -- ops ----------------------------------------------------------------
    def attention(self, q, k_cache, v_cache, scale: float, causal: bool = True, *,
                  workspace: SplitWorkspace | None = None, out=None, lse=None, return_lse: bool = False):
        """Paged attention for the plan's packed queries.

        q [queries, Hq, D]; k_cache [pages, page_size, Hkv, D];
        v_cache [pages, page_size, Hkv, Dv]; Hq % Hkv == 0 and query head h
        reads KV head h // (Hq // Hkv). ``causal``: the query at absolute
        position p sees positions 0..p of its sequence; otherwise all
        kv_lens[s]. ``scale`` multiplies q.k before the softmax.

        Returns out [queries, Hq, Dv] in q's dtype, or (out, lse) with
        ``return_lse`` (or a given ``lse``): lse float32 [queries, Hq], natural
        log of the sum of exp(scale * q.k). ``out``/``lse``: preallocated
        outputs written in place (must not overlap any input). ``workspace``:
        a SplitWorkspace to split the visible history over
        ``workspace.splits`` blocks and merge (no host sync).
        """
        self._check_backend(q=q, k_cache=k_cache, v_cache=v_cache)
        _checks.float_array("q", q, 3)
        self._check_cache("k_cache", k_cache)
        self._check_cache("v_cache", v_cache)
        _checks.same_dtype("q", q, k_cache=k_cache, v_cache=v_cache)
        queries, hq, d = (int(x) for x in q.shape)
        hkv, dv = int(k_cache.shape[2]), int(v_cache.shape[3])
        if queries != self.host.queries:
            raise PagedAttentionError(f"q: expected {self.host.queries} rows (plan.queries), got shape "
                                      f"{_checks.shape_str(q.shape)}")
        _checks.v_like_k(k_cache, v_cache)
        if int(k_cache.shape[3]) != d:
            raise PagedAttentionError(f"k_cache: expected head dim D={d} like q, got shape "
                                      f"{_checks.shape_str(k_cache.shape)}")
        _head_dims(hq, hkv, d, dv)
        scale = _checks.positive_scale(scale)
        ws = self._check_workspace(workspace, hq, dv)
        inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache)
        if ws is not None:
            inputs.update(workspace_out=ws.partial_out, workspace_lse=ws.partial_lse)
        want_lse = return_lse or lse is not None
        out, lse = self._outputs(q, out, lse, want_lse, hq, dv, inputs)
        from .attention import launch_attention
        launch_attention(self.stream, self, q, k_cache, v_cache, out, scale, bool(causal), lse=lse, workspace=ws)
        return (out, lse) if want_lse else out

    def mla(self, q, q_pos, latent, k_pos, scale: float, causal: bool = True, *,
            workspace: SplitWorkspace | None = None, out=None, lse=None, return_lse: bool = False):
        """DeepSeek-style multi-head latent attention, absorbed form.

        q [queries, H, R]: the absorbed query (q_nope times the key
        up-projection); q_pos [queries, H, P]: its rotary part;
        latent [pages, page_size, 1, R]: the normalized latent cache (one
        shared head); k_pos [pages, page_size, 1, P]: the rotated positional
        cache. score = scale * (q . latent + q_pos . k_pos); the values are
        the latent rows. Returns [queries, H, R] in q's dtype (and float32 lse
        [queries, H] with ``return_lse``).

        ``scale`` comes from the original model's QK head dimensions (e.g.
        1/sqrt(128 + 64) for DeepSeek-V3), not from R. The caller applies the
        value and output projections to the current queries only. Both caches
        are written by ``append`` (heads = 1, D = R, Dv = P). Causal masking,
        chunked prefill, split workspaces and outputs work as in ``attention``.
        """
        self._check_backend(q=q, q_pos=q_pos, latent=latent, k_pos=k_pos)
        _checks.float_array("q", q, 3)
        _checks.float_array("q_pos", q_pos, 3)
        self._check_cache("latent", latent)
        self._check_cache("k_pos", k_pos)
        _checks.same_dtype("q", q, q_pos=q_pos, latent=latent, k_pos=k_pos)
        queries, h, r = (int(x) for x in q.shape)
        if queries != self.host.queries:
            raise PagedAttentionError(f"q: expected {self.host.queries} rows (plan.queries), got shape "
                                      f"{_checks.shape_str(q.shape)}")
        for name, cache in (("latent", latent), ("k_pos", k_pos)):
            if int(cache.shape[2]) != 1:
                raise PagedAttentionError(f"{name}: expected one shared head (dim 2 == 1), got shape "
                                          f"{_checks.shape_str(cache.shape)}")
        if tuple(q_pos.shape[:2]) != (queries, h):
            raise PagedAttentionError(f"q_pos: expected shape [{queries}, {h}, P] like q, got "
                                      f"{_checks.shape_str(q_pos.shape)}")
        p = int(q_pos.shape[2])
        if not 1 <= p <= MAX_ROPE_DIM:
            raise PagedAttentionError(f"q_pos: expected a rotary dim P in 1..{MAX_ROPE_DIM}, got {p}")
        if int(k_pos.shape[3]) != p:
            raise PagedAttentionError(f"k_pos: expected rotary dim P={p} like q_pos, got shape "
                                      f"{_checks.shape_str(k_pos.shape)}")
        if int(latent.shape[3]) != r:
            raise PagedAttentionError(f"latent: expected R={r} like q, got shape {_checks.shape_str(latent.shape)}")
        _head_dims(h, 1, r, r)
        scale = _checks.positive_scale(scale)
        ws = self._check_workspace(workspace, h, r)
        inputs = dict(q=q, q_pos=q_pos, latent=latent, k_pos=k_pos)
        if ws is not None:
            inputs.update(workspace_out=ws.partial_out, workspace_lse=ws.partial_lse)
        want_lse = return_lse or lse is not None
        out, lse = self._outputs(q, out, lse, want_lse, h, r, inputs)
        from .attention import launch_attention
        launch_attention(self.stream, self, q, latent, latent, out, scale, bool(causal),
                         q_rot=q_pos, k_rot=k_pos, lse=lse, workspace=ws)
        return (out, lse) if want_lse else out

    def append(self, new_k, new_v, k_cache, v_cache) -> None:
        """Write new_k [queries, Hkv, D] and new_v [queries, Hkv, Dv] into the
        cache slot of each query's absolute position (page
        page_table[s, p // page_size], offset p % page_size), in place, in one
        kernel. Serves MLA caches too (Hkv = 1, D = R, Dv = P). See
        ``cupaged.cache.append``."""
        from .cache import append
        append(self, new_k, new_v, k_cache, v_cache)


def _head_dims(hq: int, hkv: int, d: int, dv: int) -> None:
    if hkv < 1 or hq < 1 or hq % hkv:
        raise PagedAttentionError(
            f"q: expected a head count that is a multiple of the caches' {hkv} KV heads, got Hq={hq}")
    for name, v in (("D", d), ("Dv", dv)):
        if not 1 <= v <= MAX_HEAD_DIM:
            raise PagedAttentionError(f"{name}: expected a head dim in 1..{MAX_HEAD_DIM}, got {v}")
