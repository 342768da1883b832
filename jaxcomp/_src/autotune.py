"""Pick the exchange from measurements: link, codec cost, byte model, then a timed check.

:func:`autotune` answers, on the devices at hand, "which codec, strategy and error feedback
make this tree's exchange fastest as a training step runs it, and is any faster than plain
``pmean``?" in five steps:

1. **link**: time ``psum`` (of float32, and of float16: ``all_reduce_16``), ``all_gather`` and
   ``all_to_all`` of arrays of a few sizes over ``axis_name`` and fit
   ``t = alpha + bytes / bandwidth`` per collective (ring-model
   bytes per device, as :func:`jaxcomp.comm_report` counts them: the alpha-beta model of
   Hockney, "The communication challenge for MPP", Parallel Computing 1994);
2. **codec cost**: time each candidate codec's encode, decode and (where its candidates keep
   error feedback) residual pass on every device at once over the tree's compressed leaves;
3. **predict** each candidate's exchange path: the collectives its strategy runs (bytes from
   :func:`jaxcomp.strategy_bytes`), one latency per bucket and phase, plus its codec and
   feedback passes;
4. **check**: time plain ``pmean`` and the best few predictions (the best of each codec
   first) *as the step runs them*: ``jc.compressed_allreduce`` with the candidate's error
   feedback, its state donated and fed back, so encode, decode and the memory update are in
   the time; keep the fastest measured one (:func:`select`: rows within :data:`TIE` of it
   are a tie, won by the least codec work). Plain ``pmean`` wins unless a candidate measures
   faster, so the plan never makes the step slower than it was on these devices;
5. **calibrate** (:func:`calibrate`): the table's ``predicted_ms`` scales the wire time by
   plain ``pmean``'s measured / modelled ratio and the codec passes by a factor fitted on the
   timed candidates, each timed candidate predicted without its own timing (leave-one-out).

Given ``loss_fn=`` and ``batch=``, step 4 times whole training steps instead and the fastest
step decides (:mod:`jaxcomp._src.autotune_steps`), and step 5 predicts every candidate's step.
Plain ``pmean`` is timed as :meth:`AutotunePlan.transform` runs it (:func:`plain_transform`),
and every wire in the bytes the backend moves (:func:`wire_widths`).

A candidate that fails (a trace or compile error, out of memory) is skipped with the reason in
its row's ``error``. Every process measures; the timings and the failures are reduced (max,
any) over processes before any decision, so every process reaches the same plan, and each
candidate is compiled, then given its buffers, then run, every process agreeing after each
stage (:func:`_agreed`), so none enters the collectives of a candidate another could not
build.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import buckets, feedback
from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import Codec, ceil_div, check_int, is_number
from jaxcomp._src.codecs.quantize import Cast, cast, int_quant
from jaxcomp._src.cost import STRATEGIES, _summed_dtype, check_pair, strategy_bytes

#: Candidates when ``codecs=None``: the codecs that keep quality without changing the
#: optimizer (16-bit casts, int8 blocks). Aggressive codecs (sign, top-k) only when listed.
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
    error_feedback: str | None = None  # as the step runs it (candidate_feedback)
    error: str = ""  # why the candidate was skipped ("" where it was not)
    step_ms: float = math.nan  # median measured training step (autotune with loss_fn=)
    step_spread_ms: float = math.nan  # interquartile range of the timed steps
    step_reps: int = 0  # timed steps behind step_ms
    predicted_step_ms: float = math.nan  # fitted compute + predicted exchange (leave-one-out)
    feedback_model_ms: float = 0.0  # the residual passes' share of codec_model_ms
    widen: float = 1.0  # bytes the backend moves per payload byte (wire_widths; plain: 1)
    step_cpu_ms: float = math.nan  # median process CPU time of the timed steps
    step_cpu_spread_ms: float = math.nan  # its interquartile range


@dataclasses.dataclass(frozen=True)
class AutotunePlan:
    """What :func:`autotune` chose, and why (``table``: every candidate, the chosen one first,
    then the timed ones fastest first, then the untimed ones, the failed ones last).

    Attributes:
      codec: the chosen codec; None: no compression (plain pmean is fastest here).
      strategy: the chosen strategy (``jc.pmean``'s ``strategy``).
      bucket_bytes: the chosen payload bucket size.
      min_size: the chosen ``min_size`` (smaller leaves go through plain ``pmean``).
      table: every candidate (:class:`Candidate`: bytes, predicted and measured ms, any
        failure), in the order above.
      link: the fitted latency and bandwidth per collective kind (:class:`LinkFit`).
      codec_ms: encode and decode ms of the tree per codec.
      error_feedback: what the chosen candidate was timed with.
      feedback_ms: the residual pass's ms per codec.
    """

    codec: Codec | None
    strategy: str
    bucket_bytes: int
    min_size: int
    table: tuple[Candidate, ...]
    link: dict[str, LinkFit]
    codec_ms: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    error_feedback: str | None = None
    feedback_ms: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def compressed(self) -> bool:
        return self.codec is not None

    def exchange(self) -> dict[str, Any]:
        """Keyword arguments for ``jc.pmean`` / ``jc.sgd`` / ``jc.compressed_allreduce``
        (``strategy``, ``bucket_bytes``, ``min_size``); pass ``plan.codec`` beside them, and
        ``error_feedback=plan.error_feedback`` to the two transforms."""
        return {
            "strategy": self.strategy,
            "bucket_bytes": self.bucket_bytes,
            "min_size": self.min_size,
        }

    def transform(self, axis_name: Any) -> Any:
        """The timed exchange as an optax transform to chain before the optimizer:
        ``jc.compressed_allreduce(plan.codec, axis_name, error_feedback=plan.error_feedback,
        **plan.exchange())``; for plain ``pmean`` :func:`plain_transform` (the float32 mean,
        one ``psum`` per bucket of ``plan.bucket_bytes``): in every case the exchange that
        :func:`autotune` timed."""
        from jaxcomp._src.compressed_allreduce import compressed_allreduce

        if self.codec is None:
            return plain_transform(axis_name, self.bucket_bytes)
        return compressed_allreduce(
            self.codec, axis_name, error_feedback=self.error_feedback, **self.exchange()
        )

    def format(self) -> str:
        """The table as text: one row per candidate, predicted and measured times."""
        steps = any(not math.isnan(c.step_ms) for c in self.table)
        head = f"{'candidate':<34}{'strategy':<12}{'feedback':<10}{'min_size':>9}"
        head += f"{'bytes/dev':>13}{'pred ms':>10}{'meas ms':>10}"
        head += f"{'pred step':>11}{'step ms':>10}{'spread':>8}" if steps else ""
        rows = [head]
        chosen = self.table[0] if self.table else None
        for c in self.table:
            meas = "-" if math.isnan(c.measured_ms) else f"{c.measured_ms:.2f}"
            mark = " <" if c is chosen else ""
            line = (
                f"{c.name[:33]:<34}{c.strategy:<12}{str(c.error_feedback):<10}{c.min_size:>9}"
                f"{c.bytes_per_device:>13,.0f}{c.predicted_ms:>10.2f}{meas:>10}"
            )
            if steps:
                line += f"{c.predicted_step_ms:>11.2f}" + "".join(
                    f"{'-' if math.isnan(v) else f'{v:.2f}':>{w}}"
                    for v, w in ((c.step_ms, 10), (c.step_spread_ms, 8))
                )
            rows.append(line + mark + (f"  failed: {c.error[:80]}" if c.error else ""))
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


def gradient_rows(params: Any, mesh: Any, axis_name: Any, seed: int = 7) -> Any:
    """Per-device gradients shaped and typed like ``params``: each leaf ``[n, *shape]`` of its
    own dtype, one row per device of ``axis_name`` (the timed exchange's input).

    In its own dtype, as the step's gradients are: an integer leaf (a step counter) passes
    through the exchange and has no memory in the state; given as float32 it was exchanged
    against that state, and every compressed candidate failed to time ("state field
    `memory` has shapes ...") so the plan was plain ``pmean`` whatever the link."""
    return jax.tree.map(
        lambda x: _per_device(mesh, axis_name, np.shape(x), seed, jnp.result_type(x)), params
    )


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


def elapsed_over_processes(t0: float) -> float:
    """Seconds since ``t0`` (this process's ``time.perf_counter()``), the max over processes:
    one number on every process, so a budget spent or compared with it stops every process
    at the same candidate.

    Each process's own clock is not: a process that entered :func:`autotune` earlier and
    waited in its first collective for a slower peer has spent more, and a remaining budget
    of its own made it stop timing a candidate earlier than its peers, which then entered
    that candidate's collectives alone (docs/multihost.md)."""
    return float(_reduce_over_processes(np.array([time.perf_counter() - t0]))[0])


def _abstract_rows(mesh: Any, axis_name: Any, shape: tuple[int, ...], dtype: Any = jnp.float32):
    """The abstract ``[n, *shape]`` array laid out one row per device (no data, no traffic)."""
    n = math.prod(mesh.shape[a] for a in _names(axis_name))
    return jax.ShapeDtypeStruct((n, *shape), dtype, sharding=NamedSharding(mesh, P(axis_name)))


def _per_device_program(fn: Callable, args: tuple, mesh: Any, axis_name: Any) -> Any:
    """``fn`` (per device, no collective) over every device of ``axis_name``, compiled for
    ``args`` (arrays or abstract arrays ``[n, ...]``, one row per device)."""
    spec = P(axis_name)
    run = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec, check_vma=False)
    )
    return run.lower(*args).compile()


def _codec_programs(
    codec: Codec, mesh: Any, axis_name: Any, sizes: Sequence[int], fed: bool
) -> tuple:
    """Compiled ``(encode, decode, encode with feedback or None)`` over vectors of ``sizes``,
    from abstract inputs: a codec that fails to trace or compile fails here, on this process
    alone, before any data moves between processes."""
    key = jax.random.key_data(jax.random.key(0))
    xs = [_abstract_rows(mesh, axis_name, (d,)) for d in sizes]

    def enc(xs):
        return [jax.tree.map(lambda a: a[None], codec.encode(x[0], key)) for x in xs]

    def dec(ps):
        return [
            codec.decode(jax.tree.map(lambda a: a[0], p), d)[None]
            for p, d in zip(ps, sizes, strict=True)
        ]

    def with_feedback(gs, es):  # p = encode(g + e); e <- g + e - decode(p)
        out = []
        for g, e, d in zip(gs, es, sizes, strict=True):
            sent = g[0] + e[0]
            p = codec.encode(sent, key)
            out.append((jax.tree.map(lambda a: a[None], p), (sent - codec.decode(p, d))[None]))
        return out

    enc_c = _per_device_program(enc, (xs,), mesh, axis_name)
    dec_c = _per_device_program(dec, (enc_c.out_info,), mesh, axis_name)
    fed_c = _per_device_program(with_feedback, (xs, xs), mesh, axis_name) if fed else None
    return enc_c, dec_c, fed_c


def _codec_times(programs: tuple, mesh: Any, axis_name: Any, sizes: Sequence[int], reps: int):
    """This process's ``[encode, decode, feedback]`` seconds of :func:`_codec_programs`'
    programs (feedback: encode with feedback less encode; 0 without)."""
    enc_c, dec_c, fed_c = programs
    xs = [_per_device(mesh, axis_name, (d,), i) for i, d in enumerate(sizes)]
    enc_s = _median_time(lambda: enc_c(xs), reps)
    payloads = enc_c(xs)
    dec_s = _median_time(lambda: dec_c(payloads), reps)
    fed_s = enc_s
    if fed_c is not None:
        es = [_per_device(mesh, axis_name, (d,), 50 + i) for i, d in enumerate(sizes)]
        fed_s = _median_time(lambda: fed_c(xs, es), reps)
    return np.array([enc_s, dec_s, max(0.0, fed_s - enc_s)])


def codec_seconds(
    codec: Codec, mesh: Any, axis_name: Any, sizes: Sequence[int], reps: int = 3
) -> tuple[float, float]:
    """Seconds of ``encode`` and of ``decode`` over vectors of ``sizes``, run on every device
    of ``axis_name`` at once (so devices that share a host's cores are measured sharing them);
    the max over processes."""
    programs = _codec_programs(codec, mesh, axis_name, sizes, False)
    enc_s, dec_s, _ = _reduce_over_processes(_codec_times(programs, mesh, axis_name, sizes, reps))
    return float(enc_s), float(dec_s)


def feedback_seconds(
    codec: Codec, mesh: Any, axis_name: Any, sizes: Sequence[int], reps: int = 3
) -> float:
    """Seconds the residual memory adds to one encode over vectors of ``sizes``.

    Times ``p = encode(g + e); e <- g + e - decode(p)`` (error feedback: Karimireddy et al.,
    "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019) on every
    device at once and returns ``max(0, t - t_encode)``: the memory's read and write and the
    decode of the sent vector, as :func:`jaxcomp.compressed_allreduce` runs them per leaf; the
    max over processes.
    """
    programs = _codec_programs(codec, mesh, axis_name, sizes, True)
    return float(_reduce_over_processes(_codec_times(programs, mesh, axis_name, sizes, reps))[2])


def candidate_feedback(codec: Codec | None) -> str | None:
    """The error feedback a candidate is timed and run with.

    ``None`` for plain ``pmean`` and for the 16-bit casts, the codec's ``"auto"`` feedback
    (:func:`jaxcomp.compressed_allreduce`: residual for biased codecs) otherwise. A 16-bit
    cast drops only rounding, ``|C(x)_i - x_i| <= 2^-(m+1) |x_i|`` inside the normal range
    (fp16, ``m = 10``: ``4.9e-4``; bf16, ``m = 7``: ``3.9e-3``), as torch's
    ``fp16_compress_hook``; a residual memory would cost a gradient-sized read and write per
    step to carry that rounding into the next one.

    Args:
      codec: a candidate codec, or None (plain ``pmean``).

    Returns:
      ``None``, ``"residual"`` or ``"ef21"``, as ``error_feedback=`` takes it.

    Example::

      candidate_feedback(jc.cast("fp16"))   # None
      candidate_feedback(jc.int_quant(8))   # "residual"
    """
    if codec is None or (isinstance(codec, Cast) and codec.dtype.itemsize >= 2):
        return None
    return feedback.resolve("auto", codec)


def _phases(codec: Codec | None, strategy: str, sizes: Sequence[int], n: int, widen: float = 1.0):
    """``(kind, ring bytes per device, [bytes per device sent into it, per leaf])`` of each
    phase; a codec's ring bytes times ``widen`` (:func:`wire_widths`), and a 16-bit sum the
    backend widens runs as a float32 ``all_reduce``."""
    if codec is None or not sizes:
        total = 4 * sum(sizes)
        sent = [4 * d for d in sizes]
        return [("all_reduce", _ring_bytes("all_reduce", total, n), sent)] if total else []
    rings = [strategy_bytes(codec, d, n)[strategy] for d in sizes]
    ring = widen * sum(rings)
    if strategy == "allreduce":
        narrow = _summed_dtype(codec) in ("float16", "bfloat16") and widen == 1.0
        kind = "all_reduce_16" if narrow else "all_reduce"
        # one device: no ring bytes and nothing sent (every compressed row of a one-device
        # table read "failed: bytes model: ZeroDivisionError", dividing by n - 1)
        return [(kind, ring, [r * n / (2 * (n - 1)) if n > 1 else 0.0 for r in rings])]
    if strategy == "allgather":
        return [("all_gather", ring, [r / (n - 1) if n > 1 else 0.0 for r in rings])]
    if strategy == "majority_vote":
        return _vote_phases(codec, sizes, n, widen)
    cs = [ceil_div(d, n) for d in sizes]
    phases = [codec.phase_codecs(c, n) for c in cs]
    rows = [n * first.payload_bytes(c) for c, (first, _) in zip(cs, phases, strict=True)]
    owned = [second.payload_bytes(c) for c, (_, second) in zip(cs, phases, strict=True)]
    return [("all_to_all", ring / 2, rows), ("all_gather", ring / 2, owned)]


def _vote_phases(codec: Codec, sizes: Sequence[int], n: int, widen: float = 1.0) -> list:
    """The phases of ``strategy="majority_vote"`` (signSGD with majority vote, Bernstein et
    al., ICLR 2019), as ``jc.pmean`` runs it: each device's ``W = ceil(d / 32)`` words of
    signs cut in ``n`` rows of ``w = ceil(W / n)`` words and ``all_to_all``-ed (``4 n w``
    bytes in, ring ``(n-1) 4 w``), the owners' vote words ``all_gather``-ed (``4 w`` in, ring
    ``(n-1) 4 w``), the block scales ``psum``-ed (``s`` bytes, ring ``2 (n-1)/n s``): in all
    :func:`jaxcomp.strategy_bytes`' ``majority_vote``."""
    words = [4 * ceil_div(packing.packed_words(d, 1), n) for d in sizes]
    scales = [codec.payload_bytes(d) - 4 * packing.packed_words(d, 1) for d in sizes]
    phases = [
        ("all_to_all", widen * (n - 1) * sum(words), [n * w for w in words]),
        ("all_gather", widen * (n - 1) * sum(words), words),
    ]
    if sum(scales):
        phases.append(("all_reduce", widen * _ring_bytes("all_reduce", sum(scales), n), scales))
    return phases


#: Bytes per element of the element types of a compiled program's text.
_HLO_BYTES = {
    **dict.fromkeys(("pred", "s8", "u8", "f8e4m3fn", "f8e5m2"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32"), 4),
    **dict.fromkeys(("s64", "u64", "f64"), 8),
}


def _moved_itemsize(dtype: Any, mesh: Any, axis_name: Any) -> int:
    """Bytes per element the backend's ``all_gather`` of ``dtype`` over ``axis_name`` moves, read
    from the compiled program (XLA:CPU gathers bfloat16 as float32); the dtype's own size
    where the program shows no all-gather (one device) or an unknown type."""
    dtype = jnp.dtype(dtype)

    def gather(x):
        return jax.lax.all_gather(x[0], axis_name, tiled=True)[None]

    fn = jax.shard_map(gather, mesh=mesh, in_specs=P(axis_name), out_specs=P(axis_name),
                       check_vma=False)  # fmt: skip
    text = jax.jit(fn).lower(_abstract_rows(mesh, axis_name, (64,), dtype)).compile().as_text()
    found = re.search(r"= \(?(\w+)\[[^\n]*? all-gather(?:-start)?\(", text)
    return _HLO_BYTES.get(found.group(1), dtype.itemsize) if found else dtype.itemsize


def wire_widths(codecs: Sequence[Codec | None], mesh: Any, axis_name: Any) -> dict:
    """Bytes the backend moves per byte of each codec's payload in its collectives.

    ``widen(C) = sum_leaves size * moved_itemsize / sum_leaves size * itemsize`` over the
    payload leaves of ``C.encode`` (a 4096-vector), ``moved_itemsize`` read from a compiled
    ``all_gather`` of the leaf's dtype on ``mesh`` (:func:`_moved_itemsize`). XLA:CPU widens
    bfloat16 collectives (``all_gather``, ``all_to_all``, ``psum``) to float32: a bf16 cast
    moves the bytes of float32 there (``widen = 2``), fp16 and int8 their own (1). A probe
    that fails counts as 1, on every process alike (the widths are reduced, max).

    Args:
      codecs: the candidate codecs (None is skipped).
      mesh: the mesh the candidates run on.
      axis_name: the axis their collectives run over.

    Returns:
      ``{codec: widen}`` for every codec.

    Example::

      wire_widths([jc.cast("bf16")], mesh, "data")   # {Cast(bfloat16): 2.0} on XLA:CPU
    """
    codecs = list(dict.fromkeys(c for c in codecs if c is not None))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    moved: dict[str, int] = {}
    widths = []
    for c in codecs:
        try:
            leaves = jax.tree.leaves(
                jax.eval_shape(c.encode, jax.ShapeDtypeStruct((4096,), jnp.float32), key)
            )
            for a in leaves:
                if a.dtype.name not in moved:
                    moved[a.dtype.name] = _moved_itemsize(a.dtype, mesh, axis_name)
            sent = sum(a.size * a.dtype.itemsize for a in leaves)
            widths.append(sum(a.size * moved[a.dtype.name] for a in leaves) / sent if sent else 1.0)
        except Exception:  # noqa: BLE001 - a codec that fails here fails its timing later
            widths.append(1.0)
    widths = _reduce_over_processes(np.asarray(widths, dtype=np.float64)) if codecs else []
    return {c: float(w) for c, w in zip(codecs, widths, strict=True)}


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
    feedback_s: float = 0.0,
    widen: float = 1.0,
) -> tuple[float, float]:
    """Predicted seconds and ring-model bytes per device of one exchange of leaves ``sizes``.

    ``t = sum_phases (calls * alpha + bytes / bandwidth) + codec passes``, with ``calls``
    the buckets of the phase: one per leaf whose payload is at least ``bucket_bytes / 16``
    (it travels alone) plus ``ceil(other bytes sent / bucket_bytes)``; codec passes:
    ``allreduce`` and ``majority_vote`` one encode and one decode, ``allgather`` one encode
    and ``n`` decodes, ``two_phase`` ``1 + 1/n`` encodes and two decodes (``codec_s`` =
    encode and decode seconds of the whole compressed tree), each encode with its error
    feedback's residual pass (``feedback_s``, 0 without feedback: :func:`feedback_seconds`).
    ``widen``: bytes the backend moves per payload byte (:func:`wire_widths`), scaling the
    compressed phases' wire time; the returned ring bytes stay the codec's own (plain
    ``pmean``: float32, never widened).
    """
    widen = 1.0 if codec is None else widen
    small = [d for d in sizes if codec is not None and d < min_size]
    big = [d for d in sizes if codec is None or d >= min_size]
    plain, phases = _phases(None, "pmean", small, n), _phases(codec, strategy, big, n, widen)
    ring = sum(r for _, r, _ in plain) + sum(r for _, r, _ in phases) / widen
    phases += plain
    seconds = sum(
        _calls(sent, bucket_bytes) * link[kind].alpha_s + r / link[kind].bandwidth
        for kind, r, sent in phases
    )
    enc, dec = codec_s
    passes = {
        "allreduce": (1, 1),
        "allgather": (1, n),
        "two_phase": (1 + 1 / n, 2),
        "majority_vote": (1, 1),
    }
    if codec is not None and big:
        e, k = passes[strategy]
        seconds += e * (enc + feedback_s) + k * dec
    return seconds, ring


def plain_transform(axis_name: Any, bucket_bytes: int = buckets.BUCKET_BYTES) -> Any:
    """Plain ``pmean`` as :func:`autotune` times it and :meth:`AutotunePlan.transform` runs it.

    ``jc.compressed_allreduce(jc.identity(), axis_name, error_feedback=None,
    bucket_bytes=bucket_bytes)``: the float32 mean ``(1/n) sum_i g_i`` of every leaf, the
    leaves packed into buckets of ``bucket_bytes`` (an array of at least ``bucket_bytes / 16``
    bytes in its own), one ``psum`` per bucket; its state is the step count alone.

    Args:
      axis_name: the mesh axis (or axes) the gradients are averaged over.
      bucket_bytes: the bucket size (the plain row's ``bucket_bytes``).

    Returns:
      An optax ``GradientTransformation`` to chain before the optimizer.

    Example::

      tx = optax.chain(plain_transform("data"), optax.sgd(0.1))

    Reference: the bucketed all-reduce of PyTorch DDP (Li et al., "PyTorch Distributed:
    Experiences on Accelerating Data Parallel Training", VLDB 2020).
    """
    from jaxcomp._src.codecs.quantize import identity
    from jaxcomp._src.compressed_allreduce import compressed_allreduce

    return compressed_allreduce(
        identity(), axis_name, error_feedback=None, bucket_bytes=bucket_bytes
    )


def _exchange_tx(row: Candidate, axis_name: Any) -> Any:
    """``row``'s exchange transform (:func:`plain_transform` for plain ``pmean``)."""
    from jaxcomp._src.compressed_allreduce import compressed_allreduce

    if row.codec is None:
        return plain_transform(axis_name, row.bucket_bytes)
    return compressed_allreduce(
        row.codec,
        axis_name,
        error_feedback=row.error_feedback,
        strategy=row.strategy,
        bucket_bytes=row.bucket_bytes,
        min_size=row.min_size,
    )


def compiled_path(params: Any, tree: Any, mesh: Any, axis_name: Any, row: Candidate) -> Any:
    """``row``'s exchange as a training step runs it, compiled ahead of time
    (:func:`lowered_path`, compiled)."""
    return lowered_path(params, tree, mesh, axis_name, row).compile()


def lowered_path(params: Any, tree: Any, mesh: Any, axis_name: Any, row: Candidate) -> Any:
    """``row``'s exchange as a training step runs it, lowered (``jax.stages.Lowered``).

    Compiled, ``(tree, state) -> (mean, state)`` takes the per-device gradients (each leaf
    ``[n, *shape]``, one row per device) and donates ``state`` (:func:`path_state`):
    ``jc.compressed_allreduce(codec, axis_name, error_feedback=row.error_feedback,
    strategy=..., bucket_bytes=..., min_size=...)``, or :func:`plain_transform` for plain
    ``pmean`` (what :meth:`AutotunePlan.transform` runs), so the encode, decode and
    error-feedback memory update are all in the program. Lowered from the state's abstract
    shapes: a trace (or, in :func:`compiled_path`, compile) error is raised on this process
    alone, before any data moves between processes.

    Args:
      params: the parameter tree (shapes and dtypes of the gradients).
      tree: the per-device gradients, each leaf ``[n, *shape]`` sharded over ``axis_name``.
      mesh: the device mesh.
      axis_name: the mesh axis to average over.
      row: the candidate (codec, strategy, bucket_bytes, min_size, error_feedback).

    Returns:
      The lowered program (``.compile()`` it, or read ``.as_text()``).
    """
    tx = _exchange_tx(row, axis_name)
    state, specs = abstract_state(tx, params, mesh, axis_name)

    def body(g, s):
        return tx.update(jax.tree.map(lambda a: a[0], g), s)

    fn = jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis_name), specs), out_specs=(P(), specs), check_vma=False
    )
    return jax.jit(fn, donate_argnums=(1,)).lower(tree, state)


