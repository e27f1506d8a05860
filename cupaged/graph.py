"""CUDA-graph decode: capture once, one graph launch per generated token.

* ``capture_graph(like)`` captures the stream work issued inside it (GPU:
  driver stream capture on CuPy's current stream; CPU: the recorded stream,
  see ``cupaged._runtime.stream``) and yields a handle whose ``launch()`` replays it.
  Every buffer read or written from outside the graph must exist before
  capture: an allocation inside capture is rejected with PagedAttentionError
  (cupaged's own allocation sites check; on the GPU, CuPy's allocator is
  replaced by one that refuses for the duration of the capture).
* ``DeviceScalars``: int32 ``seq_len_k`` / ``write_pos`` words at stable
  addresses, updated with stream-ordered ``memset_d32`` (no host pointer that
  could die before the copy runs).
* ``DecodeLoop``: a user's step function replayed per token, with the next
  token fed back on the device, scalars and RoPE slices updated by stream
  work before each launch.
* ``PagedDecodeLoop``: B sequences over a paged plan; a small kernel inside
  the graph advances every sequence's length and position on the device, so
  the loop issues no host data at all: one device-to-device copy and one
  graph launch per token. Given the PagedKVCache that prepared the plan, the
  manager's lengths follow the device step by step.
* ``capture_count()``: captures completed so far (no recapture, provably).

Both loops take the argmax, or with ``sampler`` (a
``cupaged.ops.sample.SamplerState`` with a slot per row, its parameters set
with ``sampler.set(row, SamplingParams(...).words(), context=...)``) draw
each row's token on the device inside the graph.

Decode batches whose membership changes between launches, on stable buffers
and one graph per batch bucket: ``cupaged.batch.DecodeBatch``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import NoReturn

import numpy as np

from . import layout
from ._runtime import GPU, Graph, Stream, backend_of, check_not_capturing, checks, empty, stream_for
from ._runtime.arrays import Array
from .cache import PagedKVCache, Sequence
from .errors import PagedAttentionError
from .layout import metadata_offsets
from .ops.advance import SlotBuffers, advance_slots
from .ops.sample import SamplerState, sample_into
from .ops.sampling import argmax_into
from .plan import DevicePlan, HostPlan


class CapturedGraph:
    """Yielded by ``capture_graph``; ``launch()`` replays the capture once it
    has ended. ``graph`` is the underlying ``cupaged.stream.Graph``."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.graph: Graph | None = None

    def launch(self) -> None:
        if self.graph is None:
            raise PagedAttentionError("graph: the capture has not ended yet")
        self.graph.launch()


def _refuse_allocation(size: int) -> NoReturn:
    raise PagedAttentionError(
        f"allocation of {size} bytes inside graph capture: every buffer the graph uses must be allocated "
        f"before capture_graph (pass out= to cupaged ops)"
    )


_captures = 0


def capture_count() -> int:
    """Captures that ``capture_graph`` completed in this process (decode
    loops and batches capture through it): a test or benchmark reads it
    before and after to prove no recapture."""
    return _captures


@contextlib.contextmanager
def capture_graph(like: Array) -> Iterator[CapturedGraph]:
    """Capture the stream work issued inside the ``with`` block on the stream
    of ``like``'s backend (CuPy's current stream on its device, or the CPU
    stream) and yield a CapturedGraph; call ``.launch()`` after the block.

    On the CPU backend only cupaged stream work is captured (kernels,
    memsets, copies), not NumPy expressions; write the step with cupaged ops
    and preallocated outputs, which also makes it capturable on the GPU.
    """
    global _captures
    stream = stream_for(like)
    handle = CapturedGraph(stream)
    stream.begin_capture()
    ok = False
    try:
        if stream.backend == GPU:
            import cupy

            with cupy.cuda.using_allocator(_refuse_allocation):
                yield handle
        else:
            yield handle
        ok = True
    finally:
        if ok:
            handle.graph = stream.end_capture()
            _captures += 1
        else:  # discard a failed capture; the error that caused it propagates
            with contextlib.suppress(Exception):
                stream.end_capture()


