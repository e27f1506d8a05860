"""Every kernel variant the package can build, for the NVRTC gate.

Each op module calls ``register(stem, defines_list)`` at import with the
compile-time choices it may ask ``_backend.get_kernel`` for; the gate
(``python -m cupaged.tools.compile_check``) compiles each for sm_80 and sm_90.
"""
from __future__ import annotations

_variants: dict[tuple, tuple[str, dict]] = {}

# Modules that register variants; imported by all_variants().
OP_MODULES = ["cupaged.rowwise", "cupaged.attention", "cupaged.layers", "cupaged.cache"]


def register(stem: str, defines_list) -> None:
    for d in defines_list:
        d = dict(d)
        _variants[(stem, tuple(sorted((k, str(v)) for k, v in d.items())))] = (stem, d)


def all_variants() -> list[tuple[str, dict]]:
    """(stem, defines) of every registered variant, after importing the op modules."""
    import importlib
    for m in OP_MODULES:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:  # a family not written yet
            if e.name != m:
                raise
    return [_variants[k] for k in sorted(_variants)]
