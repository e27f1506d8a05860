"""cupaged's vLLM 0.32.0 attention backend: ``CupagedAttentionBackend`` (what
vLLM selects), ``CupagedMetadataBuilder`` (vLLM's per-step
``CommonAttentionMetadata`` -> ``CupagedMetadata``: host arrays on vLLM's CPU
build, vLLM's device tensors as they are on a CUDA build),
``CupagedAttentionImpl`` (one per layer: the KV write through
``cupaged.ops.slots.write_slots`` and the attention through a cupaged plan).
docs/vllm.md has the mapping of vLLM's block table, slot mapping and cache
view onto cupaged's.

Tensors: torch CPU tensors are viewed as NumPy arrays without a copy
(``cupaged.interop.torch``), so cupaged's CPU backend (the CUDA kernels
compiled for the host) runs under vLLM's CPU build. CUDA tensors are viewed
as CuPy arrays (DLPack), every launch goes to torch's current stream, and the
step's plan is built on the device (``cupaged.DevicePlanBuilder``: no
device-to-host copy, no allocation per step, a grid fixed by the step's
padded token count, so vLLM may capture full CUDA graphs over it).
``KERNEL_CALLS`` counts the cupaged launches this process made
("write_slots", "attention", "plan_build"), so a test can tell cupaged ran.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout

from ...errors import ConfigError
from ...interop.torch import TorchPlan, as_array, torch_plan, torch_stream
from ...layout import MAX_PAGE_SIZE
from ...ops.slots import write_slots
from ...plan import DevicePlanBuilder, HostPlan

__all__ = [
    "CupagedAttentionBackend",
    "CupagedAttentionImpl",
    "CupagedMetadataBuilder",
    "CupagedMetadata",
    "KERNEL_CALLS",
]

#: cupaged launches made in this process, by op ("write_slots", "attention", "plan_build").
KERNEL_CALLS: collections.Counter[str] = collections.Counter()

#: vLLM's kv_cache_dtype -> the torch fp8 dtype its uint8 cache holds (vLLM's "fp8" is e4m3).
_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

#: Page sizes (vLLM's kernel block sizes) cupaged takes: 1 .. MAX_PAGE_SIZE; vLLM's CPU platform
#: allocates multiples of 16 by default, so every multiple of 16 up to MAX_PAGE_SIZE is listed.
_BLOCK_SIZES = [b for b in (16, 32, 64, 128, 256) if b <= MAX_PAGE_SIZE]


class _CupagedSupport:
    """What both of cupaged's backends (this one and mla.py's) accept alike:
    decoder self-attention; an fp8 cache under 16-bit queries only."""

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(
        cls,
        head_size,
        dtype,
        kv_cache_dtype,
        block_size,
        use_mla,
        has_sink,
        use_sparse,
        use_mm_prefix,
        device_capability,
    ) -> str | None:
        if kv_cache_dtype in _FP8 and dtype == torch.float32:
            return f"kv_cache_dtype {kv_cache_dtype} needs dtype float16 or bfloat16 (cupaged's fp8 path), got float32"
        return None


class CupagedAttentionBackend(_CupagedSupport, AttentionBackend):
    """Decoder self-attention on cupaged's paged kernels (MHA / GQA / MQA,
    mixed prefill, chunked prefill and decode steps, sliding window, logit
    soft cap, sinks, ALiBi, fp8 K/V caches with per-tensor or per-KV-head
    scales). vLLM calls ``do_kv_cache_update`` before ``forward``
    (``forward_includes_kv_cache_update`` False)."""

    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16", *_FP8]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CupagedAttentionImpl]:
        return CupagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CupagedMetadataBuilder]:
        return CupagedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return list(_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # Every head dim runs on the CUDA-core kernel; these are the dims vLLM's models use.
        return [32, 64, 80, 96, 112, 128, 160, 192, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # The impl views K and V with the cache's own strides: any layout whose content dim is innermost.
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, *args, **kwargs) -> list[str]:
        """vLLM's reasons, each made specific: which value was refused and
        what cupaged takes (an empty list: supported)."""
        reasons = super().validate_configuration(head_size, dtype, kv_cache_dtype, block_size, *args, **kwargs)
        attn_type = kwargs.get("attn_type", AttentionType.DECODER)
        detail = {
            "head_size not supported": (
                f"head_size {head_size} not supported (cupaged: {cls.get_supported_head_sizes()})"
            ),
            "dtype not supported": f"dtype {dtype} not supported (cupaged: {cls.supported_dtypes})",
            "kv_cache_dtype not supported": (
                f"kv_cache_dtype {kv_cache_dtype!r} not supported (cupaged: {cls.supported_kv_cache_dtypes})"
            ),
            "block_size not supported": f"block_size {block_size} not supported (cupaged: {_BLOCK_SIZES})",
            f"attention type {attn_type} not supported": (
                f"attention type {getattr(attn_type, 'value', attn_type)} not supported "
                "(cupaged: decoder self-attention only)"
            ),
            "MLA not supported": "MLA not supported (cupaged's vLLM backend serves non-MLA attention only)",
        }
        return [detail.get(r, r) for r in reasons]


class _DevicePlans:
    """The stable plan buffers of one metadata builder (one per KV-cache
    group): a ``DevicePlanBuilder`` per (page size, page count, device),
    sized once from vLLM's limits (``max_num_batched_tokens`` queries,
    ``max_num_seqs`` sequences, the block table's width) and replaced by a
    larger one only when a step outgrows it (never inside a CUDA graph
    capture: ConfigError), and the TorchPlan of each plan it hands out."""

    def __init__(self, queries: int, sequences: int):
        self.queries, self.sequences = queries, sequences
        self.builders: dict[tuple, DevicePlanBuilder] = {}
        self.wrapped: dict[int, TorchPlan] = {}

    @classmethod
    def for_config(cls, vllm_config: Any) -> _DevicePlans:
        """Sized from vLLM's scheduler limits (0: from the first step)."""
        sched = getattr(vllm_config, "scheduler_config", None)
        return cls(int(getattr(sched, "max_num_batched_tokens", 0) or 0), int(getattr(sched, "max_num_seqs", 0) or 0))

    def builder(self, like: torch.Tensor, queries: int, sequences: int, width: int, page_size: int, num_pages: int):
        key = (page_size, num_pages, like.device)
        b = self.builders.get(key)
        if b is None or b.queries < queries or b.sequences < sequences or b.table_width < width:
            if like.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ConfigError(
                    f"plan buffers: a step of {queries} tokens, {sequences} requests, {width} blocks a request "
                    f"outgrew them during a CUDA graph capture (sized from max_num_batched_tokens="
                    f"{self.queries}, max_num_seqs={self.sequences})"
                )
            self.queries, self.sequences = max(self.queries, queries), max(self.sequences, sequences)
            w = max(width, b.table_width if b is not None else 1)
            b = self.builders[key] = DevicePlanBuilder(
                self.queries, self.sequences, w, page_size, num_pages, as_array(like, "like")
            )
        return b


