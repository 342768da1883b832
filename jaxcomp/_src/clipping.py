"""Gradient clipping before a compressed exchange: each device clips its own gradient so that
the mean over the axis is clipped as data parallel would clip it."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import collectives, inner_replicas, shards, skeleton
from jaxcomp._src.codecs.base import clip_scales, safe_divide, scaled_global_norm_parts
from jaxcomp._src.onebit_adam import check_number


def float_leaves(tree: Any) -> list[jax.Array]:
    """The floating leaves of ``tree`` (what a global norm of gradients reads)."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _merge_parts(tops: jax.Array, roots: jax.Array, most: Any, total: Any) -> tuple:
    """One ``(m, r)`` from several norms' parts ``m_k r_k`` (:func:`scaled_global_norm_parts`):
    ``|g|^2 = sum_k m_k^2 r_k^2 = m^2 sum_k (m_k / m)^2 r_k^2`` with ``m = max_k m_k``, each
    term at most ``r_k^2``, so finite for finite values. ``most`` and ``total`` take the max
    and the sum over the parts (over an array's first axis, or ``pmax`` / ``psum`` over mesh
    axes). A NaN in any part makes ``m`` NaN, else an inf makes it inf (as one tree's)."""
    nan = jnp.isnan(tops) | jnp.isnan(roots)
    inf = jnp.isinf(tops) & ~nan
    ok = ~(nan | inf)
    mine = jnp.where(ok & (roots > 0), tops, 0.0)  # 0 for a zero part
    biggest = most(mine)
    safe = jnp.where(biggest > 0, biggest, 1.0)
    term = jnp.square(safe_divide(mine, safe)) * jnp.square(jnp.where(ok, roots, 0.0))
    sums = total(jnp.stack([term, nan.astype(jnp.float32), inf.astype(jnp.float32)]))
    whole = jnp.where(sums[1] > 0, jnp.nan, jnp.where(sums[2] > 0, jnp.inf, safe))
    return whole, jnp.sqrt(sums[0])


def sharded_norm_parts(tree: Any, shard_axis: Any) -> tuple[jax.Array, jax.Array]:
    """:func:`scaled_global_norm_parts` of the whole gradient whose shards the devices of
    ``shard_axis`` hold (FSDP): each leaf's squares are summed over the shard axes it differs
    on (a ``pmax`` and a ``psum`` of three scalars per such set of axes), and counted once
    where it is the same on every device (a replicated bias, typed so under
    ``check_vma=True``). Where jax does not type it (``pmap``, ``check_vma=False``) every leaf
    counts as a shard."""
    names = collectives.axis_names(shard_axis)
    typed = skeleton.tracks_variance(shard_axis)
    groups: dict[tuple, list] = {}
    for x in float_leaves(tree):
        axes = tuple(a for a in names if a in skeleton.varying_axes(x)) if typed else names
        groups.setdefault(axes, []).append(x)
    parts = []
    for axes, leaves in groups.items():
        top, root = scaled_global_norm_parts(leaves)
        if axes:
            most = lambda v, axes=axes: jax.lax.pmax(v, axes)  # noqa: E731
            total = lambda v, axes=axes: jax.lax.psum(v, axes)  # noqa: E731
            top, root = _merge_parts(top, root, most, total)
        parts.append((top, root))
    if not parts:
        return scaled_global_norm_parts([])
    tops, roots = (jnp.stack(p) for p in zip(*parts, strict=True))
    return _merge_parts(tops, roots, lambda v: jnp.max(v, 0), lambda v: jnp.sum(v, -1))


