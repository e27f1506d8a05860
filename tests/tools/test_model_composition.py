"""The performance model composes what a kernel serializes (issue #21,
"an honest performance model"): each test pins one defect of the static
review (/work/shared/design/perf-review.md) on a hand-written SASS listing
run through the real loop finder (``cupaged.tools.sass``) and the real
fluid simulation (``cupaged.tools.model``). No NVRTC, no GPU: the figures
expected are computed here from the listing and the arch's figures."""

import math

import numpy as np
import pytest

from cupaged.tools import archs, kernels, model, sass

SM90 = archs.get("sm_90")


def function_k():
    """The lines of an nvdisasm-style function ``k`` that reads its thread index, and the function that
    appends an instruction to them at the next offset."""
    out = [".text.k:"]
    off = 0

    def emit(text):
        nonlocal off
        out.append(f"        /*{off:04x}*/                   {text} ;")
        off += 0x10

    emit("S2R R0, SR_TID.X")
    return out, emit


def listing(body, pre=(), post=(), slow=()):
    """An nvdisasm-style function ``k``: ``pre`` lines, then a loop of
    ``body`` lines (back edge at its end), ``post`` lines, EXIT, and the
    ``slow`` lines as a BRA.DIV slow path after the EXIT (taken from the
    loop's top, rejoining it)."""
    out, emit = function_k()
    for line in pre:
        emit(line)
    out.append(".L_x_0:")
    if slow:
        emit("BRA.DIV UR4, `(.L_x_9)")
    out.append(".L_x_8:")
    for line in body:
        emit(line)
    emit("ISETP.NE.AND P2, PT, R0, R1, PT")
    emit("@P2 BRA `(.L_x_0)")
    for line in post:
        emit(line)
    emit("EXIT")
    if slow:
        out.append(".L_x_9:")
        for line in slow:
            emit(line)
        emit("BRA `(.L_x_8)")
    out.append(".L_x_1:")
    emit("BRA `(.L_x_1)")
    return "\n".join(out)


def hot_of(text):
    hot = sass.hot_loop(sass.parse(text)["k"])
    assert hot is not None
    return hot


def launch(hot, *, threads, grid, tokens, bpt, registers=64, out_bytes=0, run_bytes=None, end="pess"):
    facts = model.KernelFacts("k", "k", "sm_90", True, registers=registers, hot=hot)
    blocks = [model.Block([(("s", b), tokens)], tokens, 1, 0, out_bytes) for b in range(grid)]
    return model.model_launch(
        SM90,
        facts,
        kernels.KernelDesc(),
        grid=(grid, 1, 1),
        threads=threads,
        dynamic_smem=0,
        blocks=blocks,
        kv_bytes_per_token=bpt,
        probe=None,
        fits_l2=False,
        run_bytes=run_bytes,
        end=end,
    )


COPY = "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]"


def test_a_wgmma_wait_serializes_tensor_time_with_the_issue():
    """Defect 1: the issue before an HGMMA group, the group's tensor time
    its WARPGROUP.DEPBAR waits for, the issue after it and a block barrier
    add up; only the issue between the group and its wait overlaps it."""
    hgmma = ["HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12].tnspB, R24"] * 7 + [
        "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12].tnspB, R24, gsb0"
    ]
    body = (
        ["DEPBAR.LE SB0, 0x0"]
        + ["IADD3 R6, R6, 0x1, RZ"] * 200
        + ["WARPGROUP.ARRIVE"]
        + hgmma
        + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]
        + ["FFMA R8, R8, R9, R10"] * 200
        + ["BAR.SYNC.DEFER_BLOCKING 0x0", COPY, COPY, "LDGDEPBAR"]
    )
    hot = hot_of(listing(body))
    r = hot.regions[0]
    assert hot.cover == 1 and r.bars == 1 and len(r.segments) == 2
    pre, post, _, wg_flop, wg_smem, _, closed = r.segments[0]
    assert (pre, post, closed) == (202, 9, 1) and wg_flop == 8 * 2 * 64 * 256 * 16 / 4
    assert wg_smem == 8 * (16 * 16 * 2 + 256 * 16 * 2 / 4)  # A and B from shared memory
    rest = r.segments[1][0] + r.segments[1][1]
    # one 64 x 256 x 16 product per 16-token tile: 256-byte rows of 8 warps, 2 copies of 16 B per lane
    lm = launch(hot, threads=256, grid=SM90.sms, tokens=1024, bpt=8 * 2 * 512 / 16, registers=200)
    pt = SM90.point("pess")
    warps = 8
    t_i = max(1 / pt.warp_ipc, 2 / pt.sched_ipc) / pt.clock_hz
    tensor = warps * wg_flop / (pt.wgmma_flops / pt.sms)
    smem = warps * wg_smem / (pt.smem_bytes_per_clk * pt.clock_hz)
    serial = pre * t_i + max(post * t_i, tensor, smem) + rest * t_i + pt.bar_clk / pt.clock_hz
    it = lm.iteration
    assert it["iteration"] == pytest.approx(serial, rel=1e-9)
    # the old composition: the largest of issue, tensor, shared memory and latency
    assert it["iteration"] > 1.3 * max((pre + post + rest) * t_i, tensor, smem, pt.latency_s)
    iters = 1024 / 16
    assert lm.time_s >= iters * serial and lm.binding == "chain"