@dataclass
class _DeviceStep:
    """One step's metadata as vLLM's tensors (no host copy): query_start_loc
    int32 [reqs + 1], seq_lens int32 [reqs], block_table int32 [reqs, width]
    (rows of vLLM's persistent buffers), and the builder's stable buffers."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plans: _DevicePlans


@dataclass
class CupagedMetadata(AttentionMetadata):
    """One step's schedule. Host path (vLLM's CPU build): host arrays copied
    from vLLM's CPU tensors, ``page_table`` [reqs, width] (vLLM's block
    table), ``kv_lens`` [reqs] (seq_lens: tokens in the cache after this
    step's writes), ``q_lens`` [reqs] (from query_start_loc's CPU copy),
    ``queries`` (their sum: the real query tokens; rows past it are padding
    and left as they are). Device path (CUDA tensors, or
    ``CupagedMetadataBuilder.device_plans``): ``device`` holds vLLM's
    tensors, the host arrays are None, and the plan covers every row of the
    layer's query (padding rows get output 0). ``causal``, ``slot_mapping``
    [num_actual_tokens]. ``plan`` builds the cupaged plan once per step, on
    the first layer that asks; later layers of the step reuse it."""

    num_actual_tokens: int
    queries: int
    page_table: np.ndarray | None
    kv_lens: np.ndarray | None
    q_lens: np.ndarray | None
    causal: bool
    slot_mapping: torch.Tensor
    device: _DeviceStep | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def plan(self, like: torch.Tensor, page_size: int, num_pages: int) -> TorchPlan:
        """The step's TorchPlan for caches of ``num_pages`` pages of
        ``page_size`` tokens on ``like``'s device (built once per key; on
        the device path ``like`` [tokens, ...] gives the plan's queries)."""
        d = self.device
        key = (page_size, num_pages, like.device, None if d is None else int(like.shape[0]))
        p = self._plans.get(key)
        if p is None:
            if d is None:
                host = HostPlan.build(self.page_table, self.kv_lens, self.q_lens, page_size, num_pages)
                p = torch_plan(host, like)
            else:
                p = self._device_plan(d, like, page_size, num_pages)
            self._plans[key] = p
        return p

    @staticmethod
    def _device_plan(d: _DeviceStep, like: torch.Tensor, page_size: int, num_pages: int) -> TorchPlan:
        """One ``plan_build`` launch into the builder's stable words, on
        torch's current stream: no host read of vLLM's tensors."""
        queries, (reqs, width) = int(like.shape[0]), (int(x) for x in d.block_table.shape)
        ctx = torch_stream(like.device.index) if like.device.type == "cuda" else contextlib.nullcontext()
        with ctx:  # the buffers (once) and the build on torch's current stream, on like's device
            b = d.plans.builder(like, queries, reqs, width, page_size, num_pages)
            dp = b.build(
                as_array(d.query_start_loc, "query_start_loc"),
                as_array(d.seq_lens, "seq_lens"),
                as_array(d.block_table, "block_table_tensor"),
                queries=queries,
            )
        KERNEL_CALLS["plan_build"] += 1
        tp = d.plans.wrapped.get(id(dp))
        if tp is None or tp.plan is not dp:
            tp = d.plans.wrapped[id(dp)] = TorchPlan(dp)
        return tp