def check_shards(updates: Any, shard_axis: Any) -> None:
    """Refuse ``shard_axis`` gradients none of which is typed as differing over it: none is
    a shard (chained after an exchange, or the wrong axis). ``check_vma=True`` only."""
    names = set(collectives.axis_names(shard_axis))
    leaves = float_leaves(updates)
    if not leaves or not skeleton.tracks_variance(shard_axis):
        return
    if not any(names & skeleton.varying_axes(x) for x in leaves):
        paths = skeleton.invariant_gradients(updates, shard_axis)
        raise ValueError(
            f"clip_by_global_norm: `shard_axis`={shard_axis!r} but every gradient (`updates`, "
            f"{paths[:5]}) is identical on every device of it: none is a shard of one "
            "gradient (FSDP's, from jc.fsdp_gather). Name the axes the gradients are sharded "
            "over, or leave `shard_axis` out."
        )


def shard_axes_of_params(params: Any, axes: tuple) -> list:
    """The manual mesh axes outside ``axes`` over which both a float param and its gradient
    are typed as differing (``check_vma=True``): the param is a shard of one model there
    (FSDP's ``P("replica", "data")`` inside a replica, a manual tensor-parallel axis). Per-device
    replicas (``jc.replica_params``) differ over the transform's own axis only, which
    ``axes`` holds; none where jax does not type it (``pmap``, ``check_vma=False``) or
    ``params`` is not given."""
    if params is None:
        return []
    found = set()
    for p in float_leaves(params):
        found |= skeleton.varying_axes(p)
    found -= set(axes)
    return sorted((a for a in found if skeleton.tracks_variance(a)), key=str)


def check_whole_params(
    name: str, arg: str, params: Any, own: tuple, shards: tuple, fix: str
) -> None:
    """Refuse a clipping that would take each shard's own norm: ``params`` typed as differing
    over a manual axis outside ``own`` (the exchange's axes; inside the inner optimizer of
    ``jc.diloco`` / ``jc.local_sgd`` / ``jc.sparseloco`` their axes too, over which each device
    holds its own replica: :mod:`inner_replicas`) and ``shards`` (a ``shard_axis`` given) are
    shards of one model there, and a norm of the local shard scales each shard by
    its own factor (another direction, no error). ``fix`` names the way out, formatted with
    ``shard_axis``: the axes to name (``shards`` and the ones found)."""
    extra = shard_axes_of_params(params, (*inner_replicas.own_axes(own), *shards))
    if extra:
        found = extra[0] if len(extra) == 1 else tuple(extra)
        names = (*shards, *extra)
        suggested = names[0] if len(names) == 1 else names
        raise ValueError(
            f"{name}: the params (`params` of update) differ per device over the mesh axis "
            f"{found!r} beside the exchange's, so each device holds a shard of one model there "
            "(FSDP, e.g. params P('replica', 'data')), and `"
            f"{arg}` would clip each shard by its own norm: every shard scaled by another "
            f"factor, a gradient of another direction. {fix.format(shard_axis=suggested)}"
        )


def check_per_device_gradients(updates: Any, axis_name: Any, max_norm: Any) -> None:
    """Refuse gradients typed identical on every device (``shard_map(..., check_vma=True)``):
    chained after an exchange, :func:`clip_by_global_norm` receives the mean, and its
    per-device threshold ``c sqrt(n)`` would clip that mean ``sqrt(n)`` times looser than
    asked (8 devices: at 2.83 for ``c = 1``), with no error."""
    bad = skeleton.invariant_gradients(updates, axis_name)
    if bad:
        raise ValueError(
            f"clip_by_global_norm: the gradients (`updates`) at {bad[:5]} are identical on "
            f"every device of axis {axis_name!r}: already the mean (chained after a jaxcomp "
            "exchange?). It clips each device's own gradient, at c sqrt(n) unless bound=True, "
            "so the mean would be clipped sqrt(n) times looser than `max_norm`. To clip the "
            f"mean, chain optax.clip_by_global_norm({max_norm!r}) after the exchange; to "
            "clip before it (recipes that exchange a momentum), chain this before the "
            "exchange, on the per-device gradients. (Inside jc.delayed(tx, axis_name=...), "
            "whose `axis_name` averages the gradients before tx: with a jaxcomp exchange in "
            "tx, leave `axis_name` out.)"
        )