def test_issue_is_limited_by_the_warps_each_scheduler_holds():
    """Defect 2: a scheduler issues at most its achieved IPC, a warp at most
    its own (never 1 per clock from 2 warps on 4 schedulers); a lone 2-warp
    block gets 2 warps' worth, not 4 instructions per clock."""
    for end in ("opt", "pess"):
        pt = SM90.point(end)
        assert pt.warp_ipc < 1 and pt.sched_ipc < 1 and pt.warp_ipc < pt.sched_ipc
        assert pt.issue_per_clk(1) == pytest.approx(pt.warp_ipc)
        assert pt.issue_per_clk(2) == pytest.approx(2 * pt.warp_ipc)
        assert pt.issue_per_clk(8) == pytest.approx(4 * min(pt.sched_ipc, 2 * pt.warp_ipc))
        assert pt.issue_per_clk(64) == pytest.approx(4 * pt.sched_ipc) and pt.issue_per_clk(64) < 4
    hot = hot_of(listing(["LDG.E.128 R4, desc[UR4][R2.64]"] + ["IADD3 R6, R6, 0x1, RZ"] * 400))
    n_instr = hot.regions[0].instructions
    lm = launch(hot, threads=64, grid=SM90.sms, tokens=4096, bpt=2 * 512)  # one block of 2 warps per SM
    pt = SM90.point("pess")
    instr = 2 * (4096 * n_instr + hot.prologue + hot.epilogue)  # 2 warps, one iteration per token
    assert lm.bounds_s["issue"] == pytest.approx(instr / (2 * pt.warp_ipc * pt.clock_hz), rel=1e-6)
    assert lm.bounds_s["issue"] > 2 * instr / (4 * pt.clock_hz)


def test_dependent_round_trips_before_the_first_tile_are_not_overlapped_away():
    """Defect 3: a metadata word, a word indexed by it, then the first tile
    (three dependent round trips) delay every block of a wave by that
    chain, on top of its streaming; a word loaded and used inside an
    iteration stalls the warp once per iteration; one warp issues below 1
    instruction per clock."""
    pre = [
        "LDG.E R2, desc[UR4][R2.64]",
        "IMAD.WIDE R4, R2, 0x4, R10",
        "LDG.E R6, desc[UR4][R4.64]",
        "IMAD.WIDE R12, R6, 0x100, R14",
        "LDGSTS.E.BYPASS.128 [R20], desc[UR4][R12.64]",
        "LDGDEPBAR",
    ]
    body = [
        "LDG.E R7, desc[UR4][R16.64]",
        "IMAD.WIDE R12, R7, 0x100, R14",
        "LDGSTS.E.BYPASS.128 [R20], desc[UR4][R12.64]",
        "LDGDEPBAR",
        "DEPBAR.LE SB0, 0x1",
    ] + ["FFMA R8, R8, R9, R10"] * 20
    hot = hot_of(listing(body, pre=pre))
    assert hot.startup_levels == 3 and hot.regions[0].dep_levels == 1 and hot.cover == 1
    pt = SM90.point("pess")
    lm = launch(hot, threads=512, grid=2 * SM90.sms, tokens=64, bpt=16 * 512, run_bytes=4096)
    assert lm.startup_s == pytest.approx(3 * pt.latency_s)
    assert lm.iteration["dependent loads"] == pytest.approx(pt.dep_load_s)
    t_i = max(1 / pt.warp_ipc, 4 / pt.sched_ipc) / pt.clock_hz  # 16 warps: 4 a scheduler
    assert lm.iteration["issue"] == pytest.approx(hot.regions[0].instructions * t_i)
    hbm = lm.hbm_bytes / (pt.copy_bw * lm.dram_eff)
    # one wave: the startup adds to the streaming time (the old model took the larger of the two)
    assert lm.time_s >= 0.999 * (lm.startup_s + max(hbm, lm.bounds_s["chain"]))


def test_hbm_moves_at_the_copy_bandwidth_times_a_dram_efficiency():
    """Defect 4: an HBM-bound launch is no longer exactly at the copy
    bandwidth: 256-byte rows at a 2 KiB stride read at the arch's DRAM
    efficiency for them (a sourced range), long runs at theirs."""
    hot = hot_of(listing([COPY] * 4 + ["LDGDEPBAR", "DEPBAR.LE SB0, 0x1"] + ["FFMA R8, R8, R9, R10"] * 8))
    for end in ("opt", "pess"):
        pt = SM90.point(end)
        for run, eff in ((256, pt.dram_eff_256), (4096, pt.dram_eff_long)):
            lm = launch(hot, threads=256, grid=4 * SM90.sms, tokens=4096, bpt=8 * 2048, run_bytes=run, end=end)
            assert lm.binding == "HBM" and lm.dram_eff == pytest.approx(eff)
            assert lm.hbm_bytes / lm.time_s == pytest.approx(pt.copy_bw * eff, rel=0.03)
    assert SM90.point("pess").dram_eff_256 < SM90.point("opt").dram_eff_256 < 1.0
    assert SM90.point("pess").dram_eff(128) < SM90.point("pess").dram_eff(256)
    for name in ("dram_eff_256", "dram_eff_long"):
        assert SM90.figures[name].source


@pytest.mark.parametrize("arch", archs.MODELED)
def test_every_figure_is_a_sourced_range(arch):
    """Defect 5: every per-arch rate is a (optimistic, pessimistic) range
    with its source beside it (a publication, or "estimate" where none was
    found); wgmma is not modeled at the 989 TFLOP/s datasheet peak while
    reporting against 790; mma.sync's 2/3 of peak is the optimistic end;
    the clock is not derived from the datasheet peak."""
    a = archs.get(arch)
    need = {"clock_ghz", "latency_ns", "l2_latency_ns", "l2_bw", "dram_eff_long", "dram_eff_256", "mma_sync_flops"}
    assert need <= set(a.figures)
    for name, f in a.figures.items():
        assert f.pess <= f.opt or name in (
            "latency_ns",
            "l2_latency_ns",
            "dep_load_ns",
            "bar_clk",
            "launch_us",
            "pdl_release_us",
        )
        assert f.source and ("estimate" in f.source or any(k in f.source for k in ("arXiv", "README", ".com", "Guide")))
        if "estimate" not in f.source:
            continue
        if not f.exact:
            assert abs(f.opt - f.pess) / max(f.opt, f.pess) >= 0.05  # an estimate's range is wide
    if a.wgmma:
        wg = a.figures["wgmma_flops"]
        assert wg.opt < 989e12 and wg.pess <= a.tensor_ceiling
        assert "arXiv 2407.08608" in a.figures["mma_sync_flops"].source
        assert a.figures["mma_sync_flops"].opt <= 989.4e12 * 2 / 3 + 1e12 < wg.pess
        assert "glennklockwood" in a.figures["clock_ghz"].source and a.figures["clock_ghz"].pess < 1.83
    rows = {r[0]: r for r in a.assumptions()}
    assert " - " in rows["loaded DRAM latency"][1] and "estimate" in rows["L2 bandwidth"][2] + rows["L2 bandwidth"][1]


