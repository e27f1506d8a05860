"""attention_split_merge (``kernels_cu/attention/merge.cu``): combines the split
partials every attention kernel writes; a module of its own, one build per
q / out dtype and sink choice, launched by launch.py after a step's split
launches."""

from __future__ import annotations

from typing import Any

#: Threads per block (merge::kThreads, the first ``__launch_bounds__`` argument).
THREADS = 256
#: Resident blocks per SM by design (the second ``__launch_bounds__`` argument).
MIN_BLOCKS = 4
#: Query heads the merge serves per block: one (query, head) per block of
#: THREADS threads, every split's loads in flight.
MERGE_HEADS_PER_BLOCK = 1
#: The constants merge.cu shares with this spec (geometry.header: geom::merge).
GEOMETRY = {"kThreads": THREADS, "kMinBlocks": MIN_BLOCKS, "kHeadsPerBlock": MERGE_HEADS_PER_BLOCK}


def merge_defines(dtype: str, sinks: bool) -> dict[str, Any]:
    """The ``#define``s of the split merge's build: ``dtype`` the output's
    (q's), CP_SINKS when it folds each head's sink in (the partials leave
    it out). The merge reads no cache; CP_KV_DTYPE names q's type only
    because variant.cuh declares AttentionParams."""
    return {"CP_DTYPE": dtype, "CP_KV_DTYPE": dtype, **({"CP_SINKS": 1} if sinks else {})}


class Merge:
    """The merge's spec: its builds are ``defines(dtype, sinks)`` for each
    q / out dtype and sink choice (variants.py registers them)."""

    name = "attention_split_merge"
    source = "attention/merge"
    threads = THREADS
    min_blocks = MIN_BLOCKS
    heads_per_block = MERGE_HEADS_PER_BLOCK
    defines = staticmethod(merge_defines)


MERGE = Merge()
