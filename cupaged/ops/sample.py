"""Per-slot sampling of ``[batch, vocab]`` logits (``kernels_cu/sample.cu``).

``SamplerState`` holds, for ``slots`` decode slots, every buffer the kernel
reads and writes, allocated once (never inside a capture), at stable
addresses, so one captured graph serves any mix of parameters and a slot is
refilled by stream-ordered copies, never by recapture:

* ``params`` uint32 [slots, len(FIELDS)]: per slot temperature, top_k (0:
  off), top_p, min_p, repetition / presence / frequency penalties (float
  fields hold float32 bits), the 64-bit seed (lo, hi) and ``step``, the
  Philox counter's second word, which the kernel increments at every draw,
  ``logprobs`` (1: compute the drawn token's logprob, else NaN) and
  ``top_n`` (also the top_n most likely tokens and their logprobs, at most
  ``max_logprobs``);
* ``counts`` uint32 [slots, vocab]: per slot and token, bit 31 set when the
  token is in the slot's context (the prompt: vLLM's repetition penalty looks
  at prompt and output tokens) and bits 0..30 the times it was generated
  (presence / frequency penalties look at output tokens only). ``set``
  rewrites a slot's row (a host staging row: the context bits, and a count of
  1 for a first token known on the host); the kernel adds 1 at the token it
  draws, so after every step the row is exact with no host work;
* ``logprobs`` float32 [ring_rows, slots]: the log-softmax under the raw
  logits (vLLM's default "raw" logprobs) of each drawn token, at row
  ``clock % ring_rows`` (a ``SlotBuffers.clock``, so one readback returns a
  readback period's logprobs with the token ring), and ``first_logprobs``
  float32 [slots] for a draw outside the graph (``sample_into(...,
  clock=None)``); likewise ``top_ids`` int32 / ``top_logprobs`` float32
  [ring_rows, slots, max(1, max_logprobs)] and ``first_top_ids`` /
  ``first_top_logprobs`` [slots, max(1, max_logprobs)] (largest first; ties:
  the lower id first);
* ``identity`` int32 [slots] (0 .. slots - 1) and ``rows`` int32 [slots]:
  the row -> slot maps of a decode step and of a draw for some slots.

``sample_into(logits, state, out)`` launches ``sample_rows`` (one block per
row; semantics in the kernel's header): it allocates nothing and never
synchronises, so it is safe inside stream capture. Temperature 0 takes the
first index of the maximum of the penalised logits; with no penalty that is
``ops.sampling.row_argmax`` bit for bit. A draw depends only on the row, the
slot's parameters, counts, seed and step (Philox4x32-10, counter (token,
step)), never on the batch's other rows or its bucket.

Memory: per pass over a row, vocab logits (and vocab count words when the
slot has a penalty); greedy: 1 pass (row_argmax's cost); sampling: 1 + (4
with top_k) + (4 with top_p) + 1 passes; + 1 per top logprob.

Why these choices: thresholds by radix select (no sort, no per-row
scratch: every filter is "z >= a threshold", so min-p, top-k and top-p
compose into one key comparison), integer histograms (deterministic: a
row's draw is the same on every run and in every batch), the Gumbel-max draw
(an argmax, exact for the kept distribution: no prefix sum, no
renormalisation), one Philox word per (token, step), so nothing depends on
the block size or the batch.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes
from .._runtime import backend_of, check_not_capturing, checks, get_kernel, register, stream_for, zeros
from ..errors import PagedAttentionError
from .sampling import _check_logits, block_size

#: The per-slot parameter words, in order (``params[slot, i]``).
FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition",
    "presence",
    "frequency",
    "seed_lo",
    "seed_hi",
    "step",
    "logprobs",
    "top_n",
)
FIELD = {name: i for i, name in enumerate(FIELDS)}
#: Floating-point fields (float32 bits in their words).
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition", "presence", "frequency")
#: Bit 31 of a count word: the token is in the slot's context.
CONTEXT_BIT = 1 << 31
#: Most threads per row (the kernel's launch bound).
MAX_THREADS = 1024
_DEFINES = {f"CP_SP_{name.upper()}": i for i, name in enumerate(FIELDS)} | {
    "CP_SP_FIELDS": len(FIELDS),
    "CP_SP_CONTEXT_BIT": f"{CONTEXT_BIT:#x}u",
}
register("sample", [{"CP_DTYPE": t, **_DEFINES} for t in dtypes.QUERY_TOKENS])


def param_words(
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    seed: int = 0,
    logprobs: bool = False,
    top_n: int = 0,
) -> np.ndarray:
    """One slot's parameter words uint32 [len(FIELDS)] (step 0); values are
    taken as given (``cupaged.sampling.SamplingParams`` checks them)."""
    w = np.zeros(len(FIELDS), np.uint32)
    for name, v in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("repetition", repetition),
        ("presence", presence),
        ("frequency", frequency),
    ):
        w[FIELD[name]] = np.float32(v).view(np.uint32)
    w[FIELD["top_k"]] = int(top_k)
    w[FIELD["seed_lo"]] = int(seed) & 0xFFFFFFFF
    w[FIELD["seed_hi"]] = (int(seed) >> 32) & 0xFFFFFFFF
    w[FIELD["logprobs"]] = 1 if logprobs or top_n else 0
    w[FIELD["top_n"]] = int(top_n)
    return w


class SamplerState:
    """Sampling buffers of ``slots`` slots over a ``vocab``-token vocabulary on
    the backend of ``like`` (see the module docstring). Every slot starts
    greedy (temperature 0, no penalty) with empty counts."""

    def __init__(self, like, slots: int, vocab: int, *, ring_rows: int = 1, max_logprobs: int = 0):
        self.slots = checks.host_int("slots", slots, 1, 1 << 24)
        self.vocab = checks.host_int("vocab", vocab, 1, (1 << 31) - 1)
        self.ring_rows = checks.host_int("ring_rows", ring_rows, 1, 1 << 20)
        self.max_logprobs = checks.host_int("max_logprobs", max_logprobs, 0, 1 << 10)
        m = max(1, self.max_logprobs)
        self.stream = stream_for(like)
        check_not_capturing(self.stream, "SamplerState")
        self.params = zeros(like, (self.slots, len(FIELDS)), np.uint32)
        self.counts = zeros(like, (self.slots, self.vocab), np.uint32)
        self.logprobs = zeros(like, (self.ring_rows, self.slots), np.float32)
        self.first_logprobs = zeros(like, self.slots, np.float32)
        self.top_ids = zeros(like, (self.ring_rows, self.slots, m), np.int32)
        self.top_logprobs = zeros(like, (self.ring_rows, self.slots, m), np.float32)
        self.first_top_ids = zeros(like, (self.slots, m), np.int32)
        self.first_top_logprobs = zeros(like, (self.slots, m), np.float32)
        self.identity = zeros(like, self.slots, np.int32)
        self.rows = zeros(like, self.slots, np.int32)
        self.zero = zeros(like, 1, np.uint32)
        self.stream.copy_from_host(self.identity, np.arange(self.slots, dtype=np.int32))
        greedy = np.tile(param_words(), (self.slots, 1))
        self.stream.copy_from_host(self.params, greedy)
        self._row = np.zeros(self.vocab, np.uint32)  # host staging of one counts row

    def set(self, slot: int, words: np.ndarray, context=(), generated=()) -> None:
        """Stream-ordered: slot ``slot`` takes parameter ``words`` (from
        ``param_words``) and a counts row marking ``context`` token ids and
        counting ``generated`` ones (ids in 0..vocab-1)."""
        s = checks.host_int("slot", slot, 0, self.slots - 1)
        words = np.asarray(words, np.uint32)
        if words.shape != (len(FIELDS),):
            raise PagedAttentionError(f"words: expected uint32 [{len(FIELDS)}], got {checks.shape_str(words.shape)}")
        if int(words[FIELD["top_n"]]) > self.max_logprobs:
            raise PagedAttentionError(
                f"words: expected top_n <= {self.max_logprobs} (the sampler's max_logprobs), "
                f"got {int(words[FIELD['top_n']])}"
            )
        ctx = checks.token_ids("context", list(context), self.vocab)
        gen = checks.token_ids("generated", list(generated), self.vocab)
        row = self._row
        row[:] = 0
        row[ctx] = CONTEXT_BIT
        np.add.at(row, gen, 1)
        self.stream.copy_from_host(self.params, words, dst_offset=4 * len(FIELDS) * s)
        self.stream.copy_from_host(self.counts, row, dst_offset=4 * self.vocab * s)

    def move(self, dst: int, src: int) -> None:
        """Stream-ordered device-to-device copy of slot ``src``'s state
        (parameters with its step, counts, first logprob) into slot ``dst``."""
        self.take(dst, self, src)

    def take(self, dst: int, other: "SamplerState", src: int) -> None:
        """``move`` from slot ``src`` of ``other`` (a SamplerState of the same
        vocab and backend) into slot ``dst`` of this one."""
        if other.vocab != self.vocab:
            raise PagedAttentionError(f"other: expected a SamplerState of vocab {self.vocab}, got {other.vocab}")
        if other.max_logprobs > self.max_logprobs:
            raise PagedAttentionError(f"other: expected max_logprobs <= {self.max_logprobs}, got {other.max_logprobs}")
        d = checks.host_int("dst", dst, 0, self.slots - 1)
        s = checks.host_int("src", src, 0, other.slots - 1)
        f, v = 4 * len(FIELDS), 4 * self.vocab
        self.stream.copy(self.params, other.params, nbytes=f, dst_offset=f * d, src_offset=f * s)
        self.stream.copy(self.counts, other.counts, nbytes=v, dst_offset=v * d, src_offset=v * s)
        self.stream.copy(self.first_logprobs, other.first_logprobs, nbytes=4, dst_offset=4 * d, src_offset=4 * s)
        m, mo = 4 * self.first_top_ids.shape[1], 4 * other.first_top_ids.shape[1]
        n = min(m, mo)
        for a, b in ((self.first_top_ids, other.first_top_ids), (self.first_top_logprobs, other.first_top_logprobs)):
            self.stream.copy(a, b, nbytes=n, dst_offset=m * d, src_offset=mo * s)


def sample_into(logits, state: SamplerState, out, *, rows=None, clock=None) -> None:
    """Draw one token per row of ``logits`` [batch, vocab] (float32, float16
    or bfloat16, C-contiguous; vocab == state.vocab) with the parameters of
    slot ``rows[r]`` (``rows``: int32 [>= batch] device array of slots; None:
    row r is slot r), writing ``out[slot]`` (``out``: int64 [>= slots used],
    C-contiguous), its logprob at ``state.logprobs[clock[0] % ring_rows,
    slot]`` (``clock``: a uint32 [1] device word, e.g. ``SlotBuffers.clock``)
    or, with ``clock=None``, at ``state.first_logprobs[slot]``, and updating
    the slot's counts and step (a row whose slot id is out of range does
    nothing). One launch; no allocation, no sync. Raises
    PagedAttentionError before launching on bad input."""
    backend_of(logits=logits, state=state.params, out=out)
    _check_logits(logits)
    batch, vocab = logits.shape
    if vocab != state.vocab:
        raise PagedAttentionError(f"logits: expected vocab {state.vocab} (the sampler's), got {vocab}")
    if batch > state.slots:
        raise PagedAttentionError(f"logits: expected at most {state.slots} rows (the sampler's slots), got {batch}")
    if str(out.dtype) != "int64" or out.ndim != 1 or not out.flags.c_contiguous:
        raise PagedAttentionError(
            f"out: expected a contiguous int64 [slots] array, got {dtypes.dtype_name(out.dtype)} "
            f"{checks.shape_str(out.shape)}"
        )
    if rows is None:
        rows = state.identity
        if out.shape[0] < batch:
            raise PagedAttentionError(f"out: expected at least {batch} values, got {out.shape[0]}")
    else:
        backend_of(logits=logits, rows=rows)
        if str(rows.dtype) != "int32" or rows.ndim != 1 or rows.shape[0] < batch or not rows.flags.c_contiguous:
            raise PagedAttentionError(
                f"rows: expected a contiguous int32 array of at least {batch} slots, got "
                f"{dtypes.dtype_name(rows.dtype)} {checks.shape_str(rows.shape)}"
            )
        if out.shape[0] < state.slots:
            raise PagedAttentionError(f"out: expected at least {state.slots} values (one per slot), got {out.shape[0]}")
    if clock is None:
        lp, clock, ring = state.first_logprobs, state.zero, 1
        tid, tlp = state.first_top_ids, state.first_top_logprobs
    else:
        backend_of(logits=logits, clock=clock)
        if str(clock.dtype) != "uint32" or clock.size < 1:
            raise PagedAttentionError(f"clock: expected a uint32 [1] array, got {dtypes.dtype_name(clock.dtype)}")
        lp, ring = state.logprobs, state.ring_rows
        tid, tlp = state.top_ids, state.top_logprobs
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise PagedAttentionError("out: expected a writeable array, got a read-only one")
    checks.no_overlap("out", out, logits=logits)
    if batch == 0:
        return
    kernel = get_kernel(logits, "sample", "sample_rows", {"CP_DTYPE": dtypes.token(logits.dtype), **_DEFINES})
    threads = min(MAX_THREADS, block_size(vocab, logits.itemsize, logits))
    stream_for(logits).launch(
        kernel,
        (batch,),
        (threads,),
        (
            logits,
            np.uint32(vocab),
            rows,
            state.params,
            state.counts,
            out,
            lp,
            tid,
            tlp,
            np.uint32(tid.shape[-1]),
            clock,
            np.uint32(ring),
            np.uint32(state.slots),
        ),
    )
