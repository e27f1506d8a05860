"""Advancing a plan on the device (``kernels_cu/advance.cu``): the last
kernel of a captured decode step, so the next replay attends over, rotates
by and appends at the next position with no host data.

* ``advance_plan(plan)``: every non-padded sequence moves by its q_len.
* ``advance_slots(plan, slots, tokens)``: decode slots with a per-slot state
  (``SlotBuffers``): which slots are active, how far each one's own pages
  reach, its length limit, stop tokens, a token ring; a slot that generates a
  stop token or reaches its limit finishes on the device (docs/layout.md,
  "Decode graphs").
"""

from __future__ import annotations

import numpy as np

from .. import layout
from .._runtime import backend_of, check_not_capturing, checks, get_kernel, register, stream_for, zeros
from ..errors import PagedAttentionError

THREADS = 128
#: Threads of advance_slots' one block (they stride over the slots).
SLOT_THREADS = 256
#: Most stop tokens a SlotBuffers holds.
MAX_STOP_IDS = 64
register("advance", [{}])


def advance_plan(plan) -> None:
    """Stream work that moves every non-padded sequence of ``plan`` (a
    DevicePlan) forward by its q_len on the device: kv_len += q_len and each
    of its queries' q_pos += q_len, for every sequence whose kv_len word is
    not 0 and whose page-table row has room. The host plan is not changed."""
    h = plan.host
    k = get_kernel(plan.words, "advance", "advance_plan")
    plan.stream.launch(
        k,
        ((h.sequences + THREADS - 1) // THREADS,),
        (THREADS,),
        (plan.words, np.uint32(h.queries), np.uint32(h.sequences), np.uint32(h.table_width), np.uint32(h.page_size)),
    )


class SlotBuffers:
    """Device state of ``stride`` decode slots, on the backend of ``like``
    (allocated here, once; never inside a capture):

    * ``state`` uint32 [SLOT_FIELDS, stride]: per slot ``active`` (1/0),
      ``cap`` (tokens its own pages hold), ``max_len`` (its length limit),
      ``done_at`` (the launch whose token was its last), ``reason`` (why it
      finished: ``layout.FINISH_*``); all 0 at first (every slot inactive);
    * ``clock`` uint32 [1]: launches so far (the ring row of the next one);
    * ``stop`` int64 [max(1, len(stop_ids))]: the stop tokens;
    * ``ring`` int64 [max(1, ring_rows), stride]: row ``launch % ring_rows``
      holds every active slot's token of that launch.

    ``state`` and ``clock`` are one allocation (``words``), so one readback
    returns both.
    """

    def __init__(self, like, stride: int, *, stop_ids=(), ring_rows: int = 0):
        self.stride = checks.host_int("slots", stride, 1, 1 << 24)
        self.ring_rows = checks.host_int("ring_rows", ring_rows, 0, 1 << 20)
        stop = checks.host_int_array("stop_ids", list(stop_ids), 1)
        if stop.shape[0] > MAX_STOP_IDS:
            raise PagedAttentionError(f"stop_ids: expected at most {MAX_STOP_IDS} tokens, got {stop.shape[0]}")
        self.stream = stream_for(like)
        check_not_capturing(self.stream, "SlotBuffers")
        self.num_stop = int(stop.shape[0])
        self.stop_ids = tuple(int(t) for t in stop)
        n = len(layout.SLOT_FIELDS) * self.stride
        self.words = zeros(like, n + 1, np.uint32)
        self.state = self.words[:n]
        self.clock = self.words[n:]
        self.stop = zeros(like, max(1, self.num_stop), np.int64)
        if self.num_stop:
            self.stream.copy_from_host(self.stop, stop)
        self.ring = zeros(like, (max(1, self.ring_rows), self.stride), np.int64)

    def field_offset(self, field: int, slot: int) -> int:
        """Byte offset of ``field`` of ``slot`` in ``words``."""
        return 4 * (field * self.stride + slot)

    def set(self, slot: int, field: int, value: int) -> None:
        """Stream-ordered ``memset_d32`` of one field of one slot."""
        self.stream.memset_d32(self.words, value, count=1, offset_bytes=self.field_offset(field, slot))


def advance_slots(plan, slots: SlotBuffers, tokens, *, full_finishes: bool = False) -> None:
    """Stream work (one launch of ``advance_slots``) for the end of a decode
    step over ``plan``'s sequences as slots 0 .. plan.sequences - 1 of
    ``slots``: ``tokens`` int64 [>= plan.sequences] holds each slot's token of
    this step. Each active slot records its token in the ring, finishes on a
    stop token, on its max_len or (``full_finishes``) when its pages are
    full, else advances by its q_len while its ``cap`` allows. Then the clock
    ticks. No allocation, no synchronization."""
    h = plan.host
    backend_of(words=plan.words, slots=slots.words, tokens=tokens)
    if (
        str(tokens.dtype) != "int64"
        or tokens.ndim != 1
        or tokens.shape[0] < h.sequences
        or not tokens.flags.c_contiguous
    ):
        raise PagedAttentionError(
            f"tokens: expected a contiguous int64 array of at least {h.sequences} values, "
            f"got {tokens.dtype} {checks.shape_str(tokens.shape)}"
        )
    if h.sequences > slots.stride:
        raise PagedAttentionError(f"plan: {h.sequences} sequences exceed the {slots.stride} slots of its buffers")
    threads = min(SLOT_THREADS, max(32, -(-h.sequences // 32) * 32))
    k = get_kernel(plan.words, "advance", "advance_slots")
    plan.stream.launch(
        k,
        (1,),
        (threads,),
        (
            plan.words,
            np.uint32(h.queries),
            np.uint32(h.sequences),
            np.uint32(h.table_width),
            np.uint32(h.page_size),
            slots.state,
            np.uint32(slots.stride),
            slots.clock,
            tokens,
            slots.stop,
            np.uint32(slots.num_stop),
            slots.ring,
            np.uint32(slots.ring_rows),
            np.uint32(1 if full_finishes else 0),
        ),
    )
