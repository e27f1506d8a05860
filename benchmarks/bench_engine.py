"""cupaged.Engine benchmark: prefill and decode tokens/s and host time per
decode token at batch 1, 8 and 64, for a Llama shape with random weights.

    python benchmarks/bench_engine.py               # GPU: Llama-3.2-1B shape, bf16
    python benchmarks/bench_engine.py --shape 8b    # GPU: Llama-3.1-8B shape
    python benchmarks/bench_engine.py --cpu         # CPU backend: a tiny Llama shape (smoke run)

Each batch B runs ``engine.generate`` on B prompts of ``--prompt`` tokens
with ``--new`` new tokens each, no stop tokens, twice: a warm-up (kernels
compiled, one decode graph captured per bucket) and the measured run (other
prompts, so nothing comes from the prefix cache). prefill_tok_s: prompt
tokens / prefill time (each chunk timed to its end on the device);
decode_tok_s: tokens of the decode launches / their time up to each
readback (every 8 launches); host_us_per_step: host time of one
``DecodeBatch.advance`` (one copy + one graph launch, without waiting),
host_us_per_token the same per sequence; graph_launches_per_token: decode
graph launches per generated token (1 / B: one launch serves every
sequence). kernels_per_step (CPU backend): the kernel launches one decode
graph replays (on the GPU the graph also holds the projections' cuBLAS
products, 7 per layer and the LM head); prefill_launches_per_chunk: eager
kernel launches per prefill chunk of the measured run. roofline_decode_tok_s
(GPU): B x the measured copy bandwidth / (weight bytes + the batch's K/V
bytes at the mean context), the memory-bound ceiling of a decode step (no
modeled_* columns: cupaged.tools.perf_model models cupaged's kernels, and a
decode step's time is mostly the cuBLAS products).

Compare on the same GPU, model shape and batch with vLLM and SGLang decode
tokens/s (docs/performance.md, "Engine").

A real model against transformers, side by side in one run::

    python benchmarks/bench_engine.py --cpu --model /path/to/SmolLM2-135M --vs-transformers
    python benchmarks/bench_engine.py --cpu --model model.gguf --vs-transformers --batch 1 8 --prompt-tokens 256

``--model``: a model folder (config.json + safetensors) or a ``.gguf`` file,
float32 unless ``--dtype``. For each batch B (``--batch``, default 1 and 8):
decode tokens/s of B prompts of ``--decode-prompt`` tokens generating
``--new`` tokens each, no stop tokens; then the time of one
``--prompt-tokens`` prefill (and its first token). Each measurement runs
after a warm-up of the same shape (kernels compiled, graphs captured), so
compile time stays out of the figures; the best of ``--repeats`` runs counts.
cupaged: decode from ``engine.stats`` (decode tokens / decode seconds,
readbacks included), prefill = prefill seconds. transformers
(``--vs-transformers``, torch on the CPU with ``torch.set_num_threads`` =
the CPUs, the same as the CPU backend's BLAS and kernel workers):
``generate`` greedy with ``min_new_tokens = max_new_tokens``; decode
tokens/s = B x (new - 1) / (time(new) - time(1)), prefill = time of a
``max_new_tokens=1`` generate. Ratios are cupaged / transformers for
tokens/s and cupaged time / transformers time for the prefill.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import benchlib  # noqa: I001
import numpy as np

import cupaged
from cupaged.engine import Checkpoint, parse_config
from cupaged.testing import random_weights

SHAPES = {
    # Llama-3.2-1B and Llama-3.1-8B (dims from their config.json), random weights
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    # the CPU smoke shape: the same structure (GQA 4, llama3 rope), tiny sizes
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1024,
        tie_word_embeddings=True,
    ),
}


def llama_config(shape: str, max_len: int) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_len,
        "bos_token_id": 1,
        "eos_token_id": None,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg.update(SHAPES[shape])
    return cfg


def fast_random_weights(cfg: dict, dtype) -> dict:
    """Weights for timing: each tensor a tiled block of random normals
    (std 0.02, norms 1): values do not matter, generation time does."""
    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32).astype(dtype)
    shapes = {k: v.shape for k, v in random_weights(_shrunk(cfg), dtype="float32").items()}
    out = {}
    for name in shapes:
        shape = _full_shape(name, cfg)
        out[name] = np.ones(shape, dtype) if name.endswith("norm.weight") else np.resize(pool, shape)
    return out


def _shrunk(cfg: dict) -> dict:
    """A one-layer copy of cfg whose tensor names are those of layer 0."""
    return dict(
        cfg,
        num_hidden_layers=1,
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        head_dim=2,
        num_attention_heads=cfg["num_attention_heads"] // cfg["num_key_value_heads"],
        num_key_value_heads=1,
    )


def _full_shape(name: str, cfg: dict) -> tuple:
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    table = {
        "embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "norm.weight": (H,),
        "q_proj.weight": (q, H),
        "k_proj.weight": (kv, H),
        "v_proj.weight": (kv, H),
        "o_proj.weight": (H, q),
        "gate_proj.weight": (F, H),
        "up_proj.weight": (F, H),
        "down_proj.weight": (H, F),
    }
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    raise KeyError(name)


def all_layers(w: dict, layers: int) -> dict:
    out = {k: v for k, v in w.items() if ".layers." not in k}
    for i in range(layers):
        for k, v in w.items():
            if k.startswith("model.layers.0."):
                out[k.replace("model.layers.0.", f"model.layers.{i}.")] = v
    return out


def _roofline(engine, batch: int, ctx: int, bw) -> str:
    """Decode tokens/s if a step only moved its bytes at the measured copy
    bandwidth: every weight once, plus each sequence's K/V at the mean
    context. An upper bound, not a model (perf_model models cupaged's kernels,
    not cuBLAS)."""
    if bw is None:
        return "-"
    c = engine.config
    kv = batch * ctx * c.layers * 2 * c.kv_heads * c.head_dim * engine.dtype.itemsize
    return f"{batch * bw / (engine.model.weight_bytes + kv):.0f}"


class LaunchCounter:
    """Counts kernel launches issued on a stream (eager work only: a graph
    replays its recorded launches without calling Stream.launch)."""

    def __init__(self, stream):
        self.n, self.stream, self.real = 0, stream, stream.launch

        def launch(*a, **kw):
            self.n += 1
            return self.real(*a, **kw)

        stream.launch = launch

    def close(self):
        del self.stream.launch


def _best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def _cupaged_model(args, be, dtype, max_batch: int, max_len: int):
    like = be.asarray(np.zeros(1, np.float32))
    return cupaged.Engine.from_pretrained(
        args.model,
        like=like,
        dtype=dtype,
        max_batch=max_batch,
        prefill_chunk=max(args.prompt_tokens, 16),
        max_model_len=max_len,
        num_pages=2 * max_batch * -(-max_len // 16) + 8,
    )


def _cupaged_figures(engine, args, rng) -> dict:
    """decode tokens/s per batch and the prefill seconds of cupaged."""
    vocab = engine.config.vocab
    out = {}

    def decode(b):
        prompts = [rng.integers(2, vocab, args.decode_prompt).tolist() for _ in range(b)]
        engine.generate(prompts, args.new, stop_token_ids=())
        s = engine.stats
        return -s["decode_tokens"] / s["decode_seconds"]

    def prefill():
        engine.generate([rng.integers(2, vocab, args.prompt_tokens).tolist()], 1, stop_token_ids=())
        return engine.stats["prefill_seconds"]

    for b in args.batch:
        decode(b)  # warm-up: kernels compiled, this bucket's graph captured
        out[f"decode_b{b}"] = -_best(lambda b=b: decode(b), args.repeats)
    prefill()
    out["prefill"] = _best(prefill, args.repeats)
    return out


def _transformers_figures(args, dtype, rng) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype.name]
    path = Path(args.model)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=tdt)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=tdt)
    model.eval()
    vocab = model.config.vocab_size

    def gen(b, length, new):
        ids = torch.from_numpy(rng.integers(2, vocab, (b, length)))
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        return time.perf_counter() - t

    out = {}
    for b in args.batch:
        gen(b, args.decode_prompt, args.new)  # warm-up
        full = _best(lambda b=b: gen(b, args.decode_prompt, args.new), args.repeats)
        first = _best(lambda b=b: gen(b, args.decode_prompt, 1), args.repeats)
        out[f"decode_b{b}"] = b * (args.new - 1) / max(full - first, 1e-9)
    gen(1, args.prompt_tokens, 1)
    out["prefill"] = _best(lambda: gen(1, args.prompt_tokens, 1), args.repeats)
    return out


def model_main(args) -> int:
    """--model: a real checkpoint, optionally side by side with transformers."""
    be = benchlib.backend(args.cpu, flush=False)
    dtype = benchlib.dtype_of(args.dtype or "f32", be)
    max_batch = max(args.batch)
    max_len = max(args.prompt_tokens + 1, args.decode_prompt + args.new) + 16
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    engine = _cupaged_model(args, be, dtype, max_batch, max_len)
    c = engine.config
    print(
        f"device: {be.device}; {args.model}: {c.architecture}, {c.layers} layers, hidden {c.hidden}, heads "
        f"{c.heads}/{c.kv_heads} x {c.head_dim}, ffn {c.ffn}, vocab {c.vocab}, {dtype.name}; threads "
        f"{os.cpu_count()}; engine built in {time.perf_counter() - t0:.1f} s; load average at start "
        f"{' '.join(f'{x:.2f}' for x in load) if load else '-'}",
        flush=True,
    )
    rng = np.random.default_rng(1)
    ours = _cupaged_figures(engine, args, rng)
    print("cupaged: " + ", ".join(f"{k} {v:.3g}" for k, v in ours.items()), flush=True)
    del engine
    theirs = _transformers_figures(args, dtype, rng) if args.vs_transformers else {}
    rows = []
    for b in args.batch:
        k = f"decode_b{b}"
        rows.append(
            dict(
                figure=f"decode tok/s, batch {b}",
                cupaged=f"{ours[k]:.2f}",
                transformers=f"{theirs[k]:.2f}" if theirs else "-",
                ratio=f"{ours[k] / theirs[k]:.2f}x" if theirs else "-",
            )
        )
    rows.append(
        dict(
            figure=f"prefill {args.prompt_tokens} tokens, s",
            cupaged=f"{ours['prefill']:.3f}",
            transformers=f"{theirs['prefill']:.3f}" if theirs else "-",
            ratio=f"{ours['prefill'] / theirs['prefill']:.2f}x time" if theirs else "-",
        )
    )
    print()
    print(benchlib.table(rows, list(rows[0])))
    end = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(
        f"(decode: {args.decode_prompt}-token prompts, {args.new} new tokens; best of {args.repeats}; load average "
        f"at end {' '.join(f'{x:.2f}' for x in end) if end else '-'}: other work on the machine slows both sides)"
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU backend, tiny shape")
    p.add_argument("--model", default=None, help="a model folder or .gguf file (instead of a random --shape)")
    p.add_argument("--vs-transformers", action="store_true", help="with --model: transformers side by side")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="with --model: decode batches")
    p.add_argument("--prompt-tokens", type=int, default=256, help="with --model: the timed prefill's tokens")
    p.add_argument("--decode-prompt", type=int, default=32, help="with --model: prompt tokens of the decode runs")
    p.add_argument("--repeats", type=int, default=2, help="with --model: measured runs per figure (best counts)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="(default: 1b on the GPU, tiny on --cpu)")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512 GPU, 16 CPU)")
    p.add_argument("--new", type=int, default=None, help="new tokens (default 128 GPU, 8 CPU)")
    p.add_argument("--dtype", default=None, choices=["f32", "f16", "bf16"], help="(default bf16 GPU, f32 CPU)")
    args = p.parse_args(argv)
    if args.model is not None:
        if args.new is None:
            args.new = 32
        return model_main(args)
    if args.vs_transformers:
        p.error("--vs-transformers needs --model")
    be = benchlib.backend(args.cpu, flush=False)
    shape = args.shape or ("tiny" if args.cpu else "1b")
    prompt = args.prompt or (16 if args.cpu else 512)
    new = args.new or (8 if args.cpu else 128)
    dtype = benchlib.dtype_of(args.dtype or ("f32" if args.cpu else "bf16"), be)
    batches = [int(b) for b in args.batches.split(",")]
    max_batch = max(batches)
    max_len = prompt + new
    cfg_dict = llama_config(shape, max_len)
    cfg = parse_config(cfg_dict)
    t0 = time.perf_counter()
    weights = all_layers(fast_random_weights(cfg_dict, dtype), cfg.layers)
    like = be.asarray(np.zeros(1, np.float32))
    pages = 2 * max_batch * -(-max_len // 16) + 8
    engine = cupaged.Engine(
        cfg,
        Checkpoint.from_state_dict(weights),
        like=like,
        dtype=dtype,
        max_batch=max_batch,
        num_pages=pages,
        prefill_chunk=64 if args.cpu else 512,
        max_model_len=max_len,
    )
    del weights
    print(
        f"device: {be.device}; Llama shape '{shape}': {cfg.layers} layers, hidden {cfg.hidden}, heads "
        f"{cfg.heads}/{cfg.kv_heads} x {cfg.head_dim}, ffn {cfg.ffn}, vocab {cfg.vocab}, {dtype.name}; "
        f"prompt {prompt}, {new} new tokens; engine built in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    bw = None if args.cpu else benchlib.copy_bandwidth(be)
    rng = np.random.default_rng(1)
    rows = []
    for b in batches:
        for _run in ("warm-up", "measured"):
            prompts = [rng.integers(2, cfg.vocab, prompt).tolist() for _ in range(b)]
            counter = LaunchCounter(engine.stream)
            try:
                out = engine.generate(prompts, new, stop_token_ids=())
            finally:
                counter.close()
        s = engine.stats
        assert all(len(o) == new for o in out)
        batch = engine._batches[()]
        graph = batch._graphs.get(next(x for x in batch.buckets if x >= b))  # the full batch's graph
        launches = max(s["decode_launches"], 1)
        rows.append(
            dict(
                batch=b,
                prefill_tok_s=f"{s['prefill_tokens'] / s['prefill_seconds']:.0f}",
                decode_tok_s=f"{s['decode_tokens'] / s['decode_seconds']:.0f}",
                host_us_per_step=f"{s['advance_seconds'] / launches * 1e6:.0f}",
                host_us_per_token=f"{s['advance_seconds'] / max(s['decode_tokens'], 1) * 1e6:.1f}",
                graph_launches_per_token=f"{launches / max(s['decode_tokens'], 1):.3f}",
                kernels_per_step=graph.graph.num_ops if graph is not None and not engine.model.gpu else "-",
                prefill_launches_per_chunk=f"{counter.n / max(s['prefill_chunks'], 1):.0f}",
                captures=batch.captures,
                roofline_decode_tok_s=_roofline(engine, b, prompt + new // 2, bw),
            )
        )
        print(benchlib.table([rows[-1]], list(rows[-1])).splitlines()[-1], flush=True)
    print()
    print(benchlib.table(rows, list(rows[0])))
    if args.cpu:
        print(
            "(CPU backend: the figures above are the emulator's, not a GPU's; its stream runs the kernels inside "
            "advance(), so host_us includes them; kernels_per_step and the launch counts are what the GPU "
            "replays too)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
