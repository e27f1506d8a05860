"""Kernel sources: locate ``kernels_cu/``, inline our own headers, name variants.

Both backends compile the same assembled string: a ``#define`` prelude that
spells every compile-time choice, followed by the ``.cu`` file with every
``#include "x.cuh"`` of our own headers replaced by the header's text (once per
header). System headers in angle brackets (``<cuda_fp16.h>``) stay as they are:
NVRTC finds them in the CUDA runtime headers, g++ finds the shim's stand-ins.
Inlining keeps every byte that matters inside the string, so a hash of it is a
complete cache key.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)
# ``__launch_bounds__(...)`` may stand before or after ``void`` (the kernels
# put it after); the GPU backend scans the raw text, where it is still there.
_LB = r"(?:__launch_bounds__\s*\([^)]*\)\s*)?"
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+' + _LB + r"void\s+" + _LB + r"(\w+)\s*\(")


@functools.lru_cache(maxsize=None)
def kernel_dir() -> Path:
    """The folder holding the ``.cu`` and ``.cuh`` files: the installed
    ``cupaged/kernels_cu`` of a wheel, else ``kernels_cu/`` of a source tree."""
    package = Path(__file__).resolve().parents[1]  # cupaged/
    for cand in (package / "kernels_cu", package.parent / "kernels_cu"):
        if (cand / "common.cuh").is_file():
            return cand
    raise FileNotFoundError(f"cupaged kernel sources not found beside {package}")


def stem_of(source: str | Path) -> str:
    """The name a source goes by in variant names: ``"attention/decode"`` ->
    ``"attention_decode"``, a path -> its file stem."""
    if isinstance(source, Path) or str(source).endswith(".cu") or str(source).startswith("/"):
        return Path(source).stem
    return str(source).replace("/", "_")


def shim_dir() -> Path:
    """The CPU backend's shim folder (``kernels_cu/shim``)."""
    return kernel_dir() / "shim"


def read_source(path: Path, _seen: set | None = None) -> str:
    """The text of ``path`` with our own ``#include "x"`` headers inlined
    (each header once; paths relative to the including file's folder).
    ``#line`` directives keep compiler messages and the CPU backend's
    barrier reports pointing at the real file and line."""
    seen = set() if _seen is None else _seen
    out = [f'#line 1 "{path.name}"']
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        m = _INCLUDE.match(line)
        if not m:
            out.append(line)
            continue
        inc = (path.parent / m.group(1)).resolve()
        if inc not in seen:
            seen.add(inc)
            out.append(read_source(inc, seen))
        out.append(f'#line {lineno + 1} "{path.name}"')
    return "\n".join(out) + "\n"


def _define_value(v) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def assemble(source: Path | str, defines: dict | None = None) -> str:
    """Assembled source of one variant: ``#define`` prelude + inlined file.

    ``source`` is a path, or a stem of a file in ``kernels_cu/`` (``"rowwise"``).
    """
    path = Path(source)
    if not path.suffix:
        path = kernel_dir() / f"{source}.cu"
    prelude = "".join(f"#define {k} {_define_value(v)}\n" for k, v in sorted((defines or {}).items()))
    return prelude + read_source(path.resolve())


def kernel_names(source_text: str) -> list[str]:
    """Names of the ``extern "C" __global__`` kernels in an assembled source."""
    return sorted(set(_KERNEL.findall(source_text)))


def variant_name(stem: str, defines: dict | None = None) -> str:
    """A readable name spelling every compile-time choice, e.g.
    ``attention_DTYPE_bf16_HEAD_DIM_128``. Used as the in-process cache key."""
    parts = [stem] + [f"{k}_{_define_value(v)}" for k, v in sorted((defines or {}).items())]
    return re.sub(r"[^A-Za-z0-9_]", "_", "_".join(parts))


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]
