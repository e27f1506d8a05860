"""The SASS loop finder (cupaged.tools.sass): a fixed kernel compiled by
NVRTC for sm_80 / sm_90 and disassembled (skipped with the reason when no
nvdisasm / cuobjdump is installed), and the CFG code on a hand-written
listing (always runs)."""

from pathlib import Path

import pytest

from cupaged.tools import sass

KERNEL = Path(__file__).parent / "kernels" / "sass_loops.cu"


def _nvrtc_or_skip():
    try:
        from cupaged._runtime import nvrtc

        nvrtc.nvrtc_version()
        nvrtc.find_header_dir()
        return nvrtc
    except Exception as e:  # no cuda-python / NVRTC / headers
        pytest.skip(f"NVRTC unavailable: {e}")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_hot_loop_of_a_fixed_kernel(arch):
    nvrtc = _nvrtc_or_skip()
    if not sass.available():
        pytest.skip("nvdisasm / cuobjdump not installed: " + sass.INSTALL_HINT)
    c = nvrtc.compile_source(KERNEL.read_text(), arch, name="sass_loops.cu")
    assert c.ok, c.log
    fns = sass.parse(sass.disassemble(c.cubin))
    fn = fns["stream_sum"]
    loops = sass.find_loops(sass.build_cfg(fn))
    # the tile loop, the loop nested in it, the scalar-load loop after it
    assert len(loops) == 3
    assert sorted(lp.depth for lp in loops) == [1, 1, 2]
    hot = sass.hot_loop(fn)
    assert hot is not None and hot.nested == 1 and hot.other_loops == 0
    own, inner = hot.regions
    # two 16-byte loads per lane per iteration: 2 x 16 x 32 bytes per warp
    assert own.wide_load_bytes == 1024 and own.classes.get("ldg") == 2
    assert inner.wide_load_bytes == 0 and inner.global_load_bytes == 0 and inner.parent == 0
    assert inner.classes.get("fp32", 0) >= 1  # s * 0.5f + 1.0f
    assert own.classes.get("fp32", 0) >= 7  # eight elements summed
    assert hot.first_offset <= hot.last_offset
    # the scalar-load loop is not the hot loop: its loads are 4 bytes per lane
    scalar = [
        lp for lp in loops if lp.depth == 1 and lp.header != sass.build_cfg(fn).block_of(fn.index_of(hot.first_offset))
    ]
    assert scalar and not any(sass.is_wide_global_load(i) for i in scalar[0].instructions(fn, sass.build_cfg(fn)))


LISTING = """
        .section        .text.k,"ax",@progbits
.text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0020*/               @P0 EXIT ;
.L_x_0:
        /*0030*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0040*/                   FFMA R8, R4, R5, R8 ;
.L_x_1:
        /*0050*/                   SHFL.BFLY PT, R9, R8, 0x1, 0x1f ;
        /*0060*/                   IADD3 R10, R10, 0x1, RZ ;
        /*0070*/                   ISETP.NE.AND P1, PT, R10, R11, PT ;
        /*0080*/               @P1 BRA `(.L_x_1) ;
        /*0090*/                   LDS.U.64 R12, [R13] ;
        /*00a0*/                   ISETP.NE.AND P2, PT, R0, R1, PT ;
        /*00b0*/               @P2 BRA `(.L_x_0) ;
        /*00c0*/                   STG.E desc[UR4][R2.64], R8 ;
        /*00d0*/                   EXIT ;
.L_x_2:
        /*00e0*/                   BRA `(.L_x_2);
"""


def test_cfg_on_a_listing():
    fn = sass.parse(LISTING)["k"]
    assert len(fn.instrs) == 15
    cfg = sass.build_cfg(fn)
    loops = sass.find_loops(cfg)
    assert len(loops) == 2  # the trailing self-branch after EXIT is not a loop
    outer = next(lp for lp in loops if lp.depth == 1)
    inner = next(lp for lp in loops if lp.depth == 2)
    assert inner in outer.children
    hot = sass.hot_loop(fn)
    assert hot.instructions == 9 and hot.nested == 1
    own, nested = hot.regions
    assert own.wide_load_bytes == 512 and own.smem_bytes == 8 * 32
    assert nested.classes == {"shfl": 1, "alu": 2, "ctrl": 1}
    assert sass.classify(fn.instrs[4]) == "fp32"


