"""Local SGD: each device steps on its own, the params are averaged every ``sync_every`` steps."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from jaxcomp._src import periodic, shards
from jaxcomp._src.codecs.base import Codec


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      inner: per device: the inner optax state, every leaf with a leading slot of 1
      anchor: identical on every device: f32 params of the last sync, like the params
      exchange: with a codec: (CompressedAllreduceState,) of the params' delta; else None
      count: int32[]: number of updates applied
    """

    inner: Any
    anchor: Any
    exchange: Any
    count: jax.Array

    PER_DEVICE_FIELDS = ("inner",)
    FRAGMENT_FIELDS = ("exchange",)  # one entry per fragment (a tuple)


def local_sgd(
    inner: optax.GradientTransformation,
    axis_name: Any,
    sync_every: int | tuple[int, ...],
    *,
    codec: Codec | None = None,
    start_step: int = 0,
    error_feedback: str | None = "auto",
    shard_axis: Any = None,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""Local SGD: each device runs ``inner`` on its own gradients; every ``sync_every`` steps
    the params are averaged over ``axis_name``.

    Params are per-device replicas (:func:`jaxcomp.replica_params`); ``update(grads, state,
    params)`` takes this device's gradients and params and returns the updates that move
    them. With ``H = sync_every`` and step ``t`` counted from 0::

        theta_i <- theta_i + inner(g_i)                         # every step, on each device
        theta_i <- mean_j theta_j        if (t + 1 - start_step) % H == 0 or t < start_step

    The state keeps ``x``, the params of the last sync, and averages the change since:
    ``x <- x - mean_j (x - theta_j)`` (so that identical replicas average exactly to
    themselves), and every device restarts from ``x``. With ``codec`` the change goes
    through ``jc.compressed_allreduce`` with error feedback: ``x <- x - mean_j C(x - theta_j
    + e_j)``.
    Before ``start_step`` the params are averaged every step (post-local SGD: data-parallel
    first, local later). The inner optimizer's state stays local (Lin et al. keep each
    worker's momentum). Sync steps run their collectives inside a ``jax.lax.cond`` on the
    step count: other steps send nothing.

    A non-finite update on one device freezes that device's inner state and gives it a
    non-finite output; a sync whose mean is not finite gives non-finite outputs everywhere
    and leaves the whole state as it was. Wrap the inner optimizer, not this transform, in
    ``optax.apply_if_finite`` (its skips then stay local and the sync schedule stays in
    step on every device).

    Args:
      inner: the optax transform each device runs on its own gradients (e.g.
        ``optax.sgd(0.1, momentum=0.9)``), learning rate included: nothing may follow this
        transform in an ``optax.chain`` (it would move the replicas apart at a sync;
        ``jc.sharded_init`` refuses it).
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      sync_every: ``H``, local steps between averages (1: every step); or a sequence of
        intervals ``(h_1, ..., h_k)``: averages after ``h_1``, ``h_1 + h_2``, ... steps
        (counted from ``start_step``), then every ``h_k``.
      codec: None (``pmean`` of the params) or a jaxcomp codec for the params' change.
      start_step: average every step before this step (post-local SGD); 0: local from the
        start.
      error_feedback: the codec's feedback, as for :func:`jaxcomp.compressed_allreduce`;
        ``"residual"`` / ``"ef21"`` only with ``codec``.
      shard_axis: the mesh axis (or tuple) over which the params are FSDP shards inside each
        replica (params ``P(axis_name, "data")``, gradients from ``jc.fsdp_gather``), as
        :func:`jaxcomp.clip_by_global_norm`'s: the non-finite flags are or-ed over it (one
        scalar ``psum`` per flag), so a non-finite shard skips the sync of every shard.
        Under ``check_vma=True`` jax's types tell the shards anyway (None works); under
        ``check_vma=False`` they do not, and with another manual axis bound beside
        ``axis_name`` the update warns where this is None. ``()``: the params are whole
        (data parallel inside), no warning.
      **exchange: options of the codec's exchange (``jc.compressed_allreduce``):
        ``strategy``, ``min_size`` (default 1024: smaller leaves are averaged in plain
        float32; ``init`` warns when that leaves the codec nothing to compress),
        ``granularity``, ``bucket_bytes``, ``seed``, ``server_feedback``. Only with ``codec``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`LocalSGDState`.
      Updates of bf16/fp16 leaves come back in float32, so that after a sync
      ``optax.apply_updates`` gives every replica the anchor bit for bit (float32 params:
      to the rounding of ``p + (anchor - p)``, at most an ulp of the leaf's largest value).

    Raises:
      ValueError: at construction, ``sync_every``, ``start_step``, ``error_feedback`` or
        ``axis_name`` outside its rule (the message names the argument; the rules: docs/errors.md);
        when traced, ``shard_axis`` not bound there or holding ``axis_name``, or ``inner``
        returning an update that differs per device where its param is typed the same.
      TypeError: at construction, ``inner``, ``sync_every``, ``start_step``, ``codec``,
        ``min_size``, ``mask``, ``shard_axis`` or ``axis_name`` of the wrong kind;
        ``error_feedback`` ``"residual"`` / ``"ef21"`` without ``codec``.

    Example::

        tx = jc.local_sgd(optax.sgd(0.05, momentum=0.9), "data", sync_every=4)
        replicas = jc.replica_params(params, mesh, "data")
        opt_state = jc.sharded_init(tx, params, mesh, "data")

        def step(replicas, opt_state, x, y):
            p = jc.own(replicas)
            g = jax.grad(loss)(p, x, y)
            u, opt_state = tx.update(g, opt_state, p)
            return jc.slot(optax.apply_updates(p, u)), opt_state

    References:
      Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019;
      Lin, Stich, Patel, Jaggi, "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020.
    """
    sync_every, _, _, start_step = periodic.check_common(sync_every, start_step=start_step)
    return periodic.build(
        "local_sgd",
        LocalSGDState,
        inner,
        axis_name,
        sync_every,
        codec=codec,
        error_feedback=error_feedback,
        exchange=exchange,
        start_step=start_step,
        shard_axis=shards.check_shard_axis(shard_axis),
    )
