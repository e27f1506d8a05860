"""SASS of a cubin: disassembly (nvdisasm / cuobjdump from NVIDIA's pip
wheels), the control-flow graph, its loops, and instruction classes.

Used by ``cupaged.tools.perf_model`` to find a kernel's hot loop and count
what it issues per byte of K/V. The disassemblers are not a runtime
dependency: install the ``perf`` extra (``pip install
nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump``) or put a CUDA toolkit's
``bin`` folder on ``PATH``; ``find_tool`` says where it looked when neither
is found (``SassToolMissing``).

Control flow: basic blocks start at branch targets and after branches;
edges are fall-through and ``BRA`` targets (``EXIT``/``RET`` end a path;
the padding ``BRA`` to itself after the last ``EXIT`` is no loop; an
indirect ``BRX``/``JMX`` is reported). Loops are natural loops of back
edges (an edge to a block that dominates its source), nested by
containment. The hot loop (``hot_loop``) is, among the loops holding a
16-byte-per-lane global load or copy (``LDG.E.128``, ``LDGSTS.*.128``, a
bulk / TMA copy), the one with the most instructions of its own (nested
loops that load K/V themselves excluded): the loop that streams K/V. Its
regions (its own blocks and each nested loop) carry static counts by
instruction class; how often each runs per K/V token is solved by the
model from the CPU counters.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = ("nvdisasm", "cuobjdump")
#: What to install when the disassemblers are missing.
INSTALL_HINT = (
    "pip install nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump   (or: pip install -e '.[perf]'; "
    "or put a CUDA toolkit's bin folder on PATH; or set CUPAGED_NVDISASM)"
)


class SassToolMissing(RuntimeError):
    """Neither nvdisasm nor cuobjdump could be found."""


def _wheel_bins() -> list[Path]:
    """``site-packages/nvidia/<cu13|cuda_nvdisasm|cuda_cuobjdump>/bin`` folders."""
    roots: list[Path] = []
    try:
        import nvidia  # namespace package of NVIDIA's wheels

        roots += [Path(p) for p in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    for entry in sys.path:
        if entry and (Path(entry) / "nvidia").is_dir():
            roots.append(Path(entry) / "nvidia")
    out, seen = [], set()
    for r in roots:
        for sub in ("cu13", "cu12", "cuda_nvdisasm", "cuda_cuobjdump"):
            b = r / sub / "bin"
            if b.is_dir() and str(b) not in seen:
                seen.add(str(b))
                out.append(b)
    return out


@functools.lru_cache(maxsize=None)
def find_tool(name: str) -> str | None:
    """Path of ``nvdisasm`` or ``cuobjdump``: ``$CUPAGED_NVDISASM`` /
    ``$CUPAGED_CUOBJDUMP``, NVIDIA's pip wheels, ``PATH``,
    ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``; None when absent."""
    env = os.environ.get(f"CUPAGED_{name.upper()}")
    if env and os.access(env, os.X_OK):
        return env
    for b in _wheel_bins():
        if os.access(b / name, os.X_OK):
            return str(b / name)
    found = shutil.which(name)
    if found:
        return found
    for base in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.access(Path(base) / "bin" / name, os.X_OK):
            return str(Path(base) / "bin" / name)
    return None


def available() -> bool:
    return find_tool("nvdisasm") is not None or find_tool("cuobjdump") is not None


def missing_message() -> str:
    return (
        "SASS figures need nvdisasm or cuobjdump, and neither was found (looked at $CUPAGED_NVDISASM, "
        "NVIDIA's pip wheels under site-packages/nvidia/*/bin, PATH, $CUDA_PATH/bin, /usr/local/cuda/bin). "
        "Install: " + INSTALL_HINT
    )


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin (nvdisasm, else cuobjdump -sass). Raises
    SassToolMissing when neither tool is found, RuntimeError when it fails."""
    nvd, cuo = find_tool("nvdisasm"), find_tool("cuobjdump")
    if nvd is None and cuo is None:
        raise SassToolMissing(missing_message())
    with tempfile.TemporaryDirectory(prefix="cupaged-sass-") as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        if nvd:
            cmd = [nvd, "-c", str(path)]
        else:
            assert cuo is not None  # one of the two was found (checked above)
            cmd = [cuo, "-sass", str(path)]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"{' '.join(cmd[:2])} failed (exit {r.returncode}): {r.stderr.strip()[:500]}")
    return r.stdout


def tool_version() -> str:
    """``nvdisasm`` (or ``cuobjdump``) version line, for reports."""
    for name in TOOLS:
        p = find_tool(name)
        if p:
            try:
                out = subprocess.run([p, "--version"], capture_output=True, text=True).stdout
            except OSError:
                continue
            lines = [ln for ln in out.splitlines() if ln.strip()]
            return f"{name} {lines[-1].strip() if lines else '?'}"
    return "none"


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


@dataclass
class Instr:
    offset: int
    opcode: str  # with modifiers: "LDG.E.128.CONSTANT"
    operands: str
    pred: str = ""  # "@P0", "@!P2" or ""
    target: int | None = None  # branch target offset

    @property
    def base(self) -> str:
        """The opcode without modifiers: ``LDG``."""
        return self.opcode.split(".", 1)[0]


@dataclass
class Function:
    name: str
    instrs: list[Instr] = field(default_factory=list)

    def index_of(self, offset: int) -> int | None:
        lo, hi = 0, len(self.instrs)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.instrs[mid].offset < offset:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(self.instrs) and self.instrs[lo].offset == offset else None


_FUNC_NVD = re.compile(r"^\s*\.text\.([\w$.]+):\s*$")
_FUNC_CUO = re.compile(r"^\s*Function\s*:\s*([\w$.]+)\s*$")
_LABEL = re.compile(r"^\s*(\.L[\w$]+|[\w$.]+):\s*$")
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*?);")
_BRANCH_LABEL = re.compile(r"`\(([^)]+)\)")
_BRANCH_ADDR = re.compile(r"\b0x([0-9a-fA-F]+)\b")
_BRANCHES = ("BRA", "JMP", "CALL", "BRX", "JMX")


