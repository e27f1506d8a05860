"""The end-to-end vLLM run of tests/integrations/test_vllm_e2e.py, in a fresh
process: ``python vllm_e2e_child.py <folder>``. It never calls cupaged's
``register``: vLLM must load it through the ``vllm.general_plugins`` entry
point (the test puts one on PYTHONPATH). For a small random Llama (GQA) and
Qwen3 (MQA, q/k norms) written with ``cupaged.testing.write_random_checkpoint``
it runs the same prompts under vLLM's own CPU backend and under CUSTOM
(cupaged; for the Llama also CUSTOM with plans built on the device,
``CupagedMetadataBuilder.device_plans``), greedy, in this one process (the engine in-process, so
cupaged's launch counter is visible here), and prints ``RESULT <json>``:
tokens, sampled-token logprobs, cupaged launches per run, and whether the
plugin was registered and the CPU platform patched."""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the counter is ours

#: Prompt lengths: one under a block, several blocks, one longer than a step's token budget (chunked).
PROMPT_LENS = (3, 17, 40, 75)
MAX_TOKENS = 5
MODELS = {
    "llama": ("LlamaForCausalLM", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3ForCausalLM", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
}


def main(root: str) -> None:
    t0 = time.time()
    from cupaged.testing import write_random_checkpoint

    folders = {
        name: write_random_checkpoint(os.path.join(root, name), arch, **kw) for name, (arch, kw) in MODELS.items()
    }
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + n) % 250 + 1 for i in range(n)]) for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=1, detokenize=False)
    report: dict = {"runs": {}}
    for name, folder in folders.items():
        # CUSTOM-device: cupaged with its plans built on the device (what vLLM's CUDA build runs), on one model
        runs = ("CPU_ATTN", "CUSTOM", "CUSTOM-device") if name == "llama" else ("CPU_ATTN", "CUSTOM")
        for run in runs:
            from cupaged.integrations.vllm import KERNEL_CALLS, CupagedMetadataBuilder

            backend = run.split("-")[0]
            CupagedMetadataBuilder.device_plans = True if run == "CUSTOM-device" else None
            before = dict(KERNEL_CALLS)
            t = time.time()
            llm = LLM(
                model=str(folder),
                skip_tokenizer_init=True,
                enforce_eager=True,
                dtype="float32",
                block_size=32,
                max_model_len=128,
                max_num_batched_tokens=32,
                max_num_seqs=8,
                gpu_memory_utilization=0.3,
                kv_cache_memory_bytes=32 << 20,
                attention_backend=backend,
            )
            outs = llm.generate(prompts, params)
            report["runs"][f"{name}/{run}"] = {
                "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [
                    [lp[tok].logprob for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs
                ],
                "calls": {k: v - before.get(k, 0) for k, v in KERNEL_CALLS.items()},
                "seconds": time.time() - t,
            }
            del llm
            gc.collect()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import cupaged.integrations.vllm as cv

    report["registered"] = AttentionBackendEnum.CUSTOM.get_path() == cv.BACKEND_PATH
    report["patched"] = getattr(CpuPlatform.get_attn_backend_cls, "_cupaged_original", None) is not None
    report["seconds"] = time.time() - t0
    print("RESULT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
