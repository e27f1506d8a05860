"""cupaged's vLLM 0.32.0 backend for DeepSeek-style MLA layers (``MLAAttention``):
``CupagedMLABackend`` (what vLLM's selector returns for an MLA layer under
``CUSTOM``), ``CupagedMLAMetadataBuilder`` (vLLM's ``CommonAttentionMetadata``
-> an ``MLACommonMetadata`` whose every token is on the MQA path, with the
step's cupaged plan), ``CupagedMLAImpl`` (one per layer: the latent cache
write through ``cupaged.ops.slots.write_slots`` and the absorbed attention
through ``plan.mla``). docs/vllm.md, "MLA", has the mapping.

Which part runs on cupaged: vLLM's ``MLAAttention.forward_impl`` sends the
tokens ``attn_metadata.num_decode_tokens`` counts to ``impl.forward_mqa``
after absorbing ``W_UK`` into the query (``q_nope @ W_UK_T``), and applies
``W_UV`` to what it returns; the rest would go to ``impl.forward_mha`` (vLLM's
MLA prefill backend on K/V up-projected from the latent). The builder here
counts every token of the step as an MQA token, so prefills, chunked
prefills, prefix-cache hits and decodes all run in one ``plan.mla`` launch a
layer on the latent cache (the absorbed form is exact: q_nope . (W_UK c) =
(q_nope W_UK) . c, and the values W_UV c come out of W_UV applied to the
latent average). vLLM's projections (the absorption and ``W_UV``) stay
vLLM's; every score, softmax and latent read is cupaged's. ``forward_mha``
is never called (``NotImplementedError`` if it were).

Tensors: torch CPU tensors are viewed as NumPy arrays without a copy, as in
``backend.py`` (the latent cache is only ever written in place by
``write_slots`` and read by ``plan.mla`` through views); the step's plan is
built as ``CupagedMetadataBuilder`` builds it (a HostPlan from vLLM's CPU
copies of the metadata, or a device-built plan for CUDA tensors), and
``KERNEL_CALLS`` counts "mla" and "write_slots" launches (and "plan_build"
on the device path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonMetadata,
)
from vllm.v1.attention.backend import (
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)

from ...errors import ConfigError
from ...interop.torch import as_array, fp8_format
from ...layout import MAX_HEAD_DIM, MAX_ROPE_DIM
from ...ops.slots import write_slots
from .backend import (
    _BLOCK_SIZES,
    _FP8,
    KERNEL_CALLS,
    CupagedMetadata,
    _CupagedSupport,
    _PlanBuilding,
    _step_metadata,
)

__all__ = ["CupagedMLABackend", "CupagedMLAImpl", "CupagedMLAMetadataBuilder", "CupagedMLADecodeMetadata"]


class CupagedMLABackend(_CupagedSupport, MLACommonBackend):
    """MLA layers (DeepSeek-V2 / V3 style: one latent cache [num_blocks,
    block_size, R + P], kv_lora_rank R, qk_rope_head_dim P) on cupaged's MLA
    kernels: mixed prefill, chunked prefill, prefix-cache hits and decode
    steps, all on the absorbed (MQA) path; sliding window; fp8 latent caches
    (one per-tensor scale, vLLM's ``_k_scale``). The latent rows are written
    by ``do_kv_cache_update`` (vLLM calls it before ``forward_impl``)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16", *_FP8]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[CupagedMLAImpl]:
        return CupagedMLAImpl

    @staticmethod
    def get_builder_cls() -> type[CupagedMLAMetadataBuilder]:  # type: ignore[override]
        return CupagedMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[Any]:
        return list(_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        # No fixed list (vLLM: any): supports_head_size takes the range of R + P.
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # vLLM passes the latent width R + P only (DeepSeek-V2 / V3: 512 + 64 = 576); any R in
        # 1..MAX_HEAD_DIM with P in 1..MAX_ROPE_DIM runs, and the impl checks R and P themselves.
        return 2 <= int(head_size) <= MAX_HEAD_DIM + MAX_ROPE_DIM

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, *args, **kwargs) -> list[str]:
        """vLLM's reasons, each made specific: which value was refused and
        what cupaged takes (an empty list: supported)."""
        reasons = super().validate_configuration(head_size, dtype, kv_cache_dtype, block_size, *args, **kwargs)
        attn_type = kwargs.get("attn_type", AttentionType.DECODER)
        detail = {
            "head_size not supported": (
                f"head_size {head_size} not supported (cupaged MLA: kv_lora_rank + qk_rope_head_dim, "
                f"kv_lora_rank 1..{MAX_HEAD_DIM}, qk_rope_head_dim 1..{MAX_ROPE_DIM})"
            ),
            "dtype not supported": f"dtype {dtype} not supported (cupaged MLA: {cls.supported_dtypes})",
            "kv_cache_dtype not supported": (
                f"kv_cache_dtype {kv_cache_dtype!r} not supported (cupaged MLA: {cls.supported_kv_cache_dtypes})"
            ),
            "block_size not supported": f"block_size {block_size} not supported (cupaged MLA: {_BLOCK_SIZES})",
            f"attention type {attn_type} not supported": (
                f"attention type {getattr(attn_type, 'value', attn_type)} not supported "
                "(cupaged MLA: decoder self-attention only)"
            ),
            "non-MLA not supported": "non-MLA not supported (cupaged's MLA backend serves MLA layers only)",
            "sparse not supported": "sparse not supported (cupaged MLA: dense MLA only, no DeepSeek-V3.2 indexer)",
            "PCP not supported": "PCP not supported (cupaged MLA: no prefill context parallelism)",
            "DCP not supported": "DCP not supported (cupaged MLA: no decode context parallelism)",
        }
        return [detail.get(r, r) for r in reasons]


@dataclass
class CupagedMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata (``block_table`` [reqs, width], ``seq_lens``
    [reqs], no DCP) for every request of the step, and ``step``: the step's
    ``CupagedMetadata`` (the plan, built once on the first layer that asks)."""

    step: CupagedMetadata | None = None


class CupagedMLAMetadataBuilder(_PlanBuilding, AttentionMetadataBuilder[MLACommonMetadata]):
    """``CommonAttentionMetadata`` -> ``MLACommonMetadata``: every request a
    "decode" (``num_decodes = num_reqs``, ``num_decode_tokens =
    num_actual_tokens``, ``num_prefills = 0``, no prefill metadata), so vLLM's
    ``forward_impl`` sends the whole step to ``forward_mqa``; ``decode.step``
    is the step's ``CupagedMetadata``, built as ``CupagedMetadataBuilder``
    builds it (a HostPlan from vLLM's CPU copies of the metadata on the CPU
    build; on CUDA, or with ``device_plans`` True, a plan built on the device
    into stable buffers). No reordering (``reorder_batch_threshold`` None):
    any mix runs in one plan. CUDA graphs: as ``CupagedMetadataBuilder``
    (``ALWAYS`` on CUDA, ``NEVER`` on the CPU)."""

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> MLACommonMetadata:
        m = common_attn_metadata
        n = int(m.num_reqs)
        step = _step_metadata(m, self.device_plans, self._device_plans)
        return MLACommonMetadata(
            num_reqs=n,
            max_query_len=int(m.max_query_len),
            max_seq_len=int(m.max_seq_len),
            num_actual_tokens=int(m.num_actual_tokens),
            query_start_loc=m.query_start_loc,
            slot_mapping=m.slot_mapping,
            num_decodes=n,
            num_decode_tokens=int(m.num_actual_tokens),
            num_prefills=0,
            causal=step.causal,
            head_dim=None,
            prefill=None,
            decode=CupagedMLADecodeMetadata(
                block_table=m.block_table_tensor[:n], seq_lens=m.seq_lens[:n], dcp_tot_seq_lens=None, step=step
            ),
        )


class CupagedMLAImpl(MLAAttentionImpl[MLACommonMetadata]):
    """One MLA layer: its latent (``[..., :R]``) and rotary (``[..., R:]``)
    views of vLLM's per-layer cache, cupaged's ``write_slots`` and ``mla``
    launches."""

    supports_pcp: bool = False
    supports_dcp: bool = False
    can_return_lse_for_decode: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 0,
        qk_nope_head_dim: int = 0,
        qk_rope_head_dim: int = 0,
        qk_head_dim: int = 0,
        v_head_dim: int = 0,
        kv_b_proj: Any = None,
        indexer: object | None = None,
        q_pad_num_heads: int | None = None,
        **extra: Any,
    ) -> None:
        if attn_type != AttentionType.DECODER:
            raise ConfigError(f"attn_type: expected {AttentionType.DECODER.value!r}, got {attn_type!r}")
        refused = dict(extra)
        for name, value in (
            ("alibi_slopes", alibi_slopes),
            ("logits_soft_cap", logits_soft_cap),
            ("kv_sharing_target_layer_name", kv_sharing_target_layer_name),
            ("indexer", indexer),
            ("q_pad_num_heads", q_pad_num_heads),
        ):
            if value is not None:
                refused[name] = value
        if refused:
            raise ConfigError(f"{', '.join(refused)}: not supported by cupaged's vLLM MLA backend")
        if int(num_kv_heads) != 1:
            raise ConfigError(f"num_kv_heads: expected 1 (one latent cache), got {num_kv_heads}")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = 1
        self.kv_lora_rank = int(kv_lora_rank)
        self.qk_rope_head_dim = int(qk_rope_head_dim)
        self.qk_nope_head_dim = int(qk_nope_head_dim)
        self.qk_head_dim = int(qk_head_dim)
        self.v_head_dim = int(v_head_dim)
        self.q_lora_rank = q_lora_rank
        self.kv_b_proj = kv_b_proj
        self.indexer = None
        self.q_pad_num_heads = None
        if not 1 <= self.kv_lora_rank <= MAX_HEAD_DIM:
            raise ConfigError(f"kv_lora_rank: expected 1..{MAX_HEAD_DIM}, got {kv_lora_rank}")
        if not 1 <= self.qk_rope_head_dim <= MAX_ROPE_DIM:
            raise ConfigError(
                f"qk_rope_head_dim: expected 1..{MAX_ROPE_DIM} (cupaged writes and reads a rotary part), "
                f"got {qk_rope_head_dim}"
            )
        if self.head_size != self.kv_lora_rank + self.qk_rope_head_dim:
            raise ConfigError(
                f"head_size: expected kv_lora_rank + qk_rope_head_dim = "
                f"{self.kv_lora_rank + self.qk_rope_head_dim}, got {head_size}"
            )
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = _FP8.get(kv_cache_dtype)
        if kv_cache_dtype not in ("auto", "float16", "bfloat16") and self.fp8 is None:
            raise ConfigError(
                f"kv_cache_dtype: expected one of {CupagedMLABackend.supported_kv_cache_dtypes}, got {kv_cache_dtype!r}"
            )
        self.sliding_window = None if sliding_window is None or sliding_window <= 0 else int(sliding_window)
        # vLLM's forward_impl: no fp8 query (it passes (q_nope absorbed, q_pe) in the model's dtype)
        self.supports_quant_query_input = False

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [num_blocks, block_size, 1, R] and k_rot [num_blocks,
        block_size, 1, P]: views of vLLM's per-layer cache [num_blocks,
        block_size, R + P] (each token's latent then its rotary part; fp8
        caches as the layer's fp8 dtype, whatever vLLM viewed them as): no copy."""
        r, w = self.kv_lora_rank, self.head_size
        if kv_cache.dim() != 3 or int(kv_cache.shape[2]) != w:
            raise ConfigError(
                f"kv_cache: expected shape [num_blocks, block_size, {w}] (kv_lora_rank + qk_rope_head_dim), "
                f"got {list(kv_cache.shape)}"
            )
        if self.fp8 is not None and kv_cache.dtype != self.fp8:
            kv_cache = kv_cache.view(torch.uint8).view(self.fp8)
        c = kv_cache.unsqueeze(2)  # [num_blocks, block_size, 1, R + P]
        return c[..., :r], c[..., r:]

    def _scales(self, k_scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """fp8: vLLM's one per-tensor scale for the whole latent row (both parts)."""
        if self.fp8 is None:
            return {}
        if k_scale is None:
            raise ConfigError(f"k_scale: expected the layer's float32 scale for kv_cache_dtype {self.kv_cache_dtype}")
        s = k_scale.reshape(-1)
        return {"k_scale": s, "v_scale": s}

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
    ) -> None:
        """kv_c_normed [tokens, R] and k_pe [tokens, 1, P] into the cache at
        ``slot_mapping`` [tokens] (block * block_size + offset; -1 skips a
        padded token), in place: one ``write_slots`` launch on the latent and
        rotary views of vLLM's cache (Hkv = 1, D = R, Dv = P; fp8: ``code(x /
        k_scale)`` for both parts, as vLLM's ``concat_and_cache_mla``)."""
        if kv_cache.numel() == 0:
            return
        latent, k_rot = self._caches(kv_cache)
        n = int(slot_mapping.shape[0])
        if k_pe.dim() == 2:
            k_pe = k_pe.unsqueeze(1)
        scales = {k: as_array(v, k) for k, v in self._scales(k_scale).items()}
        write_slots(
            as_array(kv_c_normed[:n].unsqueeze(1), "kv_c_normed"),
            as_array(k_pe[:n], "k_pe"),
            as_array(latent, "kv_cache"),
            as_array(k_rot, "kv_cache"),
            as_array(slot_mapping, "slot_mapping"),
            **_storage(latent),
            **scales,
        )
        KERNEL_CALLS["write_slots"] += 1

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: MLACommonMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: (q_nope absorbed [tokens, H, R], q_pe [tokens, H, P]), or one
        [tokens, H, R + P] tensor -> (out [tokens, H, R], None): the latent
        average of each query, which vLLM multiplies by ``W_UV``. One
        ``plan.mla`` launch for every token of the step; on the host path,
        rows past the step's real tokens are 0."""
        r = self.kv_lora_rank
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q[..., :r], q[..., r:]
        tokens, heads = int(q_nope.shape[0]), int(q_nope.shape[1])
        if heads != self.num_heads or int(q_nope.shape[2]) != r or int(q_pe.shape[2]) != self.qk_rope_head_dim:
            raise ConfigError(
                f"q: expected [tokens, {self.num_heads}, {r}] and [tokens, {self.num_heads}, "
                f"{self.qk_rope_head_dim}], got {list(q_nope.shape)} and {list(q_pe.shape)}"
            )
        # a new tensor a step, as vLLM's forward_impl makes its own (per-layer buffers of [tokens, H, R] would
        # cost layers x max_num_batched_tokens x H x R x 2 bytes: gigabytes for DeepSeek-V3)
        out = q_nope.new_empty((tokens, heads, r))
        decode = attn_metadata.decode
        step = getattr(decode, "step", None)
        if not isinstance(step, CupagedMetadata):
            raise ConfigError(
                "attn_metadata: expected the metadata of CupagedMLAMetadataBuilder (decode.step), "
                f"got {type(attn_metadata).__name__}"
            )
        # the device path's plan covers every row (padding rows get 0); the host path the real ones
        n = tokens if step.device is not None else min(step.queries, tokens)
        if n < tokens:
            out[n:].zero_()
        if n == 0:
            return out, None
        # q_pe is the rotary tail of vLLM's [tokens, H, nope + P] query: read in place at its strides
        q_nope, q_pe = q_nope[:n], q_pe[:n]
        latent, k_rot = self._caches(kv_c_and_k_pe_cache)
        plan = step.plan(q_nope, page_size=int(latent.shape[1]), num_pages=int(latent.shape[0]))
        options: dict[str, Any] = dict(self._scales(getattr(layer, "_k_scale", None)))
        if self.sliding_window is not None:
            options["window"] = self.sliding_window
        plan.mla(q_nope, q_pe, latent, k_rot, self.scale, step.causal, out=out[:n], **options)
        KERNEL_CALLS["mla"] += 1
        return out, None

    def forward_mha(self, *args: Any, **kwargs: Any) -> None:
        """Not used: CupagedMLAMetadataBuilder puts every token on the MQA path."""
        raise NotImplementedError(
            "cupaged's vLLM MLA backend runs prefills on the absorbed (MQA) path; forward_mha is not used"
        )


def _storage(cache: torch.Tensor) -> dict[str, Any]:
    """``kv_dtype`` for an fp8 cache that travels as raw uint8 (CUDA)."""
    fmt = fp8_format(cache)
    if fmt is None or str(as_array(cache, "kv_cache").dtype) != "uint8":
        return {}
    return {"kv_dtype": fmt}
