"""Pick the exchange from measurements: link, codec cost, byte model, then a timed check.

:func:`autotune` answers, on the devices at hand, "which codec and strategy make this tree's
mean fastest, and is any faster than plain ``pmean``?" in four steps:

1. **link**: time ``psum`` (of float32, and of float16: ``all_reduce_16``), ``all_gather`` and
   ``all_to_all`` of arrays of a few sizes over ``axis_name`` and fit
   ``t = alpha + bytes / bandwidth`` per collective (ring-model
   bytes per device, as :func:`jaxcomp.comm_report` counts them: the alpha-beta model of
   Hockney, "The communication challenge for MPP", Parallel Computing 1994);
2. **codec cost**: time each candidate codec's encode and decode on one device over the
   tree's compressed leaves;
3. **predict** each candidate's exchange time: the collectives its strategy runs (bytes from
   :func:`jaxcomp.strategy_bytes`), one latency per bucket and phase, plus its codec passes;
4. **check**: time the best few predictions (and plain ``pmean``) for real and keep the fastest
   measured one (:func:`select`: rows within :data:`TIE` of it are a tie, won by the least codec
   work). Plain ``pmean`` wins unless a candidate measures faster, so the plan never
   makes the exchange slower than it was on these devices;
5. **calibrate** (:func:`calibrate`): the table's ``predicted_ms`` scales the wire time by
   plain ``pmean``'s measured / modelled ratio and the codec passes by a factor fitted on the
   timed candidates, each timed candidate predicted without its own timing (leave-one-out).

Every process measures; the timings are reduced (max over processes) before any decision, so
every process reaches the same plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import buckets
from jaxcomp._src.codecs.base import Codec, ceil_div, check_int
from jaxcomp._src.codecs.quantize import cast, int_quant
from jaxcomp._src.cost import _summed_dtype, check_pair, strategy_bytes

#: Candidates when ``codecs=None``: the codecs that keep quality without error feedback
#: (16-bit casts and int8 blocks). Aggressive codecs (sign, top-k) only when listed.
DEFAULT_CODECS: tuple[Codec | None, ...] = (None, cast("bf16"), cast("fp16"), int_quant(8))
#: Strategies tried when ``strategies=None`` (those the codec can carry).
DEFAULT_STRATEGIES = ("allreduce", "allgather", "two_phase")
#: Bucket sizes tried (bytes).
DEFAULT_BUCKETS = (buckets.BUCKET_BYTES,)
#: Leaf sizes below which leaves go through plain pmean (per-leaf choice).
DEFAULT_MIN_SIZES = (0, 4096)
#: A compressed candidate must measure this much faster than plain pmean to be chosen.
MARGIN = 0.10
#: Timed candidates within this fraction of the fastest one are tied (a few timed repetitions
#: on a shared host vary by more): among them the plan takes the one with the least codec
#: work, since encode / decode share the host with the step's compute and the wire does not.
TIE = 0.05
#: Collectives whose latency and bandwidth are fitted. ``all_reduce_16``: a psum of float16
#: (what a 16-bit cast's ``allreduce`` runs); over gloo it ran 1.6x slower than a float32
#: psum of the same bytes (1 Gbit/s, 2 processes), so it gets a fit of its own.
KINDS = ("all_reduce", "all_gather", "all_to_all", "all_reduce_16")


class LinkFit(NamedTuple):
    """``t(bytes) = alpha_s + bytes / bandwidth`` for one collective kind."""

    alpha_s: float  # seconds per call (latency, launch)
    bandwidth: float  # ring-model bytes per device per second


class Candidate(NamedTuple):
    """One row of :attr:`AutotunePlan.table`."""

    name: str  # "none" (plain pmean) or the codec's name
    codec: Codec | None
    strategy: str  # "pmean" for plain
    bucket_bytes: int
    min_size: int
    bytes_per_device: float  # ring-model bytes one device sends per exchange
    predicted_ms: float  # calibrated (see autotune); model_ms before calibration
    measured_ms: float  # nan where not timed
    model_ms: float = math.nan  # the alpha-beta model + standalone codec passes
    codec_model_ms: float = 0.0  # the codec passes' share of model_ms


@dataclasses.dataclass(frozen=True)
class AutotunePlan:
    """What :func:`autotune` chose, and why (``table``: every candidate, the chosen one first,
    then the timed ones fastest first)."""

    codec: Codec | None  # None: no compression (plain pmean is fastest here)
    strategy: str
    bucket_bytes: int
    min_size: int
    table: tuple[Candidate, ...]
    link: dict[str, LinkFit]
    codec_ms: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    @property
    def compressed(self) -> bool:
        return self.codec is not None

    def exchange(self) -> dict[str, Any]:
        """Keyword arguments for ``jc.pmean`` / ``jc.sgd`` / ``jc.compressed_allreduce``
        (``strategy``, ``bucket_bytes``, ``min_size``); pass ``plan.codec`` beside them."""
        return {
            "strategy": self.strategy,
            "bucket_bytes": self.bucket_bytes,
            "min_size": self.min_size,
        }

    def format(self) -> str:
        """The table as text: one row per candidate, predicted and measured times."""
        head = f"{'candidate':<34}{'strategy':<12}{'min_size':>9}{'bytes/dev':>13}"
        head += f"{'pred ms':>10}{'meas ms':>10}"
        rows = [head]
        for c in self.table:
            meas = "-" if math.isnan(c.measured_ms) else f"{c.measured_ms:.2f}"
            mark = (
                " <"
                if (c.codec, c.strategy, c.min_size)
                == (self.codec, self.strategy if self.codec else "pmean", self.min_size)
                else ""
            )
            rows.append(
                f"{c.name[:33]:<34}{c.strategy:<12}{c.min_size:>9}"
                f"{c.bytes_per_device:>13,.0f}{c.predicted_ms:>10.2f}{meas:>10}{mark}"
            )
        return "\n".join(rows)


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    """Median wall seconds of ``fn()`` (blocked on its result) after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _per_device(
    mesh: Any, axis_name: Any, shape: tuple[int, ...], seed: int, dtype: Any = np.float32
) -> jax.Array:
    """A random array ``[n, *shape]`` laid out one row per device of ``axis_name``."""
    n = math.prod(mesh.shape[a] for a in _names(axis_name))
    x = np.random.default_rng(seed).standard_normal((n, *shape), dtype=np.float32)
    return jax.device_put(x.astype(dtype), NamedSharding(mesh, P(axis_name)))


