"""Resident blocks per SM by the CUDA occupancy rules (cuda_occupancy.h's
``cudaOccMaxActiveBlocksPerMultiprocessor``), from the limits in
``archs.py``:

* registers: a warp gets ``regs x 32`` rounded up to 256 registers; each of
  the 4 sub-partitions holds ``(regs_per_sm / 4) // per_warp`` warps; blocks
  = warps an SM holds // warps per block. A block whose warps, rounded up
  to a multiple of 4, would need more than the per-block register file
  cannot launch (the hardware check), nor one above 255 per thread;
* shared memory: static + dynamic + the 1 KiB the driver reserves per block
  (sm_80+), rounded up to 128 bytes (256 before sm_80); blocks = the SM's
  shared memory (the largest carveout: cupaged sets no preference) //
  that; more than the opt-in limit per block (+ the reserve) cannot launch;
* warps: max warps per SM // warps per block; blocks: the per-SM cap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import archs as _archs


@dataclass(frozen=True)
class Occupancy:
    arch: str
    threads: int
    registers: int
    static_smem: int
    dynamic_smem: int
    blocks_per_sm: int  # resident blocks per SM (0: cannot launch)
    by_registers: int
    by_smem: int
    by_warps: int
    by_blocks: int
    limited_by: str  # "registers", "shared memory", "warps", "blocks" (first of the ties)
    smem_per_block: int  # allocated, reserve and rounding included
    regs_per_block: int  # allocated

    @property
    def warps_per_sm(self) -> int:
        return self.blocks_per_sm * (-(-self.threads // 32))

    def occupancy(self, arch: _archs.Arch | None = None) -> float:
        a = arch or _archs.get(self.arch)
        return self.warps_per_sm / a.max_warps_per_sm

    def as_dict(self) -> dict:
        d = asdict(self)
        d["warps_per_sm"] = self.warps_per_sm
        d["occupancy"] = self.occupancy()
        return d


def occupancy(arch: str, threads: int, registers: int, static_smem: int = 0, dynamic_smem: int = 0) -> Occupancy:
    """Resident blocks per SM of a kernel on ``arch`` (see the module doc)."""
    a = _archs.get(arch)
    if threads < 1:
        raise ValueError(f"threads: expected at least 1, got {threads}")
    warps = -(-threads // 32)

    # registers
    per_warp = -(-registers * 32 // a.reg_alloc_unit) * a.reg_alloc_unit
    per_block = per_warp * warps
    assumed = per_warp * (-(-warps // a.sub_partitions) * a.sub_partitions)
    if registers > a.max_regs_per_thread or assumed > a.regs_per_block or per_block > a.regs_per_block:
        by_regs = 0
    elif per_warp == 0:
        by_regs = a.max_blocks_per_sm
    else:
        by_regs = ((a.regs_per_sm // a.sub_partitions) // per_warp) * a.sub_partitions // warps

    # shared memory
    unit = a.smem_alloc_unit
    total = static_smem + dynamic_smem + a.smem_reserved_per_block
    alloc = -(-total // unit) * unit
    limit = a.smem_optin_per_block + a.smem_reserved_per_block
    if alloc > limit:
        by_smem = 0
    else:
        by_smem = a.smem_per_sm // alloc if alloc else a.max_blocks_per_sm

    by_warps = a.max_warps_per_sm // warps if threads <= a.max_threads_per_block else 0
    by_blocks = a.max_blocks_per_sm
    limits = {"registers": by_regs, "shared memory": by_smem, "warps": by_warps, "blocks": by_blocks}
    n = min(limits.values())
    limited_by = next(k for k, v in limits.items() if v == n)
    return Occupancy(
        a.name,
        threads,
        registers,
        static_smem,
        dynamic_smem,
        n,
        by_regs,
        by_smem,
        by_warps,
        by_blocks,
        limited_by,
        alloc,
        per_block,
    )