def test_missing_tools_are_reported(monkeypatch):
    monkeypatch.setattr(sass, "find_tool", lambda name: None)
    assert not sass.available()
    with pytest.raises(sass.SassToolMissing, match="nvidia-cuda-nvdisasm"):
        sass.disassemble(b"\x7fELF")


def test_split_prefill_consumers_issue_the_softmax_beside_their_products():
    """paged_prefill_wgmma's warp-specialized build (sm_90a, bf16, D 128), as NVRTC compiles it: in each of
    the consumers' (unrolled) tiles, tile j + 1's S and tile j - 1's P V are issued, then tile j's softmax
    (its 32 exponentials at least) before the one wgmma wait; the masked softmax is a branch of its own
    (PMTRIG 0x40, ptx::edge_tile); the loader loop is the producer's."""
    import numpy as np

    from cupaged import HostPlan
    from cupaged.ops.attention import plan_launches
    from cupaged.tools import model

    _nvrtc_or_skip()
    if not sass.available():
        pytest.skip("nvdisasm / cuobjdump not installed: " + sass.INSTALL_HINT)
    kv = 4096
    host = HostPlan.build(np.arange(kv // 16).reshape(1, -1), [kv], [kv], 16, kv // 16)
    (la,) = plan_launches(host, "bf16", 32, 8, 128, 128, 0, True, True, arch="sm_90")
    assert la.kernel == "paged_prefill_wgmma"
    hot = model.kernel_facts(la.source, la.defines, la.kernel, "sm_90a").hot
    assert hot is not None and hot.producer is not None
    own = hot.regions[0]
    tiles = [seg for seg in own.segments if seg[3] > 0]  # segments with wgmma work
    assert len(tiles) == 2 and own.hmma == 24, own.segments
    for pre, post, _, flop, _, _, closed in tiles:
        assert closed and flop == 2 * 2 * 64 * 64 * 128 / 4  # S and P V of one tile, per warp
        assert post - 12 >= 32 + 32 + 32, (pre, post)  # beside the products: the max, exponentials, sums
    assert sum(r.edges for r in hot.regions) == 2 and own.edges == 0


def test_seesaw_mla_consumers_keep_their_products_asynchronous():
    """paged_mla_seesaw (sm_90a, bf16, R 512 / P 64), as NVRTC compiles it: ptxas serializes none of its
    wgmma (no "Potential Performance Loss" in its log), a producer loop copies the tiles, and a consumer's
    step (its own 32-token tile and the other's before it) issues its 40 wgmma in two groups: both tiles' P V
    on its half of the value columns (2 + 2), then its next S (36), waited for once each."""
    import numpy as np

    from cupaged import HostPlan
    from cupaged.ops.attention import plan_launches
    from cupaged.tools import model

    nvrtc = _nvrtc_or_skip()
    if not sass.available():
        pytest.skip("nvdisasm / cuobjdump not installed: " + sass.INSTALL_HINT)
    kv = 4096
    host = HostPlan.build(np.arange(kv // 64).reshape(1, -1), [kv], [1], 64, kv // 64)
    (la,) = plan_launches(host, "bf16", 128, 1, 512, 512, 64, True, True, arch="sm_90", latent=True)
    assert la.kernel == "paged_mla_seesaw"
    facts = model.kernel_facts(la.source, la.defines, la.kernel, "sm_90a")
    assert not nvrtc.parse_ptxas(facts.log)[la.kernel].wgmma_serialized, facts.log
    hot = facts.hot
    assert hot is not None and hot.producer is not None and hot.pingpong(hot.consumer_warps(12)) == 2
    own = hot.regions[0]
    groups = [seg for seg in own.segments if seg[3] > 0]
    assert own.hmma == 40 and len(groups) == 2, own.segments
    pv = 2 * 2 * 64 * 256 * 16 / 4  # two m64n256k16 per warp
    assert [seg[3] for seg in groups] == [2 * pv, 36 * 2 * 64 * 32 * 16 / 4]