def abstract_state(tx: Any, params: Any, mesh: Any, axis_name: Any) -> tuple[Any, Any]:
    """``(state, specs)``: ``jc.sharded_init(tx, params, mesh, axis_name)``'s shapes, dtypes
    and shardings as ``jax.ShapeDtypeStruct`` (nothing allocated, nothing run) and its
    :func:`jaxcomp.state_specs`, to lower a step that takes that state."""
    from jaxcomp._src.sharding import abstract_init, state_specs

    specs = state_specs(abstract_init(tx, params, mesh, axis_name), axis_name)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    state = jax.tree.map(
        lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec)),
        jax.eval_shape(init, params),
        specs,
    )
    return state, specs


def path_state(params: Any, mesh: Any, axis_name: Any, row: Candidate) -> Any:
    """The first state :func:`compiled_path`'s program takes: ``jc.sharded_init`` of the
    candidate's transform (:func:`plain_transform`'s for plain ``pmean``)."""
    from jaxcomp._src.sharding import init_state

    return init_state(_exchange_tx(row, axis_name), params, mesh, axis_name)


def _path_median(compiled: Callable, tree: Any, state: Any, reps: int) -> float:
    state = jax.block_until_ready(compiled(tree, state))[1]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        state = jax.block_until_ready(compiled(tree, state))[1]
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def path_seconds(compiled: Callable, tree: Any, state: Any, reps: int = 3) -> float:
    """Median seconds of ``compiled(tree, state)`` (:func:`compiled_path`, first state from
    :func:`path_state`), each call fed the state the previous one returned, after one warm-up
    call; the max over processes."""
    return float(_reduce_over_processes(np.array([_path_median(compiled, tree, state, reps)]))[0])


