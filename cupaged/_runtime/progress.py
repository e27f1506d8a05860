"""Long work says so: one-line notices and a progress bar, on stderr.

* ``notice(text)``: one line on stderr (``cupaged: text``), unless quiet.
  ``notice_once(key, text)``: the same, at most once per process and key
  (first-run kernel compilation, a large model on the CPU backend).
* ``Progress(what, total)``: a bar for work whose length is known in units
  (checkpoint tensors, prompt tokens). It stays silent for work that ends
  within ``after`` seconds (default 2 s), and draws only on a terminal: at
  most ten redraws a second on one line (``\\r``), ended by a newline when it
  was drawn. Used as a context manager or closed with ``close()``.
* ``building()``: a context the kernel builds run in (CPU modules, the
  runtime and host libraries; NVRTC compiles), whose time ``build_seconds()``
  sums for the process, so that figures of steady work (the engine's
  tokens/s) can leave first-run compilation out and say it apart.
* Quiet: ``CUPAGED_QUIET=1`` in the environment or ``set_quiet(True)`` (the
  CLI's ``--quiet``) silences both. Errors are never silenced: they raise.

Nothing here touches a device or a kernel; a bar's ``update`` costs a clock
read, so it may sit in a loop of launches (it never synchronizes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["Progress", "build_seconds", "building", "is_quiet", "notice", "notice_once", "set_quiet"]

_quiet: bool | None = None  # None: follow CUPAGED_QUIET
_told: set[str] = set()
_builds = threading.local()  # .depth: builds this thread is inside (a build may start another: counted once)
_build_lock = threading.Lock()
_build_total = 0.0


@contextlib.contextmanager
def building() -> Iterator[None]:
    """Count the time inside as kernel build time (``build_seconds``); nested builds count once."""
    global _build_total
    depth = getattr(_builds, "depth", 0)
    _builds.depth = depth + 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _builds.depth = depth
        if depth == 0:
            with _build_lock:
                _build_total += time.perf_counter() - t0


def build_seconds() -> float:
    """Seconds this process has spent in kernel builds (``building``), every thread's."""
    return _build_total


#: Seconds between two redraws of a bar.
REDRAW_SECONDS = 0.1


def set_quiet(quiet: bool | None) -> None:
    """Silence notices and bars (True), show them (False), or follow
    ``CUPAGED_QUIET`` again (None)."""
    global _quiet
    _quiet = None if quiet is None else bool(quiet)


def is_quiet() -> bool:
    if _quiet is not None:
        return _quiet
    return os.environ.get("CUPAGED_QUIET", "").strip() not in ("", "0")


def notice(text: str, stream: TextIO | None = None) -> None:
    """``cupaged: text`` on stderr (one line), unless quiet."""
    if is_quiet():
        return
    out = sys.stderr if stream is None else stream
    print(f"cupaged: {text}", file=out, flush=True)


def notice_once(key: str, text: str, stream: TextIO | None = None) -> bool:
    """``notice(text)`` the first time ``key`` is told in this process; True when it printed."""
    if key in _told or is_quiet():
        return False
    _told.add(key)
    notice(text, stream)
    return True


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


class Progress:
    """A progress bar for ``total`` units of ``what`` (e.g. "loading weights",
    "prefill"), shown on a terminal once the work has taken ``after`` seconds.

    ``stream`` (default stderr) and ``clock`` (default ``time.monotonic``)
    are for tests."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str = "",
        *,
        after: float = 2.0,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what, self.total, self.unit = what, max(int(total), 0), unit
        self.done = 0
        self.stream = sys.stderr if stream is None else stream
        self._clock = clock
        self._t0 = clock()
        self._after = after
        self._last = -1.0
        self.drawn = False
        self._enabled = not is_quiet() and _isatty(self.stream)

    def update(self, n: int = 1) -> None:
        """``n`` more units done (redraws when due)."""
        self.done = min(self.done + int(n), self.total) if self.total else self.done + int(n)
        if not self._enabled:
            return
        now = self._clock()
        if now - self._t0 < self._after or (self.drawn and now - self._last < REDRAW_SECONDS):
            return
        self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The bar as it reads now: ``what: 120/256 tokens [#####.....] 46% 3.1 s``."""
        now = self._clock() if now is None else now
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            share = self.done / self.total
            width = 24
            fill = int(round(share * width))
            bar = f" [{'#' * fill}{'.' * (width - fill)}] {share * 100:3.0f}%"
            count = f"{self.done}/{self.total}{unit}"
        else:
            bar, count = "", f"{self.done}{unit}"
        return f"cupaged: {self.what}: {count}{bar} {now - self._t0:.1f} s"

    def _draw(self, now: float) -> None:
        self._last = now
        self.drawn = True
        self.stream.write("\r" + self.line(now))
        self.stream.flush()

    def close(self) -> None:
        """End the bar: its last state and a newline, when it was drawn."""
        if self.drawn:
            self._draw(self._clock())
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
        self._enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
