"""The page manager: paged K/V caches of every layer, sequences,
copy-on-write, reservations for decode graphs and prefix reuse.

``PagedKVCache`` owns the K and V caches of all layers (one allocation each,
layer-major) and their pages: sequences are handles, ``fork`` shares pages,
``prepare`` allocates the pages a step needs (and ``reserve`` further tokens
ahead), copies shared pages the step will write (one launch of
``copy_pages`` for every layer, ``cupaged.ops.append``) and uploads the step's
plan; ``append`` writes one layer's new rows (``DevicePlan.append``). With
``prefix_cache=True`` full pages are indexed by a hash chain of their token
ids, so a new sequence with a known prefix shares them (``add_sequence``).

Layout of caches, positions and metadata words: ``docs/layout.md``.

    cache = PagedKVCache(num_pages=1024, page_size=16, kv_heads=8, head_dim=128,
                         dtype="bfloat16", layers=32, like=some_cupy_array)
    a = cache.add_sequence()
    plan, _ = cache.prepare([a], [prompt_len])        # prefill
    for layer in range(32):
        cache.append(plan, new_k, new_v, layer=layer)  # new_k: [prompt_len, 8, 128]
        out = plan.attention(q, cache.k[layer], cache.v[layer], scale)
    b = cache.fork(a)                                  # shares every page of a
    plan, report = cache.prepare([a, b], [1, 1])       # decode: copies a shared last page
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtypes
from ._runtime import GPU, array_backend, checks, empty, stream_for, zeros
from ._runtime.arrays import Array
from .errors import PagedAttentionError
from .layout import MAX_PAGE_SIZE, U32_MAX
from .ops.append import Rotary, copy_pages
from .ops.attention.options import KVLayer
from .plan import DevicePlan, HostPlan

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

    from .batch import DecodeBatch

#: Most layers of one cache (the copy kernel's grid covers them in one launch).
MAX_LAYERS = 65535

# ---------------------------------------------------------------------------
# Page manager


class Sequence:
    """A sequence handle of one PagedKVCache. Read-only: the cache changes it.

    ``id``; ``length``: tokens cached, this step's new tokens included once
    prepared (in a decode loop or batch: the length the device holds, see
    docs/layout.md); ``pages``: page ids in token order, reserved pages past
    the length included; ``capacity``: tokens those pages hold;
    ``cached_tokens``: tokens shared from the prefix cache when it was added;
    ``tokens``: the token ids the cache knows (the prompt given to
    ``add_sequence``, ``add_tokens``, tokens read back by a DecodeBatch);
    ``batch``: the DecodeBatch whose slot holds it, or None; ``alive``:
    False once freed."""

    __slots__ = (
        "id",
        "length",
        "_pages",
        "_cache",
        "alive",
        "cached_tokens",
        "_tokens",
        "_written",
        "_indexed",
        "_batch",
        "_drive",
        "__weakref__",
    )

    def __init__(self, cache: "PagedKVCache", seq_id: int, pages: list[int], length: int):
        self.id = seq_id
        self.length = length
        self._pages = pages
        self._cache = cache
        self.alive = True
        self.cached_tokens = 0
        self._tokens: list[int] = []
        self._written = length  # tokens whose K/V are known written (prefix index; docs/layout.md)
        self._indexed = 0  # leading pages already offered to the prefix index
        self._batch: DecodeBatch | None = None  # the DecodeBatch whose slot holds it
        self._drive = None  # the _Drive of the live PagedDecodeLoop driving it

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self._pages)

    @property
    def capacity(self) -> int:
        return len(self._pages) * self._cache.page_size

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def batch(self) -> DecodeBatch | None:
        """The DecodeBatch whose slot holds this sequence (set by ``join``),
        or None: not in one, or it left (``leave``, or finishing at a
        ``readback``). Such a sequence cannot be prepared, forked or freed."""
        return self._batch

    def __repr__(self) -> str:
        state = "" if self.alive else ", freed"
        return f"Sequence(id={self.id}, length={self.length}, pages={self._pages}{state})"


@dataclass(frozen=True)
class StepReport:
    """What ``PagedKVCache.prepare`` / ``reserve`` did besides building a plan.

    ``copied_pages``: (src, dst) page ids copied on write (each in both
    caches, every layer); ``copied_bytes``: bytes copied (K and V, all
    layers); ``allocated_pages``: pages taken (copies included), evicted
    cached pages among them; ``evicted_pages``: cached prefix pages reused."""

    copied_pages: list = field(default_factory=list)
    copied_bytes: int = 0
    allocated_pages: int = 0
    evicted_pages: int = 0


class _Entry:
    """A full page in the prefix index: its page id, the token ids it holds,
    the entry of the page before it (None for a sequence's first page), its
    key (hash of the parent's key and these tokens) and its children."""

    __slots__ = ("page", "tokens", "parent", "key", "children")

    def __init__(self, page, tokens, parent, key):
        self.page, self.tokens, self.parent, self.key = page, tokens, parent, key
        self.children: set = set()


class _Writes:
    """The writes of one plan of this cache that ``append`` tracks: the
    layers appended (eagerly / under capture) and, for a prepare plan, the
    token range each sequence gets. When ``auto`` and every layer was
    appended eagerly, the range counts as written (prefix index)."""

    __slots__ = ("seqs", "starts", "ends", "layers", "captured", "auto", "driven")

    def __init__(self, seqs, starts, ends, auto):
        self.seqs, self.starts, self.ends, self.auto = seqs, starts, ends, auto
        self.layers: set = set()
        self.captured: set = set()
        self.driven = False  # a PagedDecodeLoop has driven the plan (its device words moved on)


class _Drive:
    """A cache-driven PagedDecodeLoop's hold on its sequences (``PagedKVCache._drive``).

    While it holds, each sequence's ``length`` counts the step prepared
    next, whose token is in ``next_token`` and not in the cache, so fork,
    free, prepare, reserve and ``DecodeBatch.join`` refuse the sequences.
    ``end(drop)`` lets them go: the loop's ``finish()``, its last step (which
    does not advance, ``drop=False``) or its garbage collection; ``drop``
    takes that step back off each length (and makes the loop's plan stale).
    ``taken`` / ``steps``: the loop's progress, for messages."""

    __slots__ = ("cache", "seqs", "taken", "steps", "ended", "dropped")

    def __init__(self, cache, seqs, steps):
        self.cache, self.seqs, self.taken, self.steps = cache, seqs, 0, steps
        self.ended = self.dropped = False

    def end(self, drop: bool) -> None:
        with self.cache._lock:
            if self.ended:
                return
            self.ended, self.dropped = True, drop
            for s in self.seqs:
                if s._drive is self:
                    s._drive = None
                    if drop:
                        s.length -= 1


def _locked(method):
    """Run ``method`` holding its cache's lock (docs/layout.md, "Thread safety")."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


_ROOT_KEY = b"cupaged-prefix-root"


def page_key(parent_key: bytes, tokens: Iterable[int] | np.ndarray) -> bytes:
    """The prefix-index key of a full page: a 128-bit BLAKE2b hash of the
    parent page's key and the page's token ids (int64 little-endian). A
    sequence's first page has the parent key ``_ROOT_KEY``; so a key covers
    every token before the page too (a hash chain, as vLLM's automatic
    prefix caching). A hit is only taken after comparing the token ids and
    the parent entry exactly, so a collision cannot share wrong K/V."""
    return hashlib.blake2b(parent_key + np.asarray(tokens, "<i8").tobytes(), digest_size=16).digest()


#: A CPU-backend cache of at most this many bytes (K and V) has its memory written at construction (the page
#: faults then happen there, not in the first appends); a larger one is left to the OS's lazy mapping.
CPU_COMMIT_BYTES = 1 << 30


class PagedKVCache:
    """Paged K/V caches of ``layers`` layers and their pages, shared between
    sequences with reference counts and copied on write.

    ``k`` [layers, num_pages, page_size, kv_heads, head_dim] and ``v``
    [layers, num_pages, page_size, kv_heads, value_dim] (value_dim defaults
    to head_dim): one zeroed allocation each, layer-major, so ``k[layer]`` is
    that layer's contiguous [num_pages, page_size, kv_heads, head_dim] cache
    (what ``plan.attention`` and ``plan.append`` take). On the backend and
    device of ``like`` (a NumPy or CuPy array; None: NumPy). For MLA:
    kv_heads=1, head_dim=R (latent), value_dim=P (k_pos). One page table
    serves every layer.

    ``dtype``: float32, float16, bfloat16, or an fp8 format (``"e4m3"``,
    ``"e5m2"``, or vLLM's names ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``):
    then ``k`` / ``v`` hold fp8 codes (``ml_dtypes`` fp8 arrays on NumPy, raw
    uint8 on CuPy; ``kv_dtype`` names the format) and ``k_scale`` /
    ``v_scale`` are float32 arrays on the cache's device, [layers] (a scale
    per layer) or [layers, kv_heads] (per KV head), from the arguments of the
    same names (a number, or host / device data of either shape; default 1),
    writable in place. ``append`` quantizes with them; pass
    ``**cache.kv_args(layer)`` to ``plan.attention`` (or ``plan.mla``) to
    read a layer back.

    ``prefix_cache=True``: full pages are indexed by a hash chain of their
    token ids once their K/V are written (docs/layout.md, "Prefix reuse");
    ``add_sequence(tokens=ids)`` shares the longest cached prefix; a page
    whose last holder is freed stays cached and is evicted least recently
    used when pages run out.

    Host bookkeeping only, except ``prepare`` / ``reserve``, which launch at
    most one page copy (and ``prepare`` one small upload) per call and never
    synchronize.

    Thread safety: every method holds the cache's lock (one reentrant lock,
    which its DecodeBatches and cache-driven decode loops take as well), so
    calls from several threads run one at a time (docs/layout.md, "Thread
    safety").
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: DTypeLike,
        *,
        layers: int = 1,
        value_dim: int | None = None,
        like: Array | None = None,
        prefix_cache: bool = False,
        k_scale: float | Array | None = None,
        v_scale: float | Array | None = None,
    ):
        #: The one lock of this cache, its DecodeBatches and cache-driven loops (reentrant).
        self._lock = threading.RLock()
        self.num_pages = checks.host_int("num_pages", num_pages, 1, U32_MAX - 1)
        self.page_size = checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        self.kv_heads = checks.host_int("kv_heads", kv_heads, 1, U32_MAX)
        self.head_dim = checks.host_int("head_dim", head_dim, 1, U32_MAX)
        self.value_dim = self.head_dim if value_dim is None else checks.host_int("value_dim", value_dim, 1, U32_MAX)
        self.layers = checks.host_int("layers", layers, 1, MAX_LAYERS)
        self.prefix_cache = checks.boolean("prefix_cache", prefix_cache)
        fmt = dtypes.row("dtype", dtype, kv=True)
        #: The K/V format's token ("bf16", "e4m3", ...).
        self.kv_dtype = fmt.token
        if like is None:
            like = np.zeros(0, np.float32)
        if array_backend(like) is None:
            raise PagedAttentionError(f"like: expected a NumPy or CuPy array, got {type(like).__name__}")
        # The storage dtype of k / v: the format's, except fp8 on CuPy (raw uint8).
        self.dtype = np.dtype(np.uint8) if fmt.scaled and array_backend(like) == GPU else fmt.np_dtype
        for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None and not fmt.scaled:
                raise PagedAttentionError(
                    f"{name}: expected None for a {fmt.name} cache (scales belong to fp8 caches: dtype e4m3 / e5m2)"
                )
        k_shape = (self.layers, self.num_pages, self.page_size, self.kv_heads, self.head_dim)
        v_shape = k_shape[:4] + (self.value_dim,)
        # per-page sizes must fit 32-bit indexing; page offsets are 64-bit (docs/layout.md)
        checks.u32_size("k", k_shape[2:])
        checks.u32_size("v", v_shape[2:])
        self.backend = array_backend(like)
        self.k = zeros(like, k_shape, self.dtype)
        self.v = zeros(like, v_shape, self.dtype)
        if self.backend != GPU and self.k.nbytes + self.v.nbytes <= CPU_COMMIT_BYTES:
            # The CPU backend's cache memory committed now: NumPy's zeros are pages the OS maps on first write,
            # and those faults would land in the first requests' appends (SmolLM2's 256-token prefill append:
            # 0.98 -> 0.27 ms a layer, measured on 2 cores). A larger cache stays lazily mapped (it may be sized
            # past the memory the requests will touch).
            self.k.fill(0)
            self.v.fill(0)
        self.k_scale = self._scale("k_scale", k_scale, like) if fmt.scaled else None
        self.v_scale = self._scale("v_scale", v_scale, like) if fmt.scaled else None
        self._refs = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: page 0 is handed out first
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages no sequence holds, oldest first
        self._index: dict[bytes, _Entry] = {}  # key -> entry
        self._entry: dict[int, _Entry] = {}  # page -> its entry
        self._stats = {"hits": 0, "misses": 0, "evictions": 0}
        self._writes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # plan -> _Writes
        self._next_id = 0
        self._pairs: Array | None = None  # the device page list of copies (GPU), kept with the cache
        self._generation = 0  # bumped by every fork, free, prepare and reserve: older plans are stale

    def _scale(self, name: str, val, like):
        """A [layers] or [layers, kv_heads] float32 scale array on the cache's
        device, every value finite and > 0 (``checks.scale_values``)."""
        host: Any = np.ones(self.layers, np.float32) if val is None else val  # a number, host or CuPy data
        if array_backend(host) == GPU:
            host = host.get()
        if isinstance(host, (int, float, np.integer, np.floating)) and not isinstance(host, bool):
            host = np.full(self.layers, host, np.float64)
        host = np.asarray(host)
        if host.dtype.kind not in "fiu" or host.shape not in ((self.layers,), (self.layers, self.kv_heads)):
            raise PagedAttentionError(
                f"{name}: expected a number or float data of shape [{self.layers}] (per layer) "
                f"or [{self.layers}, {self.kv_heads}] (per layer and KV head), got "
                f"{host.dtype} {checks.shape_str(host.shape)}"
            )
        with np.errstate(over="ignore"):  # a value past float32's range becomes inf, which is refused
            checks.scale_values(name, host.astype(np.float32))
        out = zeros(like, host.shape, np.float32)
        if array_backend(out) == GPU:
            out.set(host.astype(np.float32))
        else:
            out[...] = host
        return out

    def kv_args(self, layer: int) -> dict:
        """The keyword arguments that read layer ``layer`` of these caches with
        ``plan.attention`` / ``plan.mla`` (and write it with ``plan.append`` /
        ``write_slots``): ``kv_dtype``, ``k_scale`` and ``v_scale`` for fp8
        caches, nothing otherwise."""
        layer = checks.host_int("layer", layer, 0, self.layers - 1)
        if self.k_scale is None:
            return {}

        def at(s):  # [1] (per tensor) or [kv_heads]: views, so later writes to the scales are seen
            return s[layer : layer + 1] if s.ndim == 1 else s[layer]

        return dict(kv_dtype=self.kv_dtype, k_scale=at(self.k_scale), v_scale=at(self.v_scale))

    def layer(self, layer: int) -> KVLayer:
        """Layer ``layer`` of these caches as one argument of ``plan.attention``
        / ``plan.mla`` / ``plan.append`` in place of K, V and their storage
        options: ``k`` [pages, page_size, Hkv, D] and ``v`` [pages, page_size,
        Hkv, Dv] (views of ``cache.k[layer]`` / ``cache.v[layer]``) and
        ``kv_args(layer)``. ``plan.attention(q, cache.layer(0), scale=s)``."""
        layer = checks.host_int("layer", layer, 0, self.layers - 1)
        return KVLayer(self.k[layer], self.v[layer], **self.kv_args(layer))

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, kv_heads={self.kv_heads}, "
            f"head_dim={self.head_dim}, value_dim={self.value_dim}, layers={self.layers}, "
            f"dtype={dtypes.dtype_name(self.kv_dtype)}, backend={self.backend!r}, free={self.num_free_pages}"
            f"{f', cached={len(self._lru)}' if self.prefix_cache else ''})"
        )

    # -- queries ------------------------------------------------------------
    @property
    @_locked
    def num_free_pages(self) -> int:
        """Pages no sequence holds: the free list and the cached prefix pages
        (which allocation evicts once the free list is empty)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_pages(self) -> int:
        """Cached prefix pages no sequence holds (evictable)."""
        return len(self._lru)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in both caches, all layers."""
        return self.layers * self.page_size * self.kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize

    @_locked
    def ref_count(self, page: int) -> int:
        """Sequences holding ``page`` (an int in 0 .. num_pages - 1)."""
        return self._refs[checks.host_int("page", page, 0, self.num_pages - 1)]

    @_locked
    def stats(self) -> dict:
        """Prefix-cache counters: ``hits`` / ``misses`` (full prompt pages
        looked up by ``add_sequence`` and found / not found), ``evictions``
        (cached pages reused for other tokens), ``cached_pages`` (indexed
        pages no sequence holds), ``indexed_pages`` (all indexed pages)."""
        return dict(self._stats, cached_pages=len(self._lru), indexed_pages=len(self._entry))

    @_locked
    def page_table(self, seqs: Sequence | Iterable[Sequence]) -> np.ndarray:
        """int32 [len(seqs), max(1, most pages)]: row i lists seqs[i].pages,
        padded with -1."""
        seqs = self._check_seqs(seqs, "seqs")
        width = max([1] + [len(s._pages) for s in seqs])
        table = np.full((len(seqs), width), -1, np.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s._pages)] = s._pages
        return table

    # -- sequences ----------------------------------------------------------
    @_locked
    def add_sequence(self, tokens: int | Iterable[int] | np.ndarray | None = None) -> Sequence:
        """A new sequence. ``tokens``: its token ids (the prompt, int [n]),
        which the cache keeps (``seq.tokens``) to index its full pages once
        written. With ``prefix_cache``, every full page cached for the
        longest prefix of ``tokens`` is shared at once: ``seq.length`` and
        ``seq.cached_tokens`` start at the tokens those pages hold (at most
        ``len(tokens) - 1``, so the last prompt token is always computed and
        yields logits), and only the rest needs a prefill. Takes no free page
        and keeps outstanding plans valid. Token ids are ints >= 0
        (``checks.token_ids``)."""
        ids: list[int] = []
        if tokens is not None:
            ids = [int(t) for t in checks.token_ids("tokens", tokens)]
        seq = Sequence(self, self._next_id, [], 0)
        self._next_id += 1
        seq._tokens = ids
        if self.prefix_cache and ids:
            ps = self.page_size
            limit = (len(ids) - 1) // ps
            matched, parent, key = [], None, _ROOT_KEY
            for j in range(limit):
                toks = tuple(ids[j * ps : (j + 1) * ps])
                key = page_key(key, toks)
                e = self._index.get(key)
                if e is None or e.tokens != toks or e.parent is not parent:
                    break
                matched.append(e)
                parent = e
            self._stats["hits"] += len(matched)
            self._stats["misses"] += limit - len(matched)
            for e in matched:
                if self._refs[e.page] == 0:
                    del self._lru[e.page]  # revived
                self._refs[e.page] += 1
            seq._pages = [e.page for e in matched]
            seq.length = seq.cached_tokens = seq._written = len(matched) * ps
            seq._indexed = len(matched)
        return seq

    @_locked
    def add_tokens(self, seq: Sequence, tokens: int | Iterable[int] | np.ndarray) -> None:
        """Record further token ids of ``seq`` (e.g. sampled tokens read back;
        ints >= 0), which lets its full pages enter the prefix index once
        written."""
        self._check_seqs([seq], "seq")
        ids = checks.token_ids("tokens", tokens)
        seq._tokens.extend(int(t) for t in ids)
        self._index_pages(seq)

    @_locked
    def fork(self, seq: Sequence) -> Sequence:
        """A new sequence sharing every page that holds ``seq``'s tokens (and
        its length and known tokens); nothing is copied and pages ``seq``
        reserved past its length stay its own. Writes by either later copy
        the shared page first, so neither ever sees the other's new tokens."""
        self._check_seqs([seq], "seq")
        self._check_not_in_batch(seq, "seq", "fork")
        self._check_not_driven(seq, "seq", "fork")
        used = -(-seq.length // self.page_size)
        child = Sequence(self, self._next_id, list(seq._pages[:used]), seq.length)
        self._next_id += 1
        child._tokens = list(seq._tokens[: seq.length])
        child._written = min(seq._written, seq.length)
        child._indexed = min(seq._indexed, used)
        for p in child._pages:
            self._refs[p] += 1
        self._new_generation()
        return child

    @_locked
    def free(self, seq: Sequence) -> None:
        """Release ``seq``: each page goes back to the free list once no
        sequence holds it; with ``prefix_cache`` an indexed page stays cached
        instead (its later pages are evicted first). The handle is dead
        afterwards."""
        self._check_seqs([seq], "seq")
        self._check_not_in_batch(seq, "seq", "free")
        self._check_not_driven(seq, "seq", "free")
        for p in reversed(seq._pages):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._entry:
                    self._lru[p] = None
                else:
                    self._free.append(p)
        seq._pages = []
        seq.length = 0
        seq.alive = False
        self._new_generation()

    # -- a step ---------------------------------------------------------------
    @_locked
    def prepare(
        self,
        seqs: Sequence | Iterable[Sequence],
        new_tokens: int | Iterable[int] | np.ndarray,
        *,
        reserve: int | Iterable[int] | np.ndarray = 0,
    ) -> tuple[DevicePlan, StepReport]:
        """Make room for one step and return ``(plan, report)``.

        seqs: distinct live sequences of this cache, in the batch's order.
        new_tokens: an int for all, or one int >= 0 per sequence: tokens each
        appends this step (a prefill chunk, 1 for decode, 0 to sit out).
        reserve: an int for all, or one per sequence: further tokens each
        sequence's pages must hold after this step (for a decode loop that
        advances on the device, ``PagedDecodeLoop``); they are not added to
        the length.

        Takes the pages the new and reserved tokens need (free pages first,
        then evicting cached prefix pages, least recently used first), copies
        every shared page (reference count > 1) those tokens will write to a
        fresh page (one ``copy_pages`` launch for all, both caches, every
        layer), advances the lengths by ``new_tokens``, and uploads the plan
        ``HostPlan.build(rows of seqs' pages, lengths, new_tokens, page_size,
        num_pages)`` to the caches' device and current stream. Then
        ``append(plan, new_k, new_v, layer=l)`` writes layer l's tokens and
        ``plan.attention(q, cache.k[l], cache.v[l], ...)`` reads them.

        Out of pages: raises PagedAttentionError and changes nothing.
        """
        seqs = self._check_step_seqs(seqs)
        counts = self._per_seq("new_tokens", new_tokens, len(seqs))
        reserves = self._per_seq("reserve", reserve, len(seqs))
        pages, pairs, taken, evict = self._grow(seqs, counts, reserves, "prepare")
        lengths = [s.length + n for s, n in zip(seqs, counts)]
        width = max([1] + [len(p) for p in pages])
        table = np.full((len(seqs), width), -1, np.int64)
        for i, p in enumerate(pages):
            table[i, : len(p)] = p
        host = HostPlan.build(
            table, np.array(lengths, np.int64), np.array(counts, np.int64), self.page_size, self.num_pages
        )
        # The device work, which may still fail (inside a capture the upload
        # is refused; the copy kernel may fail to compile): the plan's upload,
        # then the copies, which write only pages no sequence holds.
        plan = host.upload(self.k)
        self._copy(plan.stream, pairs)
        starts = [s.length for s in seqs]
        self._commit(seqs, pages, pairs, taken, evict)
        for s, n in zip(seqs, lengths):
            s.length = n
        plan.guard = self._guard()
        plan.seqs = tuple(seqs)
        plan._cache = self  # a plan knows its cache: another cache's methods refuse it
        self._writes[plan] = _Writes(plan.seqs, starts, lengths, auto=True)
        return plan, self._report(pairs, taken, evict)

    @_locked
    def reserve(self, seqs: Sequence | Iterable[Sequence], tokens: int | Iterable[int] | np.ndarray) -> StepReport:
        """Make each of ``seqs`` hold pages for ``tokens`` (an int, or one
        per sequence) tokens past its length, copying every shared page those
        tokens will write (one launch), without building a plan or changing
        a length. Out of pages: raises PagedAttentionError and changes
        nothing. Like ``prepare``, it makes earlier plans of this cache stale.
        (A DecodeBatch reserves for its own sequences.)"""
        return self._reserve(self._check_step_seqs(seqs), tokens)

    def _reserve(self, seqs, tokens) -> StepReport:
        seqs = self._check_step_seqs(seqs, allow_batch=True)
        reserves = self._per_seq("tokens", tokens, len(seqs))
        pages, pairs, taken, evict = self._grow(seqs, [0] * len(seqs), reserves, "reserve")
        self._copy(None, pairs)
        self._commit(seqs, pages, pairs, taken, evict)
        return self._report(pairs, taken, evict)

    @_locked
    def append(
        self, plan: DevicePlan, new_k: Array, new_v: Array | None, *, layer: int = 0, rope: Rotary | None = None
    ) -> None:
        """``plan.append(new_k, new_v, self.k[layer], self.v[layer], rope=rope)``:
        layer ``layer``'s new rows (``rope``: RoPE fused in, ``cupaged.Rotary``).
        ``plan``: one of this cache's (its ``prepare``'s, or a slot plan of one
        of its DecodeBatches); a plan of another cache
        (or one no cache made) is refused, since its page table names pages
        this cache may have given to other sequences. Once every layer of a
        ``prepare`` plan was appended, its tokens count as written (the prefix
        index takes their full pages)."""
        self._check_plan(plan, "plan")
        layer = checks.host_int("layer", layer, 0, self.layers - 1)
        plan.append(new_k, new_v, self.k[layer], self.v[layer], rope=rope, **self.kv_args(layer))
        w = self._writes.get(plan)
        if w is None:
            return
        if plan.stream.capturing:
            w.captured.add(layer)
            return
        w.layers.add(layer)
        if w.auto and len(w.layers) == self.layers:
            del self._writes[plan]
            for s, a, b in zip(w.seqs, w.starts, w.ends):
                self._wrote(s, a, b)

    # -- helpers for decode loops and batches (cupaged.graph, cupaged.batch) ----
    def _track(self, plan) -> _Writes:
        """Take over the write tracking of ``plan`` (a loop marks what it
        writes itself): returns its record, which keeps counting layers. A
        plan no cache made (a DecodeBatch's slot plan) becomes this cache's; a
        plan a decode loop has driven is refused (its device words moved on)."""
        if getattr(plan, "_cache", None) is None:
            plan._cache = self
        self._check_plan(plan, "plan")
        w = self._writes.get(plan)
        if w is not None and w.driven:
            raise PagedAttentionError(
                "plan: a PagedDecodeLoop already drove this plan (its device lengths moved on); "
                "prepare a new plan: cache.prepare(seqs, 1, reserve=...)"
            )
        if w is None:
            w = _Writes((), [], [], auto=False)
            self._writes[plan] = w
        w.auto = False
        return w

    def _drive(self, plan, loop) -> _Drive:
        """Hold ``plan.seqs`` for ``loop``, the PagedDecodeLoop just built on
        ``plan`` (tracked: ``_track``), until the loop ends (``_Drive.end``;
        a loop dropped without ``finish()`` ends when it is collected). The
        plan goes stale once the loop ends before its last step."""
        self._writes[plan].driven = True
        d = _Drive(self, plan.seqs, loop.steps_left)
        for s in plan.seqs:
            s._drive = d
        fresh = plan.guard

        def guard() -> None:
            if d.dropped:
                raise PagedAttentionError(
                    f"plan: stale: its PagedDecodeLoop was finished after {d.taken} of {d.steps} steps (its device "
                    f"lengths count a step that was not run); use the plan of a new cache.prepare"
                )
            if fresh is not None:
                fresh()

        plan.guard = guard
        weakref.finalize(loop, d.end, True).atexit = False
        return d

    def _wrote(self, seq: Sequence, start: int, end: int) -> None:
        """Tokens [start, end) of ``seq`` are written (every layer): its
        written prefix grows when it reaches ``start``."""
        if seq.alive and seq._written >= start and end > seq._written:
            seq._written = end
            self._index_pages(seq)

    def _index_pages(self, seq: Sequence) -> None:
        """Offer ``seq``'s full, written pages with known tokens to the
        prefix index (docs/layout.md, "Prefix reuse")."""
        if not self.prefix_cache or not seq.alive:
            return
        ps = self.page_size
        full = min(seq._written, len(seq._tokens), seq.length) // ps
        j = min(seq._indexed, full)
        while j > 0 and seq._pages[j - 1] not in self._entry:  # an ancestor was evicted: look again
            j -= 1
        parent = self._entry[seq._pages[j - 1]] if j else None
        # a page that is not indexed because the same content is cached
        # elsewhere chains its successors under that entry
        while j < full:
            page = seq._pages[j]
            toks = tuple(seq._tokens[j * ps : (j + 1) * ps])
            key = page_key(parent.key if parent else _ROOT_KEY, toks)
            e = self._index.get(key)
            if e is not None:
                if e.tokens != toks or e.parent is not parent:
                    break  # a hash collision: index nothing past it
                parent = e  # this content is cached already (maybe in this very page)
            elif page in self._entry:
                parent = self._entry[page]  # (unreachable: a held page's entry is keyed by its content)
            else:
                e = _Entry(page, toks, parent, key)
                self._index[key] = e
                self._entry[page] = e
                if parent is not None:
                    parent.children.add(e)
                parent = e
            j += 1
        seq._indexed = j

    def _drop_entry(self, e: _Entry, to_free: list) -> None:
        """Remove ``e`` and every entry under it from the index; cached pages
        no sequence holds among them go to ``to_free``."""
        stack = [e]
        while stack:
            x = stack.pop()
            stack.extend(x.children)
            self._index.pop(x.key, None)
            self._entry.pop(x.page, None)
            if x.parent is not None:
                x.parent.children.discard(x)
            if x.page in self._lru:
                del self._lru[x.page]
                to_free.append(x.page)

    # -- internals ------------------------------------------------------------
    def _grow(self, seqs, counts, reserves, what):
        """The pages ``seqs`` need for ``counts`` new and ``reserves`` more
        tokens, nothing changed yet: (new page lists, copies (src, dst),
        pages taken, how many of them are evicted cached pages)."""
        ps = self.page_size
        holders: dict[int, int] = {}
        cows = []  # per sequence: (column, shared page) pairs it copies
        fresh = []  # per sequence: pages its tokens need
        for s, n, r in zip(seqs, counts, reserves):
            end = s.length + n + r
            mine = []
            if end > s.length:
                for col in range(s.length // ps, min(len(s._pages), -(-end // ps))):
                    page = s._pages[col]
                    left = self._refs[page] - holders.get(page, 0)
                    if left > 1:
                        holders[page] = holders.get(page, 0) + 1
                        mine.append((col, page))
            cows.append(mine)
            fresh.append(max(0, -(-end // ps) - len(s._pages)))
        copies = sum(len(c) for c in cows)
        need = sum(fresh) + copies
        if need > self.num_free_pages:
            cached = f" ({len(self._lru)} of them cached prefix pages)" if self._lru else ""
            raise PagedAttentionError(
                f"{what}: out of pages: this step needs {need} page(s) ({sum(fresh)} for new tokens, "
                f"{copies} to copy shared pages), {self.num_free_pages} of {self.num_pages} free{cached}"
            )
        from_free = min(need, len(self._free))
        taken = self._free[len(self._free) - from_free :][::-1] + list(itertools.islice(self._lru, need - from_free))
        it = iter(taken)
        pairs, pages = [], []
        for s, mine, f in zip(seqs, cows, fresh):
            new = list(s._pages)
            for col, page in mine:
                dst = next(it)
                pairs.append((page, dst))
                new[col] = dst
            new.extend(next(it) for _ in range(f))
            pages.append(new)
        return pages, pairs, taken, need - from_free

    def _copy(self, stream, pairs) -> None:
        if not pairs:
            return
        if stream is None:
            stream = stream_for(self.k)
        pairs_host = np.array(pairs, np.uint32)  # [copies, 2]
        if self.backend == GPU:
            # one device page list, reused in stream order (the copy that
            # refills it runs after the kernel that read it); it grows rarely
            if self._pairs is None or self._pairs.shape[0] < len(pairs):
                self._pairs = empty(self.k, (max(64, 2 * len(pairs)), 2), np.uint32)
            pairs_dev = self._pairs[: len(pairs)]
            stream.copy_from_host(pairs_dev, pairs_host)
        else:
            pairs_dev = pairs_host
        copy_pages(stream, self.k, self.v, pairs_dev, len(pairs))

    def _commit(self, seqs, pages, pairs, taken, evict) -> None:
        """Apply ``_grow``'s result (nothing here can fail); earlier plans go stale."""
        from_free = len(taken) - evict
        del self._free[len(self._free) - from_free :]
        released: list[int] = []
        evicted = taken[from_free:]  # cached pages, oldest first
        for p in evicted:
            del self._lru[p]
        for p in evicted:  # their entries, and the entries under them
            e = self._entry.get(p)
            if e is not None:
                self._drop_entry(e, released)
        self._stats["evictions"] += evict + len(released)
        for p in taken:
            self._refs[p] = 1
        for src, _ in pairs:
            self._refs[src] -= 1
            if self._refs[src] == 0:  # (cannot happen: a copied page keeps another holder)
                self._free.append(src)
        for s, p in zip(seqs, pages):
            s._pages = p
        self._free.extend(reversed(released))
        self._new_generation()

    def _report(self, pairs, taken, evict) -> StepReport:
        return StepReport(
            copied_pages=pairs,
            copied_bytes=len(pairs) * self.page_bytes,
            allocated_pages=len(taken),
            evicted_pages=evict,
        )

    def _new_generation(self) -> None:
        self._generation += 1

    def _guard(self):
        """A check for a plan made now: it raises once a later fork, free,
        prepare or reserve of this cache has moved pages (the plan's page
        table may name pages shared with a fork or given to another
        sequence)."""
        ref, gen = weakref.ref(self), self._generation

        def guard() -> None:
            cache = ref()
            if cache is not None and cache._generation != gen:
                raise PagedAttentionError(
                    "plan: stale: made by PagedKVCache.prepare before a later fork, free or prepare of that cache; "
                    "use the plan of the latest prepare"
                )

        return guard

    def _check_seqs(self, seqs, name: str) -> list[Sequence]:
        if isinstance(seqs, Sequence):
            seqs = [seqs]
        seqs = list(seqs)
        for i, s in enumerate(seqs):
            label = name if name == "seq" else f"{name}[{i}]"
            if not isinstance(s, Sequence):
                raise PagedAttentionError(f"{label}: expected a Sequence of this cache, got {type(s).__name__}")
            if s._cache is not self:
                raise PagedAttentionError(f"{label}: expected a Sequence of this cache, got one of another cache")
            if not s.alive:
                raise PagedAttentionError(f"{label}: sequence {s.id} was freed")
        return seqs

    def _check_step_seqs(self, seqs, allow_batch: bool = False) -> list[Sequence]:
        seqs = self._check_seqs(seqs, "seqs")
        if len({s.id for s in seqs}) != len(seqs):
            raise PagedAttentionError("seqs: expected distinct sequences, got one sequence twice")
        for i, s in enumerate(seqs):
            if not allow_batch:
                self._check_not_in_batch(s, f"seqs[{i}]", "prepare or reserve")
            self._check_not_driven(s, f"seqs[{i}]", "prepare or reserve")
        return seqs

    def _check_plan(self, plan, name: str) -> None:
        """``plan`` was made by this cache (``prepare``) or taken over by it
        (a DecodeBatch's slot plan): a plan knows its cache."""
        owner = getattr(plan, "_cache", None)
        if owner is self:
            return
        if owner is not None:
            raise PagedAttentionError(
                f"{name}: expected a plan of this cache, got one of another PagedKVCache "
                f"({owner!r}); its page table names that cache's pages"
            )
        raise PagedAttentionError(
            f"{name}: expected a plan of this cache (made by its prepare, or a DecodeBatch's), "
            f"got {type(plan).__name__} made by no PagedKVCache; write such a plan's rows with "
            f"plan.append(new_k, new_v, cache.k[layer], cache.v[layer])"
        )

    @staticmethod
    def _check_not_driven(seq: Sequence, label: str, what: str) -> None:
        d = seq._drive
        if d is not None:
            raise PagedAttentionError(
                f"{label}: sequence {seq.id} is driven by a live PagedDecodeLoop ({d.taken} of {d.steps} steps "
                f"run), and its length {seq.length} counts the step prepared next, whose token is in next_token, "
                f"not in the cache; call loop.finish() before {what}"
            )

    @staticmethod
    def _check_not_in_batch(seq: Sequence, label: str, what: str) -> None:
        if seq._batch is not None:
            raise PagedAttentionError(
                f"{label}: sequence {seq.id} sits in a DecodeBatch slot, which writes its pages on the device; "
                f"batch.leave(seq) (after batch.readback()) before {what}"
            )

    @staticmethod
    def _per_seq(name: str, value, n: int) -> list[int]:
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            value = [checks.host_int(name, value, 0, U32_MAX)] * n
        counts = checks.host_int_array(name, value, 1)
        if counts.shape[0] != n:
            raise PagedAttentionError(
                f"{name}: expected shape [{n}] (one per sequence), got {checks.shape_str(counts.shape)}"
            )
        if n and (counts.min() < 0 or counts.max() > U32_MAX):
            i = int(np.argmax((counts < 0) | (counts > U32_MAX)))
            raise PagedAttentionError(f"{name}[{i}]: expected an int in 0..{U32_MAX}, got {counts[i]}")
        return [int(c) for c in counts]