def _names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _collective(kind: str, axis_name: Any, n: int) -> Callable[[jax.Array], jax.Array]:
    def run(x):
        x = x[0]
        if kind in ("all_reduce", "all_reduce_16"):
            out = jax.lax.psum(x, axis_name)
        elif kind == "all_gather":
            out = jax.lax.all_gather(x, axis_name, tiled=True)
        else:
            out = jax.lax.all_to_all(x.reshape(n, -1), axis_name, 0, 0, tiled=True)
        return out.reshape(1, -1)

    return run


def _ring_bytes(kind: str, size_bytes: float, n: int) -> float:
    """Ring-model bytes per device (comm_report's model) for an input of ``size_bytes``."""
    if kind in ("all_reduce", "all_reduce_16"):
        return 2 * (n - 1) / n * size_bytes
    if kind == "all_gather":
        return (n - 1) * size_bytes  # output n * size, (n-1)/n of it received
    return (n - 1) / n * size_bytes


def _fit(sizes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Least-squares ``t = alpha + bytes / bw`` (alpha, 1/bw clipped to be positive)."""
    a = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=np.float64)], axis=1)
    alpha, inv_bw = np.linalg.lstsq(a, np.asarray(seconds, dtype=np.float64), rcond=None)[0]
    inv_bw = max(float(inv_bw), 1e-15)
    return LinkFit(max(float(alpha), 0.0), 1.0 / inv_bw)


def measure_link(
    mesh: Any, axis_name: Any, sizes: Sequence[int] = (1 << 12, 1 << 18, 1 << 22), reps: int = 3
) -> dict[str, LinkFit]:
    """Fit latency and bandwidth of all-reduce (float32 and float16), all-gather and
    all-to-all over ``axis_name``.

    ``sizes``: elements per device of the arrays timed (rounded to a multiple of the axis
    size; float32, float16 for ``all_reduce_16``). Returns ``{kind: LinkFit}``; timings are
    reduced over processes (max).
    """
    n = math.prod(mesh.shape[a] for a in _names(axis_name))
    sizes = [ceil_div(s, n) * n for s in sizes]
    times = np.zeros((len(KINDS), len(sizes)))
    for i, kind in enumerate(KINDS):
        fn = jax.jit(
            jax.shard_map(
                _collective(kind, axis_name, n),
                mesh=mesh,
                in_specs=P(axis_name),
                out_specs=P(axis_name),
                check_vma=False,
            )
        )
        dtype = np.float16 if kind == "all_reduce_16" else np.float32
        for j, s in enumerate(sizes):
            x = _per_device(mesh, axis_name, (s,), j, dtype)
            times[i, j] = _median_time(lambda fn=fn, x=x: fn(x), reps)
    times = _reduce_over_processes(times)
    width = {kind: 2 if kind == "all_reduce_16" else 4 for kind in KINDS}
    return {
        kind: _fit([_ring_bytes(kind, width[kind] * s, n) for s in sizes], times[i])
        for i, kind in enumerate(KINDS)
    }


def _reduce_over_processes(values: np.ndarray) -> np.ndarray:
    """The max of ``values`` over processes (the same array on every process)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values)).max(axis=0)