class _PlanBuilding:
    """What both metadata builders (this module's and mla.py's) share: the
    step's plan from vLLM's metadata (``_step_metadata``), where plans are
    built, and the CUDA-graph level."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None
    #: None: plans built on the device for CUDA tensors, on the host for CPU tensors; True: on the device
    #: for both (the CUDA path run on the CPU backend, for tests); False: on the host (CPU tensors only).
    device_plans: ClassVar[bool | None] = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._device_plans = _DevicePlans.for_config(vllm_config)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        from vllm.platforms import current_platform

        return AttentionCGSupport.ALWAYS if current_platform.is_cuda_alike() else cls._cudagraph_support


class CupagedMetadataBuilder(_PlanBuilding, AttentionMetadataBuilder[CupagedMetadata]):
    """``CommonAttentionMetadata`` -> ``CupagedMetadata``. On vLLM's CPU
    build, from host data: query_start_loc's CPU copy, and seq_lens /
    block_table_tensor read through NumPy views and copied, since vLLM
    refills those buffers; the plan is a HostPlan built per step. On CUDA
    (or with ``device_plans`` True), from vLLM's tensors as they are: the
    plan is built on the device (``DevicePlanBuilder``) into buffers sized
    once, with no device-to-host copy; its grid depends only on the step's
    padded token count, and any mix of prefills, chunked prefills and
    decodes runs on it, so on CUDA full CUDA graphs are supported for mixed
    batches (``AttentionCGSupport.ALWAYS``; on the CPU, ``NEVER``: vLLM's
    CPU build captures none)."""

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CupagedMetadata:
        return _step_metadata(common_attn_metadata, self.device_plans, self._device_plans)


def _step_metadata(m: CommonAttentionMetadata, device_plans: bool | None, plans: _DevicePlans) -> CupagedMetadata:
    """One step's ``CupagedMetadata`` from vLLM's ``CommonAttentionMetadata``
    (``CupagedMetadataBuilder.build``; the MLA builder wraps the same):
    ``device_plans`` as the builder's, ``plans`` its stable plan buffers."""
    n = int(m.num_reqs)
    if isinstance(m.causal, torch.Tensor):
        raise ConfigError("causal: expected a bool (cupaged has no per-request causal flags), got a tensor")
    on_device = device_plans
    if on_device is None:
        on_device = m.block_table_tensor.device.type != "cpu"
    if on_device:
        return CupagedMetadata(
            num_actual_tokens=int(m.num_actual_tokens),
            queries=int(m.num_actual_tokens),
            page_table=None,
            kv_lens=None,
            q_lens=None,
            causal=bool(m.causal),
            slot_mapping=m.slot_mapping,
            device=_DeviceStep(
                _int32("query_start_loc", m.query_start_loc[: n + 1]),
                _int32("seq_lens", m.seq_lens[:n]),
                _int32("block_table_tensor", m.block_table_tensor[:n]),
                plans,
            ),
        )
    qsl = _host("query_start_loc_cpu", m.query_start_loc_cpu)[: n + 1].astype(np.int64)
    return CupagedMetadata(
        num_actual_tokens=int(m.num_actual_tokens),
        queries=int(qsl[-1] - qsl[0]) if n else 0,
        # copies (host memcpy of a few KB): vLLM refills its persistent buffers for the next step
        page_table=_host("block_table_tensor", m.block_table_tensor)[:n].copy(),
        kv_lens=_host("seq_lens", m.seq_lens)[:n].copy(),
        q_lens=np.diff(qsl),
        causal=bool(m.causal),
        slot_mapping=m.slot_mapping,
    )