def test_f2fp_is_a_conversion_at_16_per_clock():
    """Defect 6: F2FP (the f32 -> bf16x2 pack, the fp8 decode) is a
    conversion, 16 results per clock per SM, not a 64-per-clock ALU op."""
    ins = sass.parse(listing(["F2FP.BF16.F32.PACK_AB R8, R9, R10"]))["k"].instrs
    assert sass.classify(next(i for i in ins if i.base == "F2FP")) == "conv"
    assert SM90.lanes_per_clk["conv"] == 16 and SM90.lanes_per_clk["alu"] == 64
    hot = hot_of(listing(["LDG.E.128 R4, desc[UR4][R2.64]"] + ["F2FP.BF16.F32.PACK_AB R8, R9, R10"] * 64))
    lm = launch(hot, threads=256, grid=SM90.sms, tokens=1000, bpt=8 * 512)
    pt = SM90.point("pess")
    assert lm.bounds_s["pipe"] == pytest.approx(8 * 1000 * 64 * 32 / 16 / pt.clock_hz, rel=1e-6)


def test_bytes_in_flight_count_the_blocks_the_grid_places():
    """Defect 7: 512 blocks on 132 SMs place 3.9 per SM, not the 6 the
    occupancy would allow; bytes in flight per SM count those."""
    hot = hot_of(listing([COPY] * 2 + ["LDGDEPBAR", "DEPBAR.LE SB0, 0x1"] + ["FFMA R8, R8, R9, R10"] * 30))
    lm = launch(hot, threads=64, grid=512, tokens=256, bpt=2 * 1024, registers=152)
    assert lm.occupancy["blocks_per_sm"] == 6
    assert lm.blocks_per_sm == pytest.approx(512 / SM90.sms)
    per_block = 2 * 2 * 512  # 2 warps, 2 copies of 16 B per lane, one tile in flight
    assert lm.in_flight_per_sm == pytest.approx(per_block * 512 / SM90.sms)


def test_prologue_and_epilogue_are_issued_and_skipped_paths_are_not():
    """Defect 8: a block's prologue and epilogue (the longest path, once)
    are charged to issue; the BRA.DIV slow path of a warp collective (never
    taken by a converged warp) is not counted; a ring that waits with
    ``DEPBAR.LE SB0, 1`` and then issues its next copies covers 2
    iterations (the 3-stage prefill), one that issues first covers 1."""
    slow = ["WARPSYNC.COLLECTIVE R9, `(.L_x_8)"] + ["SHFL.BFLY PT, R9, R8, 0x1, 0x1f"] * 30
    body = ["DEPBAR.LE SB0, 0x1", "FFMA R8, R8, R9, R10", COPY, "LDGDEPBAR"]
    text = listing(body, pre=["IADD3 R6, R6, 0x1, RZ"] * 100, post=["STG.E desc[UR4][R2.64], R8"] * 50, slow=slow)
    hot = hot_of(text)
    own = hot.regions[0]
    assert own.skipped == len(slow) + 1 and own.instructions == 1 + len(body) + 2
    assert hot.prologue == 101 and hot.epilogue == 51  # S2R + 100; 50 stores + EXIT
    assert hot.cover == 2
    ahead_first = hot_of(listing([COPY, "LDGDEPBAR", "DEPBAR.LE SB0, 0x1", "FFMA R8, R8, R9, R10"]))
    assert ahead_first.cover == 1
    lm = launch(hot, threads=128, grid=SM90.sms, tokens=160, bpt=4 * 512)
    instr = 4 * (160 * own.instructions + hot.prologue + hot.epilogue)  # per block (one per SM)
    assert lm.instr == pytest.approx(SM90.sms * instr)
    pt = SM90.point("pess")
    assert lm.bounds_s["issue"] == pytest.approx(instr / (pt.issue_per_clk(4) * pt.clock_hz), rel=1e-6)


def test_both_ends_bracket_and_the_sensitivity_is_real():
    """The optimistic end is never slower than the pessimistic one, and
    flipping one figure (the DRAM efficiency of an HBM-bound launch) moves
    the time by the ratio of its ends."""
    hot = hot_of(listing([COPY] * 4 + ["LDGDEPBAR", "DEPBAR.LE SB0, 0x1"] + ["FFMA R8, R8, R9, R10"] * 8))
    kw = dict(threads=256, grid=4 * SM90.sms, tokens=4096, bpt=8 * 2048, run_bytes=256)
    lo, hi = launch(hot, end="opt", **kw), launch(hot, end="pess", **kw)
    assert lo.time_s < hi.time_s
    facts = model.KernelFacts("k", "k", "sm_90", True, registers=64, hot=hot)
    blocks = [model.Block([(("s", b), 4096)], 4096, 1, 0, 0) for b in range(kw["grid"])]
    flipped = model.model_launch(
        SM90,
        facts,
        kernels.KernelDesc(),
        grid=(kw["grid"], 1, 1),
        threads=256,
        dynamic_smem=0,
        blocks=blocks,
        kv_bytes_per_token=kw["bpt"],
        probe=None,
        fits_l2=False,
        run_bytes=256,
        end="pess",
        flip=("dram_eff_256",),
    )
    f = SM90.figures["dram_eff_256"]
    assert flipped.time_s / hi.time_s == pytest.approx(f.pess / f.opt, rel=0.02)
    assert math.isfinite(float(np.sum([lo.time_s, hi.time_s])))