def _guarded(fn: Callable[[], Any]) -> tuple[Any, str]:
    """``(fn(), "")``, or ``(None, "Type: message")`` where ``fn`` raised on this process or
    on any other (the failure is reduced over processes, so all skip the same candidate)."""
    try:
        out, err = fn(), ""
    except Exception as e:  # noqa: BLE001 - a failing candidate is skipped, not fatal
        out, err = None, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    if _reduce_over_processes(np.array([float(bool(err))]))[0] and not err:
        err = "failed on another process"
    return (None if err else out), err


def _agreed(*stages: Callable[[Any], Any]) -> tuple[Any, str]:
    """Run ``stages`` in order, each on the previous one's output (the first on None), each
    under :func:`_guarded`, stopping at the first that fails on any process.

    Every process learns whether every other one finished a stage before any starts the
    next: a stage that fails on one process alone (a compile error, out of memory while its
    params or state are made) is skipped by all, and no process waits in the collectives of
    a later stage that the failed one never enters. So a candidate is compiled, then its
    buffers are made (blocked on), then it runs.

    Returns:
      ``(the last stage's output, "")``, or ``(None, "Type: message")`` of the first failure
      (``"failed on another process"`` where it was elsewhere).

    Example::

      out, err = _agreed(lambda _: compile_it(), lambda c: (c, make_state()), run_it)
    """
    out = None
    for stage in stages:
        out, err = _guarded(lambda stage=stage, x=out: stage(x))
        if err:
            return None, err
    return out, ""


