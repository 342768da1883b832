"""Deep Gradient Compression (Lin et al., 2018) as an optax transform.

Top-k sparsification at 0.1% made to train like dense momentum SGD, with the paper's four
corrections: momentum correction, momentum factor masking, local gradient clipping and a
warm-up of the sparsity. Chain it before a plain ``optax.sgd(learning_rate)`` (no momentum
there: DGC applies it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import (
    buckets,
    clipping,
    collectives,
    feedback,
    server,
    shards,
    skeleton,
    warmup,
)
from jaxcomp._src import layout as layouts
from jaxcomp._src.codecs.base import (
    F32_MAX,
    check_fraction,
    check_fraction_array,
    check_int,
    check_positive_float,
    clip_scales,
    is_number,
    scaled_global_norm_parts,
)
from jaxcomp._src.codecs.sparse import check_ratio, top_k
from jaxcomp._src.older_states import FRESH


class DGCState(NamedTuple):
    """State of :func:`dgc`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Fields mirror the gradient tree, None at leaves they do not cover: the per-device
    memories cover the sparsified leaves (with a leading axis of 1, this device's slot), the
    momentum the plain ones (small or 1-D leaves, averaged with plain ``pmean``).

    Attributes:
      velocity: per device, f32[1, *leaf.shape] per sparsified leaf: u, the velocity
      accumulation: per device, f32[1, *leaf.shape] per sparsified leaf: v, not yet sent
      server_residual: per device, f32[1, c] per two-phase leaf (owned chunk), else None
      momentum: identical on every device, f32[*leaf.shape] per plain leaf
      key: uint32[2], identical on every device; split every step
      count: int32[]: number of updates applied
      server_chunk: per device, int32[1]: the index along ``axis_name`` of the chunk whose
        residual this device's row of ``server_residual`` holds (-1 built outside the mesh,
        not checked), where ``server_residual`` is kept (else None); a row stepped on
        another device (a flat exchange over a tuple of axes stepped in the other order)
        flags the step as a non-finite gradient does, whole state kept
        (:func:`jaxcomp._src.server.stamp`)
    """

    velocity: Any
    accumulation: Any
    server_residual: Any
    momentum: Any
    key: chex.PRNGKey
    count: jax.Array
    server_chunk: Any = None

    PER_DEVICE_FIELDS = ("velocity", "accumulation", "server_residual", "server_chunk")
    #: Fields added since the first release, and what a state saved without them gets
    #: (:func:`jaxcomp.complete_state`): the stamps of a fresh state, which say that each
    #: row is where it was saved (restore only into the layout it was saved from).
    ADDED_FIELDS = {"server_chunk": FRESH}


def _matrix_mask(tree: Any) -> Any:
    """DGC compresses only tensors with more than one dimension."""
    return jax.tree.map(lambda leaf: np.ndim(leaf) > 1, tree)


def _check_schedule(schedule: Any, warmup_steps: int) -> tuple[float, ...] | None:
    """``warmup_schedule`` of :func:`dgc`: None (the 4x ramp), or sparsities in [0, 1)."""
    if schedule is None:
        return None
    if isinstance(schedule, str | bytes) or not hasattr(schedule, "__iter__"):
        raise TypeError(
            f"`warmup_schedule` must be None or a sequence of sparsities, got {schedule!r}"
        )
    stages = tuple(schedule)
    if warmup_steps and not stages:
        raise ValueError("`warmup_schedule` must have at least one stage when warmup_steps > 0")
    if not warmup_steps:
        raise ValueError(
            f"`warmup_schedule`={stages} sets the stages of the density warm-up, but "
            "`warmup_steps`=0 runs none (the schedule would be ignored): pass warmup_steps > 0 "
            "or leave `warmup_schedule` out"
        )
    return tuple(check_fraction("warmup_schedule", s) for s in stages)


#: Scatter dimensions of a 1-D ``[d]`` update at ``int32[k, 1]`` indices.
_SCATTER_DIMS = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)
#: What :func:`_sent_marks` writes per coordinate: not sent, sent as 0, sent non-zero.
_UNSENT, _SENT_ZERO, _SENT = 0, 1, 2


class _Slots(NamedTuple):
    """What this device sent of a leaf, as its all-gathered top-k payload's slots: the
    coordinates (``int32[K]``, ``d`` in an unused slot) and whether each was sent as 0
    (``bool[K]``), ``K`` the widest stage's ``k`` (the same shape from every branch)."""

    indices: jax.Array
    zero: jax.Array