S_GROUP = ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24"] * 7 + ["HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0"]
PV_GROUP = ["HGMMA.64x256x16.F32.BF16 R88, R120, gdesc[UR12].tnspB, R88"] * 3 + [
    "HGMMA.64x256x16.F32.BF16 R88, R120, gdesc[UR12].tnspB, R88, gsb0"
]


def group_time(lines, pt, warps):
    """Tensor time of one commit group of ``warps`` warps on one SM: the longer of its FLOP at the wgmma
    rate and its shared-memory operand bytes (counted here from the shapes, as the PTX ISA defines them)."""
    flop = byts = 0.0
    for line in lines:
        m, n, k = (int(x) for x in line.split()[0].split(".")[1].split("x"))
        flop += 2 * m * n * k / 4
        a_smem = line.split(",")[1].strip().startswith("gdesc")
        byts += (16 * k * 2 if a_smem else 0) + n * k * 2 / 4
    return max(warps * flop / (pt.wgmma_flops / pt.sms), warps * byts / (pt.smem_bytes_per_clk * pt.clock_hz))


def test_a_wait_that_leaves_a_group_in_flight_overlaps_it_with_the_work_after_it():
    """Intra-warpgroup overlap (FlashAttention-3): S(j) and P V(j - 1) issued,
    ``wait_group 1`` returns when S is done, the softmax issues while P V
    still runs, ``wait_group 0`` waits for what is left of it. A wait for
    everything (``wait_group 0`` right after the products) serializes the
    same work: only independent work after a partial wait overlaps."""
    pt = SM90.point("pess")
    warps = 8
    t_i = max(1 / pt.warp_ipc, 2 / pt.sched_ipc) / pt.clock_hz

    def body(first_wait):
        return (
            ["DEPBAR.LE SB0, 0x0", "WARPGROUP.ARRIVE"]
            + S_GROUP
            + PV_GROUP
            + [f"WARPGROUP.DEPBAR.LE gsb0, {first_wait}"]
            + ["FFMA R8, R8, R9, R10"] * 120
            + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]
            + ["FMUL R88, R88, R7"] * 20
            + ["BAR.SYNC.DEFER_BLOCKING 0x0", COPY, COPY, "LDGDEPBAR"]
        )

    t_s, t_pv = group_time(S_GROUP, pt, warps), group_time(PV_GROUP, pt, warps)
    overlapped = hot_of(listing(body("0x1")))
    r = overlapped.regions[0]
    assert r.waits == [1, 0, 0] and [len(g) for g in r.groups] == [2, 0, 0]
    n0, n1, n2 = (s[0] + s[1] for s in r.segments)
    assert (n0, n1) == (2 + 12 + 1, 120 + 1)
    softmax = n1 * t_i
    assert t_pv > softmax > 0.25 * t_pv and t_s > (n0 - 2) * t_i  # the numbers make each term count
    # S waited for; P V overlaps the softmax and is waited for after it; the rest, the barrier
    want = 2 * t_i + t_s + max(softmax, t_pv) + n2 * t_i + pt.bar_clk / pt.clock_hz
    kw = dict(threads=256, grid=SM90.sms, tokens=1024, bpt=8 * 2 * 512 / 16, registers=200)
    it = launch(overlapped, **kw).iteration
    assert it["total"] == pytest.approx(want, rel=1e-9)
    serial = 2 * t_i + t_s + t_pv + softmax + n2 * t_i + pt.bar_clk / pt.clock_hz
    assert it["total"] < serial - 0.2 * softmax
    # the same products waited for at once: the softmax after them adds
    lockstep = launch(hot_of(listing(body("0x0"))), **kw).iteration
    assert lockstep["total"] == pytest.approx(serial, rel=1e-9)