def parse(text: str) -> dict[str, Function]:
    """``{name: Function}`` from nvdisasm ``-c`` or ``cuobjdump -sass`` output."""
    funcs: dict[str, Function] = {}
    cur: Function | None = None
    labels: dict[str, int] = {}
    pending: list[tuple[Instr, str]] = []  # branches to labels, resolved per function
    pending_labels: list[str] = []

    def close():
        for ins, lab in pending:
            ins.target = labels.get(lab)
        pending.clear()
        labels.clear()
        pending_labels.clear()

    for line in text.splitlines():
        m = _FUNC_NVD.match(line) or _FUNC_CUO.match(line)
        if m:
            close()
            cur = funcs.setdefault(m.group(1), Function(m.group(1)))
            continue
        if cur is None:
            continue
        m = _LABEL.match(line)
        if m and not line.lstrip().startswith("/*"):
            pending_labels.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        offset, body = int(m.group(1), 16), m.group(2).strip()
        for lab in pending_labels:
            labels[lab] = offset
        pending_labels.clear()
        pred = ""
        if body.startswith("@"):
            pred, _, body = body.partition(" ")
            body = body.strip()
        opcode, _, operands = body.partition(" ")
        ins = Instr(offset, opcode, operands.strip(), pred)
        if ins.base in _BRANCHES:
            lm = _BRANCH_LABEL.search(operands)
            if lm and not lm.group(1).startswith("$") and ins.base in ("BRA", "JMP"):
                pending.append((ins, lm.group(1)))
            elif ins.base in ("BRA", "JMP"):
                am = _BRANCH_ADDR.search(operands)
                if am:
                    ins.target = int(am.group(1), 16)
        cur.instrs.append(ins)
    close()
    return funcs


# ---------------------------------------------------------------------------
# Control flow
# ---------------------------------------------------------------------------


@dataclass
class Block:
    start: int  # index of the first instruction
    end: int  # one past the last
    succs: list[int] = field(default_factory=list)  # block numbers
    preds: list[int] = field(default_factory=list)


@dataclass
class Loop:
    header: int  # block number
    blocks: frozenset  # block numbers (the header included)
    tails: tuple  # blocks with a back edge to the header
    depth: int = 1  # 1 = outermost
    children: list = field(default_factory=list)

    def instructions(self, fn: Function, cfg: "Cfg") -> list[Instr]:
        return [fn.instrs[i] for b in sorted(self.blocks) for i in range(cfg.blocks[b].start, cfg.blocks[b].end)]


@dataclass
class Cfg:
    blocks: list[Block]
    indirect: bool = False  # an indirect branch (BRX/JMX) was seen: edges unknown
    div_edges: set = field(default_factory=set)  # (from, to): the taken edge of a BRA.DIV

    def warm(self) -> set:
        """Blocks a converged warp can run: reachable from the entry without
        taking a ``BRA.DIV`` (the branch to the slow path of a warp
        collective, taken only when the warp is diverged; cupaged's kernels
        call their collectives converged). The blocks only a ``BRA.DIV``
        leads to, and code reached only by ``CALL`` (no edge), are skipped
        paths: counted nowhere."""
        seen, stack = set(), [0] if self.blocks else []
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            stack += [s for s in self.blocks[k].succs if (k, s) not in self.div_edges]
        return seen

    def block_of(self, index: int) -> int:
        for n, b in enumerate(self.blocks):
            if b.start <= index < b.end:
                return n
        raise IndexError(index)


def _ends_path(ins: Instr) -> bool:
    return not ins.pred and ins.base in ("EXIT", "RET", "BRX", "JMX", "KILL")


def build_cfg(fn: Function) -> Cfg:
    """Basic blocks and edges of ``fn`` (CALLs return: they do not end a block)."""
    n = len(fn.instrs)
    if n == 0:
        return Cfg([])
    starts = {0}
    indirect = False
    for i, ins in enumerate(fn.instrs):
        if ins.base in ("BRX", "JMX"):
            indirect = True
        if ins.base in ("BRA", "JMP") or ins.base in ("EXIT", "RET", "BRX", "JMX", "KILL"):
            if i + 1 < n:
                starts.add(i + 1)
            if ins.target is not None:
                t = fn.index_of(ins.target)
                if t is not None:
                    starts.add(t)
    order = sorted(starts)
    blocks = [Block(s, (order[k + 1] if k + 1 < len(order) else n)) for k, s in enumerate(order)]
    first = {b.start: k for k, b in enumerate(blocks)}
    div_edges: set = set()
    for k, b in enumerate(blocks):
        last = fn.instrs[b.end - 1]
        succ: list[int] = []
        div = None
        if last.base in ("BRA", "JMP") and last.target is not None:
            t = fn.index_of(last.target)
            if t is not None:
                succ.append(first[t])
                if ".DIV" in last.opcode:
                    div = first[t]
            # Conditional: may fall through. BRA.DIV (taken only when the warp
            # is diverged, to the slow path of a warp collective) is too,
            # though it carries no predicate.
            if (last.pred or ".DIV" in last.opcode) and b.end < n:
                succ.append(first[b.end])
        elif not _ends_path(last) and b.end < n:
            succ.append(first[b.end])
        # A branch to itself at the very end (``BRA`` to its own offset) is
        # the padding loop after the last EXIT: no edge, it never runs.
        if last.base == "BRA" and last.target == last.offset and not last.pred:
            succ = []
        for s in dict.fromkeys(succ):
            b.succs.append(s)
            blocks[s].preds.append(k)
            if s == div and not (b.end < n and s == first[b.end]):
                div_edges.add((k, s))
    return Cfg(blocks, indirect, div_edges)


def dominators(cfg: Cfg) -> list[set]:
    """Dominator sets (iterative; block 0 is the entry). Unreachable blocks
    are dominated by everything (they are never a back-edge target)."""
    n = len(cfg.blocks)
    allb = set(range(n))
    dom = [set(allb) for _ in range(n)]
    if n:
        dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for k in range(1, n):
            preds = cfg.blocks[k].preds
            new = set.intersection(*(dom[p] for p in preds)) if preds else set(allb)
            new = new | {k}
            if new != dom[k]:
                dom[k] = new
                changed = True
    return dom


def find_loops(cfg: Cfg) -> list[Loop]:
    """Natural loops (one per header: back edges to one header merge),
    nested: ``depth`` 1 for outermost; ``children`` the loops directly
    inside."""
    dom = dominators(cfg)
    by_header: dict[int, tuple[set, list]] = {}
    for k, b in enumerate(cfg.blocks):
        for s in b.succs:
            if s in dom[k]:  # back edge k -> s
                body, stack = {s, k}, [k]
                while stack:
                    x = stack.pop()
                    if x == s:
                        continue
                    for p in cfg.blocks[x].preds:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                blocks, tails = by_header.setdefault(s, (set(), []))
                blocks |= body
                tails.append(k)
    loops = [Loop(h, frozenset(bs), tuple(ts)) for h, (bs, ts) in sorted(by_header.items())]
    for lp in loops:
        parents = [o for o in loops if o is not lp and lp.blocks < o.blocks]
        lp.depth = 1 + len(parents)
        if parents:
            min(parents, key=lambda o: len(o.blocks)).children.append(lp)
    return loops


# ---------------------------------------------------------------------------
# Instruction classes
# ---------------------------------------------------------------------------

