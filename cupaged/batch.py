"""Continuous batching on captured decode graphs: ``DecodeBatch``.

A decode graph is captured once per batch bucket (1, 2, 4, ... up to
``max_batch``, as vLLM pads batch sizes) over a plan on stable buffers
(``HostPlan.slots``): B slots of one query each and a page table of a fixed
width. Sequences join and leave slots between launches by stream-ordered
updates of those words (``Stream.copy_from_host`` of a host staging copy
that lives until the copy ran, ``memset_d32``), never by recapture; an empty
slot is a padded entry (kv_len word 0) that reads and writes nothing.

Inside the graph, after the user's step and the argmax (or, with ``vocab``,
the per-slot sampler: ``cupaged.ops.sample``, each slot's ``SamplingParams``
in stable device words set at ``join``), ``advance_slots``
records every slot's token in a device ring, finishes a slot whose token is a
stop id or whose length reaches its limit (it stops advancing on the
device), and advances the others. The host reads the ring back every k
launches (``readback``, the one synchronization), learns which sequences
finished and at which step, and corrects their lengths. Pages for the next
k steps are reserved through the page manager (``PagedKVCache.reserve``) and
the changed page-table rows reach the words by stream-ordered copies.

Layout and rules: docs/layout.md, "Decode graphs".

    batch = DecodeBatch(cache, step, token_buf=tok, next_token=nxt, max_batch=8, max_len=512,
                        stop_ids=[eos], readback_every=8)
    batch.join(seq, first_token)           # a prefilled sequence and the token it feeds first
    for _ in range(8):
        batch.advance()                    # one copy + one graph launch, no host data
    out = batch.readback()                 # {seq: [tokens]}, which finished and why
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from . import layout
from ._runtime import array_backend, check_not_capturing, checks, stream_for, zeros
from ._runtime.arrays import Array
from .cache import PagedKVCache, Sequence
from .errors import PagedAttentionError, add_note
from .graph import CapturedGraph, _token_buffer, capture_graph, seed_tokens
from .layout import MAX_VISIBLE_LEN, metadata_offsets
from .ops.advance import SlotBuffers, advance_slots
from .ops.sample import SamplerState, sample_into
from .ops.sampling import argmax_into
from .plan import DevicePlan, HostPlan
from .sampling import SamplingParams

#: Most slots of one DecodeBatch.
MAX_BATCH = 1024

#: Finish reasons by ``layout.FINISH_*`` code.
REASONS = {layout.FINISH_STOP: "stop", layout.FINISH_MAX_LEN: "max_len", layout.FINISH_NO_ROOM: "no_room"}


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch``."""
    max_batch = checks.host_int("max_batch", max_batch, 1, MAX_BATCH)
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out + [max_batch])


@dataclass
class Readback:
    """What ``DecodeBatch.readback`` learned: ``tokens`` maps each sequence
    that generated since the last readback to its new tokens in order (a
    first token that joined from the device comes first); ``finished`` maps
    each sequence that finished to ``"stop"``, ``"max_len"`` or
    ``"no_room"`` (it has left the batch) and ``finished_at`` to the launch
    (0-based, counting every launch of the batch, ``batch.launches``) that
    generated its last token; ``steps``: launches covered. ``logprobs``:
    for each sequence that joined with ``SamplingParams(logprobs=0)``, the
    log-probability of each of its new tokens under the raw logits (NaN for
    a first token the batch did not draw itself); ``top_logprobs``: for those
    with ``logprobs=n`` > 0, per new token the n most likely (token id,
    logprob) pairs, largest first ([] for a first token not drawn here)."""

    tokens: dict[Sequence, list[int]] = field(default_factory=dict)
    logprobs: dict[Sequence, list[float]] = field(default_factory=dict)
    top_logprobs: dict[Sequence, list[list[tuple[int, float]]]] = field(default_factory=dict)
    finished: dict[Sequence, str] = field(default_factory=dict)
    finished_at: dict[Sequence, int] = field(default_factory=dict)
    steps: int = 0