def test_pingpong_warpgroups_overlap_one_s_gemms_with_the_others_softmax():
    """Two warpgroups taking turns through named barriers (``bar.sync id,
    256`` / ``bar.arrive``, FlashAttention-3's ping-pong): a warpgroup's wait
    sees its own products only (the other is in its softmax meanwhile) and
    issues alone on its schedulers; the block's iteration is the longest of
    one warpgroup's chain, both warpgroups' tensor time one after another,
    and both warpgroups' issue through the shared schedulers: not their
    sum. The same loop on a block barrier (lockstep) adds them."""
    pt = SM90.point("pess")
    warps = 8

    def body(turn, signal):
        return (
            ["DEPBAR.LE SB0, 0x0", turn, "WARPGROUP.ARRIVE"]
            + S_GROUP
            + PV_GROUP
            + signal
            + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]
            + ["FFMA R8, R8, R9, R10"] * 260
            + [COPY, COPY, "LDGDEPBAR"]
        )

    pp = hot_of(listing(body("BAR.SYNC.DEFER_BLOCKING R4, 0x100", ["BAR.ARV R5, 0x100"])))
    r = pp.regions[0]
    assert (r.named_syncs, r.arrives, r.named_threads, r.bars) == (1, 1, 256, 1) and pp.pingpong(warps) == 2
    ls = hot_of(listing(body("BAR.SYNC.DEFER_BLOCKING 0x0", [])))
    assert ls.pingpong(warps) == 0 and ls.regions[0].named_syncs == 0 and ls.regions[0].bars == 1
    assert not pp.pingpong(4)  # one warpgroup takes no turns
    kw = dict(threads=256, grid=SM90.sms, tokens=1024, bpt=8 * 2 * 512 / 16, registers=200)
    bar = pt.bar_clk / pt.clock_hz
    t_block = group_time(S_GROUP, pt, warps) + group_time(PV_GROUP, pt, warps)  # both warpgroups' products
    t_own = group_time(S_GROUP, pt, 4) + group_time(PV_GROUP, pt, 4)  # one warpgroup's
    seg = [s[0] + s[1] for s in r.segments]
    pre = r.segments[0][0]
    n = sum(seg)
    # lockstep: 2 warps per scheduler issue together, each wait sees the whole block's products
    t2 = max(1 / pt.warp_ipc, 2 / pt.sched_ipc) / pt.clock_hz
    lockstep = pre * t2 + max(r.segments[0][1] * t2, t_block) + seg[1] * t2 + bar
    assert launch(ls, **kw).iteration["total"] == pytest.approx(lockstep, rel=1e-9)
    # ping-pong: one warpgroup's chain, or the block's tensor time, or the block's issue
    t1 = max(1 / pt.warp_ipc, 1 / pt.sched_ipc) / pt.clock_hz
    chain = pre * t1 + max(r.segments[0][1] * t1, t_own) + seg[1] * t1 + bar
    issue = n * 2 / pt.sched_ipc / pt.clock_hz
    want = max(chain, t_block, issue)
    it = launch(pp, **kw).iteration
    assert it["pingpong"] == 2 and it["total"] == pytest.approx(want, rel=1e-9)
    assert it["ping-pong wait"] == pytest.approx(want - chain, abs=1e-15)
    assert it["total"] < 0.8 * lockstep  # the overlap is real at these numbers


