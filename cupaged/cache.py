"""The page manager: paged K/V caches, sequences and copy-on-write.

``PagedKVCache`` owns the two caches and their pages: sequences are handles,
``fork`` shares pages, ``prepare`` allocates the pages a step needs, copies
shared pages the step will write (one launch of ``copy_pages``,
``cupaged.ops.append``) and uploads the step's plan; ``append`` writes the
step's new rows (``DevicePlan.append``).

Layout of caches, positions and metadata words: ``docs/layout.md``.

    cache = PagedKVCache(num_pages=1024, page_size=16, kv_heads=8, head_dim=128,
                         dtype="bfloat16", like=some_cupy_array)
    a = cache.add_sequence()
    plan, _ = cache.prepare([a], [prompt_len])        # prefill
    cache.append(plan, new_k, new_v)                   # new_k: [prompt_len, 8, 128]
    out = plan.attention(q, cache.k, cache.v, scale)
    b = cache.fork(a)                                  # shares every page of a
    plan, report = cache.prepare([a, b], [1, 1])       # decode: copies a shared last page
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from . import dtypes
from ._runtime import GPU, array_backend, checks, empty, zeros
from .errors import PagedAttentionError
from .layout import MAX_PAGE_SIZE, U32_MAX
from .ops.append import copy_pages
from .plan import DevicePlan, HostPlan

# ---------------------------------------------------------------------------
# Page manager

class Sequence:
    """A sequence handle of one PagedKVCache. ``id``, ``length`` (tokens
    cached, this step's new tokens included once prepared), ``pages`` (page
    ids in token order), ``capacity`` (tokens that fit without a new page),
    ``alive`` (False once freed). Read-only: the cache changes them."""

    __slots__ = ("id", "length", "_pages", "_cache", "alive")

    def __init__(self, cache: "PagedKVCache", seq_id: int, pages: list[int], length: int):
        self.id = seq_id
        self.length = length
        self._pages = pages
        self._cache = cache
        self.alive = True

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self._pages)

    @property
    def capacity(self) -> int:
        return len(self._pages) * self._cache.page_size

    def __repr__(self) -> str:
        state = "" if self.alive else ", freed"
        return f"Sequence(id={self.id}, length={self.length}, pages={self._pages}{state})"


@dataclass(frozen=True)
class StepReport:
    """What ``PagedKVCache.prepare`` did besides building the plan.

    ``copied_pages``: (src, dst) page ids copied on write (each in both
    caches); ``copied_bytes``: bytes copied (K and V); ``allocated_pages``:
    pages taken from the free list, copies included."""

    copied_pages: list = field(default_factory=list)
    copied_bytes: int = 0
    allocated_pages: int = 0


class PagedKVCache:
    """Paged K/V caches and their pages, shared between sequences with
    reference counts and copied on write.

    ``k`` [num_pages, page_size, kv_heads, head_dim] and ``v`` [num_pages,
    page_size, kv_heads, value_dim] (value_dim defaults to head_dim), zeroed,
    on the backend and device of ``like`` (a NumPy or CuPy array; None: NumPy).
    For MLA: kv_heads=1, head_dim=R (latent), value_dim=P (k_pos).

    Host bookkeeping only, except ``prepare``, which launches at most one
    page copy and one small upload per call and never synchronizes.
    """

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, *,
                 value_dim: int | None = None, like=None):
        self.num_pages = checks.host_int("num_pages", num_pages, 1, U32_MAX - 1)
        self.page_size = checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        self.kv_heads = checks.host_int("kv_heads", kv_heads, 1, U32_MAX)
        self.head_dim = checks.host_int("head_dim", head_dim, 1, U32_MAX)
        self.value_dim = self.head_dim if value_dim is None else checks.host_int("value_dim", value_dim, 1, U32_MAX)
        self.dtype = dtypes.row("dtype", dtype, kv=True).np_dtype
        if like is None:
            like = np.zeros(0, np.float32)
        if array_backend(like) is None:
            raise PagedAttentionError(f"like: expected a NumPy or CuPy array, got {type(like).__name__}")
        k_shape = (self.num_pages, self.page_size, self.kv_heads, self.head_dim)
        v_shape = k_shape[:3] + (self.value_dim,)
        # per-page sizes must fit 32-bit indexing; page offsets are 64-bit (docs/layout.md)
        checks.u32_size("k", k_shape[1:])
        checks.u32_size("v", v_shape[1:])
        self.backend = array_backend(like)
        self.k = zeros(like, k_shape, self.dtype)
        self.v = zeros(like, v_shape, self.dtype)
        self._refs = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))   # a stack: page 0 is handed out first
        self._next_id = 0
        self._pairs = None      # the last copy's device page list, kept alive with the cache
        self._generation = 0    # bumped by every fork, free and prepare: older plans are stale

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.dtype.name}, "
                f"backend={self.backend!r}, free={self.num_free_pages})")

    # -- queries ------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in both caches."""
        return self.page_size * self.kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize

    def ref_count(self, page: int) -> int:
        """Sequences holding ``page``."""
        return self._refs[page]

    def page_table(self, seqs) -> np.ndarray:
        """int32 [len(seqs), max(1, most pages)]: row i lists seqs[i].pages,
        padded with -1."""
        seqs = self._check_seqs(seqs, "seqs")
        width = max([1] + [len(s._pages) for s in seqs])
        table = np.full((len(seqs), width), -1, np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(s._pages)] = s._pages
        return table

    # -- sequences ----------------------------------------------------------
    def add_sequence(self) -> Sequence:
        """A new empty sequence (no page until a step writes to it)."""
        seq = Sequence(self, self._next_id, [], 0)
        self._next_id += 1
        return seq

    def fork(self, seq: Sequence) -> Sequence:
        """A new sequence sharing every page (and the length) of ``seq``;
        nothing is copied. Writes by either later copy the shared page first,
        so neither ever sees the other's new tokens."""
        self._check_seqs([seq], "seq")
        child = Sequence(self, self._next_id, list(seq._pages), seq.length)
        self._next_id += 1
        for p in child._pages:
            self._refs[p] += 1
        self._new_generation()
        return child

    def free(self, seq: Sequence) -> None:
        """Release ``seq``: each page goes back to the free list once no
        sequence holds it. The handle is dead afterwards."""
        self._check_seqs([seq], "seq")
        for p in reversed(seq._pages):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        seq._pages = []
        seq.length = 0
        seq.alive = False
        self._new_generation()

    # -- a step ---------------------------------------------------------------
    def prepare(self, seqs, new_tokens) -> tuple[DevicePlan, StepReport]:
        """Make room for one step and return ``(plan, report)``.

        seqs: distinct live sequences of this cache, in the batch's order.
        new_tokens: an int for all, or one int >= 0 per sequence: tokens each
        appends this step (a prefill chunk, 1 for decode, 0 to sit out).

        Takes the pages the new tokens need, copies every shared page
        (reference count > 1) this step writes to a fresh page (one
        ``copy_pages`` launch for all, both caches), advances the lengths, and
        uploads the plan ``HostPlan.build(page_table(seqs), lengths,
        new_tokens, page_size, num_pages)`` to the caches' device and current
        stream. Then ``append(plan, new_k, new_v)`` writes the tokens and
        ``plan.attention(q, cache.k, cache.v, ...)`` reads them.

        Out of pages: raises PagedAttentionError and changes nothing.
        """
        seqs = self._check_seqs(seqs, "seqs")
        if len({s.id for s in seqs}) != len(seqs):
            raise PagedAttentionError("seqs: expected distinct sequences, got one sequence twice")
        counts = self._new_tokens(new_tokens, len(seqs))
        ps = self.page_size

        # 1. The whole need, nothing changed yet. A shared page written by
        # several holders in this step is copied by all but the last one.
        holders = {}
        cow = []            # per sequence: the shared page it copies, or None
        fresh = []          # per sequence: pages its new tokens need
        for s, n in zip(seqs, counts):
            if n and s.length % ps:
                last = s._pages[-1]
                left = self._refs[last] - holders.get(last, 0)
                if left > 1:
                    holders[last] = holders.get(last, 0) + 1
                    cow.append(last)
                else:
                    cow.append(None)
            else:
                cow.append(None)
            fresh.append(-(-(s.length + n) // ps) - len(s._pages))
        need = sum(fresh) + sum(c is not None for c in cow)
        if need > len(self._free):
            raise PagedAttentionError(
                f"prepare: out of pages: this step needs {need} page(s) ({sum(fresh)} for new tokens, "
                f"{need - sum(fresh)} to copy shared pages), {len(self._free)} of {self.num_pages} free")

        # 2. The new page lists and the host plan (may still raise; nothing changed).
        taken = self._free[len(self._free) - need:][::-1]
        it = iter(taken)
        pairs, pages = [], []
        for s, c, f in zip(seqs, cow, fresh):
            new = list(s._pages)
            if c is not None:
                dst = next(it)
                pairs.append((c, dst))
                new[-1] = dst
            new.extend(next(it) for _ in range(f))
            pages.append(new)
        lengths = [s.length + n for s, n in zip(seqs, counts)]
        width = max([1] + [len(p) for p in pages])
        table = np.full((len(seqs), width), -1, np.int64)
        for i, p in enumerate(pages):
            table[i, :len(p)] = p
        host = HostPlan.build(table, np.array(lengths, np.int64), np.array(counts, np.int64), ps, self.num_pages)

        # 3. The device work, which may still fail (inside a capture the upload
        # is refused; the copy kernel may fail to compile): the plan's upload,
        # then the copies, which write only pages still on the free list.
        plan = host.upload(self.k)
        if pairs:
            stream = plan.stream
            pairs_host = np.array(pairs, np.uint32)              # [copies, 2]
            if self.backend == GPU:
                pairs_dev = empty(self.k, pairs_host.shape, np.uint32)
                stream.copy_from_host(pairs_dev, pairs_host)
            else:
                pairs_dev = pairs_host
            copy_pages(stream, self.k, self.v, pairs_dev, len(pairs))
            self._pairs = pairs_dev

        # 4. Commit (nothing here can fail): pages, copies, lengths; earlier
        # plans of this cache go stale.
        del self._free[len(self._free) - need:]
        for p in taken:
            self._refs[p] = 1
        for src, _ in pairs:
            self._refs[src] -= 1
        for s, p, n in zip(seqs, pages, lengths):
            s._pages, s.length = p, n
        self._new_generation()
        plan.guard = self._guard()
        report = StepReport(copied_pages=pairs, copied_bytes=len(pairs) * self.page_bytes, allocated_pages=need)
        return plan, report

    def append(self, plan: DevicePlan, new_k, new_v) -> None:
        """``plan.append(new_k, new_v, self.k, self.v)``."""
        plan.append(new_k, new_v, self.k, self.v)

    # -- helpers --------------------------------------------------------------
    def _new_generation(self) -> None:
        self._generation += 1

    def _guard(self):
        """A check for a plan made now: it raises once a later fork, free or
        prepare of this cache has moved pages (the plan's page table may name
        pages shared with a fork or given to another sequence)."""
        ref, gen = weakref.ref(self), self._generation

        def guard() -> None:
            cache = ref()
            if cache is not None and cache._generation != gen:
                raise PagedAttentionError(
                    "plan: stale: made by PagedKVCache.prepare before a later fork, free or prepare of that cache; "
                    "use the plan of the latest prepare")
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

    @staticmethod
    def _new_tokens(new_tokens, n: int) -> list[int]:
        if isinstance(new_tokens, (int, np.integer)) and not isinstance(new_tokens, bool):
            new_tokens = [int(new_tokens)] * n
        counts = checks.host_int_array("new_tokens", new_tokens, 1)
        if counts.shape[0] != n:
            raise PagedAttentionError(f"new_tokens: expected shape [{n}] (one per sequence), got "
                                      f"{checks.shape_str(counts.shape)}")
        if n and (counts.min() < 0 or counts.max() > U32_MAX):
            i = int(np.argmax((counts < 0) | (counts > U32_MAX)))
            raise PagedAttentionError(f"new_tokens[{i}]: expected an int in 0..{U32_MAX}, got {counts[i]}")
        return [int(c) for c in counts]
