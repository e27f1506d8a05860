"""The one table that couples the performance model to kernel names.

Everything else the model knows about a launch comes from
``plan_launches`` (kernel, defines, threads, dynamic shared memory, grid,
query range), the NVRTC compile (registers, spills, static shared memory,
SASS) and the CPU run (mma / ldmatrix / cp.async counts). What neither can
say is written here, per kernel name, in a few words:

* ``loads``: how K/V bytes are kept in flight. ``"ldg"``: the 16-byte loads
  of one hot-loop iteration are issued together and consumed in the same
  iteration (nothing in flight across iterations, compute not overlapped
  with the next loads); ``"ring"``: a cp.async ring with ``ahead`` tiles
  (hot-loop iterations) in flight while one is computed.
* ``x_reversed``: block x serves the last query block of the launch first
  (the heaviest causal blocks start first).
* ``role``: ``"attention"`` for a kernel of ``plan_launches``;
  ``"merge"`` for the split merge that ``launch.py`` issues after them.

A kernel missing from the table is modeled with ``default_desc`` (a ring
when its hot loop uses cp.async, else "ldg"), and the model says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.attention.kernels import MERGE


@dataclass(frozen=True)
class KernelDesc:
    role: str = "attention"
    loads: str = "ldg"  # "ldg" | "ring"
    ahead: int = 1  # iterations in flight beyond the one computed ("ring"); 1 for "ldg"
    x_reversed: bool = False
    known: bool = True


KERNELS: dict[str, KernelDesc] = {
    "paged_attention": KernelDesc(loads="ldg"),
    "paged_prefill_tc": KernelDesc(loads="ring", ahead=1, x_reversed=True),
    "paged_prefill_wgmma": KernelDesc(loads="ring", ahead=1, x_reversed=True),
    # f32 on CUDA cores: the tensor-core prefill's two-stage ring (one 32-token tile in flight).
    "paged_prefill_simt": KernelDesc(loads="ring", ahead=1, x_reversed=True),
    "paged_mla_tc": KernelDesc(loads="ring", ahead=1, x_reversed=True),
    "paged_mla_wgmma": KernelDesc(loads="ring", ahead=1, x_reversed=True),
    "paged_mla_seesaw": KernelDesc(loads="ring", ahead=1, x_reversed=True),
    # Each warp's own two-stage ring: one 16-token tile in flight while one computes.
    "paged_decode_tc": KernelDesc(loads="ring", ahead=1),
    MERGE.name: KernelDesc(role="merge", loads="ldg"),
}


def desc(kernel: str, uses_cp_async: bool = False) -> KernelDesc:
    """The table's row, or a default (``known=False``) for a new kernel."""
    d = KERNELS.get(kernel)
    if d is not None:
        return d
    return KernelDesc(loads="ring" if uses_cp_async else "ldg", known=False)