def codec_seconds(
    codec: Codec, mesh: Any, axis_name: Any, sizes: Sequence[int], reps: int = 3
) -> tuple[float, float]:
    """Seconds of ``encode`` and of ``decode`` over vectors of ``sizes``, run on every device
    of ``axis_name`` at once (so devices that share a host's cores are measured sharing them)."""
    key = jax.random.key_data(jax.random.key(0))
    xs = [_per_device(mesh, axis_name, (d,), i) for i, d in enumerate(sizes)]
    spec = P(axis_name)

    def enc(xs):
        return [jax.tree.map(lambda a: a[None], codec.encode(x[0], key)) for x in xs]

    def dec(ps):
        return [
            codec.decode(jax.tree.map(lambda a: a[0], p), d)[None]
            for p, d in zip(ps, sizes, strict=True)
        ]

    enc_fn = jax.jit(
        jax.shard_map(enc, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)
    )
    dec_fn = jax.jit(
        jax.shard_map(dec, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)
    )
    payloads = enc_fn(xs)
    times = np.array(
        [_median_time(lambda: enc_fn(xs), reps), _median_time(lambda: dec_fn(payloads), reps)]
    )
    enc_s, dec_s = _reduce_over_processes(times)
    return float(enc_s), float(dec_s)


def _phases(codec: Codec | None, strategy: str, sizes: Sequence[int], n: int) -> list:
    """``(kind, ring bytes per device, [bytes per device sent into it, per leaf])`` of each
    phase."""
    if codec is None or not sizes:
        total = 4 * sum(sizes)
        sent = [4 * d for d in sizes]
        return [("all_reduce", _ring_bytes("all_reduce", total, n), sent)] if total else []
    rings = [strategy_bytes(codec, d, n)[strategy] for d in sizes]
    ring = sum(rings)
    if strategy == "allreduce":
        narrow = _summed_dtype(codec) in ("float16", "bfloat16")
        kind = "all_reduce_16" if narrow else "all_reduce"
        return [(kind, ring, [r * n / (2 * (n - 1)) for r in rings])]
    if strategy == "allgather":
        return [("all_gather", ring, [r / (n - 1) for r in rings])]
    cs = [ceil_div(d, n) for d in sizes]
    phases = [codec.phase_codecs(c, n) for c in cs]
    rows = [n * first.payload_bytes(c) for c, (first, _) in zip(cs, phases, strict=True)]
    owned = [second.payload_bytes(c) for c, (_, second) in zip(cs, phases, strict=True)]
    return [("all_to_all", ring / 2, rows), ("all_gather", ring / 2, owned)]


