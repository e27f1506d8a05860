"""``Engine``: Hugging Face checkpoints on the page manager, the decode graphs
and the attention kernels (see the package docstring)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import dtypes
from .._runtime import GPU, array_backend, checks, progress, stream_for
from .._runtime.arrays import Array
from ..batch import DecodeBatch
from ..cache import PagedKVCache
from ..errors import CheckpointError, PagedAttentionError
from ..layout import MAX_PAGE_SIZE
from ..ops.sample import SamplerState
from ..sampling import MAX_LOGPROBS, SamplingParams, as_sampling
from .checkpoint import Checkpoint, read_json
from .config import ModelConfig, parse_config, token_ids
from .dense import DenseLM
from .gguf import is_gguf, read_gguf
from .mla import MlaLM
from .scheduler import Scheduler
from .text import Completion, Detokenizer, TextCodec, finish_reason

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

#: The CPU backend's default cache: ``max_batch`` sequences of this many
#: tokens (or the model's longest, if shorter).
CPU_DEFAULT_TOKENS = 2048
#: The GPU's default cache takes this share of the free memory left after
#: the weights and buffers (as vLLM's gpu_memory_utilization).
GPU_MEMORY_SHARE = 0.9
#: Memory left aside on the GPU for cuBLAS workspaces, graphs and kernels.
GPU_RESERVE_BYTES = 512 << 20
#: Decode batches kept per engine (one per distinct set of stop tokens).
MAX_BATCHES = 4
#: A model above this many parameters on the CPU backend is told it will be slow.
CPU_WARN_PARAMETERS = 100_000_000
_UNSET: Any = object()


@dataclass(frozen=True)
class StreamEvent:
    """What ``Engine.stream_generate`` yields: prompt ``index``'s new
    (read back since the last event), their ``text`` (None without a
    tokenizer; a character split across tokens comes whole, later), and
    ``finished``: the prompt's ``Completion`` when this is its last event,
    else None."""

    index: int
    token_ids: list[int]
    text: str | None
    finished: Completion | None = None


class Engine:
    """A model of a supported architecture (``cupaged.engine.ARCHITECTURES``)
    with its paged cache, serving greedy generation with continuous batching.

    Build with ``Engine.from_pretrained(folder, like=...)`` or
    ``Engine.from_transformers(model, like=...)``; ``like`` (a NumPy or CuPy
    array) picks the backend: NumPy runs everything on the CPU backend (the
    same CUDA C kernels through g++), CuPy on the GPU (projections on
    cuBLAS, captured into the decode graphs with the kernels).

    Options (keyword): ``dtype`` (weights, activations and cache: float32,
    float16 or bfloat16; default the checkpoint's), ``page_size`` (tokens per
    page), ``num_pages`` (None: on the GPU 90% of the free memory left after
    weights and buffers; on the CPU enough for ``max_batch`` sequences of
    min(2048, max_model_len) tokens), ``max_batch`` (sequences decoding at
    once: the largest decode graph's batch), ``prefix_cache`` (full pages of
    known prompts are shared: docs/layout.md "Prefix reuse"),
    ``prefill_chunk`` (most prompt tokens per prefill forward pass),
    ``prefill_per_round`` (most prompt tokens prefilled between two decode
    rounds, in chunks; vLLM's default token budget), ``max_model_len``
    (the longest sequence, prompt and generated tokens; default the model's,
    capped by the cache; a sliding window runs as the model's, it caps
    nothing), ``readback_every`` (decode
    launches between token readbacks), ``graph`` (False: decode eagerly),
    ``tokenizer`` (a ``cupaged.engine.text.TextCodec``, or a model folder or
    GGUF file to load one from on first use; ``from_pretrained`` passes its
    path: ``Engine.text``).

    Attributes: ``config`` (ModelConfig), ``model`` (the family's CausalLM:
    weights and buffers), ``cache`` (the PagedKVCache), ``max_model_len``,
    ``eos_token_ids`` (the default stop tokens), ``stats`` (the last
    generate's counts and times: prefill tokens, chunks and seconds, each
    chunk timed to its end on the device; decode tokens, launches, readbacks
    and seconds, up to each round's readback; ``advance_seconds``: host time
    of the decode launches alone; ``cached_prompt_tokens``: prompt tokens
    shared from the prefix cache; ``compile_seconds``: kernel builds that ran
    during the call, first-run compilation, left out of the prefill and
    decode seconds).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ckpt: Checkpoint,
        *,
        like: Array,
        dtype: DTypeLike | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        max_batch: int = 8,
        prefix_cache: bool = True,
        prefill_chunk: int = 256,
        prefill_per_round: int = 2048,
        max_model_len: int | None = None,
        readback_every: int = 8,
        graph: bool = True,
        eos_token_ids: int | Iterable[int] | None = None,
        tokenizer: TextCodec | str | os.PathLike[str] | None = None,
    ):
        if array_backend(like) is None:
            raise PagedAttentionError(
                f"like: expected a NumPy or CuPy array (it picks the backend), got {type(like).__name__}"
            )
        stored = dtype is None
        if dtype is None:  # the checkpoint's: its embedding's dtype
            name = "model.embed_tokens.weight"
            dtype = ckpt.dtype_of(name) if name in ckpt else np.dtype(np.float32)
        dt = dtypes.lookup(dtype)
        if dt is None or not dt.query:
            raise PagedAttentionError(
                f"dtype: expected float32, float16 or bfloat16 (or None: the checkpoint's), "
                f"got {dtypes.dtype_name(dtype)}" + (" (the checkpoint's; pass dtype=)" if stored else "")
            )
        self.page_size = checks.host_int("page_size", page_size, 1, MAX_PAGE_SIZE)
        self.max_batch = checks.host_int("max_batch", max_batch, 1, 1024)
        self.prefill_chunk = checks.host_int("prefill_chunk", prefill_chunk, 1, 65535)
        self.prefill_per_round = checks.host_int("prefill_per_round", prefill_per_round, 1, 1 << 30)
        self.readback_every = checks.host_int("readback_every", readback_every, 1, 1 << 16)
        self.graph = checks.boolean("graph", graph)
        prefix_cache = checks.boolean("prefix_cache", prefix_cache)
        if num_pages is not None:
            num_pages = checks.host_int("num_pages", num_pages, 1, (1 << 31) - 1)
        limit = cfg.max_len
        if max_model_len is not None:
            limit = checks.host_int("max_model_len", max_model_len, 2, cfg.max_len)
        elif num_pages is not None:
            limit = max(2, min(limit, num_pages * self.page_size))
        elif array_backend(like) != GPU:
            limit = max(2, min(limit, CPU_DEFAULT_TOKENS))
        self.config, self.like, self.dtype = cfg, like, dt.np_dtype
        self.eos_token_ids = (
            cfg.eos_token_ids
            if eos_token_ids is None
            else token_ids("eos_token_ids", eos_token_ids, PagedAttentionError)
        )
        family = {"dense": DenseLM, "mla": MlaLM}[cfg.family]
        rows = max(self.prefill_chunk, self.max_batch)
        n_params = ckpt.num_parameters()
        if array_backend(like) != GPU and n_params > CPU_WARN_PARAMETERS:
            progress.notice_once(
                "cpu-large-model",
                f"warning: a {n_params / 1e6:.0f}M-parameter model on the CPU backend runs at CPU speed "
                f"(docs/performance.md has measured tokens/s); like=cupy.zeros(1) runs it on a GPU",
            )
        with progress.Progress("loading weights", len(ckpt.names()), "tensors") as bar:
            ckpt.on_read = bar.update
            try:
                self.model = family(
                    cfg, ckpt, like, dt.np_dtype, max_rows=rows, max_logits=self.max_batch, max_len=limit
                )
            finally:
                ckpt.on_read = None
        heads, d, dv = self.model.cache_layout()
        page_bytes = cfg.layers * self.page_size * heads * (d + dv) * dt.itemsize
        if num_pages is None:
            num_pages = self._default_pages(limit, page_bytes)
        self.cache = PagedKVCache(
            num_pages,
            self.page_size,
            heads,
            d,
            dt.np_dtype,
            layers=cfg.layers,
            value_dim=dv,
            like=like,
            prefix_cache=prefix_cache,
        )
        self.model.attach(self.cache)
        self.num_pages = num_pages
        self.max_model_len = min(limit, num_pages * self.page_size) if max_model_len is None else limit
        self.max_model_len = max(2, self.max_model_len)
        self.stream = stream_for(like)
        self._batches: dict[tuple[int, ...], DecodeBatch] = {}
        self.stats: dict[str, float] = {}
        self._text: TextCodec | None = _UNSET
        self._no_text = ""
        self._text_path: str | os.PathLike[str] | None = None
        if isinstance(tokenizer, TextCodec):
            self._text = tokenizer
        elif tokenizer is not None:
            if not isinstance(tokenizer, (str, os.PathLike)):
                raise PagedAttentionError(
                    f"tokenizer: expected a TextCodec, a model folder or a GGUF file, got {type(tokenizer).__name__}"
                )
            self._text_path = tokenizer  # loaded on first use (Engine.text)

    # -- construction -----------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        like: Array,
        dtype: DTypeLike | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        max_batch: int = 8,
        prefix_cache: bool = True,
        **options: Any,
    ) -> "Engine":
        """An engine from a local model folder: ``config.json`` and the
        ``*.safetensors`` files ``save_pretrained`` writes (nothing is
        downloaded), read through memory maps; the stop tokens default to
        ``generation_config.json``'s eos_token_id, else config.json's. Or from
        a ``.gguf`` file (the ``gguf`` extra; ``cupaged.engine.gguf``): its
        metadata as the config, its tensors dequantized to the engine's dtype
        as they load, its eos token as the stop token. Further options: see
        the class docstring. Raises CheckpointError (files, tensor types) or
        ConfigError (an architecture or field it cannot run, eos ids it
        cannot stop on): the configs are checked before any weight is read."""
        eos = options.pop("eos_token_ids", None)
        if is_gguf(path):
            cfg, ckpt, file_eos = read_gguf(path)
            if eos is None:
                eos = file_eos or None
        else:
            raw = Checkpoint.read_config(path)
            cfg = parse_config(raw)
            if eos is None:
                eos = _generation_eos(Path(path))
            ckpt = Checkpoint.from_folder(path)
        options.setdefault("tokenizer", path)
        engine = cls(
            cfg,
            ckpt,
            like=like,
            dtype=dtype,
            page_size=page_size,
            num_pages=num_pages,
            max_batch=max_batch,
            prefix_cache=prefix_cache,
            eos_token_ids=eos,
            **options,
        )
        return engine

    @classmethod
    def from_transformers(
        cls,
        model: Any,
        *,
        like: Array,
        dtype: DTypeLike | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        max_batch: int = 8,
        prefix_cache: bool = True,
        **options: Any,
    ) -> "Engine":
        """An engine from a ``transformers`` model object in memory: its
        config (``model.config.to_dict()``; the architecture is the model's
        class name when the config names none), its state dict (copied to the
        backend) and its generation config's eos_token_id."""
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "state_dict"):
            raise PagedAttentionError(
                f"model: expected a transformers model (with .config and .state_dict()), got {type(model).__name__}"
            )
        raw = config.to_dict()
        arch = None if raw.get("architectures") else type(model).__name__
        cfg = parse_config(raw, arch)
        ckpt = Checkpoint.from_state_dict(model.state_dict(), where=f"{type(model).__name__} state dict")
        eos = options.pop("eos_token_ids", None)
        if eos is None:
            gen = getattr(model, "generation_config", None)
            eos = token_ids("generation_config.eos_token_id", getattr(gen, "eos_token_id", None)) or None
        return cls(
            cfg,
            ckpt,
            like=like,
            dtype=dtype,
            page_size=page_size,
            num_pages=num_pages,
            max_batch=max_batch,
            prefix_cache=prefix_cache,
            eos_token_ids=eos,
            **options,
        )

    def _default_pages(self, limit: int, page_bytes: int) -> int:
        per_seq = -(-limit // self.page_size)
        if array_backend(self.like) != GPU:
            return self.max_batch * per_seq
        import cupy  # the GPU backend: CuPy is loaded

        free, _ = cupy.cuda.runtime.memGetInfo()
        budget = int(free * GPU_MEMORY_SHARE) - GPU_RESERVE_BYTES
        pages = budget // page_bytes
        if pages < per_seq:
            raise PagedAttentionError(
                f"num_pages: the free GPU memory ({free / 2**30:.1f} GiB after the weights) "
                f"holds {max(pages, 0)} pages of {page_bytes} bytes, fewer than one sequence of "
                f"max_model_len {limit} needs ({per_seq}); pass num_pages or max_model_len"
            )
        return int(pages)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Engine({c.architecture}, layers={c.layers}, hidden={c.hidden}, dtype={self.dtype.name}, "
            f"backend={array_backend(self.like)}, pages={self.num_pages}x{self.page_size}, "
            f"max_batch={self.max_batch}, max_model_len={self.max_model_len})"
        )

    # -- text -------------------------------------------------------------------
    @property
    def text(self) -> TextCodec | None:
        """The model's tokenizer and chat template (``cupaged.engine.text``:
        the folder's tokenizer.json and tokenizer_config.json, or the GGUF
        file's), loaded on first use; None when there is none. Assignable
        (a ``TextCodec`` of your own, e.g. for ``from_transformers``)."""
        if self._text is _UNSET:
            if self._text_path is None:
                self._text, self._no_text = None, "the engine was not built from a model folder or GGUF file"
            else:
                self._text, self._no_text = TextCodec.for_model(Path(self._text_path))
        return self._text

    @text.setter
    def text(self, codec: TextCodec | None) -> None:
        if codec is not None and not isinstance(codec, TextCodec):
            raise PagedAttentionError(
                f"text: expected a cupaged.engine.text.TextCodec or None, got {type(codec).__name__}"
            )
        self._text, self._no_text = codec, "no tokenizer was set (engine.text = None)"

    def _encode(self, prompts, chat) -> list:
        """Token ids of every prompt: ids as given, strings (and, with chat,
        message lists) through the model's tokenizer and chat template."""
        chat = checks.boolean("chat", chat)
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise PagedAttentionError(
                f"prompts: expected a list of prompts (strings or token-id lists), got {type(prompts).__name__}"
            )
        out = []
        for i, p in enumerate(prompts):
            messages = chat and isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)
            if not (isinstance(p, str) or messages):
                if chat:
                    raise PagedAttentionError(
                        f"prompts[{i}]: with chat=True expected a string or a list of {{'role', 'content'}} messages, "
                        f"got {type(p).__name__}"
                    )
                out.append(p)
                continue
            codec = self.text
            if codec is None:
                raise PagedAttentionError(
                    f"prompts[{i}]: expected token ids (ints), got a {type(p).__name__} (text needs the model's "
                    f"tokenizer: {self._no_text})"
                )
            out.append(codec.encode(p, chat=chat))
        return out

    # -- generation -------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | np.ndarray],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
        stop_token_ids: int | Iterable[int] | None = None,
        return_logits: bool = False,
        on_tokens: Callable[[int, list[int]], object] | None = None,
    ) -> Any:
        """Generation: a list, per prompt, of ``Completion`` (a list of the
        generated token ids, so it compares equal to one, with ``text``,
        ``finish_reason``, ``prompt_ids`` and ``logprobs``): ``max_new_tokens``
        tokens, or fewer when a stop token came (it is included, as in
        transformers' generate; ``finish_reason`` "stop", else "length").

        prompts: token-id sequences (ints in 0..vocab-1), or strings when the
        model has a tokenizer (``self.text``); with ``chat=True`` each string
        is a user message (or a list of ``{"role", "content"}`` messages)
        rendered by the model's chat template.

        sampling: a ``cupaged.SamplingParams`` for every prompt, a list of one
        per prompt, or None (greedy). Tokens are drawn on the device inside
        the decode graph (``cupaged.ops.sample``); a request's tokens depend
        on its prompt, parameters and seed only, not on the other requests.
        A request asking for logprobs (``logprobs=n``, n >= 0) gets
        ``Completion.logprobs``: per generated token a dict {token id:
        log-probability under the raw logits}, the drawn token first, then the
        n most likely (vLLM's layout); None for requests that did not ask.

        stop_token_ids: a token id, or token ids, that end a sequence (at most
        ``ops.advance.MAX_STOP_IDS`` distinct; default: the model's eos tokens, ``self.eos_token_ids``;
        ``()`` for none). on_tokens(index, tokens): called with each prompt's
        new tokens as they are read back (``stream_generate`` yields them).
        return_logits: also return, per prompt, float32 logits [generated,
        vocab] of every step (for checking; it reads back after every decode
        launch, so it is slow): the result is then (completions, logits).

        Continuous batching: prompts are admitted in order while fewer than
        ``max_batch`` run and the cache holds every page they may need;
        prefill runs in chunks of ``prefill_chunk`` tokens between decode
        rounds of the running sequences; finished sequences make room for
        waiting ones (``cupaged.engine.scheduler``). Every input is checked
        before anything is launched (PagedAttentionError)."""
        sched = self._scheduler(prompts, max_new_tokens, sampling, chat, stop_token_ids, return_logits, on_tokens)
        for _ in self._rounds(sched):
            pass
        out = [self._completion(sched, r) for r in sched.requests]
        if return_logits:
            vocab = self.config.vocab
            logits = [np.stack(r.logits) if r.logits else np.zeros((0, vocab), np.float32) for r in sched.requests]
            return out, logits
        return out

    def stream_generate(
        self,
        prompts: Sequence[str | Sequence[int] | np.ndarray],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
        stop_token_ids: int | Iterable[int] | None = None,
    ) -> Iterator[StreamEvent]:
        """``generate`` as an iterator of ``StreamEvent``: each prompt's new
        tokens (and text, with a tokenizer) as they are read back, every
        ``readback_every`` decode steps; a prompt's last event carries its
        ``Completion``. Inputs are checked before the first event; leaving
        the loop early (``break``, an exception) stops the requests and frees
        their pages, so the engine serves the next call."""
        got: list[tuple[int, list[int]]] = []
        sched = self._scheduler(
            prompts, max_new_tokens, sampling, chat, stop_token_ids, False, lambda i, new: got.append((i, list(new)))
        )
        return self._events(sched, got)

    def _events(self, sched: Scheduler, got: list) -> Iterator[StreamEvent]:
        codec = self.text
        detok = [Detokenizer(codec, r.prompt) for r in sched.requests] if codec is not None else []
        told = [False] * len(sched.requests)
        for _ in self._rounds(sched):
            news, got[:] = list(got), []
            for i, new in news:
                r = sched.requests[i]
                last = r.done and not told[i]
                text = None if codec is None else detok[i].push(new) + (detok[i].flush() if last else "")
                told[i] = told[i] or last
                yield StreamEvent(i, new, text, self._completion(sched, r) if last else None)
            for i, r in enumerate(sched.requests):
                if r.done and not told[i]:  # finished with no token in this round
                    told[i] = True
                    yield StreamEvent(i, [], None if codec is None else detok[i].flush(), self._completion(sched, r))

    def _scheduler(self, prompts, max_new_tokens, sampling, chat, stop_token_ids, return_logits, on_tokens):
        ids = self._encode(prompts, chat)
        prompts, max_new, stop = self._check_generate(ids, max_new_tokens, stop_token_ids)
        params = as_sampling("sampling", sampling, len(prompts))
        return_logits = checks.boolean("return_logits", return_logits)
        if on_tokens is not None and not callable(on_tokens):
            raise PagedAttentionError(
                f"on_tokens: expected a callable on_tokens(index, tokens), got {type(on_tokens).__name__}"
            )
        if getattr(self, "_prefill_sampler", None) is None:
            self._prefill_sampler = SamplerState(
                self.like, self.max_batch, self.config.vocab, max_logprobs=MAX_LOGPROBS
            )
        sched = Scheduler(
            self,
            self._batch_for(stop),
            prompts,
            max_new,
            stop,
            return_logits=return_logits,
            on_tokens=on_tokens,
            sampling=params,
            prefill_sampler=self._prefill_sampler,
        )
        self.stats = sched.stats  # updated as the call runs
        return sched

    def _rounds(self, sched: Scheduler) -> Iterator[None]:
        """The scheduler's rounds; after an error, an interrupt or a caller
        leaving a stream, its requests are stopped and their pages freed."""
        try:
            yield from sched.rounds()
        except BaseException:
            if not sched.abort():
                self._batches = {k: b for k, b in self._batches.items() if b is not sched.batch}
            raise

    def _completion(self, sched: Scheduler, r) -> Completion:
        lp = [dict(d) for d in r.logprobs] if r.sampling.logprobs is not None else None
        return Completion(
            r.out,
            prompt_index=r.index,
            prompt_ids=r.prompt,
            finish_reason=finish_reason(r.out, sched.stop, r.max_new),
            logprobs=lp,
            codec=self.text,
        )

    def _check_generate(self, prompts, max_new_tokens, stop_token_ids):
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise PagedAttentionError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
        max_new = checks.host_int("max_new_tokens", max_new_tokens, 1, self.max_model_len - 1)
        vocab, out = self.config.vocab, []
        for i, p in enumerate(prompts):
            ids = _prompt_ids(f"prompts[{i}]", p, vocab)
            n = len(ids)
            if n + max_new > self.max_model_len:
                raise PagedAttentionError(
                    f"prompts[{i}]: {n} tokens + max_new_tokens {max_new} = {n + max_new} exceed the engine's "
                    f"max_model_len {self.max_model_len} (the longest sequence its cache and rotary tables hold)"
                )
            pages = -(-(n + max_new - 1) // self.page_size)
            if pages > self.num_pages:
                raise PagedAttentionError(
                    f"prompts[{i}]: needs {pages} pages of {self.page_size} tokens, the cache "
                    f"has {self.num_pages} (num_pages)"
                )
            out.append(ids)
        stop = (
            self.eos_token_ids
            if stop_token_ids is None
            else token_ids("stop_token_ids", stop_token_ids, PagedAttentionError)
        )
        stop = tuple(sorted(stop))
        return out, max_new, stop

    # -- decode batches ---------------------------------------------------------
    def _batch_for(self, stop: tuple) -> DecodeBatch:
        """The DecodeBatch (with its captured graphs) of this set of stop
        tokens, made on first use."""
        b = self._batches.pop(stop, None)
        if b is None:
            xp = self.model.xp
            token_buf, next_token = xp.zeros(self.max_batch, np.int64), xp.zeros(self.max_batch, np.int64)
            model = self.model

            def step(plan):
                return model.forward(plan, token_buf, plan.sequences)

            b = DecodeBatch(
                self.cache,
                step,
                token_buf=token_buf,
                next_token=next_token,
                max_batch=self.max_batch,
                max_len=self.max_model_len,
                stop_ids=stop,
                readback_every=self.readback_every,
                graph=self.graph,
                vocab=self.config.vocab,
                max_logprobs=MAX_LOGPROBS,
            )
            if model.gpu and self.graph:
                # run each bucket's step once eagerly (every slot padded: it
                # reads and writes no cache row) so cuBLAS and the kernels are
                # set up before the step is captured
                for bucket in b.buckets:
                    model.forward(b.plan(bucket), token_buf, bucket)
            if len(self._batches) >= MAX_BATCHES:
                self._batches.pop(next(iter(self._batches)))
        self._batches[stop] = b
        return b


def _prompt_ids(name: str, p, vocab: int) -> list[int]:
    """One prompt as a list of token ids, each an int in 0..vocab-1 (a
    Python int or NumPy integer, not a bool), at least one."""
    if isinstance(p, (str, bytes)):
        raise PagedAttentionError(f"{name}: expected token ids (ints), got a {type(p).__name__}; tokenize it first")
    if array_backend(p) == GPU:
        raise PagedAttentionError(f"{name}: expected host token ids (a list or NumPy array), got a CuPy array")
    if isinstance(p, np.ndarray):
        if p.ndim != 1 or p.dtype.kind not in "iu":
            raise PagedAttentionError(
                f"{name}: expected a 1-D integer array of token ids, got {p.dtype} {list(p.shape)}"
            )
        p = p.tolist()
    elif not hasattr(p, "__len__") or not hasattr(p, "__iter__") or isinstance(p, (dict, set, frozenset)):
        raise PagedAttentionError(f"{name}: expected a list of token ids (ints), got {type(p).__name__}")
    ids = list(p)
    if not ids:
        raise PagedAttentionError(f"{name}: expected at least one token, got none")
    for j, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
            t = t.item() if isinstance(t, np.generic) else t
            shown = t if isinstance(t, int) and not isinstance(t, bool) else f"{type(t).__name__} {t!r}"[:100]
            raise PagedAttentionError(f"{name}[{j}]: expected a token id in 0..{vocab - 1}, got {shown}")
    return [int(t) for t in ids]


def _generation_eos(folder: Path):
    """eos_token_id of the folder's generation_config.json (None: no file or
    no eos_token_id in it; ConfigError: one the engine cannot use)."""
    p = folder / "generation_config.json"
    if not p.is_file():
        return None
    raw = read_json(p)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    return token_ids("generation_config.json: eos_token_id", raw.get("eos_token_id")) or None
