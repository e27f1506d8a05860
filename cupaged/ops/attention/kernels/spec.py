"""What every attention kernel's spec states (``KernelSpec``), and the facts
the kernels share: 16-byte vectors and the tensor-core blocks of
``kernels_cu/attention/tc_common.cuh``.

A spec is the Python side of one ``kernels_cu/attention/<stem>.cu``: its
name, block, resident blocks (``__launch_bounds__``), the ``Variant`` fields
that are its defines, the builds it has per dtype pair, which shapes it
serves and its dynamic shared memory. ``variants.py`` builds the table from
the specs and picks from it; nothing there names a kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .... import dtypes
from ...._runtime import cpu as _cpu

if TYPE_CHECKING:
    from ..variants import Shape, Variant

#: Bytes of one vector load / cp.async copy (16-byte loads need dims and
#: arrays that are multiples of it).
VECTOR_BYTES = 16
#: (query, head) rows per block of the row-packed tensor-core kernels
#: (tc_common.cuh: tc::kRows; paged_mla_tc, paged_mla_wgmma, paged_mla_seesaw) and the row unit
#: of the tensor-core segment rules (schedule.py); paged_prefill_tc's blocks
#: have the rows of their tile (prefill_tc.PREFILL_TILES).
TC_ROWS = 64
#: Shared memory the row-packed tensor-core kernels declare statically (their
#: rows' spans, the page staging of the tile ring and paged_prefill_tc's staged
#: per-token row offsets: up to 5680 bytes) stays within this budget;
#: selection adds it to the dynamic bytes when it checks an arch's limit, and
#: the gate's launch check uses the real figure (tests/attention/test_arch_select.py
#: checks the budget against the compiled kernels).
TC_STATIC_SMEM_BUDGET = 6144
#: Elements added to a 16-bit shared-memory row of the tensor-core kernels
#: (their kPitch = row + PITCH_PAD): conflict-free ldmatrix.
PITCH_PAD = 8


def is_fp8(kv_dtype: str | None) -> bool:
    """An fp8 (e4m3 / e5m2) cache: raw codes, decoded in the kernel."""
    return kv_dtype in dtypes.FP8_TOKENS


def tc_pair(dtype: str, kv_dtype: str) -> bool:
    """A (q, cache) dtype pair of the tensor-core kernels: f16 / bf16 q over a
    cache of q's type or fp8."""
    return dtype in dtypes.TC_TOKENS and (kv_dtype in dtypes.TC_TOKENS or is_fp8(kv_dtype))


class KernelSpec:
    """One attention kernel (the defaults suit a kernel with one block size
    and no dynamic shared memory).

    ``name``: its ``extern "C"`` name; ``source``: the ``kernels_cu`` stem;
    ``threads``: its block (the first ``__launch_bounds__`` argument; 0 when
    each build has its own, ``block_threads``); ``cpu_threads``: its block on
    the CPU backend where that differs (0: the same; ``cpu_block_threads``); ``min_blocks``: resident
    blocks per SM by design (the second argument; 0 when each build has its
    own, ``resident_blocks``); ``fields``: the ``Variant`` fields that are its
    defines (each as the field's name in capitals unless ``defines`` says
    otherwise); ``per_query``: one block per query (and KV head, head tile,
    split), any packing of the step; else row-packed (the tensor-core
    segments of schedule.py); ``fp8``: fp8-cache builds exist; ``strided``:
    it addresses K / V / k_rot rows through the cache strides of
    AttentionParams (any view with a contiguous innermost dim), so it serves
    caches that are not C-contiguous; ``static_smem_budget``: the static
    shared memory selection counts for it; ``target``: the arch-specific
    compile target of its builds ("" for any arch; such a build runs only
    on devices of the arch it names without the suffix); ``rank``: order of
    preference among the kernels of one kind that serve a shape (lower
    first).
    """

    name: str = ""
    source: str = ""
    threads: int = 0
    cpu_threads: int = 0
    min_blocks: int = 0
    fields: tuple[str, ...] = ()
    per_query: bool = False
    fp8: bool = True
    strided: bool = True
    static_smem_budget: int = 0
    target: str = ""
    rank: int = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} spec: {self.name}, kernels_cu/{self.source}.cu>"

    def builds(self, dtype: str, kv_dtype: str) -> Iterator[dict[str, Any]]:
        """The ``Variant`` fields (beyond kernel, dtypes and target) of each
        build for q / out ``dtype`` over a ``kv_dtype`` cache."""
        raise NotImplementedError

    def defines(self, v: Variant) -> dict[str, Any]:
        """The kernel's own ``#define``s of ``v`` (dtypes, score, target and
        features are every kernel's: ``Variant.defines``)."""
        return {f.upper(): getattr(v, f) for f in self.fields}

    def serves(self, v: Variant, s: Shape) -> bool:
        """Whether ``v`` computes shape ``s`` (its dtypes already match, and
        a strided cache is only asked of a ``strided`` kernel)."""
        raise NotImplementedError

    def smem(self, v: Variant) -> int:
        """Dynamic shared memory bytes of a launch of ``v``."""
        return 0

    def block_threads(self, v: Variant) -> int:
        """Threads per block of ``v``."""
        return self.threads

    def cpu_block_threads(self, v: Variant) -> int:
        """Threads per block of ``v`` on the CPU backend: ``cpu_threads`` where the kernel has a CPU geometry
        (its module's CPU_GEOMETRY), unless CUPAGED_CPU_GEOMETRY=gpu; else ``block_threads``."""
        if self.cpu_threads and _cpu.geometry_mode() == "cpu":
            return self.cpu_threads
        return self.block_threads(v)

    def resident_blocks(self, v: Variant) -> int:
        """Blocks per SM ``v`` is designed for (its ``__launch_bounds__``
        minimum; 0: not fixed by the kernel)."""
        return self.min_blocks

    def launch_bounds(self, v: Variant) -> tuple[int, int]:
        """The kernel's ``__launch_bounds__`` (threads, minimum blocks): its
        block and resident blocks unless the kernel caps its registers for
        another block (paged_decode_tc: a block of several KV heads)."""
        return self.block_threads(v), self.resident_blocks(v)

    def head_pack(self, v: Variant, kv_heads: int, arch: str | None) -> int:
        """KV heads one block of a launch serves (1: one; paged_decode_tc
        packs several): a divisor of ``kv_heads`` whose block (``pack x``
        the threads and dynamic shared memory of ``v``) launches on
        ``arch`` (None: no device limits known)."""
        return 1

    def gate_fast(self, v: Variant) -> bool:
        """A build the NVRTC gate compiles with each of GATE_FEATURES (the
        fast dims of the kernel)."""
        return True

    def preference(self, v: Variant) -> int:
        """Order of preference among this kernel's builds serving one shape
        (lower first)."""
        return 0


class TensorCoreSpec(KernelSpec):
    """A row-packed tensor-core kernel (its blocks hold the (query, head)
    rows of several queries: schedule.py's tensor-core segments): f16 / bf16
    q over a cache of q's type or fp8, cp.async-aligned arrays, a step whose
    packing suits it."""

    static_smem_budget = TC_STATIC_SMEM_BUDGET

    def serves(self, v: Variant, s: Shape) -> bool:
        return s.aligned_tc and s.schedule_ok and self.serves_dims(v, s)

    def serves_dims(self, v: Variant, s: Shape) -> bool:
        """Whether ``v``'s compile-time dims are ``s``'s."""
        raise NotImplementedError