def _calls(sent: Sequence[float], bucket_bytes: int) -> int:
    """Collectives of one phase (:func:`buckets.exchange`): a leaf whose payload is at least
    ``bucket_bytes // buckets.ALONE`` bytes travels in a bucket of its own, the others share
    ``ceil(bytes / bucket_bytes)`` buckets; at least one."""
    alone = [s for s in sent if s >= max(bucket_bytes // buckets.ALONE, 1)]
    shared = sum(sent) - sum(alone)
    return max(1, len(alone) + math.ceil(shared / bucket_bytes))


def predict_seconds(
    codec: Codec | None,
    strategy: str,
    sizes: Sequence[int],
    n: int,
    link: dict[str, LinkFit],
    bucket_bytes: int,
    min_size: int,
    codec_s: tuple[float, float] = (0.0, 0.0),
) -> tuple[float, float]:
    """Predicted seconds and ring-model bytes per device of one exchange of leaves ``sizes``.

    ``t = sum_phases (calls * alpha + bytes / bandwidth) + codec passes``, with ``calls``
    the buckets of the phase: one per leaf whose payload is at least ``bucket_bytes / 16``
    (it travels alone) plus ``ceil(other bytes sent / bucket_bytes)``; codec passes:
    ``allreduce`` one encode and one decode, ``allgather`` one encode and ``n`` decodes,
    ``two_phase`` ``1 + 1/n`` encodes and two decodes (``codec_s`` = encode and decode
    seconds of the whole compressed tree).
    """
    small = [d for d in sizes if codec is not None and d < min_size]
    big = [d for d in sizes if codec is None or d >= min_size]
    phases = _phases(None, "pmean", small, n) + _phases(codec, strategy, big, n)
    seconds = sum(
        _calls(sent, bucket_bytes) * link[kind].alpha_s + ring / link[kind].bandwidth
        for kind, ring, sent in phases
    )
    enc, dec = codec_s
    passes = {"allreduce": (1, 1), "allgather": (1, n), "two_phase": (1 + 1 / n, 2)}
    if codec is not None and big:
        e, k = passes[strategy]
        seconds += e * enc + k * dec
    return seconds, sum(ring for _, ring, _ in phases)


def exchange_seconds(
    tree: Any, mesh: Any, axis_name: Any, codec: Codec | None, reps: int = 3, **exchange: Any
) -> float:
    """Measured seconds of one mean of ``tree`` (each leaf ``[n, *shape]``, one row per device)
    over ``axis_name``: ``jax.lax.pmean`` for ``codec=None``, else ``jc.pmean``."""
    from jaxcomp._src.collectives import pmean

    def mean(t):
        t = jax.tree.map(lambda a: a[0], t)
        if codec is None:
            out = jax.lax.pmean(t, axis_name)
        else:
            key = jax.random.key_data(jax.random.key(0)) if codec.stochastic else None
            out = pmean(t, axis_name, codec, key=key, **exchange)
        return jax.tree.map(lambda a: a[None], out)

    fn = jax.jit(
        jax.shard_map(
            mean, mesh=mesh, in_specs=(P(axis_name),), out_specs=P(axis_name), check_vma=False
        )
    )
    return float(_reduce_over_processes(np.array([_median_time(lambda: fn(tree), reps)]))[0])


def codec_label(codec: Codec | None) -> str:
    """A short name: the registry's (``"int8"``) where one matches, else the codec's repr."""
    from jaxcomp._src.codecs.registry import CODECS

    if codec is None:
        return "none"
    return next((k for k, f in CODECS.items() if f() == codec), codec.name)


def _candidates(codecs, strategies, bucket_sizes, min_sizes) -> list[tuple]:
    """``(codec, strategy, bucket_bytes, min_size)`` of every valid combination."""
    out = [(None, "pmean", bucket_sizes[0], 0)]
    for codec in codecs:
        if codec is None:
            continue
        for strategy in strategies:
            try:
                check_pair(codec, strategy)
            except ValueError:
                continue
            out += [(codec, strategy, b, m) for b in bucket_sizes for m in min_sizes]
    return out


def _check_args(params: Any, axis_name: Any, mesh: Any, codecs: Any) -> list[int]:
    names = _names(axis_name)
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not an axis of `mesh` (its axes: {tuple(mesh.shape)})"
        )
    for c in codecs:
        if c is not None and not isinstance(c, Codec):
            raise TypeError(f"`codecs` must hold jaxcomp codecs or None, got {c!r}")
    sizes = [
        int(np.size(x))
        for x in jax.tree.leaves(params)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not sum(sizes):
        raise ValueError("`params` has no floating-point leaves to exchange")
    return sizes


def autotune(
    params: Any,
    mesh: Any,
    axis_name: Any,
    *,
    codecs: Sequence[Codec | None] | None = None,
    strategies: Sequence[str] | None = None,
    bucket_sizes: Sequence[int] = DEFAULT_BUCKETS,
    min_sizes: Sequence[int] = DEFAULT_MIN_SIZES,
    check: int = 3,
    budget_s: float = 60.0,
    reps: int = 3,
    link_sizes: Sequence[int] = (1 << 12, 1 << 18, 1 << 22),
) -> AutotunePlan:
    """Measure the link and the codecs on ``mesh``, predict every candidate, time the best.

    For each candidate ``c`` (codec, strategy, bucket size, ``min_size``) the predicted time
    of one exchange of ``params``' gradient is (see :func:`predict_seconds`)::

        t_c = sum_phases (calls * alpha_kind + ring_bytes / bandwidth_kind) + codec passes

    with ``alpha`` and ``bandwidth`` fitted per collective (:func:`measure_link`) and the
    codec's encode / decode timed on every device at once (:func:`codec_seconds`). The
    ``check`` best predictions and plain ``pmean`` are then timed for real
    (:func:`exchange_seconds`); the plan is the fastest measured, so it is plain ``pmean``
    (``plan.codec is None``) unless compression measured faster. Timings are the max over
    processes, so every process makes the same choice. The table's ``predicted_ms`` are
    calibrated on the timed rows (:func:`calibrate`; ``model_ms``: before calibration).

    Args:
      params: a pytree of arrays shaped like one device's gradient (values unused).
      mesh: the ``jax.sharding.Mesh`` to measure on.
      axis_name: the mesh axis the gradients are averaged over.
      codecs: candidate codecs; ``None`` in the list is plain pmean. Default
        :data:`DEFAULT_CODECS` (no compression, bf16, fp16, int8): codecs that keep quality.
        Aggressive ones (``jc.sign()``, ``jc.top_k(0.01)``) only when listed, and then use
        them with error feedback (``jc.sgd``).
      strategies: strategies to try (default: allreduce, allgather, two_phase where the
        codec can carry them).
      bucket_sizes: ``bucket_bytes`` values to try.
      min_sizes: ``min_size`` values to try (leaves below it travel uncompressed).
      check: how many of the best predictions to time for real.
      budget_s: stop timing further candidates once this many seconds have passed.
      reps: timed repetitions per measurement (the median is kept).
      link_sizes: float32 elements per device of the arrays timed to fit the link.

    Returns:
      A :class:`AutotunePlan`: ``codec``, ``strategy``, ``bucket_bytes``, ``min_size``, ``table``
      (every candidate with bytes, predicted and measured ms; the chosen row first, then
      measured ones fastest first),
      ``link`` (the fitted latency and bandwidth per collective) and ``codec_ms`` (encode and
      decode ms of the tree per codec).

    Example::

      plan = jc.autotune(params, mesh, "data")
      print(plan.format())
      tx = jc.sgd(0.1, plan.codec, "data", **plan.exchange()) if plan.compressed \\
          else optax.sgd(0.1, momentum=0.9)  # with jax.lax.pmean of the gradients
    """
    t0 = time.perf_counter()
    codecs = DEFAULT_CODECS if codecs is None else tuple(codecs)
    sizes = _check_args(params, axis_name, mesh, codecs)
    check = check_int("check", check, 1)
    strategies = DEFAULT_STRATEGIES if strategies is None else tuple(strategies)
    link = measure_link(mesh, axis_name, link_sizes, reps)
    n = math.prod(mesh.shape[a] for a in _names(axis_name))
    costs = {c: codec_seconds(c, mesh, axis_name, sizes, reps) for c in codecs if c is not None}
    rows = []
    for codec, strategy, bb, ms in _candidates(codecs, strategies, bucket_sizes, min_sizes):
        frac = sum(d for d in sizes if d >= ms) / sum(sizes) if codec is not None else 0.0
        cs = tuple(frac * t for t in costs.get(codec, (0.0, 0.0)))
        sec, ring = predict_seconds(codec, strategy, sizes, n, link, bb, ms, cs)
        wire, _ = predict_seconds(codec, strategy, sizes, n, link, bb, ms)
        ms_ = 1e3 * sec
        rows.append(
            Candidate(
                codec_label(codec), codec, strategy, bb, ms, ring, ms_, math.nan, ms_,
                1e3 * (sec - wire),
            )
        )  # fmt: skip
    rows.sort(key=lambda r: r.model_ms)
    plan = _checked_plan(
        params, mesh, axis_name, rows, check, budget_s - (time.perf_counter() - t0), reps, link
    )
    cost_ms = {codec_label(c): (1e3 * e, 1e3 * d) for c, (e, d) in costs.items()}
    return dataclasses.replace(plan, codec_ms=cost_ms)


def calibrate(rows: Sequence[Candidate]) -> list[Candidate]:
    """``predicted_ms`` of every row from its model, calibrated on the timed rows.

    The model splits into the wire ``w = model_ms - codec_model_ms`` and the codec passes
    ``c = codec_model_ms`` (from the standalone encode / decode timings). Two factors correct
    it::

        lam   = measured / model of plain pmean      (the tree-sized float32 all-reduce)
        kappa = argmin_k sum_timed (measured - lam * w - k * c)^2   (clipped to [0.1, 10])
        predicted = lam * w + kappa * c

    ``lam`` is the link at this size, burst and load; ``kappa`` is how much the codec passes
    cost inside an exchange against alone (they fuse with the sum and the re-encode). Each
    timed compressed row is predicted with ``kappa`` fitted on the *other* timed rows
    (leave-one-out; 1 when there are none) and plain pmean keeps its model, so a timed row's
    ``predicted_ms`` against its ``measured_ms`` is a fair test of the model.

    Args:
      rows: the candidates, ``measured_ms`` NaN where not timed.

    Returns:
      The rows in the same order, ``predicted_ms`` calibrated.

    Example::

      rows = jaxcomp._src.autotune.calibrate(plan.table)   # what autotune did to its table

    Reference: the alpha-beta model of Hockney, "The communication challenge for MPP",
    Parallel Computing 1994, with the codec's passes added as in Agarwal et al., "On the
    Utility of Gradient Compression in Distributed Training Systems", MLSys 2022.
    """
    plain = next((r for r in rows if r.codec is None and not math.isnan(r.measured_ms)), None)
    lam = plain.measured_ms / plain.model_ms if plain is not None and plain.model_ms > 0 else 1.0
    timed = [r for r in rows if r.codec is not None and not math.isnan(r.measured_ms)]

    def kappa(skip: Candidate | None) -> float:
        pts = [r for r in timed if r is not skip and r.codec_model_ms > 0]
        den = sum(r.codec_model_ms**2 for r in pts)
        if not den:
            return 1.0
        num = sum(r.codec_model_ms * (r.measured_ms - lam * (r.model_ms - r.codec_model_ms))
                  for r in pts)  # fmt: skip
        return min(max(num / den, 0.1), 10.0)

    out = []
    for r in rows:
        if r.codec is None:
            out.append(r._replace(predicted_ms=r.model_ms if r is plain else lam * r.model_ms))
            continue
        k = kappa(r if any(r is t for t in timed) else None)
        wire = r.model_ms - r.codec_model_ms
        out.append(r._replace(predicted_ms=lam * wire + k * r.codec_model_ms))
    return out


def _checked_plan(params, mesh, axis_name, rows, check, budget_s, reps, link) -> AutotunePlan:
    """Time plain pmean and the ``check`` best predicted candidates; the fastest is the plan."""
    tree = jax.tree.map(lambda x: _per_device(mesh, axis_name, np.shape(x), 7), params)
    plain = next(r for r in rows if r.codec is None)
    chosen = [plain] + [r for r in rows if r.codec is not None][:check]
    t0, timed = time.perf_counter(), {}
    for r in chosen:  # every process stops at the same row: the slowest one's clock decides
        elapsed = _reduce_over_processes(np.array([time.perf_counter() - t0]))[0]
        if r is not plain and elapsed > budget_s:
            break
        exchange = (
            {}
            if r.codec is None
            else {"strategy": r.strategy, "bucket_bytes": r.bucket_bytes, "min_size": r.min_size}
        )
        timed[id(r)] = 1e3 * exchange_seconds(tree, mesh, axis_name, r.codec, reps, **exchange)
    rows = calibrate([r._replace(measured_ms=timed.get(id(r), math.nan)) for r in rows])
    rows.sort(key=lambda r: (math.isnan(r.measured_ms), r.measured_ms, r.predicted_ms))
    best = select(rows)
    rows.remove(best)
    strategy = "auto" if best.codec is None else best.strategy
    return AutotunePlan(best.codec, strategy, best.bucket_bytes, best.min_size, (best, *rows), link)


def select(rows: Sequence[Candidate]) -> Candidate:
    """The plan's row among the timed ``rows``: plain ``pmean`` unless a codec measured faster.

    With ``m*`` the fastest measured compressed row and ``m_0`` plain ``pmean``'s time::

        plain                                   if m* > (1 - MARGIN) * m_0
        argmin_{r : m_r <= min((1 + TIE) m*, (1 - MARGIN) m_0)} codec_model_ms_r   otherwise

    Rows measured within :data:`TIE` of the fastest are a tie (timing noise); among them the
    one with the least codec work (``codec_model_ms``, then measured time) wins: in a training
    step the codec passes compete with the forward and backward for the host's cores, the
    wire time does not.

    Args:
      rows: candidates, ``measured_ms`` NaN where not timed; plain ``pmean`` timed. Every
        process must pass the same rows (:func:`autotune` reduces the timings over processes
        first), so every process selects the same row.

    Returns:
      The chosen row (the plain ``pmean`` row where no codec measured clearly faster).

    Example::

      best = jaxcomp._src.autotune.select(plan.table)   # plan.table[0]
    """
    plain = next((r for r in rows if r.codec is None and not math.isnan(r.measured_ms)), None)
    if plain is None:
        raise ValueError("`rows` must hold plain pmean's row (codec None) with its measured_ms")
    timed = [r for r in rows if r.codec is not None and not math.isnan(r.measured_ms)]
    if not timed or min(r.measured_ms for r in timed) > (1 - MARGIN) * plain.measured_ms:
        return plain
    bound = min((1 + TIE) * min(r.measured_ms for r in timed), (1 - MARGIN) * plain.measured_ms)
    tied = [r for r in timed if r.measured_ms <= bound]
    return min(tied, key=lambda r: (r.codec_model_ms, r.measured_ms))
