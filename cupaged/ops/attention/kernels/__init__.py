"""The attention kernels' specs: one module per ``kernels_cu/attention/<stem>.cu``
of the same stem, each with its spec object (``spec.KernelSpec``: name,
block, resident blocks, defines, builds, which shapes it serves, shared
memory) and the geometry both sides need. ``variants.py`` builds the table
from SPECS and picks from it; a new kernel is a ``.cu`` plus its spec,
added to SPECS."""

from __future__ import annotations

from .decode import DECODE
from .decode_tc import DECODE_TC
from .merge import MERGE
from .mla_seesaw import MLA_SEESAW
from .mla_tc import MLA_TC
from .mla_wgmma import MLA_WGMMA
from .prefill_simt import PREFILL_SIMT
from .prefill_tc import PREFILL_TC
from .prefill_wgmma import PREFILL_WGMMA
from .spec import KernelSpec

#: The attention kernels (the split merge, MERGE, is a module of its own).
SPECS: tuple[KernelSpec, ...] = (
    DECODE,
    DECODE_TC,
    PREFILL_TC,
    PREFILL_WGMMA,
    PREFILL_SIMT,
    MLA_TC,
    MLA_WGMMA,
    MLA_SEESAW,
)

__all__ = [
    "DECODE",
    "DECODE_TC",
    "MERGE",
    "MLA_SEESAW",
    "MLA_TC",
    "MLA_WGMMA",
    "PREFILL_SIMT",
    "PREFILL_TC",
    "PREFILL_WGMMA",
    "SPECS",
    "KernelSpec",
]