def _sent(r, plan, widths: list[int] | None) -> list:
    """Per leaf, what this device sent, for :func:`_feedback`: with ``widths`` (all-gathered
    top-k payloads ``(indices, values)``), a leaf of one segment as its :class:`_Slots`
    padded to ``widths[leaf]``, a leaf cut into pieces as ``uint8`` marks (``_UNSENT``,
    ``_SENT_ZERO``, ``_SENT``) scattered from its pieces' payloads and joined (a quarter of
    the bytes of the decoded ``f32`` vector); without (two-phase), the decoded vector."""
    if widths is None or not r.payload:
        return plan.join(r.sent)
    out, i = [], 0
    for pieces, width in zip(plan.pieces(), widths, strict=True):
        payloads = r.payload[i : i + len(pieces)]
        i += len(pieces)
        if len(pieces) == 1:
            (indices, values), pad = payloads[0], width - payloads[0][0].shape[0]
            out.append(
                _Slots(
                    jnp.pad(indices, (0, pad), constant_values=pieces[0]),
                    jnp.pad(values == 0, (0, pad)),
                )
            )
        else:
            out.append(_concat([_marks(p, d) for p, d in zip(payloads, pieces, strict=True)]))
    return out


def _concat(parts: list) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _marks(payload, d: int) -> jax.Array:
    """``uint8[d]`` marks of one segment's top-k payload ``(indices, values)``."""
    indices, values = payload
    mark = jnp.where(values != 0, _SENT, _SENT_ZERO).astype(jnp.uint8)
    return jax.lax.scatter(
        jnp.zeros((d,), jnp.uint8),
        indices[:, None],
        mark,
        _SCATTER_DIMS,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def _zero_at(x: jax.Array, indices: jax.Array) -> jax.Array:
    """``x`` (a state leaf ``[1, *shape]``) with 0 at the flat ``indices`` of ``shape`` (those
    ``>= x.size`` dropped): a scatter in ``x``'s own shape, so that XLA writes it in place in
    the donated buffer (a reshape between the two would make it copy ``x``)."""
    coords, rest = [], indices
    for size in reversed(x.shape[1:]):
        coords.append(rest % size)
        rest = rest // size
    coords.append(rest)  # 0, or 1 (out of range: dropped) for an index past the leaf
    dims = tuple(range(x.ndim))
    return jax.lax.scatter(
        x,
        jnp.stack(coords[::-1], axis=1),
        jnp.zeros(indices.shape, x.dtype),
        jax.lax.ScatterDimensionNumbers(
            update_window_dims=(), inserted_window_dims=dims, scatter_dims_to_operand_dims=dims
        ),
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def _feedback(u: list, v: list, sent: list, masking: Any, ok: jax.Array) -> tuple[list, list]:
    """Momentum factor masking and what stays behind: the new velocities
    ``u * 1[not sent or masking off]`` and accumulations ``v - sent``, from the decoded
    ``sent`` (float32), its :class:`_Slots` (``v_i <- 0`` at the sent coordinates, ``u_i <-
    0`` at those sent non-zero: two scatters, written in place) or its :func:`_marks`
    (``uint8``, the same rule): the same values bit for bit for a finite ``v``, whose sent
    values are its own. Where the step is not ``ok`` (a non-finite gradient on some device:
    :func:`_checked`), ``u`` and ``v`` as they are: the state as it was."""
    mask = ok if masking is False else masking & ok
    new_u, new_v = [], []
    for a, b, s in zip(u, v, sent, strict=True):
        if isinstance(s, _Slots):
            new_v.append(_zero_at(b, jnp.where(ok, s.indices, b.size)))
            if masking is not False:
                a = _zero_at(a, jnp.where(mask & ~s.zero, s.indices, b.size))
            new_u.append(a)
            continue
        s = s.reshape(b.shape)
        if s.dtype == jnp.uint8:
            new_v.append(jnp.where((s != _UNSENT) & ok, 0.0, b))
            if masking is not False:
                a = jnp.where((s == _SENT) & mask, 0.0, a)
        else:
            new_v.append(jnp.where(ok, b - s, b))
            if masking is not False:
                a = jnp.where((s != 0) & mask, 0.0, a)
        new_u.append(a)
    return new_u, new_v


def _clip_local(g: list, p: list, limit: float) -> tuple[list, list]:
    """Local gradient clipping: every leaf scaled by ``min(1, limit / ||(g, p)||)``."""
    # A norm past float32's range (all values finite) or above 2^126 (limit / norm flushed to
    # 0) zeroed the gradient: clip_scales scales such gradients by 2^-64 first. A gradient
    # with a NaN or inf passes unscaled (a NaN norm: factor 1), so its finite leaves reach
    # the exchange as they are (jc.clip_by_global_norm scales them by 0 at an inf instead).
    top, root = scaled_global_norm_parts(g + p)
    pre, factor = clip_scales(top, jnp.where(jnp.isfinite(top), root, jnp.nan), limit)
    return [(a * pre) * factor for a in g], [(a * pre) * factor for a in p]


def _check_whole_params(params: Any, clip_norm: float, axis_name: Any, inner_axis_name: Any):
    """Refuse ``clip_norm`` where ``params`` are typed as differing over a manual axis beside
    the exchange's (FSDP shards inside a replica): :func:`_clip_local` would take each
    shard's own norm (:func:`jaxcomp._src.clipping.check_whole_params`)."""
    clipping.check_whole_params(
        "dgc",
        "clip_norm",
        params,
        (*collectives.axis_names(axis_name), *collectives.axis_names(inner_axis_name)),
        (),
        f"Leave `clip_norm` out and chain jc.clip_by_global_norm({clip_norm!r}, "
        f"{axis_name!r}, shard_axis={{shard_axis!r}}) before jc.dgc.",
    )


def _correct(momentum, nesterov: bool, velocity: list, accumulation: list, g: list, ok):
    """Momentum correction: ``u <- m u + g``, ``v <- v + u`` (Nesterov: ``u <- m (u + g)``,
    ``v <- v + u + g``), each saturating at ``+-F32_MAX`` (a finite step keeps the state
    finite), where the step is ``ok``; elsewhere ``u`` and ``v`` as they were. ``ok`` is
    known before the step (:func:`_checked`), so each new leaf, in its state shape, is
    written in place in its donated buffer. Returns the new velocities and accumulations."""
    u, v = [], []
    for w, acc, a in zip(velocity, accumulation, g, strict=True):
        a = a.reshape(w.shape)
        # v from the new u as written (not its formula): XLA then writes u in place
        # before v reads it, rather than computing u twice (and copying the velocity).
        u.append(jnp.where(ok, _saturate(momentum * (w + a) if nesterov else momentum * w + a), w))
        vv = _saturate(acc + u[-1] + a if nesterov else acc + u[-1])
        v.append(jnp.where(ok, vv, acc))
    return u, v


def _saturate(x: jax.Array) -> jax.Array:
    """``x`` clipped to ``[-F32_MAX, F32_MAX]``: sums of finite values stay finite."""
    return jnp.clip(x, -F32_MAX, F32_MAX)


def _checked(g: list, plain_bad: Any, axis_name: Any, misplaced: Any = None) -> jax.Array:
    """The step's non-finite flag, identical on every device, from its inputs before any
    state is written: some device's compressed gradient ``g`` holds a NaN or inf, or the
    plain leaves' means do (``plain_bad``), or some device's row of the server residual is
    another device's (``misplaced``, :func:`jaxcomp._src.server.misplaced`; or-ed into the
    same scalar ``psum``): :func:`collectives.inputs_nonfinite`. Saturated sums keep a
    finite step's velocity and accumulation finite, so nothing later can raise it."""
    return collectives.inputs_nonfinite(g, plain_bad, axis_name, misplaced)


def _plain_momentum(momentum, nesterov: bool, traces: list, means: list) -> tuple[list, list]:
    """Momentum SGD's trace on the leaves sent by plain ``pmean``: the new traces and the
    output (the trace, or Nesterov's ``mean + m * trace``)."""
    traces = [momentum * t + m for t, m in zip(traces, means, strict=True)]
    if nesterov:
        return traces, [m + momentum * t for m, t in zip(means, traces, strict=True)]
    return traces, traces


def dgc(
    ratio: float = 0.001,
    axis_name: Any = None,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    momentum_masking: bool = True,
    clip_norm: float | None = None,
    warmup_steps: int = warmup.DGC_WARMUP_STEPS,
    warmup_schedule: Sequence[float] | None = None,
    sample_ratio: float | None = 0.01,
    min_size: int = 1024,
    strategy: str = "allgather",
    seed: int = 0,
    inner_axis_name: Any = None,
    param_specs: Any = None,
    shard_axis: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Deep Gradient Compression: top-k at ``ratio`` with momentum correction and masking.

    Each device ``i`` with local gradient ``g_i`` keeps a velocity ``u_i`` and an accumulation
    ``v_i`` (per compressed leaf, in float32)::

        g_i <- g_i * min(1, (clip_norm / sqrt(n)) / ||g_i||)     # local clipping (optional)
        u_i <- m * u_i + g_i                                     # momentum correction
        v_i <- v_i + u_i                                         # (nesterov: u_i <- m (u_i + g_i),
                                                                 #  v_i <- v_i + u_i + g_i)
        S_i  = top-k(|v_i|), k = ceil(ratio_t * d_leaf)          # per leaf
        out  = mean_i v_i * 1[S_i]                               # all-gather of (values, indices)
        v_i <- v_i * 1[not S_i],  u_i <- u_i * 1[not S_i]        # momentum factor masking

    and ``out`` goes to ``optax.sgd(learning_rate)``, so ``w <- w - lr * out``. What is not
    sent waits in ``v_i``: without masking nothing is lost, only delayed. Momentum correction
    accumulates the *velocity* rather than the gradient, so a coordinate sent after ``T``
    quiet steps carries the momentum-SGD update of those steps. Momentum factor masking stops
    the stale momentum of a coordinate that was just sent from pushing it again. That
    momentum is dropped, not delayed: a device's gradient counts ``1 / (1 - m)`` times where
    it waits long and less where it is sent often, so where the devices' data differ (each
    device's own gradient far from the mean's at the optimum) the devices are weighted by how
    often they send and DGC converges to another point than the minimiser of the mean loss:
    pass ``momentum_masking=False`` there (measured: docs/choosing-a-codec.md, "What each
    exchange converges to"). (So at ``ratio = 1`` masking zeroes every ``u_i`` each step and
    DGC is plain SGD on the compressed leaves; with
    ``momentum_masking=False`` it is momentum SGD on the mean gradient, up to float32
    rounding.)

    Warm-up (``warmup_steps``, default 200; 0 turns it off): the density ``ratio_t`` falls
    by 4x per stage from 25% to ``ratio`` (the paper's 75%, 93.75%, 98.4375%, 99.6%, 99.9%
    sparsity; at 0.1%: 25%, 6.25%, 1.5625%, 0.39% for 50 steps each, then 0.1% from step 200
    on), the stages of ``jc.compressed_allreduce(warmup_steps=...)``
    (:func:`jaxcomp._src.warmup.densities`). Payload shapes are static, so each stage is its
    own branch of a ``jax.lax.switch`` (compiled once; ``comm_report`` counts every branch's
    collectives: weigh them with ``mean_bytes_per_device``; after the warm-up the bytes are
    those of ``ratio``). Momentum factor masking starts with the sparse regime, at step
    ``warmup_steps``: at a warm-up density it would zero most velocities every few steps
    (at 100%, every step: plain SGD, a tenth of momentum SGD's step at ``m = 0.9``), so the
    warm-up keeps the velocity and a 100% stage is momentum SGD on the mean gradient (up to
    float32 rounding: each device's velocity is averaged, not the velocity of the mean).

    Local gradient clipping (``clip_norm``) rescales each device's gradient, over all of its
    floating leaves, to global norm at most ``clip_norm / sqrt(n)`` before it is accumulated:
    the sum of ``n`` such gradients then has norm ``~ clip_norm`` as in ordinary clipping.

    Only leaves with more than one dimension and at least ``min_size`` elements are sparsified
    (the paper: "only tensors with dim > 1"). Biases, norms and small leaves go through plain
    ``pmean`` of the clipped gradient followed by ordinary momentum (optax's ``trace``, same
    ``momentum`` and ``nesterov``), so every leaf sees momentum SGD. Integer leaves pass through.

    The selection is DGC's sampled threshold by default (``sample_ratio=0.01``, the paper's:
    ``jc.top_k(ratio_t, approx="sample", sample_ratio=sample_ratio)``, see
    :func:`jaxcomp._src.codecs.sparse.sampled_top_k`): a threshold from a random sample of the
    accumulation, re-adjusted while the count over it is outside ``[0.8 k, 1.3 k]``, at most
    ``k`` values sent (the exact top-k whenever at least ``k`` reach the threshold, else the
    ``>= 0.8 k`` that do). ``sample_ratio=None`` selects the exact top-k with the two-stage
    block selection (``approx="blocked"``), which is the faster of the two on XLA:CPU (see
    ``benchmarks/topk_speed.py``). Vectors too small for a useful sample use exact top-k.

    At 0.1% DGC stays close to uncompressed momentum SGD on the MLPs of
    ``benchmarks/sparse_convergence.py``, where plain top-k without error feedback falls well
    behind and top-k with residual feedback followed by the optimizer's momentum is unstable,
    hence momentum correction (measured: docs/choosing-a-codec.md, from
    ``benchmarks/results/sparse_convergence*.json``).

    A non-finite gradient on any device makes the compressed output NaN on every device and
    leaves the whole state as it was, so ``optax.apply_if_finite`` can skip the step. The
    flag is read from the gradients before any state is written (one scalar ``psum``), and
    ``u_i`` and ``v_i`` saturate at ``+-F32_MAX``, so a finite gradient always leaves them
    finite: each is then written once, in place in its donated buffer (the step's
    temporaries: docs/memory.md, "Memory of the step").

    Args:
      ratio: density after warm-up: the fraction of each compressed leaf sent per step.
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      momentum: the momentum ``m`` in [0, 1): a number, or a 0-d array (a hyperparameter
        ``optax.inject_hyperparams`` schedules; checked where concrete). The other numbers are
        static: ``optax.inject_hyperparams(jc.dgc, static_args=("ratio", "warmup_steps",
        "sample_ratio", "min_size", "seed"))(momentum=schedule, ...)``.
      nesterov: Nesterov momentum.
      momentum_masking: zero ``u_i`` where ``v_i`` was sent (the paper's default, True), from
        step ``warmup_steps`` on.
      clip_norm: global-norm threshold of the (summed) gradient; None: no clipping.
      warmup_steps: steps of the sparsity warm-up (default 200; 0: ``ratio`` from the first
        step). At 0.1% a weight waits hundreds of steps between two selections, and what
        waits is held back: on mnist1d (8 devices, three seeds) DGC at 300 steps lagged
        momentum SGD by 3.0 points with a 100-step warm-up and by 1.2 with 200; at 1000
        steps both were level (docs: "Choosing a codec", "the density warm-up").
      warmup_schedule: None (default: the 4x ramp from 25%) or the sparsities of the warm-up
        stages, each in [0, 1) (density ``max(1 - s, ratio)``; stages at ``ratio`` dropped).
        Only with ``warmup_steps`` > 0.
      sample_ratio: fraction of each compressed leaf sampled to estimate DGC's threshold, in
        (0, 1] (clipped to ``[32 d / k, 512 d / k]`` entries); None: exact top-k (two-stage).
      min_size: leaves with fewer elements go through plain ``pmean``.
      strategy: ``"allgather"`` (default: the paper's exchange, one round; the output is the mean
        over devices of the values each sent), ``"two_phase"`` (chunked, gTop-k style: each device
        sends the top ``k1 = 2k / (n + 1)`` of each chunk and the chunk's owner the top ``2k - k1``
        of their sum, keeping the rest in a per-device server residual,
        ``jc.top_k(ratio).phase_codecs(c, n)``; bytes per device do not grow with ``n``: 21 KB
        instead of 63 KB per step for 1M parameters on 8 devices) or ``"auto"`` (the fewest bytes by
        the ring model: two_phase from 3 devices; at 2 the bytes tie and allgather is taken).
        Both train equally well, but on XLA:CPU a
        two_phase step of a top-k payload is much slower than an allgather one, hence the default.
      seed: seeds the PRNG key kept in the state.
      param_specs: where params are sharded over other mesh axes than ``axis_name`` (a data
        x model mesh, ``jax.shard_map(..., axis_names={axis_name})``): a tree like the params
        of ``PartitionSpec`` (or ``NamedSharding``). Each device then compresses its own block
        of every leaf (per-block scales and selections) and keeps its memories sharded like
        the params: no gradient-sized traffic over the other axes. Build the state with
        ``jc.sharded_init(tx, params, mesh, axis_name, param_specs)``. The model axis must
        be ``AxisType.Auto``: an Explicit one is refused (the data-manual ``shard_map``
        would gather every model-sharded operand in float32); None beside an Auto axis warns.
      inner_axis_name: a fast mesh axis (devices of one host) averaged uncompressed first
        (float32 ``pmean``); DGC then runs over ``axis_name`` between hosts, every device
        of a host sending the host's payload (``L`` copies per host on the outer axis; see
        :func:`jaxcomp._src.collectives.inner_mean`). The devices of a host hold the same state:
        ``jc.sharded_init(tx, params, mesh, axis_name)`` and
        ``jc.state_specs(state, axis_name)`` (per host, replicated over the inner axis).
      shard_axis: the mesh axis (or tuple) over which the gradients are shards of one model
        (HSDP: FSDP over ``"data"`` inside each group averaged over ``axis_name``), as
        :func:`jaxcomp.compressed_allreduce`'s: the non-finite flag is or-ed over it (one
        scalar ``psum``), so a non-finite shard poisons every shard's output and freezes every
        shard's state. Under ``check_vma=True`` jax's types tell (None works); under
        ``check_vma=False`` they do not, and with another manual axis bound beside
        ``axis_name`` / ``inner_axis_name`` the update warns where this is None. ``()``: the
        leaves are whole, no warning.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its update returns the averaged sparse
      momentum update, to be scaled by ``optax.sgd(learning_rate)``.

    Raises:
      ValueError: at construction, ``ratio``, ``axis_name``, ``momentum``, ``clip_norm``,
        ``warmup_steps``, ``warmup_schedule``, ``sample_ratio``, ``min_size``, ``strategy``,
        ``seed`` or ``inner_axis_name`` outside its rule (the message names the argument; the rules:
        docs/errors.md); when traced, ``clip_norm`` given while the ``params`` passed to update
        are typed as differing over a manual axis outside ``axis_name`` (FSDP shards inside a
        replica: the local clipping would take each shard's own norm).
      TypeError: at construction, ``ratio``, ``momentum``, ``nesterov``, ``momentum_masking``,
        ``clip_norm``, ``warmup_steps``, ``warmup_schedule``, ``sample_ratio``, ``min_size``,
        ``seed``, ``axis_name``, ``inner_axis_name`` or ``shard_axis`` of the wrong kind.

    Example::

        tx = optax.chain(jc.dgc(0.001, "data", momentum=0.9), optax.sgd(0.1))
        opt_state = jc.sharded_init(tx, params, mesh, "data")

    References:
      Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication
      Bandwidth for Distributed Training", ICLR 2018. https://arxiv.org/abs/1712.01887
    """
    ratio = check_ratio(ratio)
    collectives.check_axes(axis_name, inner_axis_name)
    shard_axis = shards.check_shard_axis(shard_axis)
    momentum = check_fraction_array("momentum", momentum)
    if not isinstance(nesterov, bool):
        raise TypeError(f"`nesterov` must be a bool, got {nesterov!r}")
    if not isinstance(momentum_masking, bool):
        raise TypeError(f"`momentum_masking` must be a bool, got {momentum_masking!r}")
    if clip_norm is not None:
        if not is_number(clip_norm):
            raise TypeError(f"`clip_norm` must be a number or None, got {clip_norm!r}")
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"`clip_norm` must be > 0 and finite, got {clip_norm}")
    warmup_steps = check_int("warmup_steps", warmup_steps, 0)
    schedule = _check_schedule(warmup_schedule, warmup_steps)
    if sample_ratio is not None:
        sample_ratio = check_positive_float("sample_ratio", sample_ratio, upper=1.0)
    min_size = check_int("min_size", min_size, 0)
    collectives.check_strategy(strategy)
    if strategy == "allreduce":
        raise ValueError(
            "`strategy`='allreduce' needs a summable codec; DGC's top-k is not "
            "(use 'allgather', 'two_phase' or 'auto')"
        )
    seed = check_int("seed", seed, 0)

    if sample_ratio is None:
        codec = top_k(ratio, approx="blocked")
    else:
        codec = top_k(ratio, approx="sample", sample_ratio=sample_ratio)
    codecs = [*warmup.stage_codecs(codec, warmup_steps, schedule), codec]
    use_server = strategy != "allgather"

    def chunks(layout: layouts.Layout):
        sizes = server.bound_sizes(axis_name, None)
        if sizes is None:
            return None
        plan = collectives.segments_for(list(layout.compressed_sizes), "leaf")
        return server.chunk_sizes(plan, codecs[-1], strategy, *sizes)

    def fields(layout: layouts.Layout) -> dict[str, Any]:
        some = bool(layout.compressed_size)
        plain = [
            jnp.zeros(s, jnp.float32)
            for s, g in zip(layout.shapes, layout.groups, strict=True)
            if g == layouts.PLAIN
        ]
        return {
            "velocity": skeleton.zeros_like_compressed(layout) if some else None,
            "accumulation": skeleton.zeros_like_compressed(layout) if some else None,
            "server_residual": server.zeros(layout, chunks(layout), False, use_server and some),
            "server_chunk": server.stamp(axis_name, None, use_server and some),
            "momentum": layouts.like_plain(layout, plain) if plain else None,
        }

    def init_fn(params):
        layout = layouts.layout_of(params, min_size, _matrix_mask)
        return DGCState(
            key=jax.random.PRNGKey(seed), count=jnp.zeros([], jnp.int32), **fields(layout)
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        n = skeleton.begin("dgc", updates, params, axis_name, inner_axis_name)
        updates = collectives.inner_mean(updates, inner_axis_name)
        layout = layouts.layout_of(updates, min_size, _matrix_mask)
        skeleton.check_state(
            "dgc", state, lambda: fields(layout), layout, axis_name=axis_name, updates=updates
        )
        skeleton.check_per_host("dgc", state, axis_name, inner_axis_name)
        g = layouts.compressed_vectors(updates, layout)
        p = [a.astype(jnp.float32) for a in layouts.leaves_of(updates, layout, layouts.PLAIN)]

        if clip_norm is not None:
            _check_whole_params(params, clip_norm, axis_name, inner_axis_name)
            g, p = _clip_local(g, p, clip_norm / math.sqrt(n))
        plain_mean, plain_bad = skeleton.plain_means(p, axis_name, buckets.BUCKET_BYTES)
        owner = server.Owner(axis_name, None)
        bad = _checked(g, plain_bad, axis_name, server.misplaced(state, owner))
        ok = ~bad
        velocity, accumulation = map(layouts.field_leaves, (state.velocity, state.accumulation))
        u, v = _correct(momentum, nesterov, velocity, accumulation, g, ok)
        key, step_key = jax.random.split(state.key)
        plan = collectives.segments_for([a.size for a in v], "leaf")
        owned = chunks(layout) if g and use_server else None
        servers = (
            None
            if owned is None
            else server.read(state.server_residual, layout, owned, False, owner)
        )

        # Masking only once the warm-up is over: at a warm-up density it would zero the
        # velocity of most coordinates every few steps (momentum SGD -> plain SGD).
        sparse_regime = len(codecs) == 1 or state.count >= warmup_steps
        masking = momentum_masking and sparse_regime

        # The widest stage's k of each leaf of one segment: the sent slots' shape.
        widths = None
        if strategy == "allgather":
            widths = [max(c.size(d) for c in codecs) for d in plan.wholes()]

        def reduce_with(codec):
            def branch(servers):
                r = collectives.reduce_segments(
                    plan.split([a.ravel() for a in v]),
                    axis_name,
                    codec,
                    strategy,
                    step_key,
                    servers,
                    None,
                    bad,
                    gather_pieces=True,
                    checked=True,
                    with_payload=strategy == "allgather",
                )
                sent = _sent(r, plan, widths)
                return plan.join(r.mean), sent, r.server

            return branch

        means, sent, new_servers = warmup.switch(
            state.count, warmup_steps, [reduce_with(c) for c in codecs], servers
        )
        new_velocity, new_accumulation = _feedback(u, v, sent, masking, ok)
        # A bfloat16 / float16 leaf's accumulation also keeps its output's rounding.
        new_accumulation = feedback.with_rounding(
            new_accumulation, means, feedback.compressed_dtypes(layout), ok
        )

        traces, plain_out = _plain_momentum(
            momentum, nesterov, layouts.field_leaves(state.momentum), plain_mean
        )

        # The velocity and accumulation are final (as they were where not ok); the rest
        # is kept as it was on a non-finite step.
        small = DGCState(
            velocity=None,
            accumulation=None,
            server_residual=state.server_residual
            if owned is None
            else server.write(new_servers, state.server_residual, layout, owned, False, owner),
            momentum=layouts.like_plain(layout, traces) if traces else None,
            key=key,
            count=state.count + 1,
            server_chunk=state.server_chunk,
        )
        small = skeleton.freeze(bad, state._replace(velocity=None, accumulation=None), small)
        new_state = small._replace(
            velocity=skeleton.like_state(layout, new_velocity) if g else None,
            accumulation=skeleton.like_state(layout, new_accumulation) if g else None,
        )
        return layouts.assemble(updates, layout, means, plain_out), new_state

    every_axis = collectives.axis_names(axis_name, inner_axis_name)
    update_fn = shards.with_shard_axis(update_fn, "jc.dgc", every_axis, shard_axis)
    return optax.GradientTransformationExtraArgs(
        init_fn, shards.over_shards(update_fn, param_specs, every_axis)
    )