def codec_label(codec: Codec | None) -> str:
    """A short name: the registry's (``"int8"``) where one matches, else the codec's repr."""
    from jaxcomp._src.codecs.registry import CODECS

    if codec is None:
        return "none"
    return next((k for k, f in CODECS.items() if f() == codec), codec.name)


def _candidates(codecs, strategies, bucket_sizes, min_sizes) -> list[tuple]:
    """``(codec, strategy, bucket_bytes, min_size, error_feedback)`` of every valid
    combination (error feedback from :func:`candidate_feedback`)."""
    out = [(None, "pmean", bucket_sizes[0], 0, None)]
    for codec in codecs:
        if codec is None:
            continue
        ef = candidate_feedback(codec)
        for strategy in strategies:
            try:
                check_pair(codec, strategy)
            except ValueError:
                continue
            out += [(codec, strategy, b, m, ef) for b in bucket_sizes for m in min_sizes]
    return out


def check_carried(codecs: Sequence[Codec | None], strategies: Sequence[str]) -> None:
    """Every codec of ``codecs`` carried by at least one of ``strategies``, else a ValueError
    naming ``strategies``: such a codec had no candidate at all and was left out of the table
    without a word (``codecs=[None, jc.int_quant(8)], strategies=["allreduce"]``: the plan
    plain ``pmean``, int8 never timed)."""
    for codec in codecs:
        if codec is None:
            continue
        carried = []
        for strategy in strategies:
            try:
                check_pair(codec, strategy)
                carried.append(strategy)
            except ValueError:
                continue
        if not carried:
            raise ValueError(
                f"`strategies` {list(strategies)} carry none of {codec.name}'s payloads "
                "(allreduce needs a summable codec, majority_vote a sign codec): add "
                "'allgather' or 'two_phase', or leave the codec out of `codecs`"
            )


