"""Every kernel variant the package can build, for the NVRTC gate.

Each op module calls ``register(stem, defines_list)`` at import with the
compile-time choices it may ask ``get_kernel`` for; the gate
(``python -m cupaged.tools.compile_check``) imports ``cupaged.ops`` (every
op module) and compiles each registered variant for sm_80 and sm_90.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_variants: dict[tuple, tuple[str, dict]] = {}


def register(stem: str, defines_list: Iterable[Mapping[str, object]]) -> None:
    """Record the variants of ``stem`` (a ``kernels_cu`` path without .cu)."""
    for d in defines_list:
        d = dict(d)
        _variants[(stem, tuple(sorted((k, str(v)) for k, v in d.items())))] = (stem, d)


def all_variants() -> list[tuple[str, dict]]:
    """(stem, defines) of every variant registered so far, sorted."""
    return [_variants[k] for k in sorted(_variants)]