def clip_by_global_norm(
    max_norm: float, axis_name: Any, *, bound: bool = False, shard_axis: Any = None
) -> optax.GradientTransformation:
    r"""Clip each device's gradient so that the mean gradient's norm is about ``max_norm``.

    ``optax.clip_by_global_norm(c)`` chained before a jaxcomp recipe clips each device's
    gradient ``g_i`` by its own norm, which is larger than the norm of the mean gradient
    (noise averages out): it clips too often and too hard (a per-device ``c`` gave an update
    norm 0.073 where data parallel, clipping the mean, gave 0.100). The mean is not known
    before the exchange, so this clips each device at a threshold scaled to the mean::

        tau = c sqrt(n)    (default)       DGC's local clipping (threshold c N^{-1/2} on each
                                           node of a *sum*), written for a *mean* over n:
                                           n devices' independent gradients of norm tau
                                           average to norm ~ tau / sqrt(n) = c
        tau = c            (bound=True)    a guarantee: ||mean_i g_i'|| <= c always
        g_i' = g_i * min(1, tau / ||g_i||)

    The default matches clipping of the mean where the devices' gradients disagree (noise
    dominates: small per-device batches); where they agree (a loss spike seen by every
    device) the mean may reach ``c sqrt(n)``. ``bound=True`` never lets the mean past ``c``
    but clips harder where they disagree. Where the exchange returns the mean (a
    ``jc.compressed_allreduce`` or ``jc.powersgd`` chain), ``optax.clip_by_global_norm(c)``
    placed *after* it and before the optimizer clips the mean exactly: prefer that order.
    Recipes that exchange a momentum (``jc.sgd``, ``jc.onebit_adam``, ``jc.zero_one_adam``)
    never form the mean gradient: chain this before them.

    A zero gradient stays zero; a non-finite gradient stays non-finite (never hidden). The
    norm is computed after scaling by the largest magnitude, and a finite gradient whose norm
    overflows float32 (values of ``1e38``, or ``~1e19`` and more in a large tree) is clipped to
    the threshold along its direction (:func:`~jaxcomp._src.codecs.base.clip_scales`), where
    ``optax.clip_by_global_norm`` returns zeros (its norm is inf).

    Sharded gradients (FSDP, ``jc.fsdp_gather``): each device holds a shard ``g_j`` of one
    gradient, and the norm to clip by is the whole gradient's, ``sqrt(sum_j |g_j|^2)`` over
    the devices of ``shard_axis`` (one scalar ``psum``), every shard scaled by the same factor.
    A norm of the local shard alone (what this transform without ``shard_axis``, or
    ``optax.clip_by_global_norm``, takes of a shard) scales each shard by its own factor: a
    gradient of another direction, with no error. With FSDP alone the shard gradients are
    already the whole batch's (``fsdp_gather``'s reduce-scatter): pass ``axis_name=None``,
    ``shard_axis="data"``, and the threshold is ``c``. With a replica axis averaged after it
    (HSDP, ``jc.compressed_allreduce(codec, "replica")``): ``axis_name="replica"``,
    ``shard_axis="data"``, the threshold ``c sqrt(n_replica)`` (or ``c`` with ``bound``).

    Args:
      max_norm: ``c`` > 0, the norm the mean gradient is clipped to.
      axis_name: the data-parallel axis the recipe after it averages over; None only with
        ``shard_axis`` (nothing averages after: FSDP alone). Not before (or inside)
        ``jc.local_sgd``, ``jc.diloco``, ``jc.sparseloco`` or ``jc.gossip``, which average no
        gradient: their replicas are clipped with ``optax.clip_by_global_norm(c)``, or with
        FSDP shards inside each replica by ``jc.clip_by_global_norm(c, None,
        shard_axis="data")`` in the inner optimizer (the replica axis is not a shard axis
        there: :mod:`jaxcomp._src.inner_replicas`).
      bound: clip each device at ``c`` (a bound on the mean) instead of ``c sqrt(n)``.
      shard_axis: None or ``()`` (the leaves are whole, as for the transforms), or the mesh
        axis (or tuple) over which the gradients are shards of one gradient (FSDP): the norm
        is taken over all of them. A leaf typed identical on
        every device of it (a replicated bias) counts once; under ``pmap`` or
        ``check_vma=False`` jax does not type it and every leaf counts as a shard.

    Returns:
      An ``optax.GradientTransformation`` (stateless) to chain before the recipe.

    Raises:
      ValueError: at construction, ``max_norm``, ``axis_name`` or ``shard_axis`` outside its
        rule (the message names the argument; the rules: docs/errors.md).
      TypeError: at construction, ``max_norm``, ``bound`` or ``shard_axis`` of the wrong kind.

    The update refuses gradients already identical on every device (``check_vma=True``),
    the mean of an exchange chained before it, with ValueError naming ``updates``;
    gradients identical on every device of ``shard_axis`` (not shards), naming ``shard_axis``;
    and, naming ``shard_axis``, ``params`` typed as differing over a manual axis outside
    ``axis_name`` and ``shard_axis`` (shards of one model there, e.g. HSDP's
    ``P("replica", "data")``: each shard would be clipped by its own norm). FSDP shards over
    ``axis_name`` itself look like per-device replicas (``jc.replica_params``) in jax's types
    and are not refused: pass ``shard_axis`` for them.

    Example::

        tx = optax.chain(jc.clip_by_global_norm(1.0, "data"), jc.sgd(0.1, jc.sign(), "data"))

    References:
      Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression", ICLR 2018 (local gradient
      clipping); Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural
      networks", ICML 2013 (clipping by the global norm).
    """
    max_norm = check_number("max_norm", max_norm, 0.0, float("inf"))
    if not isinstance(max_norm, jax.core.Tracer) and float(max_norm) == 0.0:
        raise ValueError("`max_norm` must be > 0, got 0")
    if not isinstance(bound, bool):
        raise TypeError(f"`bound` must be a bool, got {bound!r}")
    # (): the leaves are whole, as the transforms' shard_axis=() says
    shard_axis = shards.check_shard_axis(shard_axis) or None
    if axis_name is None and shard_axis is None:
        raise ValueError(
            "`axis_name` is required: the data-parallel axis the exchange after this averages "
            "over (None only with `shard_axis`, for FSDP shard gradients that nothing averages)"
        )

    def update_fn(updates, state, params=None):
        skeleton.check_real("clip_by_global_norm", updates)  # it would pass unclipped
        check_whole_params(
            "clip_by_global_norm",
            "shard_axis",
            params,
            () if axis_name is None else collectives.axis_names(axis_name),
            () if shard_axis is None else collectives.axis_names(shard_axis),
            "Clip by the norm of the whole gradient: "
            f"jc.clip_by_global_norm({max_norm!r}, {axis_name!r}, shard_axis={{shard_axis!r}})",
        )
        if axis_name is not None:
            check_per_device_gradients(updates, axis_name, max_norm)
        n = 1 if axis_name is None else collectives.axis_size(axis_name)
        limit = max_norm if bound else max_norm * math.sqrt(n)
        if shard_axis is None:
            parts = scaled_global_norm_parts(float_leaves(updates))
        else:
            if collectives.bound_axis_size(shard_axis) is None:
                raise ValueError(
                    f"`shard_axis` {shard_axis!r} is not bound here: clip inside the "
                    "jax.shard_map whose mesh shards the gradients over it"
                )
            check_shards(updates, shard_axis)
            parts = sharded_norm_parts(updates, shard_axis)
        # A norm past float32's range (finite values) or above 2^126 (limit / norm flushed
        # to 0) zeroed every update: clip_scales scales such updates by 2^-64 first.
        pre, factor = clip_scales(*parts, limit)
        clipped = jax.tree.map(
            lambda x: (
                ((x * pre) * factor).astype(x.dtype)
                if jnp.issubdtype(jnp.result_type(x), jnp.floating)
                else x
            ),
            updates,
        )
        return clipped, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
