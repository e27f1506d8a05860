"""The CPU backend's host library: every ``.cpp`` of ``kernels_cu/host`` (the engine's few-row products,
``products.cpp``; its row-wise layers, ``layers.cpp``) built once per source, flags and compiler into one shared
library beside the runtime's (which it calls for its worker pool) and loaded after it. Host code, not kernels:
``host_products`` and ``host_layers`` declare its functions and build their argument structs.

Built with this machine's ISA flags (``cpu._host_isa_flags``), part of the cache key: a cache shared with a
machine without them builds its own."""

from __future__ import annotations

import ctypes
import functools
import tempfile
from pathlib import Path

from . import cpu as _cpu
from . import source as _source

#: Flags of the host library (with the host's ISA flags: part of its cache key). -ffp-contract=off: nothing
#: fuses but an explicit fused multiply-add.
FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off")


def folder() -> Path:
    return _source.kernel_dir() / "host"


def _sources() -> list[Path]:
    return sorted(p for p in folder().iterdir() if p.is_file() and p.suffix == ".cpp")


def _sources_blob() -> bytes:
    """Every file of kernels_cu/host (names and contents): the library's sources and headers."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in sorted(folder().iterdir()) if p.is_file())


def _flags() -> tuple[str, ...]:
    return FLAGS + _cpu._host_isa_flags()


def _build(cxx: str, path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        out = Path(tmp) / path.name
        _cpu._run_compiler(
            [cxx, *_flags(), *map(str, _sources()), "-o", str(out)], "the CPU host library (kernels_cu/host)"
        )
        _cpu._install(out, path)


@functools.cache
def library() -> ctypes.CDLL:
    """The host library (the runtime loaded first: it resolves cupaged_rt_parallel)."""
    _cpu.runtime()
    cxx, version = _cpu._compiler()
    key = _source.digest("host library", _sources_blob(), " ".join(_flags()), version)
    path = _cpu._library(f"cupaged_host-{key}.so", functools.partial(_build, cxx))
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