def _int32(name: str, t: torch.Tensor) -> torch.Tensor:
    """vLLM's int32 metadata tensor as it is (no copy, no device read)."""
    if t.dtype != torch.int32:
        raise ConfigError(f"{name}: expected an int32 tensor, got {t.dtype}")
    return t


def _host(name: str, t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (no copy); the host path only (CUDA
    metadata takes the device path)."""
    if t.device.type != "cpu":
        raise ConfigError(f"{name}: expected a CPU tensor on the host-plan path (device_plans False), got {t.device}")
    return t.numpy()


class CupagedAttentionImpl(AttentionImpl[CupagedMetadata]):
    """One attention layer: its options from vLLM's arguments, its K/V
    views of vLLM's per-layer cache, cupaged's ``write_slots`` and
    ``attention`` launches."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            raise ConfigError(f"attn_type: expected {AttentionType.DECODER.value!r}, got {attn_type!r}")
        if extra:
            raise ConfigError(f"{', '.join(extra)}: not supported by cupaged's vLLM backend")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_kv_heads or num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, got {self.num_kv_heads}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = _FP8.get(kv_cache_dtype)
        if kv_cache_dtype not in ("auto", "float16", "bfloat16") and self.fp8 is None:
            raise ConfigError(
                f"kv_cache_dtype: expected one of {CupagedAttentionBackend.supported_kv_cache_dtypes}, "
                f"got {kv_cache_dtype!r}"
            )
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sliding_window = None if sliding_window is None or sliding_window <= 0 else int(sliding_window)
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        if self.alibi_slopes is not None and tuple(self.alibi_slopes.shape) != (self.num_heads,):
            raise ConfigError(
                f"alibi_slopes: expected {self.num_heads} values (one per query head), got {self.alibi_slopes.numel()}"
            )
        if sinks is not None and tuple(sinks.shape) != (self.num_heads,):
            raise ConfigError(f"sinks: expected shape [{self.num_heads}], got {list(sinks.shape)}")
        self.sinks = sinks
        self._sinks32: torch.Tensor | None = None
        self._alibi_on: dict[torch.device, torch.Tensor] = {}

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self._sinks32 = None  # the sinks parameter may have been (re)loaded

    def _sinks(self) -> torch.Tensor | None:
        """The sinks as the float32 contiguous [Hq] cupaged reads (one
        conversion, after the weights are loaded)."""
        if self.sinks is None:
            return None
        if self._sinks32 is None:
            self._sinks32 = self.sinks.detach().to(torch.float32).contiguous()
        return self._sinks32

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as cupaged's [pages, page_size, Hkv, D] views of vLLM's
        per-layer cache ``[num_blocks, Hkv, block_size, 2 * D]`` (K in the
        first D of each token's content, V in the next; any stride order):
        no copy."""
        if kv_cache.dim() != 4 or kv_cache.shape[1] != self.num_kv_heads or kv_cache.shape[3] != 2 * self.head_size:
            raise ConfigError(
                f"kv_cache: expected shape [num_blocks, {self.num_kv_heads}, block_size, {2 * self.head_size}], "
                f"got {list(kv_cache.shape)}"
            )
        if self.fp8 is not None:
            kv_cache = kv_cache.view(self.fp8)
        nhd = kv_cache.transpose(1, 2)  # [num_blocks, block_size, Hkv, 2 * D]
        return nhd[..., : self.head_size], nhd[..., self.head_size :]

    def _scales(self, layer: Any) -> dict[str, torch.Tensor]:
        if self.fp8 is None:
            return {}
        return {"k_scale": layer._k_scale.reshape(-1), "v_scale": layer._v_scale.reshape(-1)}

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """key / value [tokens, Hkv, D] into the cache at ``slot_mapping``
        [tokens] (block * block_size + offset; -1 skips a padded token), in
        place: one ``write_slots`` launch on views of vLLM's cache."""
        if kv_cache.numel() == 0 or self.kv_sharing_target_layer_name is not None:
            return
        k_cache, v_cache = self._caches(kv_cache)
        n = int(slot_mapping.shape[0])
        scales = {k: as_array(v, k) for k, v in self._scales(layer).items()}
        write_slots(
            as_array(key[:n], "key"),
            as_array(value[:n], "value"),
            as_array(k_cache, "kv_cache"),
            as_array(v_cache, "kv_cache"),
            as_array(slot_mapping, "slot_mapping"),
            **scales,
        )
        KERNEL_CALLS["write_slots"] += 1

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CupagedMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [tokens, Hq, D] -> output [tokens, Hq, D] (written in place;
        rows past the step's real tokens are left as they are on the host
        path and set to 0 on the device path). The cache already holds this
        step's K/V (``do_kv_cache_update``)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("cupaged's vLLM backend: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's profiling / warm-up run
            return output
        # the device path's plan covers every row of query (padding rows get 0); the host path the real ones
        n = int(query.shape[0]) if attn_metadata.device is not None else attn_metadata.queries
        if n == 0:
            return output
        k_cache, v_cache = self._caches(kv_cache)
        plan = attn_metadata.plan(query, page_size=int(k_cache.shape[1]), num_pages=int(k_cache.shape[0]))
        out = output.view(output.shape[0], self.num_heads, -1)[:n]
        options: dict[str, Any] = dict(self._scales(layer))
        if self.sliding_window is not None:
            options["window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            options["soft_cap"] = self.logits_soft_cap
        if self.alibi_slopes is not None:
            slopes = self._alibi_on.get(query.device)
            if slopes is None:  # one copy per device, at the first step there
                slopes = self._alibi_on[query.device] = self.alibi_slopes.to(query.device)
            options["alibi_slopes"] = slopes
        sinks = self._sinks()
        if sinks is not None:
            options["sinks"] = sinks
        plan.attention(query[:n], k_cache, v_cache, self.scale, attn_metadata.causal, out=out, **options)
        KERNEL_CALLS["attention"] += 1
        return output
