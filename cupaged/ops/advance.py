"""Advancing a plan on the device (``kernels_cu/advance.cu``): the last
kernel of a captured decode step, so the next replay attends over, rotates
by and appends at the next position with no host data."""
from __future__ import annotations

import numpy as np

from .._runtime import get_kernel, register

THREADS = 128
register("advance", [{}])


def advance_plan(plan) -> None:
    """Stream work that moves every non-padded sequence of ``plan`` (a
    DevicePlan) forward by its q_len on the device: kv_len += q_len and each
    of its queries' q_pos += q_len, for every sequence whose kv_len word is
    not 0 and whose page-table row has room. The host plan is not changed;
    ``PagedDecodeLoop`` keeps the host count."""
    h = plan.host
    k = get_kernel(plan.words, "advance", "advance_plan")
    plan.stream.launch(k, ((h.sequences + THREADS - 1) // THREADS,), (THREADS,),
                       (plan.words, np.uint32(h.queries), np.uint32(h.sequences), np.uint32(h.table_width),
                        np.uint32(h.page_size)))
