"""The keyword options of an attention call, defined once: one row
(``Option``) per option in ``ROWS``, the only place their names are
written. A row holds the option's host check, the ``AttentionParams``
fields it fills (``params.py``), its compile-time column (a
``variants.FEATURES`` name and so a ``CP_<FEATURE>`` define, or the
``CP_SCORE`` it selects), its float64 hook in
``cupaged/testing/reference.py`` and its docs line, which the public
signatures' docstrings list (``document``). ``AttentionOptions`` carries
one call's checked values. Adding an option (e.g. a score with runtime
data) is one row here, one hook in ``kernels_cu/attention/variant.cuh`` and
one params field: docs/layout.md, "Adding a score variant".

``SCORES`` are the score variants (``CP_SCORE``), a column of their own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..._runtime import address, array_backend, checks
from ..._runtime.arrays import Array
from ...errors import PagedAttentionError
from ...layout import U32_MAX

#: log2(e): the kernels' scores are in the log2 domain (softmax_state.cuh).
LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Score:
    """A score variant: ``name`` is the ``score`` option and the ``CP_SCORE``
    define, which selects ``struct score_<name>`` in
    ``kernels_cu/attention/variant.cuh`` (the hook). ``built``: registered
    for the NVRTC gate with every shape variant (compiled for sm_80 / sm_90
    ahead of any launch)."""

    name: str
    built: bool
    doc: str


#: The score variants, by name (docs/layout.md, "Adding a score variant").
SCORES: dict[str, Score] = {
    "plain": Score("plain", True, "softmax(scale * q.k)"),
}


def head_array(plan: Any, name: str, a: Array, heads: int) -> None:
    """``a``: a C-contiguous float32 [heads] array on the plan's backend and
    device (sinks, ALiBi slopes)."""
    if array_backend(a) is None:
        raise PagedAttentionError(f"{name}: expected a NumPy or CuPy float32 array [{heads}], got {type(a).__name__}")
    checks.plan_arrays(plan, **{name: a})
    if str(a.dtype) != "float32":
        raise PagedAttentionError(f"{name}: expected float32 [{heads}] (one value per query head), got {a.dtype}")
    if tuple(a.shape) != (heads,):
        raise PagedAttentionError(
            f"{name}: expected shape [{heads}] (one value per query head), got shape {checks.shape_str(a.shape)}"
        )
    if not a.flags.c_contiguous:
        raise PagedAttentionError(f"{name}: expected a contiguous array, got strides {tuple(a.strides)}")


def per_head(name: str, a: Array, plan: Any, heads: int | None) -> Array:
    """The check of a per-query-head float32 [Hq] option (``head_array``)."""
    if plan is None or heads is None:
        raise PagedAttentionError(f"{name}: AttentionOptions.checked needs plan= and heads= to check it")
    head_array(plan, name, a, heads)
    return a


def score_name(name: str, s: object, plan: Any, heads: int | None) -> str:
    if not isinstance(s, str) or s not in SCORES:
        raise PagedAttentionError(f"{name}: expected one of {', '.join(map(repr, SCORES))}, got {s!r}")
    return s


#: An option's host check: ``(name, value, plan, heads) -> the value kept``.
Check = Callable[[str, Any, Any, int | None], Any]


@dataclass(frozen=True)
class Option:
    """One keyword option of ``attention`` / ``mla``.

    ``check(name, value, plan, heads)``: the host check of a given value
    (PagedAttentionError naming the option), returning the value the call
    keeps; None: checked with the caches (the storage options,
    ``inputs.cache_read``). ``fields`` / ``params(value)``: the
    AttentionParams fields it fills and their values (all 0 when the option
    is not given). ``feature``: its ``variants.FEATURES`` name (a ``Variant``
    field; ``CP_<FEATURE>=1`` when given); ``score``: the ``CP_SCORE`` it
    selects when given (a score with runtime data). ``array``: an array
    input (outputs must not overlap it; the torch adapter views it).
    ``reference``: the key of its float64 hook in
    ``cupaged.testing.reference.LOGIT_HOOKS`` ("" when the reference
    spells it out: visibility, the sink's denominator, the storage).
    ``doc``: its line in the public docstrings."""

    name: str
    doc: str
    check: Check | None = None
    fields: tuple[str, ...] = ()
    params: Callable[[Any], tuple[float, ...]] | None = None
    feature: str = ""
    score: str = ""
    array: bool = False
    reference: str = ""
    default: object = None


def _cap(name: str, v: object, plan: Any, heads: int | None) -> float:
    return checks.positive_scale(v, name)


def _window(name: str, v: object, plan: Any, heads: int | None) -> int:
    return checks.host_int(name, v, 1, U32_MAX)


#: Every option, by name, in the order they compose (score, cap, ALiBi) and
#: positional order of ``AttentionOptions`` after scale and causal.
ROWS: dict[str, Option] = {
    r.name: r
    for r in (
        Option(
            "score", 'a name in ``SCORES`` ("plain": softmax(scale * q.k)); compile-time', score_name, default="plain"
        ),
        Option(
            "soft_cap",
            "float > 0: logit = cap * tanh(scale * q.k / cap) (Gemma 2)",
            _cap,
            ("soft_cap", "inv_soft_cap"),
            lambda c: (c * LOG2E, 1.0 / (c * LOG2E)),
            feature="soft_cap",
            reference="soft_cap",
        ),
        Option(
            "window",
            "int >= 1: the query at p sees no position below p - window + 1 (vLLM's sliding_window, "
            "FlashInfer's window_left + 1; the pages before are never read)",
            _window,
            ("window",),
            lambda w: (w,),
            feature="window",
        ),
        Option(
            "sinks",
            "float32 [Hq]: a per-head logit in the softmax denominator (gpt-oss), counted by the lse",
            per_head,
            ("sinks",),
            lambda a: (address(a),),
            feature="sinks",
            array=True,
        ),
        Option(
            "alibi_slopes",
            "float32 [Hq]: logit += slope[h] * (k_pos - q_pos) (BLOOM / MPT)",
            per_head,
            ("alibi_slopes",),
            lambda a: (address(a),),
            feature="alibi",
            array=True,
            reference="alibi_slopes",
        ),
        Option("kv_dtype", "'e4m3' / 'e5m2': the format of uint8 cache storage (fp8 caches)"),
        Option(
            "k_scale",
            "float32 [] / [1] / [Hkv] (None: 1): K = code * k_scale for an fp8 cache (MLA: the latent's)",
            array=True,
        ),
        Option(
            "v_scale",
            "float32 [] / [1] / [Hkv] (None: 1): V = code * v_scale for an fp8 cache (MLA: k_rot's)",
            array=True,
        ),
    )
}

#: The score and visibility features: each a compile-time flag of every
#: kernel (``Variant`` fields of these names, defines ``CP_<FEATURE>``),
#: off by default, from the rows.
FEATURES: tuple[str, ...] = tuple(r.feature for r in ROWS.values() if r.feature)


def _row(name: str) -> Option:
    row = ROWS.get(name)
    if row is None:
        raise PagedAttentionError(f"{name}: expected an option among {', '.join(ROWS)}, got an unknown keyword")
    return row


@dataclass(frozen=True, init=False, eq=False)
class AttentionOptions:
    """The options of one attention call: ``scale`` (multiplies q.k before
    the softmax), ``causal`` (the query at absolute position p sees
    positions 0..p of its sequence, otherwise all kv_lens[s]) and the
    options of ``ROWS`` by name (attributes; a row not given reads its
    default). ``features`` and ``kernel_score`` pick the compiled variant,
    ``params()`` fills the options' AttentionParams fields (docs/layout.md,
    "Score variants and visibility"). ``AttentionOptions.checked`` checks
    every value; the constructor takes them as they are."""

    scale: float
    causal: bool
    #: (name, value) of the options given (not None), in row order.
    given: tuple[tuple[str, Any], ...]

    def __init__(self, scale: float, causal: bool = True, *args: Any, **options: Any):
        if len(args) > len(ROWS):
            raise PagedAttentionError(f"AttentionOptions: expected at most {len(ROWS) + 2} positional arguments")
        for name, v in zip(ROWS, args):
            if name in options:
                raise PagedAttentionError(f"{name}: given twice")
            options[name] = v
        for name in options:
            _row(name)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "causal", causal)
        object.__setattr__(self, "given", tuple((n, options[n]) for n in ROWS if options.get(n) is not None))

    def __getattr__(self, name: str) -> Any:
        row = ROWS.get(name)
        if row is None or name == "given":
            raise AttributeError(name)
        return dict(self.given).get(name, row.default)

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}={v!r}" for n, v in self.given if not ROWS[n].array)
        return f"AttentionOptions(scale={self.scale!r}, causal={self.causal!r}{', ' if shown else ''}{shown})"

    @property
    def features(self) -> tuple[str, ...]:
        """The features that are on, as ``FEATURES`` names (each a
        compile-time flag of the kernels)."""
        return tuple(ROWS[n].feature for n, _ in self.given if ROWS[n].feature)

    @property
    def kernel_score(self) -> str:
        """The compiled score (``CP_SCORE``): that of a given option with a
        score of its own (runtime data), else ``score``."""
        return next((ROWS[n].score for n, _ in self.given if ROWS[n].score), self.score)

    def params(self) -> dict[str, float]:
        """The AttentionParams fields of the rows: their values where given,
        0 where not."""
        values = dict(self.given)
        out: dict[str, float] = {}
        for row in ROWS.values():
            if row.fields:
                v = values.get(row.name)
                if v is None:
                    out.update(zip(row.fields, (0,) * len(row.fields)))
                else:
                    assert row.params is not None, f"{row.name}: a row with fields has params"
                    out.update(zip(row.fields, row.params(v)))
        return out

    def arrays(self) -> dict[str, Array]:
        """The array options given, by name: inputs the outputs must not overlap."""
        return {n: v for n, v in self.given if ROWS[n].array}

    @classmethod
    def checked(
        cls,
        scale: object,
        causal: object = True,
        score: str = "plain",
        *,
        plan: Any = None,
        heads: int | None = None,
        **options: Any,
    ) -> AttentionOptions:
        """Every option checked (the storage ones go unchecked here: they are
        checked with the caches); the per-head arrays against ``plan``
        (backend, device, stream) and ``heads`` (Hq), which they then need."""
        options["score"] = score
        values: dict[str, Any] = {}
        for name, v in options.items():
            row = _row(name)
            values[name] = v if v is None or row.check is None else row.check(name, v, plan, heads)
        opts = cls(checks.positive_scale(scale), checks.boolean("causal", causal), **values)
        scored = [n for n, _ in opts.given if ROWS[n].score]
        if scored and (len(scored) > 1 or opts.score != "plain"):
            raise PagedAttentionError(
                f"{scored[0]}: expected score 'plain' and no other score option with it "
                f"(each selects a score variant), got score={opts.score!r} and {scored}"
            )
        return opts

    def check_plan(self, plan: Any, what: str = "attention") -> None:
        """A plan with a sequence whose queries outnumber its keys (q_len >
        kv_len, kv_len 0 included) is non-causal only (docs/layout.md): a
        causal query at a negative position means its K/V were not appended.
        Host plan data only (no device read)."""
        if self.causal and not plan.host.causal_ok:
            s = plan.host.non_causal_sequence
            raise PagedAttentionError(
                f"causal: expected False for this plan (sequence {s} has q_lens={int(plan.host.q_lens[s])} > "
                f"kv_lens={int(plan.host.kv_lens[s])}: its first queries sit at negative positions; append the "
                f"step's new K/V first, so kv_lens counts them), got True ({what})"
            )


def docs(indent: str = "") -> str:
    """The rows' docs lines, one an option, for the public docstrings."""
    return "\n".join(f"{indent}``{r.name}``: {r.doc}" for r in ROWS.values())