#: Instruction class of each SASS base opcode (what ``classify`` returns);
#: anything else is "other". The pipes these map to are in archs.PIPES.
CLASSES: dict[str, tuple[str, ...]] = {
    "tensor": ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "DMMA", "BMMA", "UTCHMMA", "UTCQMMA"),
    "fp32": ("FFMA", "FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I", "HFMA2", "HADD2", "HMUL2", "FSWZADD"),
    "mufu": ("MUFU",),
    "shfl": ("SHFL",),
    "ldg": ("LDG", "LD"),
    "ldgsts": ("LDGSTS", "UBLKCP", "UTMALDG", "UTMAPF"),
    "lds": ("LDS",),
    "ldsm": ("LDSM",),
    "sts": ("STS",),
    "stg": ("STG", "ST", "RED", "ATOM", "ATOMG", "REDG"),
    "local": ("LDL", "STL"),
    "atoms": ("ATOMS",),
    "imad": ("IMAD", "IMUL", "IMAD32I", "IMUL32I"),
    "alu": (
        "IADD3",
        "IADD",
        "IADD32I",
        "VIADD",
        "VIADDMNMX",
        "LOP3",
        "LOP",
        "LOP32I",
        "SHF",
        "SHL",
        "SHR",
        "LEA",
        "ISETP",
        "FSETP",
        "HSETP2",
        "DSETP",
        "FMNMX",
        "IMNMX",
        "VIMNMX",
        "VIMNMX3",
        "FMNMX3",
        "SEL",
        "FSEL",
        "PRMT",
        "IABS",
        "BFE",
        "BFI",
        "BMSK",
        "FLO",
        "POPC",
        "BREV",
        "PLOP3",
        "PSETP",
        "P2R",
        "R2P",
        "CS2R",
        "MOV",
        "MOV32I",
        "FCHK",
        "LEPC",
        "ISCADD",
        "XMAD",
        "SGXT",
        "IDP",
        "IDP4A",
        "HMNMX2",
        "VHMNMX",
        "FSET",
        "ISET",
    ),
    # conversions: 16 results per clock per SM on 8.x / 9.0 (the programming guide's throughput table), F2FP
    # (the packing f32 -> bf16x2 / f16x2 and, on sm_89+, the fp8 <-> f16 conversions) among them
    "conv": ("F2F", "F2I", "I2F", "I2I", "FRND", "I2FP", "F2IP", "F2FP"),
    "ldc": ("LDC", "ULDC"),
    "sync": (
        "BAR",
        "BSSY",
        "BSYNC",
        "WARPSYNC",
        "DEPBAR",
        "MEMBAR",
        "ERRBAR",
        "CCTL",
        "SYNCS",
        "ARRIVES",
        "BMOV",
        "NANOSLEEP",
        "VOTE",
        "VOTEU",
        "MATCH",
        "REDUX",
        "ELECT",
        "WARPGROUP",
    ),
    "ctrl": (
        "BRA",
        "JMP",
        "BRX",
        "JMX",
        "CALL",
        "RET",
        "EXIT",
        "BREAK",
        "BPT",
        "KILL",
        "YIELD",
        "NOP",
        "S2R",
        "S2UR",
        "CS2UR",
        "R2UR",
        "ACQBULK",
        "PREEXIT",
    ),
}
_CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}


def classify(ins: Instr) -> str:
    """The class of an instruction: a key of CLASSES, "uniform" for the
    uniform datapath (``U*`` opcodes not listed), else "other"."""
    c = _CLASS_OF.get(ins.base)
    if c is not None:
        return c
    if ins.base.startswith("U"):
        return "uniform"
    return "other"


_WIDTH = re.compile(r"\.(8|16|32|64|128|256|U8|S8|U16|S16)\b")


def access_bytes(ins: Instr) -> int:
    """Bytes one lane moves with a load/store/copy (LDG.E.128 -> 16,
    LDGSTS.E.BYPASS.LTC128B.128 -> 16, LDS.U.64 -> 8, LDSM.16.M88.4 -> 16
    (four 8x8 tiles: 512 bytes a warp), plain -> 4)."""
    op = ins.opcode
    if ins.base == "LDSM":
        tiles = 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
        return 4 * tiles
    sizes = []
    for m in _WIDTH.finditer(op):
        w = m.group(1)
        sizes.append({"U8": 8, "S8": 8, "U16": 16, "S16": 16}.get(w) or int(w))
    return max(sizes) // 8 if sizes else 4


def is_wide_global_load(ins: Instr) -> bool:
    """A 16-byte-per-lane global load or global->shared copy (or wider / a
    bulk copy): how the kernels stream K/V."""
    if ins.base in ("UBLKCP", "UTMALDG"):
        return True
    return ins.base in ("LDG", "LDGSTS", "LD") and access_bytes(ins) >= 16


@dataclass
class Region:
    """Static counts of part of a loop: the loop's own blocks, without the
    loops nested in it (those are regions of their own), skipped paths
    (``Cfg.warm``) left out.

    ``segments`` splits the region, in program order, at each wait for the
    warpgroup's asynchronous tensor work (``WARPGROUP.DEPBAR``): what the
    warp issues, and the tensor and shared-memory work of its HGMMA / HMMA,
    between two waits, per warp. A segment costs the issue up to its first
    HGMMA plus the longer of the issue after it and the tensor (and operand
    read) time it waits for: what a wait serializes adds up;
    ``bars`` block barriers (``BAR.SYNC`` / ``BAR.RED``) add their own
    cost; ``waits`` / ``groups``: per segment, the depth N of its wait
    (``WARPGROUP.DEPBAR.LE gsb0, N``: the newest N commit groups stay in
    flight past it) and its HGMMA commit groups (split after each HGMMA
    that carries ``gsb0``): [wgmma FLOP, operand bytes] per group, per warp;
    ``named_syncs`` / ``arrives``: named barriers that wait (``BAR.SYNC``
    with an id other than 0) / only arrive (``BAR.ARV``), and
    ``named_threads`` the largest constant thread count they name (0: none
    or in a register); ``dep_levels``: dependent global-load round trips the warp waits
    for inside one execution of the region (a word loaded and used in the
    same pass: the issue of everything after it waits; ``dataflow``)."""

    offset: int  # first instruction
    depth: int
    parent: int  # index of the enclosing region in HotLoop.regions (-1: the hot loop itself)
    instructions: int
    classes: dict
    wide_load_bytes: int  # per warp: 16-byte-per-lane global loads / copies x 32 lanes
    global_load_bytes: int  # per warp: every global load / copy
    smem_bytes: int  # per warp: LDS / STS (not LDSM)
    hmma: int  # HMMA and HGMMA (mma.sync, wgmma)
    ldsm: int
    ldgsts: int
    pmtrig: int = 0  # cold-path markers (ptx::cold_path: pmevent 7, PMTRIG 0x80)
    segments: list = field(default_factory=list)  # see ``segments``
    bars: int = 0  # block barriers that wait (BAR.SYNC, BAR.RED)
    waits: list = field(default_factory=list)  # per segment: N of its WARPGROUP.DEPBAR.LE gsb0, N (0: none)
    groups: list = field(default_factory=list)  # per segment: [[wgmma FLOP, operand bytes] per commit group]
    named_syncs: int = 0  # BAR.SYNC / BAR.RED on a named barrier (id not 0)
    arrives: int = 0  # BAR.ARV (arrive on a named barrier, no wait)
    named_threads: int = 0  # the largest constant thread count of a named barrier (0: none)
    named_counts: list = field(default_factory=list)  # the constant thread counts of its named barriers
    dep_levels: int = 0  # dependent scalar global-load round trips in one pass
    dep_gaps: list = field(default_factory=list)  # per such round trip: instructions between the load and its use
    ring_wait: int = -1  # N of the cp.async wait (DEPBAR.LE SB0, N) in the region, -1: none
    commit_after_wait: bool = False  # the region's cp.async commit (LDGDEPBAR) follows that wait
    skipped: int = 0  # instructions on skipped paths (BRA.DIV slow paths) left out
    edges: int = 0  # edge-tile markers (ptx::edge_tile: pmevent 6, PMTRIG 0x40)

    def count(self, what: str) -> int:
        return {
            "hmma": self.hmma,
            "ldsm": self.ldsm,
            "ldgsts": self.ldgsts,
            "pmtrig": self.pmtrig,
            "edges": self.edges,
        }[what]


