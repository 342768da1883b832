"""Params that differ per device: local SGD, DiLoCo and gossip keep one replica per device.

Data-parallel transforms (``compressed_allreduce``, ``dgc``, the recipes) return the same
update on every device, so the params stay replicated (``P()``). Transforms that communicate
less often or only with neighbours (``jc.local_sgd``, ``jc.diloco``, ``jc.gossip``) let each
device's params drift between synchronizations: the params are then *replicas*, stacked on a
leading device axis like the per-device state fields, ``(n, *shape)`` globally with spec
``P(axis_name)``, and each device's step sees its own ``(1, *shape)`` slot::

    replicas = jc.replica_params(params, mesh, "data")          # (n, *shape), P("data")
    opt_state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(opt_state, "data")

    def step(replicas, opt_state, batch):
        params = jc.own(replicas)                                # this device's (*shape)
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jc.slot(optax.apply_updates(params, updates)), opt_state

    step = jax.jit(jax.shard_map(step, mesh=mesh,
                                 in_specs=(P("data"), specs, P("data")),
                                 out_specs=(P("data"), specs)))
    model = jc.mean_replica(replicas)                            # evaluate the mean model

Under ``jax.pmap`` the replicas are the pmapped params themselves (``jc.replicate``): each
device's step sees its own params without a slot.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _lead(axis_name: Any) -> Any:
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    return names if len(names) > 1 else names[0]


def _size(mesh: jax.sharding.Mesh, axis_name: Any) -> int:
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    missing = [a for a in names if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not an axis of the mesh (axes: {tuple(mesh.shape)})"
        )
    n = 1
    for a in names:
        n *= mesh.shape[a]
    return n


def replica_specs(params: Any, axis_name: Any) -> Any:
    """``P(axis_name)`` for every leaf of ``params``: the specs of stacked replicas.

    Args:
      params: a pytree of arrays (or of anything: only its structure is read).
      axis_name: the replica axis.
    """
    lead = _lead(axis_name)
    return jax.tree.map(lambda _: P(lead), params)


def replica_params(params: Any, mesh: jax.sharding.Mesh, axis_name: Any) -> Any:
    """One copy of ``params`` per device of ``axis_name``: leaves ``(n, *shape)``, sharded
    ``P(axis_name)`` on ``mesh``, so that each device's ``shard_map`` step holds its own.

    Args:
      params: a pytree of arrays, one model.
      mesh: the mesh the copies are laid out on.
      axis_name: the replica axis of ``mesh``.
    """
    n = _size(mesh, axis_name)
    sharding = NamedSharding(mesh, P(_lead(axis_name)))
    return jax.tree.map(
        lambda x: jax.device_put(jnp.broadcast_to(x, (n, *jnp.shape(x))), sharding), params
    )


def own(replicas: Any) -> Any:
    """Inside a ``shard_map`` step: this device's params from its ``(1, *shape)`` slots.

    Args:
      replicas: the step's block of :func:`replica_params`: leaves ``(1, *shape)``.
    """
    return jax.tree.map(lambda x: x[0], replicas)


def slot(params: Any) -> Any:
    """Inside a ``shard_map`` step: this device's params as ``(1, *shape)`` slots again.

    Args:
      params: this device's params, leaves ``shape`` (as :func:`own` returns them).
    """
    return jax.tree.map(lambda x: x[None], params)


def mean_replica(replicas: Any) -> Any:
    """The mean model of stacked replicas ``(n, *shape)``: the one to evaluate.

    Integer leaves (step counters, which agree across replicas) give their minimum.

    Args:
      replicas: stacked replicas, leaves ``(n, *shape)`` (:func:`replica_params`' layout).
    """

    def mean(x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.mean(x.astype(jnp.float32), axis=0).astype(x.dtype)
        return jnp.min(x, axis=0)

    return jax.tree.map(mean, replicas)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which ``x`` differs per device (empty outside shard_map)."""
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    if kind is not None:
        return frozenset(kind.varying)
    return frozenset(getattr(aval, "vma", ()))


def check_within_replica(name: str, grads: Any, params: Any, axis_name: Any) -> None:
    """Refuse, at trace time, gradients that still differ inside a replica.

    Over a replica x data mesh (``jc.diloco(inner, "replica", ...)`` with plain data
    parallelism inside each replica) every device of a replica must feed the transform the
    replica's mean gradient: a gradient leaf that varies over a mesh axis (``shard_map``'s
    ``vma``) over which neither its param nor ``axis_name`` varies would give each device of
    the replica its own inner optimizer state and params, silently. Not checked where the
    types carry no ``vma`` (``check_vma=False``, ``pmap``).
    """
    names = set(tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,))
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=False):
        extra = varying_axes(g) - varying_axes(p) - names
        if extra:
            axes = tuple(sorted(extra))
            raise ValueError(
                f"{name}: the gradients vary over mesh axes {axes} inside each replica of "
                f"`axis_name`={axis_name!r}: average them first, "
                f"`grads = jax.lax.pmean(grads, {axes[0]!r})` (data parallel inside a replica), "
                "or name every axis in `axis_name`"
            )