def check_strategies(strategies: Sequence[str]) -> tuple[str, ...]:
    """``strategies`` as a tuple of names a candidate can take (``auto`` picks for itself:
    not one), else a ValueError naming the argument: an unknown name was skipped like a
    strategy the codec cannot carry, so a typo tuned nothing but plain pmean."""
    if isinstance(strategies, str):
        strategies = (strategies,)
    known = tuple(s for s in STRATEGIES if s != "auto")
    bad = [s for s in strategies if s not in known]
    if bad or not strategies:
        raise ValueError(f"`strategies` must be names among {known}, got {list(strategies)!r}")
    return tuple(strategies)


def _check_ints(name: str, values: Any, lo: int, distinct: int = 1) -> tuple[int, ...]:
    """``values`` as a tuple of ints ``>= lo``, at least ``distinct`` of them different, else
    an error naming ``name``."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
        raise TypeError(f"`{name}` must be a sequence of ints, got {type(values).__name__}")
    out = tuple(check_int(name, v, lo) for v in values)
    if len(set(out)) < distinct:
        raise ValueError(
            f"`{name}` must hold at least {distinct} different int(s) >= {lo}, got {list(out)}"
        )
    return out


def check_tuning(
    reps: Any, budget_s: Any, bucket_sizes: Any, min_sizes: Any, link_sizes: Any
) -> tuple[int, float, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """:func:`autotune`'s measuring arguments, checked before anything is measured.

    ``reps`` an int >= 1 (0 timed nothing: every median NaN, "every timed candidate failed
    ()"); ``budget_s`` a number >= 0, not NaN (a NaN budget was never exceeded); ``bucket_sizes``
    at least one int >= 1 (none: IndexError); ``min_sizes`` at least one int >= 0 (none: no
    compressed candidate at all, the plan plain ``pmean`` without a word; a negative one
    failed every row); ``link_sizes`` at least two different ints >= 1 (the fit has two
    unknowns, latency and bandwidth; 0 failed in jax's verifier, none gave a bandwidth of
    1e15 bytes/s).

    Returns:
      ``(reps, budget_s, bucket_sizes, min_sizes, link_sizes)``, the sequences as tuples.
    """
    reps = check_int("reps", reps, 1)
    if not is_number(budget_s):
        raise TypeError(f"`budget_s` must be a number, got {type(budget_s).__name__}")
    if not budget_s >= 0:
        raise ValueError(f"`budget_s` must be a number >= 0 (seconds), got {budget_s}")
    return (
        reps,
        float(budget_s),
        _check_ints("bucket_sizes", bucket_sizes, 1),
        _check_ints("min_sizes", min_sizes, 0),
        _check_ints("link_sizes", link_sizes, 1, distinct=2),
    )


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
    # An empty leaf takes no part in any exchange (its own mean), so no size of 0: the codec
    # timing would compile an encode of f32[0] beside the other sizes' (XLA:CPU in jaxlib
    # 0.11.2 segfaults on such an operand: docs/errors.md).
    sizes = [
        int(np.size(x))
        for x in jax.tree.leaves(params)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating) and np.size(x)
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
    check: int = 4,
    budget_s: float = 60.0,
    reps: int = 3,
    link_sizes: Sequence[int] = (1 << 12, 1 << 18, 1 << 22),
    loss_fn: Callable[..., jax.Array] | None = None,
    batch: Any = None,
    optimizer: Any = None,
) -> AutotunePlan:
    """Measure the link and the codecs on ``mesh``, predict every candidate, time the best.

    For each candidate ``c`` (codec, strategy, bucket size, ``min_size``, and the error
    feedback it runs with: :func:`candidate_feedback`, none for 16-bit casts) the predicted
    time of one exchange of ``params``' gradient, as a training step runs it, is (see
    :func:`predict_seconds`)::

        t_c = sum_phases (calls * alpha_kind + ring_bytes / bandwidth_kind)
              + encodes * (t_encode + t_feedback) + decodes * t_decode

    with ``alpha`` and ``bandwidth`` fitted per collective (:func:`measure_link`) and the
    codec's encode, decode and residual pass timed on every device at once
    (:func:`codec_seconds`, :func:`feedback_seconds`). Plain ``pmean`` and ``check``
    candidates (the best predicted of each codec, then the next best) are then timed for
    real as the step runs them (:func:`compiled_path`: ``jc.compressed_allreduce`` with its
    feedback and state, encode to memory update); the plan is the fastest measured
    (:func:`select`), so it is plain ``pmean`` (``plan.codec is None``) unless compression
    measured faster. In a step the exchange follows the forward and backward, so on hosts
    that run them one after the other the step's time is ``compute + t_c`` and the
    fastest exchange path is the fastest step. The table's ``predicted_ms`` are calibrated
    on the timed rows (:func:`calibrate`; ``model_ms``: before calibration). With
    ``loss_fn=`` and ``batch=`` the check times whole steps instead, and the step decides
    (exchanges timed alone can tie where the steps they run in do not: docs/autotune.md,
    "Whole steps", has the measurements).

    A candidate that fails to trace, compile or run (an error in a codec, out of memory) is
    skipped: its row keeps the reason in ``error`` and no measured time. Failures and
    timings are reduced over processes (any, max), so every process makes the same choice;
    a failure is detected before the candidate's collectives run (it is compiled ahead of
    time, then its buffers are made, every process agreeing after each stage), except a
    failure inside a running program (then the peers may wait in its collective).

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
      check: how many candidates besides plain ``pmean`` to time for real (default 4).
      budget_s: stop timing further candidates once this many seconds have passed.
      reps: timed repetitions per measurement (the median is kept).
      link_sizes: float32 elements per device of the arrays timed to fit the link.
      loss_fn: ``loss_fn(params, *batch) -> scalar``, one device's loss: with it the
        checked candidates are timed as whole training steps (gradients, the candidate's
        exchange with its error feedback, ``optimizer``, the update; params and state
        donated) and ranked by their median step
        (:func:`jaxcomp._src.autotune_steps.select_step`), ties within the timing noise
        timed again, interleaved, and settled by the least CPU time per step, then the
        least codec work (:func:`jaxcomp._src.autotune_steps.settle_tie`); every row gets
        a predicted step
        (:func:`jaxcomp._src.autotune_steps.calibrate_steps`). ``params`` must then hold the
        values to start from. None: the exchange path is timed alone (above).
      batch: with ``loss_fn``, the arrays of one step's global batch, each with its leading
        dimension split over ``axis_name`` (a tuple, or one array; host arrays are
        placed on ``mesh``, :func:`jaxcomp._src.autotune_steps.place_batch`).
      optimizer: with ``loss_fn``, the optax optimizer chained after the exchange (default
        ``optax.sgd(1e-3)``).

    Returns:
      A :class:`AutotunePlan`: ``codec``, ``strategy``, ``bucket_bytes``, ``min_size``,
      ``error_feedback``, ``table`` (every candidate with bytes, predicted and measured ms and
      any failure; the chosen row first, then measured ones fastest first, failed ones last),
      ``link`` (the fitted latency and bandwidth per collective), ``codec_ms`` (encode and
      decode ms of the tree per codec) and ``feedback_ms`` (the residual pass per codec).

    Raises:
      ValueError: before anything is measured, ``axis_name`` not an axis of ``mesh``,
        ``params`` without floating-point leaves, ``check`` or ``reps`` < 1, unknown
        ``strategies`` (or none that carries one of ``codecs``), ``budget_s`` negative or
        NaN, ``bucket_sizes`` / ``min_sizes`` empty or out of range, ``link_sizes`` without
        two different sizes >= 1 (:func:`check_tuning`), or ``batch`` without ``loss_fn``
        (or ``loss_fn`` without it).
      TypeError: ``codecs`` not jaxcomp codecs, ``loss_fn`` not callable, ``optimizer`` not an
        optax transform, ``reps`` not an int, ``budget_s`` not a number, ``bucket_sizes``,
        ``min_sizes`` or ``link_sizes`` not a sequence of ints (the message names the
        argument; the rules: docs/errors.md).
      RuntimeError: every timed candidate failed (the reasons are in the message).

    Example::

      plan = jc.autotune(params, mesh, "data")
      # or rank whole steps of this loss and batch (x, y split over "data"):
      plan = jc.autotune(params, mesh, "data", loss_fn=loss_fn, batch=(x, y))
      print(plan.format())
      tx = optax.chain(plan.transform("data"), optax.sgd(0.1, momentum=0.9))
      # or momentum before the codec: jc.sgd(0.1, plan.codec, "data",
      #     error_feedback=plan.error_feedback, **plan.exchange()) where plan.compressed

    Reference: the alpha-beta model of Hockney, Parallel Computing 1994, with the codec's
    passes added as in Agarwal et al., "On the Utility of Gradient Compression in Distributed
    Training Systems", MLSys 2022.
    """
    from jaxcomp._src import autotune_steps

    t0 = time.perf_counter()
    codecs = DEFAULT_CODECS if codecs is None else tuple(codecs)
    sizes = _check_args(params, axis_name, mesh, codecs)
    batch, optimizer = autotune_steps.check_step_args(loss_fn, batch, optimizer)
    if loss_fn is not None:
        batch = autotune_steps.place_batch(batch, mesh, axis_name)
    check = check_int("check", check, 1)
    strategies = DEFAULT_STRATEGIES if strategies is None else check_strategies(strategies)
    reps, budget_s, bucket_sizes, min_sizes, link_sizes = check_tuning(
        reps, budget_s, bucket_sizes, min_sizes, link_sizes
    )
    check_carried(codecs, strategies)
    link = measure_link(mesh, axis_name, link_sizes, reps)
    n = math.prod(mesh.shape[a] for a in _names(axis_name))
    costs, failed = _codec_costs(codecs, mesh, axis_name, sizes, reps)
    widths = wire_widths(codecs, mesh, axis_name)
    cands = _candidates(codecs, strategies, bucket_sizes, min_sizes)
    rows = _model_rows(cands, sizes, n, link, costs, failed, widths)
    budget_s -= elapsed_over_processes(t0)  # the same remaining budget on every process
    if loss_fn is None:  # the exchange path alone
        plan = _checked_plan(params, mesh, axis_name, rows, check, budget_s, reps, link)
    else:  # whole steps
        timer = autotune_steps._Timer(params, batch, mesh, axis_name, loss_fn, optimizer, reps)
        plan = autotune_steps.stepped_plan(rows, check, budget_s, timer, link)
    cost_ms = {codec_label(c): (1e3 * e, 1e3 * d) for c, (e, d, _) in costs.items()}
    fed_ms = {codec_label(c): 1e3 * f for c, (_, _, f) in costs.items() if candidate_feedback(c)}
    return dataclasses.replace(plan, codec_ms=cost_ms, feedback_ms=fed_ms)


def _codec_costs(codecs, mesh, axis_name, sizes, reps) -> tuple[dict, dict]:
    """``({codec: (encode, decode, feedback) seconds}, {codec: why it failed})``, agreed over
    processes: each codec's programs are compiled first (a failure there is agreed on before
    any data moves), then timed."""
    costs, failed = {}, {}
    for c in dict.fromkeys(c for c in codecs if c is not None):
        fed = candidate_feedback(c) is not None
        local, err = _agreed(
            lambda _, c=c, f=fed: _codec_programs(c, mesh, axis_name, sizes, f),
            lambda p: _codec_times(p, mesh, axis_name, sizes, reps),
        )
        if err:  # every process agrees (_agreed): skip the codec's candidates
            failed[c] = f"codec timing: {err}"
        else:
            costs[c] = tuple(float(t) for t in _reduce_over_processes(local))
    return costs, failed


def compresses(codec: Codec | None, min_size: int, sizes: Sequence[int]) -> bool:
    """Whether a candidate sends any leaf through its codec: plain ``pmean`` (None) always
    counts; a codec only where some leaf has at least ``min_size`` values.

    A codec's candidate whose ``min_size`` exceeds every leaf is plain ``pmean`` under
    another name: every leaf goes through the transform's plain path. Timed beside plain
    ``pmean`` it could measure faster by noise and become the plan, ``plan.compressed`` True
    while nothing was compressed, and ``jc.sgd`` built from the plan took that codec's
    defaults (the look-ahead momentum of a biased codec) for an exchange that compressed
    nothing (measured: docs/autotune.md).

    Example::

      compresses(jc.int_quant(8), 4096, [2000, 50])   # False: no leaf reaches 4096
    """
    return codec is None or any(d >= min_size for d in sizes)


def _model_rows(candidates, sizes, n, link, costs, failed, widths=None) -> list[Candidate]:
    """A :class:`Candidate` per ``(codec, strategy, bucket_bytes, min_size, error_feedback)``
    with its modelled time (:func:`predict_seconds`, the wire widened by ``widths``:
    :func:`wire_widths`), failed ones last, by ``model_ms``. A codec's candidate whose
    ``min_size`` exceeds every leaf is left out (:func:`compresses`)."""
    rows = []
    for codec, strategy, bb, ms, ef in candidates:
        if not compresses(codec, ms, sizes):
            continue
        frac = sum(d for d in sizes if d >= ms) / sum(sizes) if codec is not None else 0.0
        enc, dec, fed = costs.get(codec, (0.0, 0.0, 0.0))
        fb = frac * fed if ef is not None else 0.0
        wide = (widths or {}).get(codec, 1.0) if codec is not None else 1.0
        try:  # the bytes model traces the codec: the same outcome on every process
            args = (codec, strategy, sizes, n, link, bb, ms)
            sec, ring = predict_seconds(*args, (frac * enc, frac * dec), fb, widen=wide)
            unfed, _ = predict_seconds(*args, (frac * enc, frac * dec), 0.0, widen=wide)
            wire, _ = predict_seconds(*args, widen=wide)
            error = failed.get(codec, "")
        except Exception as e:  # noqa: BLE001 - a failing candidate is skipped, not fatal
            sec = ring = wire = unfed = math.nan
            error = failed.get(codec) or f"bytes model: {type(e).__name__}: {e}".splitlines()[0]
        ms_ = 1e3 * sec
        rows.append(
            Candidate(
                codec_label(codec), codec, strategy, bb, ms, ring, ms_, math.nan, ms_,
                1e3 * (sec - wire), ef, error, feedback_model_ms=1e3 * (sec - unfed),
                widen=wide,
            )
        )  # fmt: skip
    # a model that failed on another process fails here too (every process sorts the same)
    elsewhere = _reduce_over_processes(np.array([float(bool(r.error)) for r in rows]))
    rows = [
        r._replace(error="bytes model: failed on another process") if f and not r.error else r
        for r, f in zip(rows, elsewhere, strict=True)
    ]
    rows.sort(key=lambda r: (bool(r.error), r.model_ms if not r.error else 0.0))
    return rows


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
        pts = [
            (r.codec_model_ms, r.measured_ms - lam * (r.model_ms - r.codec_model_ms))
            for r in timed
            if r is not skip
        ]
        return fit_scale(pts, 0.1, 10.0)

    out = []
    for r in rows:
        if r.codec is None:
            out.append(r._replace(predicted_ms=r.model_ms if r is plain else lam * r.model_ms))
            continue
        k = kappa(r if any(r is t for t in timed) else None)
        wire = r.model_ms - r.codec_model_ms
        out.append(r._replace(predicted_ms=lam * wire + k * r.codec_model_ms))
    return out


def fit_scale(points: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """The ``k`` minimizing ``sum (y - k c)^2`` over the points ``(c, y)``, i.e.
    ``sum c y / sum c^2``, clipped to ``[lo, hi]``; 1 where no point has ``c != 0``.

    Example::

      fit_scale([(500.0, 40.0), (250.0, 15.0)], 0.0, 10.0)   # 0.0733...
    """
    den = sum(c * c for c, _ in points)
    if not den:
        return 1.0
    return float(np.clip(sum(c * y for c, y in points) / den, lo, hi))


def _to_check(rows: Sequence[Candidate], check: int) -> list[Candidate]:
    """Plain ``pmean``, then ``check`` rows: the best predicted of each codec (so a model that
    misranks codecs is still checked against each), then the next best predicted."""
    ok = [r for r in rows if r.codec is not None and not r.error]
    ok.sort(key=lambda r: r.model_ms)
    firsts = [r for i, r in enumerate(ok) if all(q.codec != r.codec for q in ok[:i])]
    rest = [r for r in ok if not any(r is f for f in firsts)]
    return [next(r for r in rows if r.codec is None), *(firsts + rest)[:check]]


def _time_row(params, tree, mesh, axis_name, row, reps) -> tuple[float, str]:
    """``(measured ms, "")`` of ``row``'s compiled exchange path, or ``(nan, reason)`` where it
    failed to trace, compile, allocate or run on any process (:func:`_agreed`: compiled, then
    its state made, then run, every process agreeing after each stage, so none enters the
    path's collectives unless every process got that far)."""
    local, err = _agreed(
        lambda _: compiled_path(params, tree, mesh, axis_name, row),
        lambda c: (c, jax.block_until_ready(path_state(params, mesh, axis_name, row))),
        lambda cs: _path_median(cs[0], tree, cs[1], reps),
    )
    if err:
        return math.nan, err
    return 1e3 * float(_reduce_over_processes(np.array([local]))[0]), ""


def _checked_plan(params, mesh, axis_name, rows, check, budget_s, reps, link) -> AutotunePlan:
    """Time plain pmean and the rows of :func:`_to_check`; the plan is :func:`select`'s."""
    tree = gradient_rows(params, mesh, axis_name)
    t0, timed = time.perf_counter(), {}
    for r in _to_check(rows, check):  # every process stops at the same row: the slowest decides
        if r.codec is not None and elapsed_over_processes(t0) > budget_s:
            break
        timed[id(r)] = _time_row(params, tree, mesh, axis_name, r, reps)
    rows = [
        r._replace(measured_ms=timed[id(r)][0], error=timed[id(r)][1] or r.error)
        if id(r) in timed
        else r
        for r in rows
    ]
    if all(math.isnan(r.measured_ms) for r in rows):
        reasons = "; ".join(f"{r.name} {r.strategy}: {r.error}" for r in rows if r.error)
        raise RuntimeError(f"jc.autotune: every timed candidate failed ({reasons})")
    rows = calibrate(rows)
    rows.sort(key=lambda r: (True, 0, 0.0, 0.0) if r.error else (False, math.isnan(
        r.measured_ms), r.measured_ms, r.predicted_ms))  # fmt: skip
    best = select(rows)
    rows.remove(best)
    strategy = "auto" if best.codec is None else best.strategy
    return AutotunePlan(
        best.codec, strategy, best.bucket_bytes, best.min_size, (best, *rows), link,
        error_feedback=best.error_feedback,
    )  # fmt: skip


def select(rows: Sequence[Candidate]) -> Candidate:
    """The plan's row among the timed ``rows``: plain ``pmean`` unless a codec measured faster.

    With ``m*`` the fastest measured compressed row and ``m_0`` plain ``pmean``'s time
    (infinite where plain ``pmean`` failed or was not timed)::

        plain                                   if m* > (1 - MARGIN) * m_0
        argmin_{r : m_r <= min((1 + TIE) m*, (1 - MARGIN) m_0)} codec_model_ms_r   otherwise

    Rows measured within :data:`TIE` of the fastest are a tie (timing noise); among them the
    one with the least codec work (``codec_model_ms``: encode, decode and feedback passes,
    then measured time) wins: on a host shared with other work the passes' cost varies with
    the load, the wire time does not. Failed rows (``error``) carry no measured time and are
    never chosen. Where rows carry measured training steps (``step_ms``: :func:`autotune`
    with ``loss_fn=``) the rule is the step's instead: the fastest measured step, plain
    ``pmean`` one row among the others, steps within the timing noise of it settled by the
    least CPU time per step, then the least codec work
    (:func:`jaxcomp._src.autotune_steps.select_step`).
    Pure: no timing, so it is tested on tables alone.

    Args:
      rows: candidates, ``measured_ms`` NaN where not timed or failed; at least one timed.
        Every process must pass the same rows (:func:`autotune` reduces the timings and the
        failures over processes first), so every process selects the same row.

    Returns:
      The chosen row (the plain ``pmean`` row where no codec measured clearly faster).

    Example::

      best = jaxcomp._src.autotune.select(plan.table)   # plan.table[0]
    """
    if any(not math.isnan(r.step_ms) for r in rows):  # whole steps timed: the fastest
        from jaxcomp._src.autotune_steps import select_step

        return select_step(rows)
    plain = next((r for r in rows if r.codec is None and not math.isnan(r.measured_ms)), None)
    timed = [r for r in rows if r.codec is not None and not math.isnan(r.measured_ms)]
    if plain is None and not timed:
        raise ValueError(
            "`rows` must hold at least one measured row (plain pmean's: codec None, or a "
            "codec's), each with its measured_ms"
        )
    limit = math.inf if plain is None else (1 - MARGIN) * plain.measured_ms
    if not timed or min(r.measured_ms for r in timed) > limit:
        return plain
    bound = min((1 + TIE) * min(r.measured_ms for r in timed), limit)
    tied = [r for r in timed if r.measured_ms <= bound]
    return min(tied, key=lambda r: (r.codec_model_ms, r.measured_ms))