class DeviceScalars:
    """Two int32 device scalars at stable addresses: ``seq_len_k`` [1] (tokens
    to attend over) and ``write_pos`` [1] (slot of this step's K/V), views of
    one ``buffer`` int32 [2] on the backend of ``like``.

    Both start at ``initial_seq_len``. ``update(seq_len)`` sets
    write_pos = seq_len and seq_len_k = seq_len + 1 with two stream-ordered
    ``memset_d32`` (the value travels inside the call; no host buffer).
    ``DeviceScalars.of_plan`` aliases a plan's own metadata words instead,
    so paged kernels read them directly.
    """

    def __init__(self, initial_seq_len: int, like: Array):
        n = checks.host_int("initial_seq_len", initial_seq_len, 0, 0x7FFFFFFF)
        self.stream = stream_for(like)
        check_not_capturing(self.stream, "DeviceScalars")
        self.buffer = empty(like, 2, np.int32)
        self.seq_len_k = self.buffer[0:1]
        self.write_pos = self.buffer[1:2]
        self.stream.memset_d32(self.buffer, n, count=2)

    @classmethod
    def of_plan(cls, plan: DevicePlan, sequence: int = 0) -> "DeviceScalars":
        """Scalars that alias ``plan``'s words for one sequence:
        ``seq_len_k`` is its kv_len word, ``write_pos`` the position word of
        its (single) query. Updating them moves that sequence on the device."""
        host = plan.host
        s = checks.host_int("sequence", sequence, 0, host.sequences - 1)
        if host.q_lens[s] != 1:
            raise PagedAttentionError(
                f"sequence: expected a sequence with exactly one query (decode), q_lens[{s}] = {host.q_lens[s]}"
            )
        off = metadata_offsets(host.queries, host.sequences)
        q = int(np.searchsorted(np.cumsum(host.q_lens), s, side="right"))
        self = cls.__new__(cls)
        self.stream = plan.stream
        self.buffer = plan.words
        self.seq_len_k = plan.words[off["kv_len"] + s : off["kv_len"] + s + 1]
        self.write_pos = plan.words[off["q_pos"] + q : off["q_pos"] + q + 1]
        return self

    def update(self, seq_len: int) -> None:
        n = checks.host_int("seq_len", seq_len, 0, 0x7FFFFFFE)
        self.stream.memset_d32(self.write_pos, n, count=1)
        self.stream.memset_d32(self.seq_len_k, n + 1, count=1)


def seed_tokens(next_token: Array, tokens: int | Iterable[int] | np.ndarray, *, vocab: int | None = None) -> None:
    """Write host token ids ``tokens`` [batch] (ints >= 0, below ``vocab``
    when given: ``checks.token_ids``) into ``next_token`` int64 [batch] with
    stream-ordered 32-bit memsets of each value's low and high halves
    (little-endian); no host buffer is involved. Checks everything before
    the first memset."""
    stream = stream_for(next_token)
    if str(next_token.dtype) != "int64" or next_token.ndim != 1:
        raise PagedAttentionError(
            f"next_token: expected an int64 [batch] array, got {next_token.dtype} {checks.shape_str(next_token.shape)}"
        )
    if isinstance(tokens, np.ndarray) and tokens.ndim == 0:
        tokens = tokens.reshape(1)
    tokens = [int(t) for t in checks.token_ids("tokens", tokens, vocab)]
    if len(tokens) != next_token.shape[0]:
        raise PagedAttentionError(f"tokens: expected {next_token.shape[0]} values, got {len(tokens)}")
    for i, t in enumerate(tokens):
        stream.memset_d32(next_token, t & 0xFFFFFFFF, count=1, offset_bytes=8 * i)
        stream.memset_d32(next_token, t >> 32, count=1, offset_bytes=8 * i + 4)


def _token_buffer(name: str, buf: Array) -> None:
    if str(buf.dtype) != "int64" or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise PagedAttentionError(
            f"{name}: expected a contiguous int64 [batch] array, got {buf.dtype} {checks.shape_str(buf.shape)}"
        )