@dataclass
class HotLoop:
    """The K/V loop of a kernel: its own region first, then the loops
    nested in it. Static: one count per instruction, predicated ones
    included, skipped paths (``Cfg.warm``) not; trip counts of nested loops
    are not in the SASS (see ``perf_model`` for how they are solved from
    the counters).

    Outside the loop: ``prologue`` / ``epilogue`` instructions a warp
    issues once per block before / after it (other loops there counted
    once), and ``startup_levels``: the dependent global-memory round trips
    before the first tile is in hand (``dataflow`` from the entry through
    the first pass of the loop: metadata word -> query load -> page word
    -> first tile ...)."""

    function: str
    first_offset: int
    last_offset: int
    regions: list
    other_loops: int  # other loops of the function with wide loads
    indirect: bool = False
    prologue: int = 0
    epilogue: int = 0
    startup_levels: int = 0
    # A warp-specialized kernel (FlashAttention-3's producer / consumer split): this loop is the consumers'
    # tensor loop, which loads nothing itself, and ``producer`` the loop of the warps that fill the ring
    # (its copies, their waits, its own instructions), run beside it by other warps of the block.
    producer: "HotLoop | None" = None

    @property
    def instructions(self) -> int:
        """Static instructions of the loop and everything nested (each once)."""
        return sum(r.instructions for r in self.regions)

    @property
    def nested(self) -> int:
        return len(self.regions) - 1

    @property
    def cover(self) -> int:
        """Hot-loop iterations between issuing a tile's copies and waiting
        for them: a cp.async ring waiting with ``DEPBAR.LE SB0, N`` covers N
        iterations, one more when the loop commits its next copies after
        that wait (a 3-stage ring that waits with N = 1 and then issues:
        2). 0: no cp.async ring (loads used in the iteration that issues
        them)."""
        r = self.regions[0]
        if r.ring_wait < 0:
            return 0
        return r.ring_wait + (1 if r.commit_after_wait else 0)

    def latency_time(self, latency: float, work: float) -> float:
        """The least time of one iteration whose own work takes ``work``
        seconds, when its copies take ``latency`` to land: N + 1 tiles are in
        flight while the wait (``DEPBAR.LE SB0, N``) stalls. A loop that
        commits its next copies after the wait covers N + 1 whole iterations
        with them: latency / (N + 1). One that commits them before the wait
        (issue, wait for the tile N back, then its work) issues the next ones
        only after that work: (latency + work) / (N + 1) (N = 0: the copies
        used where they are issued, latency + work). No ring: latency + work."""
        r = self.regions[0]
        if r.ring_wait < 0:
            return latency + work
        n = r.ring_wait + 1
        return max(work, (latency if r.commit_after_wait else latency + work) / n)

    def consumer_warps(self, warps: int) -> int:
        """The warps of a block of ``warps`` that run this loop: all of them, or for a warp-specialized
        kernel (``producer``) the largest constant thread count of the loop's named barriers below the
        block's (the computing warpgroups' own barriers: their turns; the block-wide ones are the
        producer's hand-offs) / 32, else the block less one warpgroup."""
        if self.producer is None:
            return warps
        below = [n for r in self.regions for n in r.named_counts if n < 32 * warps]
        return max(below) // 32 if below else max(1, warps - 4)

    def pingpong(self, warps: int) -> int:
        """Warpgroups of ``warps`` warps running the loop that take turns
        through named barriers in the hot loop (one waits with ``BAR.SYNC id,
        n`` while the other ``BAR.ARV``s it on, so the tensor phase of one
        overlaps the other's issue: FlashAttention-3's ping-pong): the
        barriers' thread count / 128 (at most ``warps`` / 4), else those
        warps' warpgroups; 0 when the loop has no such pair (or fewer than 2
        warpgroups take part)."""
        if not any(r.named_syncs for r in self.regions) or not any(r.arrives for r in self.regions):
            return 0
        n = max((c for r in self.regions for c in r.named_counts if c <= 32 * warps), default=0)
        g = min(n // 128, warps // 4) if n else warps // 4
        return g if g >= 2 else 0

    def totals(self) -> Region:
        cls: Counter = Counter()
        for r in self.regions:
            cls.update(r.classes)
        return Region(
            self.first_offset,
            self.regions[0].depth,
            -1,
            self.instructions,
            dict(cls),
            sum(r.wide_load_bytes for r in self.regions),
            sum(r.global_load_bytes for r in self.regions),
            sum(r.smem_bytes for r in self.regions),
            sum(r.hmma for r in self.regions),
            sum(r.ldsm for r in self.regions),
            sum(r.ldgsts for r in self.regions),
            sum(r.pmtrig for r in self.regions),
            bars=sum(r.bars for r in self.regions),
            skipped=sum(r.skipped for r in self.regions),
            edges=sum(r.edges for r in self.regions),
        )

    def as_dict(self) -> dict:
        return {
            "function": self.function,
            "first_offset": self.first_offset,
            "last_offset": self.last_offset,
            "other_loops": self.other_loops,
            "indirect": self.indirect,
            "prologue": self.prologue,
            "epilogue": self.epilogue,
            "startup_levels": self.startup_levels,
            "regions": [dict(r.__dict__) for r in self.regions],
            "producer": self.producer.as_dict() if self.producer else None,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "HotLoop":
        return cls(
            d["function"],
            d["first_offset"],
            d["last_offset"],
            [Region(**r) for r in d["regions"]],
            d["other_loops"],
            d["indirect"],
            d.get("prologue", 0),
            d.get("epilogue", 0),
            d.get("startup_levels", 0),
            cls.from_dict(d["producer"]) if d.get("producer") else None,
        )


# ---------------------------------------------------------------------------
# Tensor work and dependences of an instruction stream
# ---------------------------------------------------------------------------

_MMA_SHAPE = re.compile(r"^(?:HMMA|HGMMA)\.(\d+)x?(\d+)x(\d+)")
_HMMA_SHAPE = re.compile(r"^HMMA\.(16|8)(8)(\d+)")  # HMMA.16816: m16 n8 k16; HMMA.1688; HMMA.884


def mma_flop(ins: Instr) -> float:
    """FLOP of one warp's share of an HMMA (mma.sync: HMMA.16816 -> 2 x 16 x
    8 x 16) or HGMMA (a quarter of the warpgroup's 2 x 64 x N x K:
    HGMMA.64x32x16 -> 16384); 0 for anything else."""
    if ins.base == "HGMMA":
        m = _MMA_SHAPE.match(ins.opcode)
        if not m:
            return 0.0
        mm, nn, kk = (int(g) for g in m.groups())
        return 2.0 * mm * nn * kk / 4
    if ins.base == "HMMA":
        m = _HMMA_SHAPE.match(ins.opcode)
        if not m:
            return 2.0 * 16 * 8 * 16
        mm, nn, kk = (int(g) for g in m.groups())
        return 2.0 * mm * nn * kk
    return 0.0


def hgmma_smem_bytes(ins: Instr) -> float:
    """Shared-memory operand bytes one warp's share of an HGMMA reads, as
    the counters of ``kernels_cu/ptx.cuh`` count them: A (when it is a
    descriptor, not registers) 16 rows x K x 2 bytes per warp, B N x K x 2
    bytes per warpgroup (a quarter per warp); 16-bit operands."""
    if ins.base != "HGMMA":
        return 0.0
    m = _MMA_SHAPE.match(ins.opcode)
    if not m:
        return 0.0
    _, nn, kk = (int(g) for g in m.groups())
    ops = [o.strip() for o in ins.operands.split(",")]
    a_smem = len(ops) > 1 and ops[1].startswith("gdesc")
    return (16 * kk * 2 if a_smem else 0) + nn * kk * 2 / 4


def _is_gwait(ins: Instr) -> bool:
    return ins.base == "WARPGROUP" and "DEPBAR" in ins.opcode


def _is_bar_wait(ins: Instr) -> bool:
    return ins.base == "BAR" and (".SYNC" in ins.opcode or ".RED" in ins.opcode)


def _bar_operands(ins: Instr) -> list:
    """Operands of a BAR instruction (``BAR.RED.POPC`` / ``.OR`` / ``.AND``: the predicate first, left out)."""
    ops = [o.strip() for o in ins.operands.split(",") if o.strip()]
    return [o for o in ops if not re.fullmatch(r"!?U?P(T|\d+)", o)]


def is_named_barrier(ins: Instr) -> bool:
    """A BAR on a named barrier: an id in a register or an immediate other than 0 (``__syncthreads`` is
    ``BAR.SYNC.DEFER_BLOCKING 0x0``), or a thread count (a second operand)."""
    if ins.base != "BAR":
        return False
    ops = _bar_operands(ins)
    if not ops:
        return False
    if len(ops) > 1 or ".ARV" in ins.opcode:
        return True
    try:
        return int(ops[0], 0) != 0
    except ValueError:
        return True  # an id in a register


def named_barrier_threads(ins: Instr) -> int:
    """The constant thread count of a named barrier (``BAR.SYNC R4, 0x100``: 256), 0 when none or in a
    register."""
    ops = _bar_operands(ins) if ins.base == "BAR" else []
    if len(ops) < 2:
        return 0
    try:
        return int(ops[1], 0)
    except ValueError:
        return 0


def _gwait_depth(ins: Instr) -> int:
    """N of ``WARPGROUP.DEPBAR.LE gsb0, N``: the newest N wgmma commit groups it leaves in flight."""
    m = re.search(r"gsb0\s*,\s*(0x[0-9a-fA-F]+|\d+)", ins.operands)
    return int(m.group(1), 0) if m else 0


def _cp_wait(ins: Instr) -> int | None:
    """N of a cp.async wait ``DEPBAR.LE SB0, N``, else None."""
    if ins.base != "DEPBAR" or "SB0" not in ins.operands:
        return None
    m = re.search(r"SB0\s*,\s*(0x[0-9a-fA-F]+|\d+)", ins.operands)
    return int(m.group(1), 0) if m else 0


def segment_groups(ins: list) -> tuple:
    """(waits, groups) of an instruction list, one entry per ``segments``
    entry: the depth of the segment's closing wait (0: waits for all, or
    no wait) and its HGMMA commit groups [[wgmma FLOP, operand bytes]],
    a group ending at an HGMMA marked ``gsb0`` (the commit), per warp."""
    waits, groups = [], []
    cur: list = []
    open_group: list | None = None
    started = False
    for i in ins:
        started = True
        if i.base == "HGMMA":
            if open_group is None:
                open_group = [0.0, 0.0]
                cur.append(open_group)
            open_group[0] += mma_flop(i)
            open_group[1] += hgmma_smem_bytes(i)
            if "gsb0" in i.operands:
                open_group = None
        if _is_gwait(i):
            waits.append(_gwait_depth(i))
            groups.append(cur)
            cur, open_group, started = [], None, False
    if started:
        waits.append(0)
        groups.append(cur)
    return waits, groups


def segments(ins: list) -> list:
    """``Region.segments`` of an instruction list (program order): per
    segment [instructions before its first HGMMA, instructions from it on,
    mma.sync FLOP, wgmma FLOP, wgmma shared-memory operand bytes, LDS / STS
    / LDSM bytes, 1 when it ends in a wait for the wgmma group else 0], per
    warp."""
    out = []

    def fresh() -> list:
        return [0, 0, 0.0, 0.0, 0.0, 0.0, 0]

    cur = fresh()
    for i in ins:
        if i.base == "HGMMA" or cur[1]:
            cur[1] += 1
        else:
            cur[0] += 1
        f = mma_flop(i)
        if i.base == "HGMMA":
            cur[3] += f
            cur[4] += hgmma_smem_bytes(i)
        else:
            cur[2] += f
        if i.base in ("LDS", "STS") and i.pred != "@!PT" or i.base == "LDSM":
            cur[5] += 32 * access_bytes(i)
        if _is_gwait(i):
            cur[6] = 1
            out.append(cur)
            cur = fresh()
    if cur[0] or cur[1]:
        out.append(cur)
    return out


_REG_TOKEN = re.compile(r"(?<![\w.])(U?R\d+|U?P\d+)(?:\.(64|128))?\b")
_NO_DEST = {
    "STS", "STG", "ST", "STL", "RED", "REDG", "LDGSTS", "BAR", "BRA", "JMP", "EXIT", "RET", "CALL", "DEPBAR",
    "LDGDEPBAR", "WARPSYNC", "MEMBAR", "BSSY", "BSYNC", "NOP", "WARPGROUP", "YIELD", "UBLKCP", "UTMALDG",
    "ARRIVES", "SYNCS", "PMTRIG", "ERRBAR", "CCTL", "BPT", "KILL",
}  # fmt: skip


def _regs(tok: str, width: str | None, n: int = 1) -> list:
    m = re.match(r"(U?[RP])(\d+)", tok)
    if not m:
        return [tok]
    k = max(n, {"64": 2, "128": 4}.get(width or "", 1))
    return [f"{m.group(1)}{int(m.group(2)) + j}" for j in range(k)]


#: A ``Flow.gaps`` entry for a wait that shares a 16-byte load's round trip (no wait of its own).
SHARED = -1


@dataclass
class Flow:
    """State of ``dataflow``: when each register is ready and when the warp
    can issue, in dependent round trips from the start (``level``)."""

    level: int = 0  # the warp issues in order: nothing issues before this
    ready: dict = field(default_factory=dict)  # register -> level its value is there
    smem: int = 0  # level by which what STS wrote is there
    group: int = -1  # the open cp.async group's completion level (-1: none)
    groups: list = field(default_factory=list)  # committed, oldest first
    first_wide: int = -1  # level at which the first wide load / copy issued
    first_wait: int = -1  # level after the first cp.async wait
    n: int = 0  # instructions seen (issued, or waiting to) so far
    issued_at: dict = field(default_factory=dict)  # register -> the instruction count at its global load's issue
    gaps: list = field(default_factory=list)  # per level the stream waited for: instructions from the load to that use
    wide_at: int = -1  # level at which the newest 16-byte load into registers issued


def dataflow(ins: list, flow: Flow | None = None, *, wide: int = 1, scalar: int = 1, shared: bool = False) -> Flow:
    """Dependent global-memory round trips of an instruction stream run in
    order by one warp: a global load's value is there ``scalar`` (or, for a
    16-byte load, ``wide``) round trips after it issues; an instruction
    issues when its sources are there and not before the one ahead of it;
    a cp.async wait (``DEPBAR.LE SB0, N``) waits for all but the newest N
    committed groups; LDS / LDSM read what STS stored (or what a waited
    cp.async copied). Straight-line: every instruction once, in the order
    given. ``shared`` (a loop whose 16-byte loads are used where issued,
    their round trip its memory wait): a wait issued at a level where such
    a load issued shares its round trip (``SHARED`` in ``gaps``)."""
    f = flow or Flow()
    for i in ins:
        ops = [o.strip() for o in i.operands.split(",")] if i.operands else []
        toks = [(m.group(1), m.group(2)) for m in _REG_TOKEN.finditer(i.operands)]
        has_dest = i.base not in _NO_DEST and bool(ops) and bool(_REG_TOKEN.match(ops[0]))
        srcs = toks[1:] if has_dest else toks
        if i.pred:
            srcs = srcs + [(i.pred.lstrip("@!"), None)]
        need = 0
        for t, w in srcs:
            for r in _regs(t, w):
                need = max(need, f.ready.get(r, 0))
        if need > f.level:
            # the wait for a load's value: the instructions issued since that load overlap its latency
            src = [f.issued_at.get(r) for t, w in srcs for r in _regs(t, w) if f.ready.get(r, 0) == need]
            known = [k for k in src if k is not None]
            gap = f.n - max(known) if known else 0
            # (shared) a 16-byte load issued at this level is in flight too: this wait is that load's
            # round trip (which the loop's memory wait charges), not one of its own.
            first = SHARED if shared and f.wide_at == f.level else gap
            f.gaps += [first] + [gap] * (need - f.level - 1)
        f.level = max(f.level, need)
        lvl = f.level
        f.n += 1
        if i.pred == "@!PT":
            continue
        if i.base in ("LDGSTS", "UBLKCP", "UTMALDG"):
            f.group = max(f.group, lvl + wide)
            if f.first_wide < 0:
                f.first_wide = lvl
        elif i.base == "LDGDEPBAR":
            f.groups.append(max(f.group, lvl))
            f.group = -1
        elif _cp_wait(i) is not None:
            n = _cp_wait(i) or 0
            done, f.groups = (f.groups[: len(f.groups) - n], f.groups[len(f.groups) - n :]) if n else (f.groups, [])
            if done:
                f.level = max(f.level, *done)
            if f.first_wait < 0:
                f.first_wait = f.level
        elif i.base == "STS":
            f.smem = max(f.smem, lvl)
        if not has_dest:
            continue
        t, w = toks[0]
        n = max(1, access_bytes(i) // 4) if i.base in ("LDG", "LD", "LDS", "LDSM") else 1
        if ".WIDE" in i.opcode:
            n = max(n, 2)
        if i.base in ("LDG", "LD"):
            big = is_wide_global_load(i)
            if big and f.first_wide < 0:
                f.first_wide = lvl
            if big:
                f.wide_at = lvl
            val = lvl + (wide if big else scalar)
            for r in _regs(t, w, n):
                f.issued_at[r] = f.n
        elif i.base in ("LDS", "LDSM"):
            val = max(lvl, f.smem)
        else:
            val = lvl
        for r in _regs(t, w, n):
            f.ready[r] = val
    return f


def _region(fn: Function, cfg: Cfg, blocks, depth: int, parent: int, warm: set | None = None) -> Region:
    order = sorted(blocks)
    skipped = 0
    if warm is not None:
        skipped = sum(cfg.blocks[b].end - cfg.blocks[b].start for b in order if b not in warm)
        order = [b for b in order if b in warm]
    ins = [fn.instrs[i] for b in order for i in range(cfg.blocks[b].start, cfg.blocks[b].end)]
    cls = Counter(classify(i) for i in ins)
    glob = [i for i in ins if i.base in ("LDG", "LD", "LDGSTS", "UBLKCP", "UTMALDG")]
    wait, commit_after = -1, False
    for k, i in enumerate(ins):
        n = _cp_wait(i)
        if n is not None and wait < 0:
            wait = n
            commit_after = any(j.base == "LDGDEPBAR" for j in ins[k + 1 :]) and not any(
                j.base == "LDGDEPBAR" for j in ins[:k]
            )
    flow = dataflow(ins, wide=0, shared=wait < 0)
    return Region(
        min((i.offset for i in ins), default=0),
        depth,
        parent,
        len(ins),
        dict(cls),
        sum(32 * access_bytes(i) for i in ins if is_wide_global_load(i)),
        sum(32 * access_bytes(i) for i in glob),
        # "@!PT LDS RZ, [RZ]" (ptxas' never-true placeholders beside LDGSTS) moves no bytes
        sum(32 * access_bytes(i) for i in ins if i.base in ("LDS", "STS") and i.pred != "@!PT"),
        sum(1 for i in ins if i.base in ("HMMA", "HGMMA")),
        sum(1 for i in ins if i.base == "LDSM"),
        sum(1 for i in ins if i.base == "LDGSTS"),
        sum(1 for i in ins if i.base == "PMTRIG" and not is_edge_marker(i)),
        segments=segments(ins),
        bars=sum(1 for i in ins if _is_bar_wait(i)),
        waits=segment_groups(ins)[0],
        groups=segment_groups(ins)[1],
        named_syncs=sum(1 for i in ins if _is_bar_wait(i) and is_named_barrier(i)),
        arrives=sum(1 for i in ins if i.base == "BAR" and ".ARV" in i.opcode),
        named_threads=max((named_barrier_threads(i) for i in ins if is_named_barrier(i)), default=0),
        named_counts=sorted({named_barrier_threads(i) for i in ins if is_named_barrier(i)} - {0}),
        dep_levels=flow.level,
        dep_gaps=flow.gaps,
        ring_wait=wait,
        commit_after_wait=commit_after,
        skipped=skipped,
        edges=sum(1 for i in ins if is_edge_marker(i)),
    )


def is_edge_marker(ins: Instr) -> bool:
    """An edge-tile marker (``ptx::edge_tile``: ``pmevent 6``, SASS ``PMTRIG 0x40``); any other PMTRIG is
    a cold-path marker (``ptx::cold_path``: ``pmevent 7``, ``PMTRIG 0x80``)."""
    return ins.base == "PMTRIG" and ins.operands.strip().lower() == "0x40"


def _all_inside(loop: Loop):
    for c in loop.children:
        yield c
        yield from _all_inside(c)


def _has_load(fn: Function, cfg: Cfg, loop: Loop, wide: bool) -> bool:
    for i in loop.instructions(fn, cfg):
        if is_wide_global_load(i) if wide else i.base in ("LDG", "LD", "LDGSTS", "UBLKCP", "UTMALDG"):
            return True
    return False


def _join(flows: list) -> Flow:
    """The state after whichever of several paths took longest: levels,
    readiness and cp.async groups the latest of them."""
    if not flows:
        return Flow()
    base = max(flows, key=lambda f: f.level)
    # cp.async groups: the open one and the committed ones (aligned from the
    # newest) each complete at the latest any path leaves them, so a path that
    # skips a loop of copies does not hide the copies of the path through it.
    depth = max(len(f.groups) for f in flows)
    groups = [
        max(f.groups[k - depth + len(f.groups)] for f in flows if k - depth + len(f.groups) >= 0) for k in range(depth)
    ]
    out = Flow(
        base.level,
        dict(base.ready),
        max(f.smem for f in flows),
        max(f.group for f in flows),
        groups,
        max((f.first_wide for f in flows), default=-1),
        max((f.first_wait for f in flows), default=-1),
    )
    for f in flows:
        for r, v in f.ready.items():
            if v > out.ready.get(r, -1):
                out.ready[r] = v
    return out


def _paths(fn: Function, cfg: Cfg, dom: list, allowed: set, starts: list, stop: int | None = None) -> tuple:
    """(instructions on the longest path, ``dataflow`` state at its end)
    through the blocks ``allowed`` from ``starts``, back edges left out
    (a loop there counts once), to the end of the paths, or up to block
    ``stop`` (not included). Only one of two branches runs: paths, not the
    sum of every block, so code a warp skips is not counted."""
    seen: set = set()
    order: list = []

    def visit(b: int) -> None:  # iterative post-order DFS
        stack = [(b, iter(cfg.blocks[b].succs))]
        seen.add(b)
        while stack:
            k, it = stack[-1]
            nxt = next((x for x in it if x in allowed and x not in seen and x not in dom[k] and x != stop), None)
            if nxt is None:
                order.append(k)
                stack.pop()
                continue
            if (k, nxt) in cfg.div_edges:
                continue
            seen.add(nxt)
            stack.append((nxt, iter(cfg.blocks[nxt].succs)))

    for b in starts:
        if b not in seen:
            visit(b)
    order.reverse()
    length: dict = {}
    state: dict = {}
    for b in order:
        preds = [p for p in cfg.blocks[b].preds if p in length and b not in dom[p] and (p, b) not in cfg.div_edges]
        before = max((length[p] for p in preds), default=0)
        flow = _join([state[p] for p in preds])
        blk = cfg.blocks[b]
        length[b] = before + (blk.end - blk.start)
        state[b] = dataflow([fn.instrs[i] for i in range(blk.start, blk.end)], flow)
    if stop is not None:
        ends = [p for p in cfg.blocks[stop].preds if p in length]
    else:
        ends = [b for b in length if not any(x in length and x not in dom[b] for x in cfg.blocks[b].succs)]
    if not ends:
        return 0, Flow()
    return max(length[b] for b in ends), _join([state[b] for b in ends])


def _marked_cold(fn: Function, cfg: Cfg, b: int) -> bool:
    """Block ``b`` holds a path marker (PMTRIG: ``ptx::cold_path`` or ``ptx::edge_tile``), the start of a
    branch region of its own."""
    return any(fn.instrs[i].base == "PMTRIG" for i in range(cfg.blocks[b].start, cfg.blocks[b].end))


def hot_loop(fn: Function) -> HotLoop | None:
    """The K/V streaming loop of ``fn``. Among the loops holding a 128-bit
    global load or copy, the one with the most instructions of its own,
    counting the loops nested in it except those that hold such loads
    themselves (a pass loop around the tile loop owns only its prologue
    and epilogue; a copy loop inside the tile loop owns only its copies);
    but when a loop nested in that one holds such loads and tensor
    instructions of its own (the tile loop of a pass loop that owns a
    peeled first tile), the deepest such loop.
    The loop's regions are its own blocks and every loop nested in it. A
    function without wide loads (the split merge) falls back to loops with
    any global load. None when no loop loads from global memory.

    Outside the loop (``HotLoop.prologue`` / ``epilogue``): the longest
    path of warm blocks without a cold-path marker from the entry to the
    loop, and from the loop to the end (``_paths``; another loop on it
    counts once). ``startup_levels``: ``dataflow`` along those paths to the
    loop and through the loop's own region once, the round trips by which
    the first cp.async wait returns (or, without one, before the first
    16-byte load issues).

    Warp-specialized (a loop whose own blocks issue tensor instructions and
    no global loads, outside the loader loop, which issues none: the
    consumers of FlashAttention-3's schedule): that tensor loop is the hot
    one (the deepest such, its tile loop), and the loader loop its
    ``producer``."""
    cfg = build_cfg(fn)
    loops = find_loops(cfg)
    warm = cfg.warm()

    def size(blocks) -> int:
        return sum(cfg.blocks[b].end - cfg.blocks[b].start for b in blocks)

    for wide in (True, False):
        cands = [lp for lp in loops if _has_load(fn, cfg, lp, wide)]
        if cands:
            break
    else:
        return None

    def own(lp: Loop) -> int:
        loaders = [c for c in _all_inside(lp) if c in cands]
        return size(set(lp.blocks) - set().union(*(c.blocks for c in loaders)))

    best = max(cands, key=own)

    def tensor_own(lp: Loop) -> bool:
        loaders = [c for c in _all_inside(lp) if c in cands]
        mine = set(lp.blocks) - set().union(*(c.blocks for c in loaders))
        return any(
            fn.instrs[i].base in ("HMMA", "HGMMA") for b in mine for i in range(cfg.blocks[b].start, cfg.blocks[b].end)
        )

    # A pass loop that owns a peeled first tile (and the last tile's deferred products) can own more
    # instructions than the tile loop inside it; the tile loop, run once per tile, is the hot one: the deepest
    # loader loop inside whose own blocks issue tensor instructions (a copy loop inside a tile loop issues none).
    tiles = [c for c in cands if c is not best and set(c.blocks) < set(best.blocks) and tensor_own(c)]
    if tiles:
        best = max(tiles, key=lambda c: (c.depth, own(c)))

    def tensor_in(lp: Loop) -> bool:
        return any(i.base in ("HMMA", "HGMMA") for i in lp.instructions(fn, cfg))

    if not tensor_in(best):
        consumers = [
            lp
            for lp in loops
            if not _has_load(fn, cfg, lp, False)
            and not set(lp.blocks) & set(best.blocks)
            and any(
                fn.instrs[i].base in ("HMMA", "HGMMA")
                for b in set(lp.blocks) - set().union(*(c.blocks for c in _all_inside(lp)))
                for i in range(cfg.blocks[b].start, cfg.blocks[b].end)
            )
        ]
        if consumers:
            hot = _loop_at(fn, cfg, warm, max(consumers, key=lambda c: (c.depth, size(c.blocks))), 0)

            def wide_own(lp: Loop) -> bool:  # the copies in the loop's own blocks (its tile loop)
                mine = set(lp.blocks) - set().union(*(c.blocks for c in _all_inside(lp)))
                return any(
                    is_wide_global_load(fn.instrs[i])
                    for b in mine
                    for i in range(cfg.blocks[b].start, cfg.blocks[b].end)
                )

            copiers = [c for c in cands if set(c.blocks) <= set(best.blocks) and wide_own(c)]
            loader = max(copiers, key=lambda c: (c.depth, size(c.blocks))) if copiers else best
            hot.producer = _loop_at(fn, cfg, warm, loader, len(cands) - 1)
            return hot
    return _loop_at(fn, cfg, warm, best, len(cands) - 1)


def _loop_at(fn: Function, cfg: Cfg, warm: set, best: Loop, others: int) -> HotLoop:
    """The HotLoop of loop ``best`` of ``fn`` (``hot_loop``'s regions, prologue, epilogue and startup);
    ``others``: the function's other loops with wide loads."""
    inner = list(_all_inside(best))
    parents = {}
    for k, c in enumerate(inner):
        up = [j for j, o in enumerate(inner) if c.blocks < o.blocks]
        parents[k] = (1 + max(up, key=lambda j: inner[j].depth)) if up else 0
    own_blocks = set(best.blocks) - set().union(*(c.blocks for c in inner))
    dom = dominators(cfg)
    # Cold branches: a block of the loop's own that holds a cold-path marker (PMTRIG: ptx::cold_path, code
    # that runs only on rare inputs) and every block of the loop it dominates, a region of its own (its rate
    # from the counters' marks, 0 when the probe never took it) instead of counted once per iteration;
    # loops inside it are its children. Only the outermost of nested cold branches.
    marks = [b for b in sorted(own_blocks & warm) if _marked_cold(fn, cfg, b)]
    cold = {m: {b for b in best.blocks if m in dom[b]} for m in marks if m != best.header}
    cold = {m: d for m, d in cold.items() if not any(m in d2 for m2, d2 in cold.items() if m2 != m)}
    loop_own = set(own_blocks)
    own_blocks -= set().union(*cold.values())
    regions = [_region(fn, cfg, own_blocks, best.depth, -1, warm)]
    cold_index = {m: 1 + len(inner) + k for k, m in enumerate(cold)}
    for k, c in enumerate(inner):
        mine = set(c.blocks) - set().union(*(g.blocks for g in _all_inside(c)))
        parent = parents[k]
        if parent == 0:  # directly inside the hot loop: inside a cold branch, that branch's child
            parent = next((cold_index[m] for m, d in cold.items() if c.header in d), 0)
        regions.append(_region(fn, cfg, mine, c.depth, parent, warm))
    for d in cold.values():
        regions.append(_region(fn, cfg, d & loop_own, best.depth + 1, 0, warm))
    offs = [fn.instrs[i].offset for b in best.blocks for i in range(cfg.blocks[b].start, cfg.blocks[b].end)]
    outside = {b for b in warm - set(best.blocks) if not _marked_cold(fn, cfg, b)}
    pro_len, flow = _paths(fn, cfg, dom, outside, [0] if 0 in outside else [], stop=best.header)
    exits = sorted({s for b in best.blocks for s in cfg.blocks[b].succs if s in outside})
    epi_len, _ = _paths(fn, cfg, dom, outside, exits)
    own_ins = [fn.instrs[i] for b in sorted(own_blocks & warm) for i in range(cfg.blocks[b].start, cfg.blocks[b].end)]
    flow.first_wide = flow.first_wait = -1  # the loop's own first copy / wait (the query's came before)
    flow = dataflow(own_ins, flow)
    startup = flow.first_wait if flow.first_wait >= 0 else flow.first_wide
    return HotLoop(
        fn.name,
        min(offs),
        max(offs),
        regions,
        others,
        cfg.indirect,
        prologue=pro_len,
        epilogue=epi_len,
        startup_levels=max(0, startup),
    )


def function_profile(fn: Function) -> dict:
    """Whole-function static counts by class (for reports)."""
    return dict(Counter(classify(i) for i in fn.instrs))
