"""Command line: ``python -m cupaged demo``, ``python -m cupaged check OP`` and
``python -m cupaged generate --model DIR --prompt TEXT``.

demo: a tiny Llama-style decoder with seeded random weights prefills a batch
of prompts in chunks, then decodes greedily through the paged decode graph,
and checks every token against a float64 NumPy reference model. GPU when
CuPy sees one, else the CPU backend (the same CUDA C kernels through g++).

check: one kernel on random data against the float64 reference, with its
error and time: the standalone kernel test.

generate: greedy generation with a local Hugging Face model folder (or a
``.gguf`` file) through cupaged.Engine: text in and out with the folder's
tokenizer.json (the GGUF file's tokenizer) when the ``tokenizers`` package is
installed, token ids otherwise; tokens print as they are read back, then a
line with prefill and decode tokens/s.

Errors: a refused input, checkpoint, config or environment (a cupaged
error) prints one line and exits with status 2; anything else is a bug in
cupaged and prints one line and exits with status 1. --traceback (before or
after the command) or CUPAGED_TRACEBACK=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import (
    CheckpointError,
    CompileError,
    ConfigError,
    Engine,
    HostPlan,
    KernelError,
    PagedAttentionError,
    SetupError,
    SplitWorkspace,
    __version__,
    argmax_into,
    stream_for,
)
from ._runtime import progress, xp_of
from .demo import tiny
from .engine import parse_config
from .engine.gguf import is_gguf
from .engine.text import Detokenizer, TextCodec
from .sampling import SamplingParams
from .testing import as_dtype, make_mla_case, make_paged_case, reference, tolerance

#: Set (to anything but 0) for the traceback of every error, as --traceback.
TRACEBACK_ENV = "CUPAGED_TRACEBACK"
#: What a refused input or a broken environment raises: one line, exit status 2.
REFUSED = (PagedAttentionError, ConfigError, CheckpointError, CompileError, SetupError, KernelError)


def _like(force_cpu: bool):
    if not force_cpu:
        try:
            import cupy

            if cupy.cuda.is_available():
                # CUDA cannot capture the legacy default stream (the demo's decode graph):
                # make a stream of our own current for the rest of the process.
                cupy.cuda.Stream(non_blocking=True).use()
                return cupy.zeros(1, np.float32), "gpu"
        except Exception:  # no CuPy, no driver: the CPU backend
            pass
    return np.zeros(1, np.float32), "cpu"


def _sync(like):
    stream_for(like).synchronize()


def cmd_demo(args: argparse.Namespace) -> int:
    like, backend = _like(args.cpu)
    cfg = tiny.TinyConfig(
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        ffn=2 * args.hidden,
        max_pos=max(1024, args.prompt_max + args.tokens + 8),
        mla=args.mla,
        latent_dim=args.latent_dim,
        rope_dim=args.rope_dim,
        nope_dim=args.head_dim,
        v_head_dim=args.head_dim,
    )
    dtype = {"f32": np.float32}[args.dtype]
    weights = tiny.rounded(tiny.init_weights(cfg, seed=args.seed), dtype)
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(max(1, args.prompt_max // 3), args.prompt_max + 1, size=args.batch)
    prompts = [rng.integers(0, cfg.vocab, size=int(n)).tolist() for n in lens]
    pages = int(sum(-(-(int(n) + args.tokens) // args.page_size) for n in lens)) + 4
    attn = (
        f"MLA: {cfg.heads} heads, latent {cfg.latent_dim}, rotary {cfg.rope_dim}"
        if cfg.mla
        else f"GQA: {cfg.heads}/{cfg.kv_heads} heads x {cfg.head_dim}"
    )
    print(
        f"cupaged demo on the {backend} backend: {cfg.layers} layers, hidden {cfg.hidden}, {attn}, "
        f"vocab {cfg.vocab}, {args.dtype}"
    )
    print(
        f"batch {args.batch}, prompt lengths {lens.tolist()}, prefill chunk {args.chunk}, "
        f"{args.tokens} new tokens each, page size {args.page_size}, {pages} pages"
    )
    model = tiny.TinyModel(
        cfg,
        weights,
        like,
        dtype=dtype,
        num_pages=pages,
        page_size=args.page_size,
        max_rows=max(args.batch, args.batch * args.chunk),
    )
    t0 = time.perf_counter()

    def progress(i):
        if args.tokens >= 32 and i % max(1, args.tokens // 8) == 0:
            print(f"  step {i}/{args.tokens - 1}", flush=True)

    tokens, loop = tiny.generate(model, prompts, args.tokens, chunk=args.chunk, graph=not args.eager, on_step=progress)
    _sync(like)
    total = time.perf_counter() - t0
    # time the decode steps alone (host + device), after the first run compiled everything
    t1 = time.perf_counter()
    steps = min(loop.steps_left, args.tokens)
    for _ in range(steps):
        loop.advance()
    _sync(like)
    per_step = (time.perf_counter() - t1) / max(steps, 1)
    exact, ok = tiny.check_tokens(cfg, weights, prompts, tokens)
    for s in range(args.batch):
        print(f"  seq {s}: {tokens[s].tolist()}")
    mode = "eager" if args.eager else "one graph launch per token"
    print(
        f"decode ({mode}): {per_step * 1e3:.2f} ms per step, {args.batch / per_step:.1f} tokens/s "
        f"(batch {args.batch}); whole run incl. compile and prefill {total:.1f} s"
    )
    print(
        f"tokens matching the float64 reference argmax: {exact}/{tokens.size}; "
        f"all within a {1e-3} logit margin: {'yes' if ok else 'NO'}"
    )
    return 0 if ok else 1


def cmd_check(args: argparse.Namespace) -> int:
    like, backend = _like(args.cpu)
    xp = xp_of(like)
    rng = np.random.default_rng(args.seed)
    dt = as_dtype(args.dtype)
    if args.op == "argmax":
        logits = rng.standard_normal((args.batch, args.vocab)).astype(dt)
        out = xp.zeros(args.batch, np.int64)
        dev = xp.asarray(logits)
        t = _timed(like, lambda: argmax_into(dev, out), args.repeat)
        bad = int((_host(out) != reference.row_argmax(logits)).sum())
        print(
            f"argmax [{args.batch}, {args.vocab}] {args.dtype} on {backend}: {bad} mismatching rows, {t * 1e3:.3f} ms"
        )
        return int(bad != 0)
    q_lens = None if args.q_len == 1 else args.q_len
    if args.op == "mla":
        mcase = make_mla_case(
            rng,
            sequences=args.batch,
            max_kv_len=args.context,
            page_size=args.page_size,
            num_heads=args.heads,
            latent_dim=args.head_dim,
            pos_dim=args.rope_dim,
            dtype=dt,
            q_lens=q_lens,
        )
        mplan = HostPlan.build(mcase.page_table, mcase.kv_lens, mcase.q_lens, args.page_size, mcase.num_pages)
        dm = mplan.upload(like)
        mq, mq_pos, mlatent, mk_pos = (xp.asarray(a) for a in (mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos))
        scale = 1.0 / np.sqrt(192)
        out = xp.zeros(mcase.q.shape, dt)
        ws = SplitWorkspace(mplan.queries, args.heads, args.head_dim, args.splits, like) if args.splits > 1 else None
        t = _timed(like, lambda: dm.mla(mq, mq_pos, mlatent, mk_pos, scale, True, out=out, workspace=ws), args.repeat)
        exp_out, _ = reference.paged_mla(
            mcase.q, mcase.q_pos, mcase.latent, mcase.k_pos, mcase.page_table, mcase.kv_lens, mcase.q_lens, scale, True
        )
        err, ok = _max_error(out, exp_out, dt)
        print(
            f"mla: {mplan.queries} queries x {args.heads} heads, R {args.head_dim}, P {args.rope_dim}, "
            f"{args.dtype}, splits {args.splits} on {backend}: max |out - ref| {err:.2e} "
            f"({'ok' if ok else 'TOO LARGE'}), {t * 1e3:.3f} ms"
        )
        return 0 if ok else 1
    heads = args.kv_heads if args.op == "append" else args.heads
    case = make_paged_case(
        rng,
        sequences=args.batch,
        max_kv_len=args.context,
        page_size=args.page_size,
        num_q_heads=heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=dt,
        q_lens=q_lens,
    )
    plan = HostPlan.build(case.page_table, case.kv_lens, case.q_lens, args.page_size, case.num_pages)
    dplan = plan.upload(like)
    q, k, v = (xp.asarray(a) for a in (case.q, case.k_cache, case.v_cache))
    scale = 1.0 / np.sqrt(args.head_dim)
    if args.op in ("attention", "merge"):
        splits = args.splits
        ws = SplitWorkspace(plan.queries, args.heads, args.head_dim, splits, like) if splits > 1 else None
        out = xp.zeros(q.shape[:2] + (args.head_dim,), dt)
        lse = xp.zeros(q.shape[:2], np.float32)
        t = _timed(like, lambda: dplan.attention(q, k, v, scale, True, workspace=ws, out=out, lse=lse), args.repeat)
        exp_out, exp_lse = reference.paged_attention(
            case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens, scale, True
        )
        err, ok = _max_error(out, exp_out, dt)
        lerr = float(np.max(np.abs(_host(lse) - exp_lse))) if exp_lse.size else 0.0
        print(
            f"{args.op}: {plan.queries} queries x {args.heads}/{args.kv_heads} heads x d{args.head_dim}, "
            f"context <= {args.context}, page {args.page_size}, {args.dtype}, splits {splits}, on {backend}: "
            f"max |out - ref| {err:.2e}, max |lse - ref| {lerr:.2e} ({'ok' if ok else 'TOO LARGE'}), "
            f"{t * 1e3:.3f} ms"
        )
        return 0 if ok else 1
    # append
    new_k = rng.standard_normal((plan.queries, args.kv_heads, args.head_dim)).astype(dt)
    new_v = rng.standard_normal((plan.queries, args.kv_heads, args.head_dim)).astype(dt)
    exp_k, exp_v = reference.paged_append(
        new_k, new_v, case.k_cache, case.v_cache, case.page_table, case.kv_lens, case.q_lens
    )
    nk, nv = xp.asarray(new_k), xp.asarray(new_v)
    t = _timed(like, lambda: dplan.append(nk, nv, k, v), args.repeat)
    same = np.array_equal(_host(k).astype(np.float64), exp_k, equal_nan=True) and np.array_equal(
        _host(v).astype(np.float64), exp_v, equal_nan=True
    )
    print(
        f"append: {plan.queries} rows x {args.kv_heads} heads x d{args.head_dim} {args.dtype} on {backend}: "
        f"{'bit-exact' if same else 'MISMATCH'}, {t * 1e3:.3f} ms"
    )
    return 0 if same else 1


def _prompt_ids(text: str) -> list[int] | None:
    parts = text.replace(",", " ").split()
    if not parts or not all(p.isascii() and p.isdigit() for p in parts):  # (not '²', '١')
        return None
    return [int(p) for p in parts]


#: --dtype spellings: cupaged's short names and NumPy / torch's long ones.
DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "float32": "float32", "float16": "float16"}
DTYPES["bfloat16"] = "bfloat16"


def _sampling(args: argparse.Namespace):
    """The CLI's SamplingParams: greedy unless --temperature is above 0."""
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prog = "python -m cupaged generate"
    if args.quiet:
        progress.set_quiet(True)
    like, backend = _like(args.cpu)
    codec, no_tok = (None, "--ids was given") if args.ids else TextCodec.for_model(args.model)
    if args.chat and codec is None:
        print(f"{prog}: --chat: expected a model with a tokenizer ({no_tok})", file=sys.stderr)
        return 2
    prompts = []
    for text in args.prompt:
        ids = codec.encode(text, chat=args.chat) if codec is not None else _prompt_ids(text)
        if ids is None:
            print(f"{prog}: --prompt: expected token ids like '1 2 3' ({no_tok}), got {text!r}", file=sys.stderr)
            return 2
        prompts.append(ids)
    sampling = _sampling(args)  # (checked before the model loads)
    longest = max(len(ids) for ids in prompts)
    max_len = (
        min(longest + args.max_new_tokens, _model_limit(args.model))
        if args.max_model_len is None
        else args.max_model_len
    )
    pages = -(-max_len // args.page_size) + 1
    engine = Engine.from_pretrained(
        args.model,
        like=like,
        dtype=None if args.dtype is None else DTYPES[args.dtype],
        max_batch=len(prompts),
        page_size=args.page_size,
        max_model_len=max_len,
        num_pages=pages * len(prompts),
    )
    c = engine.config
    lens = ", ".join(str(len(ids)) for ids in prompts)
    print(
        f"{c.architecture} on the {backend} backend: {c.layers} layers, hidden {c.hidden}, "
        f"{engine.dtype.name}; prompt{'s' if len(prompts) > 1 else ''} {lens} tokens, up to "
        f"{args.max_new_tokens} new",
        flush=True,
    )
    one = len(prompts) == 1
    streams = [Detokenizer(codec, ids) for ids in prompts] if codec is not None else []
    got: list[list[int]] = [[] for _ in prompts]

    def show(i, new):
        got[i].extend(new)
        if not one:
            return
        if codec is None:
            print(" ".join(map(str, new)), end=" ", flush=True)
        else:
            print(streams[i].push(new), end="", flush=True)

    if one and codec is not None:
        print(codec.decode(prompts[0]), end="", flush=True)  # the prompt as the tokenizer reads it
    engine.generate(prompts, args.max_new_tokens, sampling=sampling, on_tokens=show)
    if one:
        if codec is not None:
            print(streams[0].flush(), end="")
        print()
    else:
        for i, ids in enumerate(prompts):
            body = " ".join(map(str, got[i])) if codec is None else codec.decode(ids) + codec.decode(got[i])
            print(f"[{i}] {body}")
    s = engine.stats
    pre = s["prefill_tokens"] / s["prefill_seconds"] if s["prefill_seconds"] else float("inf")
    dec = s["decode_tokens"] / s["decode_seconds"] if s["decode_seconds"] else float("inf")
    print(
        f"prefill: {s['prefill_tokens']} tokens in {s['prefill_seconds']:.3f} s ({pre:.1f} tokens/s); "
        f"decode: {s['decode_tokens']} tokens in {s['decode_seconds']:.3f} s ({dec:.1f} tokens/s, "
        f"{s['decode_launches']} graph launches)"
        + (f"; compiling kernels: {s['compile_seconds']:.1f} s, not counted" if s.get("compile_seconds") else "")
    )
    return 0


def _model_limit(folder: str) -> int:
    """The model's longest sequence (engine checks come later, with the config)."""
    try:
        if is_gguf(folder):
            from .engine.gguf import gguf_config, open_gguf

            return gguf_config(open_gguf(folder)).max_len
        return parse_config(json.loads((Path(folder) / "config.json").read_text())).max_len
    except Exception:  # noqa: BLE001 -- the engine reports the real error with its message
        return 1 << 30


def _host(a):
    """A host (NumPy) copy of a result array of either backend."""
    return a if isinstance(a, np.ndarray) else sys.modules["cupy"].asnumpy(a)


def _max_error(got, expected, dt) -> tuple[float, bool]:
    """(max |got - expected|, within the dtype's tolerance)."""
    err = float(np.max(np.abs(_host(got).astype(np.float64) - expected))) if expected.size else 0.0
    atol, rtol = tolerance(dt)
    return err, err <= atol + rtol * float(np.max(np.abs(expected), initial=0))


def _timed(like, fn, repeat: int) -> float:
    fn()  # compile + warm up
    _sync(like)
    times = []
    for _ in range(max(1, repeat)):
        t = time.perf_counter()
        fn()
        _sync(like)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


class _Parser(argparse.ArgumentParser):
    """Errors as one line naming the flag and what it takes (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


def _int_in(lo: int, hi: int, what: str = "an integer"):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} from {lo} to {hi}, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} from {lo} to {hi}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _float_in(lo: float, hi: float, low_open: bool = False):
    def parse(text: str) -> float:
        span = f"{'above' if low_open else 'from'} {lo:g} {'and at most' if low_open else 'to'} {hi:g}"
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {span}, got {text!r}") from None
        if not (v > lo if low_open else v >= lo) or not v <= hi:
            raise argparse.ArgumentTypeError(f"expected a number {span}, got {text}")
        return v

    parse.__name__ = "float"
    return parse


def _even_in(lo: int, hi: int):
    base = _int_in(lo, hi, "an even integer")

    def parse(text: str) -> int:
        v = base(text)
        if v % 2:
            raise argparse.ArgumentTypeError(f"expected an even integer from {lo} to {hi}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _opt(p, flag, type_, default, help_):
    p.add_argument(flag, type=type_, default=default, help=f"{help_} (default {default})")


def _traceback_flag(p, default=argparse.SUPPRESS):
    """--traceback (a subcommand's default leaves the top level's in place)."""
    p.add_argument(
        "--traceback",
        action="store_true",
        default=default,
        help=f"on an error, print its traceback, not one line (or set {TRACEBACK_ENV}=1)",
    )


def _demo_parser(sub):
    d = sub.add_parser(
        "demo",
        help="tiny decoder: chunked prefill + graph decode, checked against float64",
        description="A tiny Llama-style decoder (or DeepSeek-style MLA with --mla): chunked "
        "prefill, then greedy decode through the paged decode graph, every token "
        "checked against a float64 reference.",
    )
    _opt(d, "--batch", _int_in(1, 1024), 3, "sequences")
    _opt(d, "--tokens", _int_in(1, 4096), 16, "new tokens per sequence")
    _opt(d, "--prompt-max", _int_in(1, 4096), 24, "longest prompt")
    _opt(d, "--chunk", _int_in(1, 4096), 8, "prefill chunk per sequence")
    _opt(d, "--page-size", _int_in(1, 256), 16, "tokens per page")
    _opt(d, "--layers", _int_in(1, 64), 2, "decoder layers")
    _opt(d, "--hidden", _int_in(1, 8192), 64, "hidden size")
    _opt(d, "--heads", _int_in(1, 256), 4, "query heads")
    _opt(d, "--kv-heads", _int_in(1, 256), 2, "KV heads (divides --heads)")
    _opt(d, "--head-dim", _even_in(2, 1024), 16, "head dim (even: rotary)")
    _opt(d, "--vocab", _int_in(2, 1_000_000), 256, "vocabulary size")
    d.add_argument("--mla", action="store_true", help="DeepSeek-style MLA attention (absorbed latent cache)")
    _opt(d, "--latent-dim", _int_in(1, 1024), 32, "MLA latent dim R")
    _opt(d, "--rope-dim", _even_in(2, 256), 8, "MLA rotary dim P")
    d.add_argument("--dtype", default="f32", choices=["f32"], help="storage type (default f32)")
    _opt(d, "--seed", _int_in(0, 2**32 - 1), 0, "random seed")
    d.add_argument("--eager", action="store_true", help="no graph: issue every kernel per step")
    d.add_argument("--cpu", action="store_true", help="use the CPU backend even when a GPU is present")
    _traceback_flag(d)
    d.set_defaults(fn=cmd_demo, checks=_check_demo)


def _check_demo(p, args) -> None:
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads: expected a divisor of --heads {args.heads}, got {args.kv_heads}")


def _check_parsers(sub):
    c = sub.add_parser(
        "check",
        help="run one kernel on random data against the float64 reference",
        description="Run one kernel on random data against the float64 reference, with its "
        "error and time. `check OP --help` lists that op's options.",
    )
    ops = c.add_subparsers(dest="op", required=True, metavar="OP", parser_class=_Parser)
    common = _Parser(add_help=False)
    common.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"], help="(default bf16)")
    _opt(common, "--repeat", _int_in(1, 1000), 5, "timed runs")
    _opt(common, "--seed", _int_in(0, 2**32 - 1), 0, "random seed")
    common.add_argument("--cpu", action="store_true", help="use the CPU backend even when a GPU is present")
    _traceback_flag(common)
    paged = _Parser(add_help=False)
    _opt(paged, "--batch", _int_in(1, 65536), 4, "sequences")
    _opt(paged, "--context", _int_in(1, 1 << 24), 300, "longest sequence")
    _opt(paged, "--q-len", _int_in(1, 1 << 24), 1, "queries per sequence (1 = decode)")
    _opt(paged, "--page-size", _int_in(1, 256), 16, "tokens per page")
    kinds = {
        "attention": ("paged attention (GQA/MQA/MHA)", True, 1),
        "merge": ("split-KV attention and its merge", True, 2),
        "mla": ("MLA over a latent + rotary cache", True, 1),
        "append": ("the paged K/V append (bit-exact)", False, None),
    }
    for op, (what, heads, splits) in kinds.items():
        o = ops.add_parser(op, parents=[paged, common], help=what, description=f"Check {what}.")
        if heads:
            _opt(o, "--heads", _int_in(1, 1024), 8, "query heads")
        if op != "mla":
            _opt(o, "--kv-heads", _int_in(1, 1024), 2, "KV heads")
        _opt(o, "--head-dim", _int_in(1, 1024), 128, "latent dim R" if op == "mla" else "head dim D")
        if op == "mla":
            _opt(o, "--rope-dim", _int_in(1, 256), 64, "rotary dim P")
        if splits is not None:
            lo = 2 if op == "merge" else 1
            _opt(
                o,
                "--splits",
                _int_in(lo, 64),
                splits,
                "splits of each history" + (" (a merge needs 2)" if op == "merge" else ""),
            )
        o.set_defaults(fn=cmd_check, checks=_check_check)
    a = ops.add_parser("argmax", parents=[common], help="row argmax over logits", description="Check argmax.")
    _opt(a, "--batch", _int_in(1, 1 << 20), 4, "rows")
    _opt(a, "--vocab", _int_in(1, 2**31 - 1), 32000, "columns")
    a.set_defaults(fn=cmd_check, checks=None)


def _check_check(p, args) -> None:
    if args.q_len > args.context:
        p.error(f"--q-len: expected at most --context {args.context}, got {args.q_len}")
    heads = getattr(args, "heads", None)
    if heads is not None and hasattr(args, "kv_heads") and heads % args.kv_heads:
        p.error(f"--kv-heads: expected a divisor of --heads {heads}, got {args.kv_heads}")


def _generate_parser(sub):
    g = sub.add_parser(
        "generate",
        help="greedy generation with a local Hugging Face model folder or GGUF file",
        description="Greedy generation with a local Hugging Face model folder (config.json, "
        "*.safetensors; tokenizer.json for text) or a GGUF file (dequantized at load; its "
        "byte-level BPE tokenizer for text) through cupaged.Engine: tokens print "
        "as they come, then prefill and decode tokens/s.",
    )
    g.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="the model folder, or a .gguf file (its tokenizer too; needs the gguf extra)",
    )
    g.add_argument(
        "--prompt",
        required=True,
        action="append",
        help="text (with the model's tokenizer), or token ids like '1 2 3'; several --prompt run as one batch",
    )
    g.add_argument("--chat", action="store_true", help="apply the model's chat template (each prompt a user message)")
    _opt(g, "--max-new-tokens", _int_in(1, 1 << 20), 32, "tokens to generate")
    g.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="weights, activations and cache (default: the checkpoint's)",
    )
    _opt(g, "--temperature", _float_in(0.0, 1e6), 0.0, "0: greedy (the argmax)")
    _opt(g, "--top-k", _int_in(-1, (1 << 31) - 1), 0, "keep the k likeliest tokens (0 or -1: all)")
    _opt(g, "--top-p", _float_in(0.0, 1.0, low_open=True), 1.0, "keep the smallest set of tokens of this mass")
    _opt(g, "--min-p", _float_in(0.0, 1.0), 0.0, "drop tokens below this share of the likeliest one's probability")
    _opt(g, "--repetition-penalty", _float_in(0.0, 1e6, low_open=True), 1.0, "1: off")
    g.add_argument("--seed", type=_int_in(0, (1 << 64) - 1), default=None, help="the sampling seed (default random)")
    _opt(g, "--page-size", _int_in(1, 256), 16, "tokens per page")
    g.add_argument(
        "--max-model-len",
        type=_int_in(2, 1 << 24),
        default=None,
        help="longest sequence the cache holds (default: prompt + new tokens)",
    )
    g.add_argument("--ids", action="store_true", help="read --prompt as token ids and print ids, even with a tokenizer")
    g.add_argument("--cpu", action="store_true", help="use the CPU backend even when a GPU is present")
    g.add_argument("--quiet", action="store_true", help="no progress notices or bars on stderr")
    _traceback_flag(g)
    g.set_defaults(fn=cmd_generate, checks=None)


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog="python -m cupaged", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _traceback_flag(p, default=False)
    p.add_argument("--version", action="version", version=f"cupaged {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    _demo_parser(sub)
    _check_parsers(sub)
    _generate_parser(sub)
    args, extra = p.parse_known_args(argv)
    prog = f"python -m cupaged {args.cmd}" + (f" {args.op}" if getattr(args, "op", None) else "")
    if extra:
        p.exit(2, f"{prog}: unrecognized arguments: {' '.join(extra)} ({prog} --help lists its options)\n")
    if args.checks is not None:
        args.checks(_Parser(prog=prog), args)
    if args.traceback or os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
        return args.fn(args)
    try:
        return args.fn(args)
    except REFUSED as e:  # a refused input or a broken environment: one line, no traceback
        print(f"{prog}: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- a bug: one line and how to see the traceback
        print(
            f"{prog}: internal error (a bug in cupaged): {type(e).__name__}: {_one_line(e)}; rerun with "
            f"--traceback or {TRACEBACK_ENV}=1 for the traceback",
            file=sys.stderr,
        )
        return 1


def _one_line(e: BaseException) -> str:
    """The first line of an error's message (a compiler log has many), with
    a count of the rest."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    more = len(lines) - 1
    return lines[0] + (f" ({more} more line{'s' if more > 1 else ''}: --traceback shows them)" if more else "")


if __name__ == "__main__":
    sys.exit(main())