class _Loop:
    """What both decode loops share: capture ``_body`` once (or not), seed
    the first tokens, and run one step (graph launch or eager body)."""

    graph: CapturedGraph | None
    next_token: Array = None
    _argmax: Callable[[Array, Array], object]
    vocab: int | None = None  # the logits' last dim, once the step ran (captured or eager)

    def _body(self) -> None:
        raise NotImplementedError

    def _argmax_of(self, logits: Array) -> None:
        self.vocab = int(logits.shape[-1])
        self._argmax(logits, self.next_token)

    def _drawer(self, sampler: SamplerState | None, clock: Array | None) -> Callable[[Array, Array], object]:
        """The token step: the argmax, or ``sampler``'s draw (logprobs at
        ``clock``'s ring row, or ``sampler.first_logprobs`` without one)."""
        if sampler is None:
            return argmax_into
        if not isinstance(sampler, SamplerState):
            raise PagedAttentionError(f"sampler: expected a SamplerState or None, got {type(sampler).__name__}")
        self.sampler = sampler
        return lambda logits, out: sample_into(logits, sampler, out, clock=clock)

    sampler: SamplerState | None = None

    def _capture(self, graph: bool, like: Array) -> None:
        self.graph = None
        if graph:
            with capture_graph(like) as g:
                self._body()
            self.graph = g

    def _run_step(self) -> None:
        if self.graph is not None:
            self.graph.launch()
        else:
            self._body()

    def seed(self, tokens: int | Iterable[int] | np.ndarray) -> None:
        """Set the first input token(s): written to next_token, which the
        first ``advance`` copies into token_buf. Token ids are ints >= 0,
        below ``vocab`` once the step ran (under capture: at construction)."""
        seed_tokens(self.next_token, tokens, vocab=self.vocab)


class DecodeLoop(_Loop):
    """Replay a user's decode step once per token.

    ``step()`` is called once (under capture when ``graph=True``, else on
    every token) and issues the stream work of one decode step, reading the
    token from ``token_buf`` [batch] int64, positions from ``scalars`` and
    RoPE rows from ``rope_slices``; it returns logits [batch, vocab]. The
    loop appends ``argmax_into(logits, next_token)`` (with ``sampler``: row
    r drawn with slot r's parameters, its logprob in
    ``sampler.first_logprobs[r]``).

    Per token, ``advance()`` issues: a device-to-device copy
    next_token -> token_buf; ``scalars.update(seq_len)``; copies of RoPE row
    ``seq_len`` from the full tables (``rope_tables`` = (cos, sin), each
    [max_pos, half] float32) into the stable ``rope_slices`` (each
    [1, half]); the graph launch; then ``seq_len += 1`` on the host.
    """

    def __init__(
        self,
        step: Callable[[], Array],
        *,
        token_buf: Array,
        next_token: Array,
        scalars: DeviceScalars,
        seq_len: int,
        rope_tables: tuple[Array, Array] | None = None,
        rope_slices: tuple[Array, Array] | None = None,
        graph: bool = True,
        sampler: SamplerState | None = None,
    ):
        _token_buffer("token_buf", token_buf)
        _token_buffer("next_token", next_token)
        backend_of(token_buf=token_buf, next_token=next_token)
        self.stream = stream_for(token_buf)
        self.token_buf, self.next_token, self.scalars = token_buf, next_token, scalars
        self.seq_len = checks.host_int("seq_len", seq_len, 0, 0x7FFFFFFE)
        self.rope_tables, self.rope_slices = rope_tables, rope_slices
        if (rope_tables is None) != (rope_slices is None):
            raise PagedAttentionError("rope_slices: expected both rope_tables and rope_slices, or neither")
        if rope_tables is not None:
            assert rope_slices is not None  # both or neither (checked above)
            for t, sl, name in zip(rope_tables, rope_slices, ("cos", "sin")):
                if t.ndim != 2 or sl.size != t.shape[1] or t.dtype != sl.dtype:
                    raise PagedAttentionError(
                        f"rope_slices: expected a {name} slice of {t.shape[1]} "
                        f"{t.dtype} values, got {sl.dtype} {checks.shape_str(sl.shape)}"
                    )
        self._step, self._argmax = step, self._drawer(sampler, None)
        self._capture(graph, token_buf)

    def _body(self) -> None:
        self._argmax_of(self._step())

    def advance(self) -> None:
        """Issue one token's work; no host synchronization. Past the RoPE
        table (or the int32 device scalars) it raises before issuing anything."""
        s = self.stream
        if self.seq_len >= 0x7FFFFFFF:
            raise PagedAttentionError(f"seq_len: expected 0..{0x7FFFFFFE}, got {self.seq_len}")
        if self.rope_tables is not None:
            for table in self.rope_tables:
                if self.seq_len >= table.shape[0]:
                    raise PagedAttentionError(
                        f"seq_len: position {self.seq_len} is past the RoPE table ({table.shape[0]} rows)"
                    )
        s.copy(self.token_buf, self.next_token)
        self.scalars.update(self.seq_len)
        if self.rope_tables is not None:
            assert self.rope_slices is not None  # both or neither (checked at construction)
            for table, sl in zip(self.rope_tables, self.rope_slices):
                row = table.shape[1] * table.itemsize
                s.copy(sl, table, nbytes=row, src_offset=self.seq_len * row)
        self._run_step()
        self.seq_len += 1