class _Slot:
    """Host view of one occupied slot."""

    __slots__ = (
        "seq",
        "max_len",
        "start",
        "len0",
        "written0",
        "first_on_device",
        "done",
        "logprobs",
        "top_n",
        "first_drawn",
    )

    def __init__(
        self, seq: Sequence, max_len: int, start: int, first_on_device: bool, logprobs: bool = False, top_n: int = 0
    ):
        self.seq, self.max_len, self.start = seq, max_len, start
        self.logprobs, self.top_n = logprobs, top_n  # read its logprobs (and top n) back
        self.first_drawn = False  # its first token was drawn by a SamplerState (join drawn_by=): its logprob is known
        self.len0 = seq.length  # prepared length at the start of this round
        self.written0 = seq.length - 1  # tokens written at the start of this round
        self.first_on_device = first_on_device
        self.done = False  # the host knows it finishes (its max_len)


class DecodeBatch:
    """Decode of a changing set of sequences of ``cache`` (greedy, or each
    with its own SamplingParams when made with ``vocab``), one graph launch
    per token, one capture per batch bucket.

    ``step(plan)`` issues one decode step's stream work for ``plan`` (a
    stable slot plan of B = plan.sequences slots; B is a bucket): embedding of
    ``token_buf[:B]``, every layer's ``cache.append(plan, k, v, layer=l)`` and
    ``plan.attention(q, cache.k[l], cache.v[l], ...)``, and returns logits
    [B, vocab]. It runs under capture once per bucket (``graph=True``) or on
    every launch (``graph=False``).

    token_buf, next_token: int64 [max_batch] device buffers (the step reads
    token_buf; the argmax writes next_token; ``advance`` copies one to the
    other first). max_batch: slots. max_len: the longest a sequence may get
    (its tokens, the generated ones included); the page-table width is
    ceil(max_len / page_size) and it is each slot's default length limit.
    stop_ids: tokens that end a sequence. readback_every (k): launches
    between readbacks (the ring's rows). buckets: batch sizes with a graph
    each (default 1, 2, 4, ..., max_batch). vocab: the logits' last dim;
    given, the graph draws each slot's token with its own ``SamplingParams``
    (``join(..., sampling=)``; per-slot device words and token counts,
    ``cupaged.ops.sample.SamplerState`` as ``sampler``) instead of the argmax
    (temperature 0 is the argmax, bit for bit). max_logprobs: the most top
    logprobs a slot may ask for (``SamplingParams.logprobs``).

    ``captures`` counts this batch's captures (at most one per bucket);
    ``launches`` its launches. Hot paths (advance, join, leave) allocate
    nothing on the device and never synchronize; ``readback`` is the one
    synchronization. ``vocab``: the logits' last dim, once the step ran.

    Failures change nothing the batch relies on: ``readback`` either returns
    everything since the last one or raises and leaves the batch as it was
    (call it again); device work of a reorganization that failed midway
    (padding, packing, shrinking) is issued again by the next call.
    Every method holds the cache's lock (docs/layout.md, "Thread safety").
    """

    def __init__(
        self,
        cache: PagedKVCache,
        step: Callable[[DevicePlan], Array],
        *,
        token_buf: Array,
        next_token: Array,
        max_batch: int,
        max_len: int,
        stop_ids: Iterable[int] = (),
        readback_every: int = 8,
        buckets: Iterable[int] | None = None,
        graph: bool = True,
        vocab: int | None = None,
        max_logprobs: int = 0,
    ):
        if not isinstance(cache, PagedKVCache):
            raise PagedAttentionError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
        if not callable(step):
            raise PagedAttentionError(
                f"step: expected a callable step(plan) -> logits [B, vocab], got {type(step).__name__}"
            )
        self.cache = cache
        self.max_batch = checks.host_int("max_batch", max_batch, 1, MAX_BATCH)
        self.max_len = checks.host_int("max_len", max_len, 2, MAX_VISIBLE_LEN)
        self.k = checks.host_int("readback_every", readback_every, 1, 1 << 16)
        self.graph = checks.boolean("graph", graph)
        _token_buffer("token_buf", token_buf)
        _token_buffer("next_token", next_token)
        for name, b in (("token_buf", token_buf), ("next_token", next_token)):
            checks.shape_is(name, b, (self.max_batch,))
            if array_backend(b) != cache.backend:
                raise PagedAttentionError(f"{name}: expected an array of the cache's {cache.backend} backend")
        self.token_buf, self.next_token = token_buf, next_token
        bs = (
            default_buckets(self.max_batch)
            if buckets is None
            else tuple(sorted({int(b) for b in checks.host_int_array("buckets", buckets, 1)}))
        )
        if not bs or bs[0] < 1 or bs[-1] != self.max_batch:
            raise PagedAttentionError(
                f"buckets: expected batch sizes in 1..{self.max_batch} ending at max_batch, got {list(bs)}"
            )
        self.buckets = bs
        self.stream = stream_for(cache.k)
        check_not_capturing(self.stream, "DecodeBatch")
        self.table_width = -(-self.max_len // cache.page_size)
        self.slots = SlotBuffers(cache.k, self.max_batch, stop_ids=stop_ids, ring_rows=self.k)
        self.sampler = (
            None
            if vocab is None
            else SamplerState(cache.k, self.max_batch, vocab, ring_rows=self.k, max_logprobs=max_logprobs)
        )
        self.first = zeros(cache.k, self.max_batch, np.int64)
        self._plans: dict[int, DevicePlan] = {}
        self._writes = {}
        for b in bs:
            plan = HostPlan.slots(b, self.table_width, cache.page_size, cache.num_pages).upload(cache.k)
            self._plans[b] = plan
            self._writes[b] = cache._track(plan)
        self._graphs: dict[int, CapturedGraph] = {}
        self._step = step
        self._slot: list[_Slot | None] = [None] * self.max_batch
        self._bucket = bs[0]
        self.launches = 0
        self._read_at = 0
        self.captures = 0
        self._appends_all = True  # every launch so far appended every layer (prefix index)
        self._row = np.empty(self.table_width, np.uint32)  # host staging of one page-table row
        self.vocab: int | None = None
        self._pad: set[int] = set()  # released slots whose padding on the device is still to issue
        self._unsettled = False  # padding, packing or a bucket change is still to issue (_settle)
        self._held: Readback | None = None  # a readback whose reorganization failed: the next one returns it

    # -- queries ------------------------------------------------------------
    @property
    def bucket(self) -> int:
        """The batch size of the graph the next launch replays."""
        return self._bucket

    @property
    def members(self) -> tuple[Sequence, ...]:
        return tuple(s.seq for s in self._slot if s is not None)

    def slot_of(self, seq: Sequence) -> int:
        for i, s in enumerate(self._slot):
            if s is not None and s.seq is seq:
                return i
        raise PagedAttentionError(f"seq: sequence {getattr(seq, 'id', seq)} is not in this batch")

    def plan(self, bucket: int | None = None) -> DevicePlan:
        """The stable plan of ``bucket`` (one of ``buckets``; default: the current one)."""
        if bucket is None:
            return self._plans[self._bucket]
        b = checks.host_int("bucket", bucket, 1, self.max_batch)
        if b not in self._plans:
            raise PagedAttentionError(f"bucket: expected one of the batch's buckets {list(self.buckets)}, got {b}")
        return self._plans[b]

    # -- membership -----------------------------------------------------------
    def join(
        self,
        seq: Sequence,
        token: int | Array,
        *,
        max_len: int | None = None,
        sampling: SamplingParams | None = None,
        drawn_by: tuple[SamplerState, int] | None = None,
    ) -> int:
        """Put ``seq`` (prefilled: ``seq.length`` tokens written) into the
        lowest free slot, feeding ``token`` first at position ``seq.length``:
        an int (set on the device with memsets) or a 1-element int64 device
        array (copied on the device, e.g. the prefill's argmax; the host
        learns it at the next readback). ``max_len``: this sequence's length
        limit (at most the batch's). Reserves its pages for the next k steps
        (copying a shared last page); the bucket grows when the slot needs it.
        Returns the slot. Raises (changing nothing) when the batch is full,
        out of pages, the sequence is too long or driven by a live decode
        loop, or an int ``token`` is no token id (< 0, or >= ``vocab`` once
        known). ``sampling`` (a batch made with ``vocab``): how the slot draws
        its tokens (default greedy); its repetition penalty sees the
        sequence's known tokens (``add_sequence(tokens=...)``) and an int
        ``token`` counts as generated. ``drawn_by`` = (state, row): the device
        ``token`` was drawn by ``ops.sample.sample_into`` with slot ``row`` of
        SamplerState ``state`` (e.g. the prefill's last row with this
        request's parameters): the slot takes that slot's parameters (its
        step), counts and logprob, so the draws go on as one sequence."""
        with self.cache._lock:
            self._settle()
            return self._join(seq, token, max_len, sampling, drawn_by)

    def _join(self, seq, token, max_len, sampling=None, drawn_by=None) -> int:
        self.cache._check_seqs([seq], "seq")
        if seq._batch is not None:
            raise PagedAttentionError(f"seq: sequence {seq.id} is already in a DecodeBatch")
        self.cache._check_not_driven(seq, "seq", "join")
        limit = self.max_len if max_len is None else checks.host_int("max_len", max_len, 2, self.max_len)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise PagedAttentionError(f"sampling: expected a SamplingParams or None, got {type(sampling).__name__}")
        if sampling is not None and self.sampler is None and not sampling.is_greedy:
            raise PagedAttentionError(
                "sampling: this DecodeBatch takes the argmax; make it with vocab= to sample on the device"
            )
        sp = SamplingParams.greedy() if sampling is None else sampling
        if sp.logprobs and (self.sampler is None or sp.logprobs > self.sampler.max_logprobs):
            most = 0 if self.sampler is None else self.sampler.max_logprobs
            raise PagedAttentionError(f"sampling: logprobs={sp.logprobs} exceeds the batch's max_logprobs {most}")
        L = seq.length
        context = list(seq._tokens[:L])
        if self.sampler is not None and context:
            checks.token_ids("seq", context, self.sampler.vocab)
        if drawn_by is not None:
            ok = isinstance(drawn_by, tuple) and len(drawn_by) == 2 and isinstance(drawn_by[0], SamplerState)
            ok = ok and self.sampler is not None and drawn_by[0].max_logprobs <= self.sampler.max_logprobs
            if not ok or self.sampler is None or drawn_by[0].vocab != self.sampler.vocab:
                raise PagedAttentionError(
                    "drawn_by: expected (SamplerState of the batch's vocab and at most its max_logprobs, row) "
                    "on a batch made with vocab="
                )
            checks.host_int("drawn_by", drawn_by[1], 0, drawn_by[0].slots - 1)
        if L + 1 >= limit:
            raise PagedAttentionError(
                f"max_len: sequence {seq.id} holds {L} tokens and feeds one more; expected "
                f"a limit above {L + 1}, got {limit}"
            )
        device_token = not isinstance(token, (int, np.integer)) or isinstance(token, bool)
        if device_token:
            if array_backend(token) is None or str(token.dtype) != "int64" or token.size != 1:
                raise PagedAttentionError(
                    f"token: expected an int or a 1-element int64 array, got {type(token).__name__}"
                )
            checks.plan_arrays(self._plans[self._bucket], token=token)
        elif drawn_by is not None:
            raise PagedAttentionError("drawn_by: expected a device token (the one the state drew), got an int")
        else:
            vocab = self.vocab if self.sampler is None else self.sampler.vocab
            token = int(checks.token_ids("token", token, vocab)[0])
        try:
            slot = self._slot.index(None)
        except ValueError:
            raise PagedAttentionError(f"seq: the batch is full ({self.max_batch} slots)") from None
        target = self._target(L + 1, limit)  # positions L .. target - 1 in its own pages
        if -(-target // self.cache.page_size) > self.table_width:
            raise PagedAttentionError(
                f"seq: sequence {seq.id} needs more than {self.table_width} pages (max_len {self.max_len})"
            )
        self.cache._reserve([seq], max(0, target - L))  # may raise: nothing changed
        if slot >= self._bucket:
            self._switch(self._bucket_for(slot + 1))
        seq._batch = self
        seq.length = L + 1  # the fed token is prepared (docs/layout.md)
        state = _Slot(seq, limit, self.launches, device_token, sp.logprobs is not None, sp.logprobs or 0)
        self._slot[slot] = state
        if drawn_by is not None:
            assert self.sampler is not None  # checked above
            self.sampler.take(slot, drawn_by[0], int(drawn_by[1]))
            state.first_drawn = True
        elif self.sampler is not None:
            self.sampler.set(slot, sp.words(), context=context, generated=[] if device_token else [token])
        if device_token:
            self.stream.copy(self.next_token, token, nbytes=8, dst_offset=8 * slot)
            self.stream.copy(self.first, token, nbytes=8, dst_offset=8 * slot)
        else:
            seed_tokens(self.next_token[slot : slot + 1], [token])
            if len(seq._tokens) == L:
                seq._tokens.append(token)
        self._write_slot(slot, seq, limit)
        return slot

    def leave(self, seq: Sequence) -> None:
        """Take ``seq`` out of its slot (the slot becomes padded on the
        device). Only right after ``readback()`` (its length is then known):
        the token it would have fed next is not written, so ``seq.length``
        drops it and ``cache.prepare(seq, 1)`` or a later ``join`` feeds it."""
        with self.cache._lock:
            self._settle()
            slot = self.slot_of(seq)
            if self.launches != self._read_at:
                raise PagedAttentionError(
                    "leave: the batch ran since its last readback(); call readback() first so "
                    "the sequence's length and tokens are known"
                )
            self._release(slot)
            seq.length -= 1
            self._unsettled = True
            try:
                self._settle()
            except BaseException as err:
                add_note(
                    err,
                    "DecodeBatch.leave: the sequence has left; padding and packing its slot failed and are "
                    "issued again by the next call",
                )
                raise

    # -- running --------------------------------------------------------------
    def advance(self) -> None:
        """One decode step of every occupied slot: reserve pages where a
        slot's next write needs one (raises, launching nothing, when out of
        pages), copy next_token -> token_buf, launch the bucket's graph
        (captured at its first use). No host data, no synchronization."""
        with self.cache._lock:
            self._settle()
            self._advance()

    def _advance(self) -> None:
        live = [(i, s) for i, s in enumerate(self._slot) if s is not None and not s.done]
        if not live:
            raise PagedAttentionError(
                "advance: no sequence to decode; join one first (sequences that reached "
                "their limit leave at the next readback())"
            )
        if self.launches - self._read_at >= self.k:
            raise PagedAttentionError(
                f"advance: {self.k} launches since the last readback fill the token ring; call readback() first"
            )
        short = [(i, s) for i, s in live if self._short(s.seq, s.max_len)]
        if short:
            seqs = [s.seq for _, s in short]
            need = [self._target(s.seq.length, s.max_len) - s.seq.length for _, s in short]
            self.cache._reserve(seqs, need)  # may raise: nothing changed, nothing launched
            for i, s in short:
                self._write_row(i, s.seq)
        b = self._bucket
        self.stream.copy(self.token_buf, self.next_token, nbytes=8 * b)
        self._launch(b)
        self.launches += 1
        for _, s in live:
            if s.seq.length + 1 >= s.max_len:  # the device finishes it at this launch
                s.done = True
            else:
                s.seq.length += 1

    def readback(self) -> Readback:
        """Read the token ring back (the one synchronization, every k
        launches or sooner): each sequence's new tokens, which finished (a
        stop token, its length limit, no room) and at which launch. Finished
        sequences leave the batch, their lengths exact (the tokens written;
        the final token is reported, not written); the others' lengths are
        exact as well. Then the slots are packed and the bucket shrinks.

        Transactional: when anything fails before the tokens are learned (the
        device read, the prefix index, ...), it raises with the batch as it
        was (a note on the exception says so): a later ``readback()`` returns
        these tokens. When packing the slots fails after that, the tokens are
        kept and the next ``readback()`` returns them (with any newer ones);
        the next call issues the packing again."""
        with self.cache._lock:
            self._settle()
            if self.launches == self._read_at:
                out, self._held = self._held or Readback(), None
                return out
            try:
                out = self._learn()
            except BaseException as err:
                add_note(
                    err,
                    "DecodeBatch.readback: nothing was learned and the batch is as it was before this "
                    "call; call readback() again",
                )
                raise
            if self._held is not None:
                out = _merged(self._held, out)
            self._held = out
            try:
                self._settle()
            except BaseException as err:
                add_note(
                    err,
                    "DecodeBatch.readback: the tokens were read and are kept, the next readback() returns "
                    "them; packing the slots failed and is issued again by the next call",
                )
                raise
            self._held = None
            return out

    def _learn(self) -> Readback:
        """The host side of a readback: read the ring and the slot state,
        then update lengths, tokens, slots and the prefix index; restores
        everything it changed when anything fails."""
        out = Readback(steps=self.launches - self._read_at)
        ring = self.stream.read(self.slots.ring)
        words = self.stream.read(self.slots.words)
        first = self.stream.read(self.first) if any(s is not None and s.first_on_device for s in self._slot) else None
        lps: tuple | None = None
        if self.sampler is not None and any(s is not None and s.logprobs for s in self._slot):
            sm = self.sampler
            lps = (self.stream.read(sm.logprobs), self.stream.read(sm.first_logprobs))
            if any(s is not None and s.top_n for s in self._slot):
                lps += (
                    self.stream.read(sm.top_ids),
                    self.stream.read(sm.top_logprobs),
                    self.stream.read(sm.first_top_ids),
                    self.stream.read(sm.first_top_logprobs),
                )
        saved = self._snapshot()
        try:
            self._learn_from(out, ring, words, first, lps)
        except BaseException:
            self._restore(saved)
            raise
        return out

    def _learn_from(self, out: Readback, ring, words, first, lps=None) -> None:
        stride = self.max_batch
        for i, s in enumerate(self._slot):
            if s is None:
                continue
            active = words[layout.SLOT_ACTIVE * stride + i]
            end = self.launches
            reason = None
            if not active:
                end = int(words[layout.SLOT_DONE_AT * stride + i]) + 1
                reason = REASONS.get(int(words[layout.SLOT_REASON * stride + i]), "stop")
            toks = [int(ring[t % self.k, i]) for t in range(s.start, end)]
            lp = None if lps is None or not s.logprobs else [float(lps[0][t % self.k, i]) for t in range(s.start, end)]
            top = None
            if lp is not None and s.top_n:
                n, ids, tl = s.top_n, lps[2], lps[3]
                top = [_pairs(ids[t % self.k, i, :n], tl[t % self.k, i, :n]) for t in range(s.start, end)]
            if s.first_on_device:
                ft = int(first[i])
                if len(s.seq._tokens) == s.written0:
                    s.seq._tokens.append(ft)
                toks.insert(0, ft)
                if lp is not None:
                    lp.insert(0, float(lps[1][i]) if s.first_drawn else float("nan"))
                if top is not None:
                    top.insert(0, _pairs(lps[4][i, : s.top_n], lps[5][i, : s.top_n]) if s.first_drawn else [])
                s.first_on_device = False
            m = end - s.start
            seq = s.seq
            seq.length = s.len0 + m - (1 if reason else 0)
            if len(seq._tokens) == s.len0:
                seq._tokens.extend(toks[-m:] if m else [])
            written = seq.length if reason else seq.length - 1
            if self._appends_all:
                self.cache._wrote(seq, s.written0, written)
            else:
                self.cache._index_pages(seq)
            if toks:
                out.tokens[seq] = toks
                if lp is not None:
                    out.logprobs[seq] = lp
                if top is not None:
                    out.top_logprobs[seq] = top
            if reason:
                out.finished[seq] = reason
                out.finished_at[seq] = end - 1
                self._release(i)
            else:
                s.start, s.len0, s.written0 = self.launches, seq.length, written
        self._read_at = self.launches
        self._unsettled = True

    def _snapshot(self):
        """What ``_learn_from`` changes (the prefix index aside: an entry it
        added describes written pages, and offering them again finds it)."""
        slots = [
            (s, s.start, s.len0, s.written0, s.first_on_device, s.done, s.first_drawn) if s is not None else None
            for s in self._slot
        ]
        seqs = [
            (s.seq, s.seq.length, len(s.seq._tokens), s.seq._written, s.seq._indexed, s.seq._batch)
            for s in self._slot
            if s is not None
        ]
        return slots, seqs, set(self._pad), self._read_at, self._unsettled

    def _restore(self, saved) -> None:
        slots, seqs, pad, read_at, unsettled = saved
        self._slot = [None if t is None else t[0] for t in slots]
        for t in slots:
            if t is not None:
                t[0].start, t[0].len0, t[0].written0, t[0].first_on_device, t[0].done, t[0].first_drawn = t[1:]
        for seq, length, ntok, written, indexed, batch in seqs:
            seq.length, seq._written, seq._indexed, seq._batch = length, written, indexed, batch
            del seq._tokens[ntok:]
        self._pad, self._read_at, self._unsettled = pad, read_at, unsettled

    # -- internals ------------------------------------------------------------
    def _target(self, length: int, limit: int) -> int:
        """Tokens a slot of prepared ``length`` (its next launch writes
        position length - 1) should hold pages for: this launch's write and
        the next k - 1, plus the one after, which the advance kernel needs
        room for at the end of the launch, never past the last position its
        limit lets it write (limit - 2)."""
        return max(length, min(length + self.k, limit - 1))

    @staticmethod
    def _short(seq: Sequence, limit: int) -> bool:
        """The slot's next launch needs a page it does not hold: room to
        write position length - 1 and to advance past it (unless its limit
        finishes it there)."""
        return seq.capacity < min(seq.length + 1, limit - 1)

    def _bucket_for(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _words(self, bucket: int | None = None) -> tuple[DevicePlan, dict[str, int]]:
        plan = self._plans[self._bucket if bucket is None else bucket]
        return plan, metadata_offsets(plan.host.queries, plan.host.sequences)

    def _write_row(self, slot: int, seq: Sequence) -> None:
        """Stream-ordered: the slot's page-table row and its cap."""
        plan, off = self._words()
        row = self._row
        row[:] = layout.NO_PAGE
        row[: len(seq._pages)] = seq._pages
        self.stream.copy_from_host(plan.words, row, dst_offset=4 * (off["page_table"] + slot * self.table_width))
        self.slots.set(slot, layout.SLOT_CAP, seq.capacity)

    def _write_slot(self, slot: int, seq: Sequence, limit: int) -> None:
        """Stream-ordered: every word of a slot that (re)starts with ``seq``
        at its prepared length (kv_len = length, q_pos = length - 1)."""
        plan, off = self._words()
        self._write_row(slot, seq)
        self.stream.memset_d32(plan.words, seq.length - 1, count=1, offset_bytes=4 * (off["q_pos"] + slot))
        self.stream.memset_d32(plan.words, seq.length, count=1, offset_bytes=4 * (off["kv_len"] + slot))
        self.slots.set(slot, layout.SLOT_MAX_LEN, limit)
        self.slots.set(slot, layout.SLOT_DONE_AT, 0)
        self.slots.set(slot, layout.SLOT_REASON, 0)
        self.slots.set(slot, layout.SLOT_ACTIVE, 1)

    def _release(self, slot: int) -> None:
        """The host forgets the slot; ``_settle`` pads it on the device."""
        s = self._slot[slot]
        assert s is not None, "only an occupied slot is released"
        s.seq._batch = None
        self._slot[slot] = None
        self._pad.add(slot)

    def _pad_slot(self, slot: int) -> None:
        """Stream-ordered: the slot reads and writes nothing (kv_len 0, inactive)."""
        plan, off = self._words()
        self.stream.memset_d32(plan.words, 0, count=1, offset_bytes=4 * (off["kv_len"] + slot))
        self.slots.set(slot, layout.SLOT_ACTIVE, 0)

    def _settle(self) -> None:
        """At a readback boundary (or before any later call, when one failed
        midway): pad released slots, move the highest occupied slots into the
        lowest free ones (the host knows their state exactly; the token each
        feeds next moves on the device), then shrink the bucket. The host
        takes each step only after its device work was issued, and each step
        can be issued again, so a failure leaves nothing the next call does
        not redo."""
        if not self._unsettled:
            return
        for slot in sorted(self._pad):
            self._pad_slot(slot)
            self._pad.discard(slot)
        while True:
            used = [i for i, s in enumerate(self._slot) if s is not None]
            free = [i for i, s in enumerate(self._slot) if s is None]
            if not used or not free or free[0] > used[-1]:
                break
            src, dst = used[-1], free[0]
            s = self._slot[src]
            assert s is not None  # src is in used
            for buf in (self.next_token, self.first):
                self.stream.copy(buf, buf, nbytes=8, dst_offset=8 * dst, src_offset=8 * src)
            if self.sampler is not None:
                self.sampler.move(dst, src)  # its parameters, step and counts
            self._write_slot(dst, s.seq, s.max_len)
            self._slot[dst], self._slot[src] = s, None  # src still active on the device: padded next
            self._pad.add(src)
            self._pad_slot(src)
            self._pad.discard(src)
        used = [i for i, s in enumerate(self._slot) if s is not None]
        want = self._bucket_for(used[-1] + 1 if used else 1)
        if want != self._bucket:
            self._switch(want)
        self._unsettled = False

    def _switch(self, bucket: int) -> None:
        """Make ``bucket`` current: its words take the current words' slots
        (device-to-device, so state the host has not read yet moves too),
        its extra slots padded."""
        old, off_old = self._words()
        new, off_new = self._words(bucket)
        m = min(self._bucket, bucket)
        for name, n in (("kv_len", m), ("q_pos", m), ("page_table", m * self.table_width)):
            self.stream.copy(
                new.words, old.words, nbytes=4 * n, dst_offset=4 * off_new[name], src_offset=4 * off_old[name]
            )
        if bucket > m:
            self.stream.memset_d32(new.words, 0, count=bucket - m, offset_bytes=4 * (off_new["kv_len"] + m))
        self._bucket = bucket

    def _body(self, bucket: int) -> None:
        plan = self._plans[bucket]
        logits = self._step(plan)
        self.vocab = int(logits.shape[-1])
        if self.sampler is None:
            argmax_into(logits, self.next_token[:bucket])
        else:
            sample_into(logits, self.sampler, self.next_token, clock=self.slots.clock)
        advance_slots(plan, self.slots, self.next_token, full_finishes=True)

    def _launch(self, bucket: int) -> None:
        w = self._writes[bucket]
        if not self.graph:
            self._body(bucket)
            self._appends_all &= len(w.layers) == self.cache.layers
            return
        g = self._graphs.get(bucket)
        if g is None:
            with capture_graph(self.cache.k) as g:
                self._body(bucket)
            self._graphs[bucket] = g
            self.captures += 1
        self._appends_all &= len(w.captured) == self.cache.layers
        g.launch()


def _pairs(ids, lps) -> list[tuple[int, float]]:
    return [(int(t), float(v)) for t, v in zip(ids, lps)]


def _merged(a: Readback, b: Readback) -> Readback:
    """Readback ``a`` followed by ``b``."""
    out = Readback(
        tokens={s: list(t) for s, t in a.tokens.items()},
        finished=dict(a.finished),
        finished_at=dict(a.finished_at),
        steps=a.steps + b.steps,
    )
    for s, t in b.tokens.items():
        out.tokens.setdefault(s, []).extend(t)
    out.logprobs = {s: list(lp) for s, lp in a.logprobs.items()}
    for s, lp in b.logprobs.items():
        out.logprobs.setdefault(s, []).extend(lp)
    out.top_logprobs = {s: list(tp) for s, tp in a.top_logprobs.items()}
    for s, tp in b.top_logprobs.items():
        out.top_logprobs.setdefault(s, []).extend(tp)
    out.finished.update(b.finished)
    out.finished_at.update(b.finished_at)
    return out


__all__ = ["DecodeBatch", "Readback", "default_buckets"]
