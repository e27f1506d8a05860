"""Continuous batching for ``Engine.generate``: one scheduler per call.

The loop, until every request is done:

1. **Admit** waiting requests in order while fewer than ``max_batch`` are
   running (prefilling or decoding) and the cache can hold every page each
   running request may still need (its prompt and generated tokens, less the
   pages it holds): so no step ever runs out of pages and nothing is ever
   preempted. ``cache.add_sequence(tokens=prompt)`` shares the longest cached
   prefix (prefix reuse); only the rest is prefilled.
2. **Prefill** up to ``prefill_per_round`` prompt tokens (admitting more
   requests as prompts complete), in chunks: a chunk is up to
   ``prefill_chunk`` prompt tokens, taken from the prefilling requests in
   admission order, in one ``cache.prepare`` plan and one eager forward pass;
   each request whose prompt ends in the chunk gets its first token drawn
   from its last row with its ``SamplingParams`` (``ops.sample.sample_into``
   on the engine's prefill ``SamplerState``, row i set to the request's
   parameters and its prompt as context; temperature 0 is the argmax) and
   joins the ``DecodeBatch`` with that token on the device, taking the
   state's row with it (``join(seq, best[i:i+1], drawn_by=(state, i))``: its
   step, counts and logprob), so its draws go on in the decode graph. A longer backlog waits for the next
   round, so running sequences keep decoding (as vLLM's token budget per
   step, ``max_num_batched_tokens``, whose default of 2048 this follows).
3. **Decode one round**: up to ``readback_every`` launches of the batch's
   captured graph (one per token for every member), then the one readback:
   new tokens, and which requests finished (a stop token or their
   ``max_new_tokens``; they leave the batch, their sequence is freed and its
   full pages stay in the prefix cache), so waiting requests take their place
   at the next admission.

Steps 2 and 3 alternate, so new prompts are prefilled in chunks between the
decode rounds of running ones. A stop token is checked on the device every
step; the engine also cuts a request's output after its first stop token
(the prefill's token can be one), so outputs end at a stop token or at
``max_new_tokens``, as transformers' greedy ``generate``.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .._runtime import progress
from ..batch import DecodeBatch
from ..cache import Sequence
from ..ops.sample import SamplerState, sample_into
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(eq=False)
class Request:
    """One prompt of a generate call and what it produced."""

    index: int
    prompt: list[int]
    max_new: int
    seq: Sequence | None = None  # its sequence in the cache, once admitted
    prefilled: int = 0  # prompt tokens in the cache (a shared prefix included)
    need_pages: int = 0  # pages its whole life needs
    out: list[int] = field(default_factory=list)
    launches: int = 0  # decode launches it took part in
    done: bool = False
    logits: list[np.ndarray] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams.greedy)
    seed: int | None = None  # the seed its draws use (its own, else a random one)
    # per token {token id: logprob}: the drawn token and the top n, when sampling.logprobs is set
    logprobs: list[dict[int, float]] = field(default_factory=list)


class Scheduler:
    """One ``Engine.generate`` call (see the module docstring) decoding in
    ``batch``, the engine's DecodeBatch of these ``stop_ids``."""

    def __init__(
        self,
        engine: Engine,
        batch: DecodeBatch,
        prompts: Iterable[Iterable[int]],
        max_new: int,
        stop_ids: tuple[int, ...],
        *,
        return_logits: bool = False,
        on_tokens: Callable[[int, list[int]], object] | None = None,
        sampling: list[SamplingParams] | None = None,
        prefill_sampler: SamplerState | None = None,
    ):
        self.e = engine
        self.cache, self.model = engine.cache, engine.model
        self.stream = engine.stream
        self.stop = set(stop_ids)
        self._bar: progress.Progress | None = None  # the prefill bar while rounds() runs
        self.batch = batch
        self.return_logits, self.on_tokens = return_logits, on_tokens
        ps = self.cache.page_size
        self.requests = [Request(i, list(p), max_new) for i, p in enumerate(prompts)]
        if sampling is not None:
            for r, sp in zip(self.requests, sampling):
                r.sampling = sp
        for r in self.requests:
            r.seed = r.sampling.seed if r.sampling.seed is not None else secrets.randbits(64)
        self.prefill_sampler = prefill_sampler
        for r in self.requests:
            r.need_pages = -(-(len(r.prompt) + max_new - 1) // ps)
        self.waiting = deque(self.requests)
        self.prefilling: list[Request] = []
        self.decoding: dict[Sequence, Request] = {}
        self._try_admit = True
        self._pending = 0  # decode launches since the last readback
        self.stats = {
            "prefill_tokens": 0,
            "prefill_seconds": 0.0,
            "decode_tokens": 0,
            "decode_seconds": 0.0,
            "prefill_chunks": 0,
            "decode_launches": 0,
            "readbacks": 0,
            "cached_prompt_tokens": 0,
            "advance_seconds": 0.0,
            "compile_seconds": 0.0,  # kernel builds during the rounds: not in prefill_seconds / decode_seconds
        }

    # -- the loop -----------------------------------------------------------------
    def run(self) -> list[list[int]]:
        for _ in self.rounds():
            pass
        return [r.out for r in self.requests]

    def rounds(self) -> Iterator[None]:
        """The loop, a round at a time (prefill chunks up to the round's
        token budget, then a decode round of the running sequences): it
        yields after each round, when ``on_tokens`` has had what was read
        back, so a caller can stream it. A prefill taking more than ~2 s
        shows a progress bar (``progress.Progress``; stderr, a terminal)."""
        bar = progress.Progress("prefill", sum(len(r.prompt) for r in self.requests), "tokens")
        self._bar = bar
        try:
            while self.waiting or self.prefilling or self.decoding:
                self._admit()
                done = 0
                while self.prefilling and done < self.e.prefill_per_round:
                    done += self._prefill_chunk(self.e.prefill_per_round - done)
                    self._admit()
                if not self.prefilling and not self.waiting:
                    bar.close()  # every prompt is in: the rest is decode
                if self.decoding:
                    self._decode_round()
                if self.waiting and not (self.prefilling or self.decoding) and not self._try_admit:
                    raise RuntimeError("scheduler: nothing runs and nothing can be admitted")  # (cannot happen)
                yield
        finally:
            bar.close()

    def _running(self):
        return self.prefilling + list(self.decoding.values())

    def _admit(self) -> None:
        if not self._try_admit:
            return
        cache = self.cache
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.e.max_batch:
            r = self.waiting[0]
            outstanding = sum(max(0, q.need_pages - len(q.seq.pages)) for q in self._running())
            seq = cache.add_sequence(tokens=r.prompt)
            if r.need_pages - len(seq.pages) + outstanding > cache.num_free_pages:
                cache.free(seq)  # back to waiting; retried once pages are freed
                self._try_admit = False
                return
            self.waiting.popleft()
            r.seq, r.prefilled = seq, seq.length
            self.stats["cached_prompt_tokens"] += seq.length
            self.prefilling.append(r)

    def _prefill_chunk(self, budget: int) -> int:
        """Prefill up to min(budget, prefill_chunk) prompt tokens; returns how many."""
        t0, b0 = time.perf_counter(), progress.build_seconds()
        model, stream = self.model, self.stream
        budget = min(budget, self.e.prefill_chunk)
        reqs, counts = [], []
        for r in self.prefilling:
            if budget == 0:
                break
            c = min(len(r.prompt) - r.prefilled, budget)
            reqs.append(r)
            counts.append(c)
            budget -= c
        plan, _ = self.cache.prepare([r.seq for r in reqs], counts)
        tokens = np.concatenate(
            [np.asarray(r.prompt[r.prefilled : r.prefilled + c], np.int64) for r, c in zip(reqs, counts)]
        )
        n = int(tokens.shape[0])
        stream.copy_from_host(model.tokens, tokens)
        ends, row = [], 0
        for r, c in zip(reqs, counts):
            row += c
            r.prefilled += c
            if r.prefilled == len(r.prompt):
                ends.append((r, row - 1))
        m = len(ends)
        if m:
            stream.copy_from_host(model.idx, np.array([row for _, row in ends], np.int64))
        logits = model.forward(plan, model.tokens, n, gather=m)
        if m:
            st = self.prefill_sampler
            assert st is not None and m <= st.slots  # (the engine's; at most max_batch requests prefill)
            for i, (r, _) in enumerate(ends):
                st.set(i, r.sampling.words(seed=r.seed), context=r.prompt)
            sample_into(logits, st, model.best, clock=None)
            host_logits = stream.read(logits) if self.return_logits else None
            host_best = stream.read(model.best[:m]) if any(r.max_new == 1 for r, _ in ends) else None
            want_lp = any(r.sampling.logprobs is not None and r.max_new == 1 for r, _ in ends)
            host_lp = stream.read(st.first_logprobs[:m]) if want_lp else None
            host_top = (stream.read(st.first_top_ids[:m]), stream.read(st.first_top_logprobs[:m])) if want_lp else None
            for i, (r, _) in enumerate(ends):
                self.prefilling.remove(r)
                if host_logits is not None:
                    r.logits.append(np.asarray(host_logits[i], np.float32))
                if r.max_new == 1:
                    assert host_best is not None  # read above: a request ends with max_new 1
                    lp, top = None, None
                    if host_lp is not None and host_top is not None:
                        n = r.sampling.logprobs or 0
                        lp = [float(host_lp[i])]
                        top = [[(int(t), float(v)) for t, v in zip(host_top[0][i, :n], host_top[1][i, :n])]]
                    self._emit(r, [int(host_best[i])], lp, top)
                    self._finish(r)
                else:
                    assert r.seq is not None  # admitted
                    self.batch.join(
                        r.seq,
                        model.best[i : i + 1],
                        max_len=len(r.prompt) + r.max_new,
                        sampling=r.sampling,
                        drawn_by=(st, i),
                    )
                    self.decoding[r.seq] = r
        stream.synchronize()  # (for the prefill / decode time split in stats)
        self.stats["prefill_tokens"] += n
        self.stats["prefill_chunks"] += 1
        if self._bar is not None:
            self._bar.update(n)
        self.stats["prefill_seconds"] += self._minus_builds(time.perf_counter() - t0, b0)
        return n

    def _minus_builds(self, seconds: float, builds_before: float) -> float:
        """``seconds`` less the kernel builds since ``builds_before`` (added to compile_seconds)."""
        built = progress.build_seconds() - builds_before
        self.stats["compile_seconds"] += built
        return max(0.0, seconds - built)

    def _decode_round(self) -> None:
        t0, b0 = time.perf_counter(), progress.build_seconds()
        batch, k = self.batch, (1 if self.return_logits else self.batch.k)
        remaining = {r: r.max_new - 1 - r.launches for r in self.decoding.values()}
        steps = min(k, max(remaining.values()))
        for _ in range(steps):
            live = [r for r in self.decoding.values() if r.launches < r.max_new - 1]
            bucket = batch.bucket
            ta = time.perf_counter()
            batch.advance()
            self.stats["advance_seconds"] += time.perf_counter() - ta
            self._pending += 1
            for r in live:
                r.launches += 1
            self.stats["decode_launches"] += 1
            self.stats["decode_tokens"] += len(live)
            if self.return_logits:
                rows = self.stream.read(self.model.logits[:bucket])
                for r in live:
                    assert r.seq is not None  # a decoding request's sequence
                    r.logits.append(np.asarray(rows[batch.slot_of(r.seq)], np.float32))
        rb = batch.readback()
        self._pending = 0
        self.stats["readbacks"] += 1
        for seq, toks in rb.tokens.items():
            self._emit(self.decoding[seq], toks, rb.logprobs.get(seq), rb.top_logprobs.get(seq))
        for seq in list(self.decoding):
            r = self.decoding[seq]
            if seq in rb.finished or r.done:
                if seq not in rb.finished:
                    batch.leave(seq)  # the engine saw a stop token the device did not check
                del self.decoding[seq]
                self._finish(r)
        self.stats["decode_seconds"] += self._minus_builds(time.perf_counter() - t0, b0)

    def abort(self) -> bool:
        """After an error or an interrupt: take every running sequence out of
        the batch (reading back what it launched) and free it, so the engine
        serves the next call. Returns False when that failed too (the batch
        is then dropped; its sequences' pages stay held)."""
        ok = True
        try:
            if self._pending:
                self.batch.readback()
                self._pending = 0
            for seq in list(self.batch.members):
                self.batch.leave(seq)
        except Exception:  # noqa: BLE001 -- best effort after the first error, which is re-raised
            ok = False
        for r in self.requests:
            if r.seq is not None and r.seq.alive and r.seq.batch is None:
                self.cache.free(r.seq)
        return ok

    # -- outputs ------------------------------------------------------------------
    def _emit(
        self,
        r: Request,
        toks: Iterable[int],
        lps: list[float] | None = None,
        tops: list[list[tuple[int, float]]] | None = None,
    ) -> None:
        """Append a request's new tokens (and, when it asked for them, their
        logprobs ``lps`` and top-n pairs ``tops``), cut after the first stop
        token and at max_new; report them to ``on_tokens``."""
        new = []
        for j, t in enumerate(toks):
            if r.done or len(r.out) >= r.max_new:
                break
            r.out.append(int(t))
            if lps is not None and r.sampling.logprobs is not None:
                d = {int(t): float(lps[j])}
                for tok, v in tops[j] if tops is not None else ():
                    d.setdefault(tok, v)
                r.logprobs.append(d)
            new.append(int(t))
            if int(t) in self.stop:
                r.done = True
        if len(r.out) >= r.max_new:
            r.done = True
        if self.return_logits:
            del r.logits[len(r.out) :]
        if new and self.on_tokens is not None:
            self.on_tokens(r.index, new)

    def _finish(self, r: Request) -> None:
        r.done = True
        if r.seq is not None and r.seq.alive:
            self.cache.free(r.seq)
        self._try_admit = True