def test_a_block_barrier_in_a_pingpong_loop_starts_the_warpgroups_together():
    """Ping-pong with a block barrier in the loop too (a ring's per-tile
    ``__syncthreads``): every iteration the warpgroups restart together, so
    the one whose turn comes last waits for the other's products before its
    own; the overlap left is what the turns buy after that."""
    pt = SM90.point("pess")
    warps = 8
    body = (
        ["DEPBAR.LE SB0, 0x0", "BAR.SYNC.DEFER_BLOCKING 0x0", "BAR.SYNC.DEFER_BLOCKING R4, 0x100", "WARPGROUP.ARRIVE"]
        + S_GROUP
        + PV_GROUP
        + ["BAR.ARV R5, 0x100", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
        + ["FFMA R8, R8, R9, R10"] * 260
        + [COPY, COPY, "LDGDEPBAR"]
    )
    hot = hot_of(listing(body))
    r = hot.regions[0]
    assert hot.pingpong(warps) == 2 and (r.bars, r.named_syncs) == (2, 1)
    kw = dict(threads=256, grid=SM90.sms, tokens=1024, bpt=8 * 2 * 512 / 16, registers=200)
    it = launch(hot, **kw).iteration
    flop = 8 * 2 * 64 * 64 * 16 / 4 + 4 * 2 * 64 * 256 * 16 / 4  # one warp's share of S and P V
    other = 4 * flop / (pt.wgmma_flops / pt.sms)  # the other warpgroup's products
    assert it["turn wait"] == pytest.approx(other, rel=1e-9)
    t1 = max(1 / pt.warp_ipc, 1 / pt.sched_ipc) / pt.clock_hz
    pre, post = r.segments[0][:2]
    rest = r.segments[1][0] + r.segments[1][1]
    own = group_time(S_GROUP, pt, 4) + group_time(PV_GROUP, pt, 4)
    chain = pre * t1 + max(post * t1, own) + rest * t1 + 2 * pt.bar_clk / pt.clock_hz + other
    t_block = group_time(S_GROUP, pt, warps) + group_time(PV_GROUP, pt, warps)
    want = max(chain, t_block, (pre + post + rest) * 2 / pt.sched_ipc / pt.clock_hz)
    assert it["total"] == pytest.approx(want, rel=1e-9) and chain > t_block


def test_a_cold_branch_is_a_region_of_its_own_that_the_probe_rates():
    """Defect 8, its pessimistic side: a branch that runs only on rare inputs
    (ptx::cold_path at its top: PMTRIG) and the blocks it dominates (here a
    block barrier and 20 instructions) form a region of their own, rated by
    the counters' cold-path marks (0 when the probe never took it), not
    counted once per iteration; the join after it stays in the loop's own."""

    def text(n_cold):
        rows = (
            [
                "S2R R0, SR_TID.X",
                None,
                "LDG.E.128 R4, desc[UR4][R2.64]",
                "FFMA R8, R4, R5, R8",
                "ISETP.NE.AND P3, PT, R7, RZ, PT",
                "@!P3 BRA `(.L_x_5)",
                "PMTRIG 0x80",
                "BAR.SYNC.DEFER_BLOCKING 0x0",
            ]
            + ["IADD3 R6, R6, 0x1, RZ"] * n_cold
            + [
                "BRA `(.L_x_5)",
                None,
                "FADD R8, R8, R9",
                "ISETP.NE.AND P2, PT, R0, R1, PT",
                "@P2 BRA `(.L_x_0)",
                "EXIT",
                None,
                "BRA `(.L_x_1)",
            ]
        )
        labels = iter([".L_x_0:", ".L_x_5:", ".L_x_1:"])
        out, off = [".text.k:"], 0
        for r in rows:
            if r is None:
                out.append(next(labels))
                continue
            out.append(f"        /*{off:04x}*/                   {r} ;")
            off += 0x10
        return "\n".join(out)

    hot = hot_of(text(20))
    own, cold = hot.regions
    assert cold.pmtrig == 1 and cold.bars == 1 and cold.instructions == 1 + 1 + 20 + 1 and cold.parent == 0
    assert own.bars == 0 and own.pmtrig == 0 and own.classes.get("fp32") == 2  # FFMA, and the join's FADD
    never = model.solve_rates(hot, 512.0, None, None, cold_per_token=0.0)
    assert never.y[1] == 0 and never.iter_instr == own.instructions
    often = model.solve_rates(hot, 512.0, None, None, cold_per_token=0.25)  # a warp's every 4th token
    assert often.y[1] == pytest.approx(0.25) and often.y[0] == pytest.approx(1.0)


def test_an_edge_tile_branch_is_charged_per_block_from_the_probes_intercept():
    """The masked softmax of the tiles some row sees only part of (ptx::edge_tile at its top: PMTRIG 0x40)
    is a region of its own, apart from the cold paths (PMTRIG 0x80): its per-token rate comes from the
    counters' edge marks per token (0 on a causal probe: the diagonal's tiles are a number per block), and
    model_launch charges the counters' per-block intercept of those marks, per consumer warp, as that many
    runs of the region on top of the loop's iterations (chain and issue)."""
    out, emit = function_k()
    out.append(".L_x_0:")
    for line in ("LDG.E.128 R4, desc[UR4][R2.64]", "FFMA R8, R4, R5, R8", "ISETP.NE.AND P3, PT, R7, RZ, PT"):
        emit(line)
    emit("@!P3 BRA `(.L_x_5)")
    emit("PMTRIG 0x40")
    for _ in range(30):
        emit("FSEL R6, R6, -INF , P0")
    emit("BRA `(.L_x_5)")
    out.append(".L_x_5:")
    for line in ("FADD R8, R8, R9", "ISETP.NE.AND P2, PT, R0, R1, PT", "@P2 BRA `(.L_x_0)", "EXIT"):
        emit(line)
    out.append(".L_x_1:")
    emit("BRA `(.L_x_1)")
    hot = hot_of("\n".join(out))
    own, edge = hot.regions
    assert (edge.edges, edge.pmtrig, edge.instructions, edge.parent) == (1, 0, 1 + 30 + 1, 0)
    assert own.edges == 0 and own.pmtrig == 0
    # a cold-path rate says nothing of the edge branch: counted once per iteration unless its own marks rate it
    assert model.solve_rates(hot, 512.0, None, None, cold_per_token=0.0).y[1] == pytest.approx(1.0)
    never = model.solve_rates(hot, 512.0, None, None, cold_per_token=0.0, edge_per_token=0.0)
    assert never.y[1] == 0 and never.iter_instr == own.instructions

    warps, tokens = 4, 4096
    facts = model.KernelFacts("k", "k", "sm_90", True, registers=64, hot=hot)

    def chain(per_block_marks):
        from cupaged.tools.counters import Probe

        marks = {"cold_path": 0.0, "edge_tile": per_block_marks * warps}
        probe = Probe("k", {}, 1, 1, (256, 512), marks, {"cold_path": 0.0, "edge_tile": 0.0})
        lm = model.model_launch(
            SM90,
            facts,
            kernels.KernelDesc(),
            grid=(1, 1, 1),
            threads=32 * warps,
            dynamic_smem=0,
            blocks=[model.Block([(("s", 0), tokens)], tokens, 1, 0, 0)],
            kv_bytes_per_token=512.0 * warps,
            probe=probe,
            fits_l2=False,
        )
        return lm.bounds_s["chain"], lm.bounds_s["issue"], lm.iteration["per_instruction"]

    c0, i0, per = chain(0.0)
    c2, i2, _ = chain(2.0)  # two edge tiles a block
    assert c2 - c0 == pytest.approx(2 * edge.instructions * per, rel=1e-6)
    assert i2 > i0


def test_a_dependent_load_waits_only_for_what_the_issue_before_its_use_leaves():
    """Defect 3, refined: a word loaded inside an iteration stalls the warp
    by its latency less the issue of the instructions between the load and
    its first use (in-order issue runs them meanwhile): used at once, the
    whole latency; used after enough independent work, nothing."""

    def body(gap):
        return (
            ["LDG.E R7, desc[UR4][R16.64]"]
            + ["FFMA R8, R8, R9, R10"] * gap
            + ["IMAD.WIDE R12, R7, 0x100, R14", "LDGSTS.E.BYPASS.128 [R20], desc[UR4][R12.64]", "LDGDEPBAR"]
        )

    pt = SM90.point("pess")
    t_own = max(1 / pt.warp_ipc, 4 / pt.sched_ipc) / pt.clock_hz  # 16 warps: 4 a scheduler
    waits = {}
    for gap in (0, 40, 4000):
        own = hot_of(listing(body(gap))).regions[0]
        assert own.dep_levels == 1 and own.dep_gaps == [gap]
        waits[gap] = model.dependent_wait(own, pt.dep_load_s, t_own)
        lm = launch(hot_of(listing(body(gap))), threads=512, grid=2 * SM90.sms, tokens=64, bpt=16 * 512)
        assert lm.iteration["dependent loads"] == pytest.approx(waits[gap])
    assert waits[0] == pytest.approx(pt.dep_load_s)
    assert waits[40] == pytest.approx(pt.dep_load_s - 40 * t_own) and 0 < waits[40] < pt.dep_load_s
    assert waits[4000] == 0


def test_a_word_loaded_beside_the_tiles_used_in_place_shares_their_round_trip():
    """Defect 3, refined again: a loop whose 16-byte loads are used where
    issued waits their latency once an iteration (its memory wait); a word
    loaded beside them (the split merge's LSEs next to its partial chunks)
    arrives in that same wait and adds nothing, while one used before the
    tiles' loads issue (what ptxas made of the merge with its LSE loads
    first) is a round trip of its own; in a cp.async ring the word's wait
    is always its own."""
    pt = SM90.point("pess")
    word = "LDG.E R7, desc[UR4][R16.64]"
    tiles = ["LDG.E.128 R20, desc[UR4][R12.64]", "LDG.E.128 R24, desc[UR4][R14.64]"]
    use = ["FMUL R8, R7, R9", "FFMA R10, R20, R8, R10", "FFMA R11, R24, R8, R11"]
    beside = hot_of(listing([word] + tiles + use)).regions[0]
    before = hot_of(listing([word, "FMUL R8, R7, R9"] + tiles + use[1:])).regions[0]
    ring = hot_of(listing([word] + tiles + use + [COPY, "LDGDEPBAR", "DEPBAR.LE SB0, 0x1"])).regions[0]
    assert beside.dep_levels == before.dep_levels == ring.dep_levels == 1
    assert beside.dep_gaps == [sass.SHARED] and model.dependent_wait(beside, pt.dep_load_s, 1e-9) == 0
    assert before.dep_gaps == [0] and model.dependent_wait(before, pt.dep_load_s, 1e-9) == pytest.approx(pt.dep_load_s)
    assert ring.dep_gaps == [2] and model.dependent_wait(ring, pt.dep_load_s, 1e-9) > 0
    for text, wait in ((listing([word] + tiles + use), 0.0), (listing([word, "FMUL R8, R7, R9"] + tiles + use[1:]), 1)):
        lm = launch(hot_of(text), threads=256, grid=SM90.sms, tokens=64, bpt=16 * 256)
        assert (lm.iteration["dependent loads"] > 0) == bool(wait)


def specialized(consumer, producer):
    """An nvdisasm-style function ``k`` of a warp-specialized block: warpgroup 0 branches to a producer loop
    of ``producer`` lines, the others run a consumer loop of ``consumer`` lines (each loop's back edge at its
    end, both to one EXIT)."""
    out, emit = function_k()
    emit("ISETP.GE.U32.AND P0, PT, R0, 0x80, PT")
    emit("@!P0 BRA `(.L_x_5)")
    out.append(".L_x_0:")
    for line in consumer:
        emit(line)
    emit("ISETP.NE.AND P2, PT, R0, R1, PT")
    emit("@P2 BRA `(.L_x_0)")
    emit("BRA `(.L_x_7)")
    out.append(".L_x_5:")
    for line in producer:
        emit(line)
    emit("ISETP.NE.AND P3, PT, R0, R2, PT")
    emit("@P3 BRA `(.L_x_5)")
    out.append(".L_x_7:")
    emit("EXIT")
    out.append(".L_x_1:")
    emit("BRA `(.L_x_1)")
    return "\n".join(out)


def test_a_producer_warpgroup_beside_its_consumers_is_its_own_loop():
    """FlashAttention-3's warp specialization: a producer warpgroup copies the tiles and signals them
    (``bar.arrive`` on block-wide named barriers), two consumer warpgroups wait for them and compute, taking
    turns (256-thread barriers). The consumers' tensor loop is the hot loop and the copy loop its producer;
    the consumers are the warps of their own barriers (8 of 12) and take turns as two warpgroups; the
    iteration is the longer of the consumers' chain and the producer's for the same tokens, the issue bound
    counts both, the bytes in flight are the producer's."""
    pt = SM90.point("pess")
    consumer = (
        ["BAR.SYNC.DEFER_BLOCKING R6, 0x180", "BAR.SYNC.DEFER_BLOCKING R4, 0x100", "WARPGROUP.ARRIVE"]
        + S_GROUP
        + PV_GROUP
        + ["BAR.ARV R5, 0x100", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "BAR.ARV R7, 0x180"]
        + ["FFMA R8, R8, R9, R10"] * 200
    )

    def producer(extra):
        return (
            ["BAR.SYNC.DEFER_BLOCKING R6, 0x180"]
            + [COPY] * 16
            + ["LDGDEPBAR", "DEPBAR.LE SB0, 0x2"]
            + ["IMAD R8, R8, R9, R10"] * extra
            + ["BAR.ARV R7, 0x180"]
        )

    kw = dict(threads=384, grid=SM90.sms, tokens=1024, bpt=8 * 2 * 256, registers=168)
    light, heavy = hot_of(specialized(consumer, producer(20))), hot_of(specialized(consumer, producer(3000)))
    for hot in (light, heavy):
        assert hot.producer is not None and hot.regions[0].hmma == 12 and hot.regions[0].ldgsts == 0
        assert hot.producer.regions[0].ldgsts == 16 and hot.producer.cover == 2
        assert hot.consumer_warps(12) == 8 and hot.pingpong(8) == 2
    lo, hi = launch(light, **kw), launch(heavy, **kw)
    # one consumer iteration per tile: the 16 copies of 512 bytes per producer warp are the tile's bytes
    assert lo.iteration["iteration"] == pytest.approx(lo.iteration["total"], rel=1e-9)  # the consumers bind
    assert lo.iteration["producer"] < lo.iteration["total"]
    t1 = max(1 / pt.warp_ipc, 1 / pt.sched_ipc) / pt.clock_hz
    p_issue = len(producer(3000)) * t1
    assert hi.iteration["iteration"] == pytest.approx(hi.iteration["producer"], rel=1e-9)
    assert hi.iteration["producer"] >= p_issue  # the producer's own chain binds
    assert hi.bounds_s["issue"] > lo.bounds_s["issue"] * 3  # the producer's instructions are issued
    assert lo.in_flight_per_sm == pytest.approx(16 * 512 * 4 * 2, rel=1e-9)  # its copies, two tiles in flight


def test_a_ring_that_issues_before_its_wait_has_one_more_tile_in_flight_during_it():
    """A cp.async ring whose loop issues the next tile's copies, then waits with ``DEPBAR.LE SB0, N`` for the
    tile N back and does its work: N + 1 tiles are in flight while it stalls, and the next copies issue only
    after the work, so an iteration takes the longer of its work and (latency + work) / (N + 1); N = 0 is a
    load used where it is issued (latency + work). A loop that waits first and issues after covers N + 1
    whole iterations: latency / (N + 1). (The model charged latency / N for the first: a latency-bound
    producer warpgroup at twice its time.)"""
    pt = SM90.point("pess")
    lat = pt.latency_s

    def ring(n, before, work=400):
        copies = [COPY] * 8 + ["LDGDEPBAR"]
        wait = [f"DEPBAR.LE SB0, {hex(n)}"]
        return hot_of(listing((copies + wait if before else wait + copies) + ["FFMA R8, R8, R9, R10"] * work))

    kw = dict(threads=128, grid=SM90.sms, tokens=4096, bpt=2 * 256)
    for n in (0, 1, 2):
        hot = ring(n, True)
        assert (hot.regions[0].ring_wait, hot.regions[0].commit_after_wait) == (n, False)
        assert hot.latency_time(lat, 1e-7) == pytest.approx(max(1e-7, (lat + 1e-7) / (n + 1)))
        one = launch(hot, **kw)
        w = one.iteration["total"]
        assert one.iteration["iteration"] == pytest.approx(max(w, (lat + w) / (n + 1)), rel=1e-9)
    after = ring(1, False)
    assert after.regions[0].commit_after_wait and after.latency_time(lat, 1e-7) == pytest.approx(max(1e-7, lat / 2))


def test_a_pack_of_kv_heads_is_one_block_reading_their_runs():
    """A block serving a pack of KV heads (paged_decode_tc) is modeled as one
    block: the pack's tokens, rows and data keys, none lost or counted twice;
    its contiguous run in an NHD cache is a token's rows of the pack's heads
    (1 KiB for four 256-byte rows), which the DRAM efficiency rates."""
    from cupaged.ops.attention.schedule import Launch
    from cupaged.plan import HostPlan
    from cupaged.tools import perf_model

    host = HostPlan.build(np.arange(16, dtype=np.int32).reshape(2, 8), [40, 100], [1, 1], 16, 16)

    def blocks(pack):
        launch = Launch("attention/decode_tc", "paged_decode_tc", {}, 64 * pack, 0, 2, 1, 0, 2, pack=pack)
        kw = dict(hkv=8, hq=32, d=128, dv=128, rot=0, itemsize=2, splits=1, causal=True, x_reversed=False)
        return model.attention_blocks(launch, host, **kw)

    one, four = blocks(1), blocks(4)
    assert (len(one), len(four)) == (16, 4)
    assert sum(b.tokens for b in four) == sum(b.tokens for b in one) == 8 * (40 + 100)
    assert sorted(k for b in four for k in b.keys) == sorted(k for b in one for k in b.keys)
    assert [b.rows for b in four] == [4 * 4] * 4 and four[0].out_bytes == 4 * one[0].out_bytes
    shape = next(s for s in perf_model.SHAPES if s.name == "gqa_g4")
    assert perf_model._run_bytes(shape, 2) == 256 and perf_model._run_bytes(shape, 2, 4) == 1024
    pt = SM90.point("pess")
    assert pt.dram_eff(1024) == pt.dram_eff_long > pt.dram_eff(512) > pt.dram_eff(256) == pt.dram_eff_256


def test_a_copy_loop_on_the_way_to_the_tile_loop_is_waited_for_on_every_path():
    """The startup chain joins the paths into the tile loop by their latest
    state: a prologue loop of copies (a query staged in shared memory) that
    a guard may skip still leaves its cp.async group to the wait after it,
    so the page word loaded after that wait is one round trip later, and
    the tile after it another. (The join kept only one path's groups: the
    skip's, none, and the query's wait cost nothing.)"""
    out, emit = function_k()
    emit("LDG.E R2, desc[UR4][R2.64]")  # the sequence word: there at level 1
    emit("ISETP.GE.U32.AND P0, PT, R2, R3, PT")
    emit("@P0 BRA `(.L_x_3)")
    out.append(".L_x_2:")  # the query's copies, issued at level 1: landed at level 2
    emit("LDGSTS.E.BYPASS.128 [R20], desc[UR4][R4.64]")
    emit("IADD3 R4, R4, 0x10, RZ")
    emit("ISETP.NE.AND P1, PT, R4, R5, PT")
    emit("@P1 BRA `(.L_x_2)")
    out.append(".L_x_3:")
    emit("LDGDEPBAR")
    emit("DEPBAR.LE SB0, 0x0")  # the query has landed: level 2
    emit("LDG.E R6, desc[UR4][R8.64]")  # the page word, issued at 2: there at 3
    emit("IMAD.WIDE R12, R6, 0x100, R14")
    out.append(".L_x_0:")  # the tile loop: its copies issue at 3 and land at 4
    emit("LDGSTS.E.BYPASS.128 [R20], desc[UR4][R12.64]")
    emit("LDGDEPBAR")
    emit("DEPBAR.LE SB0, 0x0")
    for _ in range(8):
        emit("FFMA R8, R8, R9, R10")
    emit("IADD3 R12, R12, 0x100, RZ")
    emit("ISETP.NE.AND P2, PT, R0, R1, PT")
    emit("@P2 BRA `(.L_x_0)")
    emit("EXIT")
    out.append(".L_x_1:")
    emit("BRA `(.L_x_1)")
    assert hot_of("\n".join(out)).startup_levels == 4