_F = TypeVar("_F", bound=Callable[..., Any])


def document(fn: _F) -> _F:
    """Replace the ``{options}`` line of ``fn``'s docstring with ``docs()``
    at that line's indent."""
    if fn.__doc__:
        lines = fn.__doc__.split("\n")
        at = next(i for i, line in enumerate(lines) if line.strip() == "{options}")
        lines[at] = docs(lines[at][: len(lines[at]) - len(lines[at].lstrip())])
        fn.__doc__ = "\n".join(lines)
    return fn


@dataclass(frozen=True)
class KVLayer:
    """One layer of a ``PagedKVCache`` (``cache.layer(i)``): ``k`` [pages,
    page_size, Hkv, D], ``v`` [pages, page_size, Hkv, Dv] (views of layer
    i) and their storage options ``kv_dtype``, ``k_scale``, ``v_scale``
    (None unless fp8). ``plan.attention`` / ``plan.mla`` / ``plan.append``
    take it in place of the caches and their scales."""

    k: Array
    v: Array
    kv_dtype: object = None
    k_scale: Array = None
    v_scale: Array = None

    def storage(self) -> dict[str, Any]:
        """The storage options given, by name."""
        return {
            n: v
            for n, v in (("kv_dtype", self.kv_dtype), ("k_scale", self.k_scale), ("v_scale", self.v_scale))
            if v is not None
        }


def renamed(options: dict[str, Any], new: dict[str, Any], old: dict[str, str]) -> dict[str, Any]:
    """``new`` (name -> value, ``MISSING`` when not given) with the values
    of the deprecated spellings ``old`` (old name -> new name) taken out of
    ``options`` (a DeprecationWarning each; both spellings: an error)."""
    out = dict(new)
    for was, now in old.items():
        if was in options:
            if out[now] is not MISSING:
                raise PagedAttentionError(f"{was}: given together with {now}, its new name; pass {now} only")
            warnings.warn(
                f"{was}= is deprecated, pass {now}= (the MLA rotary part); {was} is accepted for one release",
                DeprecationWarning,
                stacklevel=3,
            )
            out[now] = options.pop(was)
    return out


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: An argument not given (the rotary parts of ``mla``, whose None means P = 0).
MISSING = _Missing()
