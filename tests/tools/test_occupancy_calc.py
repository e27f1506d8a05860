"""The occupancy calculator (cupaged.tools.occupancy) against published
cases and the CUDA occupancy rules (cuda_occupancy.h), and the per-arch
launch check (cupaged.tools.archs.launchable)."""

import pytest

from cupaged.tools import archs, occupancy


def test_best_practices_guide_example():
    """CUDA C++ Best Practices Guide, "Calculating Occupancy": on compute
    capability 7.0, 128-thread blocks at 37 registers per thread give 75%
    occupancy with 12 resident blocks; 320-thread blocks at the same 37
    registers, only 4 blocks (63%)."""
    o = occupancy.occupancy("sm_70", 128, 37)
    assert o.blocks_per_sm == 12 and o.occupancy() == pytest.approx(0.75) and o.limited_by == "registers"
    o = occupancy.occupancy("sm_70", 320, 37)
    assert o.blocks_per_sm == 4 and o.occupancy() == pytest.approx(0.625)  # the guide rounds to 63%


@pytest.mark.parametrize(
    "regs,blocks", [(32, 16), (64, 8), (128, 4), (154, 3), (156, 3), (168, 3), (170, 2), (232, 2), (255, 2)]
)
def test_register_granularity_128_threads_sm90(regs, blocks):
    """Registers go to warps in units of 256 (regs x 32 rounded up), each
    of the 4 sub-partitions holds 16384 registers: 156 -> 5120 per warp ->
    3 warps per sub-partition -> 3 four-warp blocks (the perf review's
    paged_attention at GROUP_TILE 4); 232 -> 2 blocks."""
    o = occupancy.occupancy("sm_90", 128, regs)
    assert o.by_registers == blocks


def test_block_and_warp_caps_per_arch():
    """Tiny blocks hit the per-SM block cap: 32 on 8.0 / 9.0, 16 on 8.6,
    24 on 8.9; 1024-thread blocks the warp cap (64 warps on 8.0 / 9.0, 48
    on 8.6 / 8.9)."""
    for arch, cap in (("sm_80", 32), ("sm_86", 16), ("sm_89", 24), ("sm_90", 32)):
        o = occupancy.occupancy(arch, 32, 16)
        assert o.blocks_per_sm == cap and o.limited_by == "blocks"
    assert occupancy.occupancy("sm_90", 1024, 32).blocks_per_sm == 2
    assert occupancy.occupancy("sm_86", 1024, 32).blocks_per_sm == 1
    assert occupancy.occupancy("sm_86", 512, 32).blocks_per_sm == 3


def test_shared_memory_reserve_and_granularity():
    """Static + dynamic + 1 KiB reserved per block (sm_80+), rounded up to
    128 bytes, against 228 KiB per SM on sm_90 (164 on sm_80)."""
    # 228 KiB / 3 = 76 KiB: 75 KiB dynamic + the 1 KiB reserve fit three times, one byte more does not
    o = occupancy.occupancy("sm_90", 128, 32, 0, 75 * 1024)
    assert o.smem_per_block == 76 * 1024 and o.by_smem == 3
    o = occupancy.occupancy("sm_90", 128, 32, 0, 75 * 1024 + 1)
    assert o.smem_per_block == 76 * 1024 + 128 and o.by_smem == 2
    assert occupancy.occupancy("sm_80", 128, 32, 0, 81 * 1024).by_smem == 2  # 164 KiB / 82 KiB
    # the tensor-core prefill kernel (D 128): 1808 static + 69632 dynamic -> 3 by shared memory
    assert occupancy.occupancy("sm_90", 128, 202, 1808, 69632).by_smem == 3
    # the MLA kernel: 2320 + 154624 -> 1 on sm_90 and sm_80; none on sm_86 (over the 99 KiB opt-in)
    assert occupancy.occupancy("sm_90", 256, 235, 2320, 154624).blocks_per_sm == 1
    assert occupancy.occupancy("sm_80", 256, 235, 2320, 154624).blocks_per_sm == 1
    assert occupancy.occupancy("sm_86", 256, 235, 2320, 154624).blocks_per_sm == 0


def test_register_hardware_check():
    """A block whose warps, rounded up to a multiple of 4, need more than
    64K registers cannot launch, nor more than 255 registers per thread."""
    assert occupancy.occupancy("sm_90", 1024, 64).blocks_per_sm == 1
    assert occupancy.occupancy("sm_90", 1024, 72).blocks_per_sm == 0
    assert occupancy.occupancy("sm_90", 32, 256).blocks_per_sm == 0


def test_launchable_limits():
    """The opt-in limits: 227 KiB per block on sm_90, 163 KiB on sm_80,
    99 KiB on sm_86 / sm_89; 48 KiB of static shared memory; 1024 threads."""
    assert archs.launchable("sm_90", 0, 227 * 1024, 128)
    assert not archs.launchable("sm_90", 1, 227 * 1024, 128)
    assert archs.launchable("sm_80", 0, 163 * 1024, 128) and not archs.launchable("sm_80", 0, 163 * 1024 + 1, 128)
    # the D = 256 prefill kernel (1296 static + 101376 dynamic) and the MLA kernel
    for arch in ("sm_86", "sm_89"):
        assert not archs.launchable(arch, 1296, 101376, 128)
        assert not archs.launchable(arch, 2320, 154624, 256)
        assert archs.launchable(arch, 1808, 69632, 128)
    assert not archs.launchable("sm_90", 49 * 1024, 0, 128)
    assert not archs.launchable("sm_90", 0, 0, 1025)
    assert not archs.launchable("sm_90", 0, 0, 1024, registers=72)
    problems = archs.launch_problems("sm_86", 2320, 154624, 256)
    assert len(problems) == 1 and "opt-in" in problems[0] and "sm_86" in problems[0]


def test_arch_names():
    assert archs.get("sm_90a").name == "sm_90" and archs.get("compute_80").name == "sm_80"
    with pytest.raises(KeyError, match="sm_80"):
        archs.get("sm_75")
    assert set(archs.MODELED) == {"sm_80", "sm_90"}
    for a in archs.MODELED:
        rows = archs.get(a).assumptions()
        assert rows and all(src for _, _, src in rows if _ != "bytes in flight needed per SM")