class PagedDecodeLoop(_Loop):
    """Decode of B sequences over a paged plan (greedy, or drawn by ``sampler``), one graph launch per token.

    ``plan``: a DevicePlan for the first decode step with one query per
    sequence (q_lens all 1). ``step(plan)`` issues one step's stream work
    (embedding of ``token_buf``, layers, appends, ``plan.attention``, ...)
    and returns logits [B, vocab]. The captured graph is: step, argmax into
    ``next_token``, then ``advance_slots`` (lengths and positions += 1 on the
    device, for each sequence while its pages have room). Per token,
    ``advance()`` issues one device-to-device copy (next_token -> token_buf)
    and one graph launch.

    With ``cache`` (the PagedKVCache whose ``prepare`` made ``plan``, e.g.
    ``cache.prepare(seqs, 1, reserve=r)``; ``seqs``, if given, must be the
    plan's sequences in row order) the manager drives the loop: it runs as
    many steps as the sequences' own pages hold from their first decode
    position (at least 1 + reserve; ``steps_left``), each step's K/V go
    through ``cache.append(plan, ..., layer=l)`` in ``step``, and after
    every ``advance()`` each sequence's ``seq.length`` equals its length on
    the device (the host knows each step adds one token; the device does not
    advance past the last reserved step, whose generated token has no page
    yet, so at the end ``seq.length`` counts exactly the tokens written and
    ``cache.prepare(seqs, 1, ...)`` continues from there, feeding
    ``next_token``). ``finish()`` ends a loop early the same way. Until the
    loop ends (its last step, ``finish()``, or its garbage collection, which
    finishes it), a fork, free, prepare or reserve of one of its sequences,
    or a ``DecodeBatch.join``, raises naming ``loop.finish()``: their
    lengths count the step prepared next, whose row is not written. A fork,
    free, prepare or reserve of other sequences makes ``advance`` raise
    (stale); ``finish()`` still ends the loop. A loop that ended before its
    last step leaves its plan stale. The loop holds the cache's lock in
    every call (docs/layout.md, "Thread safety").

    Without a cache, the plan's rows must already hold the pages for the
    steps to come; ``active`` [B] bool marks padding: a padded entry's length
    word is set to 0 on the device, so its attention output is 0, its append
    is skipped and it never advances; ``lengths`` is the host mirror.

    ``sampler`` (a SamplerState of at least B slots): row r's token is drawn
    with slot r's parameters instead of the argmax; the logprob of step t
    (0-based) lands in ``sampler.logprobs[t % sampler.ring_rows, r]``.
    """

    def __init__(
        self,
        step: Callable[[DevicePlan], Array],
        plan: DevicePlan,
        *,
        token_buf: Array,
        next_token: Array,
        cache: PagedKVCache | None = None,
        seqs: Collection[Sequence] | None = None,
        active: Iterable[bool] | None = None,
        graph: bool = True,
        sampler: SamplerState | None = None,
    ):
        if cache is not None and not hasattr(cache, "_drive"):
            raise PagedAttentionError(f"cache: expected a PagedKVCache (or None), got {type(cache).__name__}")
        self._lock = contextlib.nullcontext() if cache is None else cache._lock
        self._drive = None
        with self._lock:
            self._build(step, plan, token_buf, next_token, cache, seqs, active, graph, sampler)
            if cache is not None:
                self._drive = cache._drive(plan, self)

    def _build(
        self,
        step: Callable[[DevicePlan], Array],
        plan: DevicePlan,
        token_buf: Array,
        next_token: Array,
        cache: PagedKVCache | None,
        seqs: Collection[Sequence] | None,
        active: Iterable[bool] | None,
        graph: bool,
        sampler: SamplerState | None = None,
    ) -> None:
        h = plan.host
        if h.queries != h.sequences or (h.q_lens != 1).any():
            raise PagedAttentionError("plan: expected one query per sequence (decode: q_lens all 1)")
        if sampler is not None and not isinstance(sampler, SamplerState):
            raise PagedAttentionError(f"sampler: expected a SamplerState or None, got {type(sampler).__name__}")
        if sampler is not None and sampler.slots < h.sequences:
            raise PagedAttentionError(
                f"sampler: expected a SamplerState of at least {h.sequences} slots (one per sequence), "
                f"got {sampler.slots}"
            )
        _token_buffer("token_buf", token_buf)
        _token_buffer("next_token", next_token)
        for name, b in (("token_buf", token_buf), ("next_token", next_token)):
            checks.shape_is(name, b, (h.sequences,))
        self.plan, self.stream = plan, plan.stream
        self.token_buf, self.next_token = token_buf, next_token
        self.cache = cache
        self.seqs: tuple[Sequence, ...] | None = None
        shared: set[int] = set()
        if cache is not None:
            owner: object = getattr(plan, "_cache", None)
            if owner is not cache or plan.seqs is None:
                got = (
                    "one of another PagedKVCache"
                    if owner is not None and owner is not cache
                    else "a DecodeBatch's slot plan"
                    if owner is not None
                    else "a plan made by no PagedKVCache"
                )
                raise PagedAttentionError(f"plan: expected a plan made by cache.prepare of the given cache, got {got}")
            plan.check_fresh()
            if seqs is not None and (len(seqs) != len(plan.seqs) or any(a is not b for a, b in zip(seqs, plan.seqs))):
                raise PagedAttentionError("seqs: expected the plan's sequences (plan.seqs), in row order")
            if active is not None:
                raise PagedAttentionError(
                    "active: a loop driven by a cache decodes every sequence of its plan; "
                    "prepare only the sequences that decode"
                )
            self.seqs = plan.seqs
            shared = {p for s in self.seqs for p in s._pages if cache.ref_count(p) > 1}
        self.active = np.ones(h.sequences, bool) if active is None else np.asarray(active, bool)
        checks.shape_is("active", self.active, (h.sequences,))
        self.lengths = np.where(self.active, h.kv_lens, 0)  # host mirror of the device lengths
        self.capacity = h.table_width * h.page_size
        self._writable, self._why = _writable_steps(h, self.active, shared)
        self._taken = 0
        # the slots' state: active, how far each may advance (cache: the last
        # reserved step does not advance), no length limit, no stop tokens
        n = h.sequences
        self.slots = SlotBuffers(plan.words, max(1, n))
        state = np.zeros(len(layout.SLOT_FIELDS) * self.slots.stride + 1, np.uint32)
        cap = self.lengths - 1 + self._writable if cache is not None else np.full(n, self.capacity)
        state[layout.SLOT_ACTIVE * self.slots.stride :][:n] = self.active
        state[layout.SLOT_CAP * self.slots.stride :][:n] = np.clip(cap, 0, layout.U32_MAX)
        state[layout.SLOT_MAX_LEN * self.slots.stride :][:n] = layout.NO_LIMIT
        self.stream.copy_from_host(self.slots.words, state)
        off = metadata_offsets(h.queries, h.sequences)
        for s in np.nonzero(~self.active)[0]:
            plan.stream.memset_d32(plan.words, 0, count=1, offset_bytes=4 * (off["kv_len"] + int(s)))
        self._writes = cache._track(plan) if cache is not None else None
        self._step, self._argmax = step, self._drawer(sampler, self.slots.clock)
        self._capture(graph, token_buf)
        self._all_layers = (
            cache is not None
            and self._writes is not None
            and len(self._writes.captured if graph else self._writes.layers) == cache.layers
        )

    def _body(self) -> None:
        self._argmax_of(self._step(self.plan))
        advance_slots(self.plan, self.slots, self.next_token)

    @property
    def steps_left(self) -> int:
        """Tokens every active sequence can still take: each step writes one
        slot per active sequence, which must lie on a valid page of its row
        that no other sequence holds (checked when the loop is built)."""
        return max(0, self._writable - self._taken)

    def advance(self) -> None:
        """Issue one token's work (one copy, one graph launch); no host data.
        Raises before issuing anything when no step is left or (with a
        cache) the plan went stale."""
        with self._lock:
            if self.steps_left <= 0:
                raise PagedAttentionError(f"plan: {self._why}; reserve more pages")
            if self.cache is not None:
                self.plan.check_fresh()
            self.stream.copy(self.token_buf, self.next_token)
            self._run_step()
            if self._writes is not None and not self._all_layers:  # eager: the first step tells
                assert self.cache is not None  # (the writes are the cache's)
                self._all_layers = len(self._writes.layers) == self.cache.layers
            self._taken += 1
            last = self._taken == self._writable
            if self.cache is not None:
                assert self.seqs is not None and self._drive is not None  # a cache-driven loop holds both
                for s, n in zip(self.seqs, self.lengths):
                    s.length = int(n) if last else int(n) + 1
                    if self._all_layers:
                        self.cache._wrote(s, int(n) - 1, int(n))
                self._drive.taken = self._taken
                if last:
                    self._drive.end(False)  # the last step does not advance: nothing to drop
            if not (last and self.cache is not None):
                self.lengths[self.active] += 1

    def finish(self) -> None:
        """End the loop now (cache-driven loops): each sequence's length drops
        the token the device prepared for the next step (it is in
        ``next_token``, not in the cache), so ``cache.prepare(seqs, 1)`` feeds
        it next, and the sequences are free for fork, free, prepare, reserve
        and join again. Works on a stale loop too. Later ``advance()`` calls
        raise, and the plan is stale. A loop that ran all its steps has
        nothing to drop; finishing twice does nothing more."""
        with self._lock:
            if self._drive is not None and not self._drive.ended:
                self._drive.end(True)
                self.lengths[self.active] -= 1
            self._writable = self._taken
            self._why = "the loop was finished"


def _writable_steps(h: HostPlan, active: np.ndarray, shared: Collection[int] = frozenset()) -> tuple[int, str]:
    """(steps, why they end): how many decode steps every active sequence of
    the decode plan ``h`` can take while each step's write slot (position
    kv_len - 1 + t of its row) lies on a valid page id that appears nowhere
    else among the active rows nor in ``shared`` (pages a page manager knows
    other sequences hold): a page shared with another sequence, or reached
    twice, would take two sequences' tokens in one slot."""
    ps, width, pages = h.page_size, h.table_width, h.pages
    table = np.asarray(h.page_table)
    rows = np.nonzero(active)[0]
    valid = (table >= 0) & (table < pages)
    holders: dict[int, int] = {}
    for r in rows:
        for p in np.unique(table[r][valid[r]]):
            holders[int(p)] = holders.get(int(p), 0) + 1
    best, why = None, "no active sequence"
    for r in rows:
        p0 = int(h.kv_lens[r]) - 1  # the first step writes at the query's position
        col0 = p0 // ps
        steps, reason = width * ps - p0, f"sequence {r}'s page-table row is full"
        for col in range(col0, width):
            page = int(table[r, col])
            bad = None
            if not valid[r, col]:
                bad = f"sequence {r}'s page-table column {col} holds no page"
            elif holders[page] > 1 or page in shared or int((table[r][valid[r]] == page).sum()) > 1:
                bad = f"sequence {r}'s page {page} (column {col}) is held twice; copy it before decoding into it"
            if bad is not None:
                steps, reason = max(0, col * ps - p0), bad
                break
        if best is None or steps < best:
            best, why = steps, reason
    return (best or 0), why
