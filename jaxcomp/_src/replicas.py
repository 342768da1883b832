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
import optax
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


#: The public transform behind each replica state class, for the messages.
_TRANSFORM = {
    "DiLoCoState": "jc.diloco",
    "LocalSGDState": "jc.local_sgd",
    "SparseLoCoState": "jc.sparseloco",
    "GossipState": "jc.gossip",
}

#: The states of optax's masking wrappers (``optax.masked``; ``multi_transform`` / ``partition``).
_MASKS = (optax.MaskedState, optax.PartitionState)


def replica_states() -> tuple[type, ...]:
    """The states of the transforms whose params differ per device between exchanges."""
    from jaxcomp._src.diloco import DiLoCoState
    from jaxcomp._src.gossip import GossipState
    from jaxcomp._src.local_sgd import LocalSGDState
    from jaxcomp._src.sparseloco import SparseLoCoState

    return (DiLoCoState, LocalSGDState, SparseLoCoState, GossipState)


def _children(node: Any) -> list:
    """The pytree children of ``node`` (none for a leaf)."""
    kids = jax.tree.leaves(node, is_leaf=lambda x: x is not node)
    return [] if len(kids) == 1 and kids[0] is node else kids


def _nodes(state: Any):
    """Every pytree node of ``state``, not looking inside a replica transform's own state
    (DiLoCo's outer chain, its exchange: no replica transform there)."""
    kinds = replica_states()
    todo = [state]
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, kinds):
            todo.extend(_children(node))


def check_replicas_last(state: Any, params: Any = None) -> None:
    """Refuse a ``tx`` whose ``optax.chain`` runs a transform after ``jc.local_sgd``,
    ``jc.diloco``, ``jc.sparseloco`` or ``jc.gossip`` (``state``: the chain's state, a plain
    tuple of its transforms' states, anywhere inside ``tx.init``'s state; ``params``: the
    params it was built for, whose leaves name the masked ones).

    At a sync such a transform returns ``u_i = x - theta_i``, the move that lands device
    ``i``'s params ``theta_i`` on the synchronized ``x``. A transform after it changes each
    device's move by what differs per device (``optax.scale(s)``: ``theta_i + s (x -
    theta_i)``; ``optax.add_decayed_weights(w)``: ``+ w theta_i``), so the replicas no longer
    agree after a sync, with no error (docs/local-sgd-diloco.md). Chained before it, or
    inside ``inner``, the same transform is fine. A replica transform inside a nested chain
    or a wrapper (``optax.inject_hyperparams``, ``jc.accumulate``) counts as where that
    chain or wrapper is (until 2026-11-27 ``optax.chain(optax.chain(jc.local_sgd(...)),
    optax.scale(0.5))`` was accepted, the same updates as the flat chain refused); so does
    one under ``optax.masked`` / ``multi_transform`` / ``partition`` where a transform on
    every leaf follows. Followed by masked transforms only, it is accepted where each of
    them provably leaves its leaves alone (:func:`_check_masked_after`).
    """
    for node in _nodes(state):
        if type(node) is tuple:  # an optax.chain's state
            for i, k in enumerate(node[:-1]):
                masked_after = all(isinstance(a, _MASKS) for a in node[i + 1 :])
                kind = _replicas_run(k, through_masks=not masked_after)
                if kind is not None:
                    _refuse_after(kind)
                if masked_after and params is not None:
                    _check_masked_after(k, node[i + 1 :], params)


def _check_masked_after(node: Any, after: tuple, params: Any) -> None:
    """Refuse masked transforms ``after`` a masked replica transform in ``node`` that touch
    its leaves, or whose leaves cannot be read.

    ``optax.chain(optax.masked(jc.local_sgd(...), m), optax.masked(optax.scale(0.5), m))``
    is the refused ``chain(local_sgd, scale)`` on the leaves of ``m`` (accepted until
    2026-11-27; measured: docs/errors.md, the ``optax.chain(jc.local_sgd(...), after)`` row).
    Which leaves a masked transform touches is read from its per-leaf state
    (``optax.masked`` gives its inner transform the params with ``optax.MaskedNode`` where
    the mask is False); a stateless one (``optax.scale``, ``add_decayed_weights``) records
    none, so it is refused too.
    """
    kinds = replica_states()
    found = [n for n in _all_nodes(node) if isinstance(n, kinds)]
    if not found:
        return
    name = _TRANSFORM[type(found[0]).__name__]
    ours = set()
    for n in found:
        leaves = _synced_paths(n, params)
        if leaves is None:
            _refuse_unreadable(name, "its own leaves", "jc.gossip records no leaves of its own")
        ours |= leaves
    for a in after:
        theirs = _masked_paths(a, params)
        if theirs is None:
            _refuse_unreadable(name, "the leaves of a masked transform after it", "")
        shared = sorted(ours & theirs, key=jax.tree_util.keystr)
        if shared:
            raise ValueError(
                f"jc.sharded_init: `tx` chains a masked transform after {name} on its leaves "
                f"{', '.join(map(jax.tree_util.keystr, shared[:5]))}: at a sync it changes "
                "each device's move onto the synchronized params differently, so the replicas "
                f"would not agree after the sync. Put it inside `inner` ({name}(optax.chain("
                "..., optax.scale_by_learning_rate(lr)), ...)) or before it in the chain."
            )


def _refuse_unreadable(name: str, what: str, why: str) -> None:
    raise ValueError(
        f"jc.sharded_init: `tx` chains masked transforms after {name} under optax.masked / "
        f"multi_transform / partition, and {what} cannot be read from the state "
        f"({why or 'a stateless transform records none'}): a transform after {name} on its "
        "leaves would move the replicas apart at every sync. Put the per-group transforms "
        f"inside `inner` ({name}(optax.multi_transform(..., labels), ...)), or before "
        f"{name} in the chain."
    )


def _all_nodes(state: Any):
    """Every pytree node of ``state``, replica states' insides included."""
    todo = [state]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(_children(node))


def _params_like(node: Any, params: Any) -> set | None:
    """The float leaves of ``params`` that ``node`` holds a value for, where ``node`` is
    shaped like ``params`` (a per-leaf state field: ``optax.MaskedNode`` or None at the
    leaves masked out, whole masked subtrees too); else None."""
    kids = _children(node)
    if not kids:
        return None
    try:
        jax.tree_util.tree_structure(node, is_leaf=_empty).flatten_up_to(params)
    except (ValueError, TypeError):
        return None
    pairs = jax.tree_util.tree_flatten_with_path(node, is_leaf=_empty)[0]
    held = {k for k, x in pairs if not _empty(x)}
    if not held <= {k for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]}:
        return None
    return held & set(_float_paths(params))


def _mirror_paths(node: Any, params: Any) -> set | None:
    """The float leaves of ``params`` held by some per-leaf field anywhere in ``node``
    (None where no field is shaped like the params: a stateless transform)."""
    found = [p for n in _all_nodes(node) if (p := _params_like(n, params)) is not None]
    return set().union(*found) if found else None


def _synced_paths(node: Any, params: Any) -> set | None:
    """The float leaves a replica state syncs: its ``anchor``'s (DiLoCo, local SGD,
    SparseLoCo), else (gossip) those of its per-leaf fields, None where it has none."""
    if hasattr(node, "anchor"):
        return set(_float_paths(node.anchor))
    return _mirror_paths(node, params)  # gossip: CHOCO's copies, its inner's fields


def _masked_paths(node: Any, params: Any) -> set | None:
    """The float leaves a masked transform's state ``node`` touches; a partition's groups
    one by one (None where any group's cannot be read)."""
    if isinstance(node, optax.PartitionState):
        groups = [_masked_paths(g, params) for g in node.inner_states.values()]
        return None if any(g is None for g in groups) else set().union(*groups)
    return _mirror_paths(node, params)


def _replicas_run(node: Any, through_masks: bool) -> str | None:
    """The state class name of a replica transform that ``node``'s transform runs: ``node``
    itself, or one inside it through chains and wrappers (through ``optax.masked`` /
    ``multi_transform`` / ``partition`` too where ``through_masks``); else None."""
    kinds = replica_states()
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, kinds):
            return type(n).__name__
        if through_masks or not isinstance(n, _MASKS):
            todo.extend(_children(n))
    return None


def _empty(x: Any) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _float_paths(tree: Any) -> list:
    """The key paths of the floating, non-empty leaves of ``tree``."""
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_empty)[0]
    dtype = lambda x: x.dtype if hasattr(x, "dtype") else jnp.result_type(x)  # noqa: E731
    return [k for k, x in pairs if not _empty(x) and jnp.issubdtype(dtype(x), jnp.floating)]


def check_replicas_cover(state: Any, params: Any) -> None:
    """Refuse a ``tx`` that runs ``jc.local_sgd``, ``jc.diloco``, ``jc.sparseloco`` or
    ``jc.gossip`` on some of the params only (inside ``optax.masked``,
    ``optax.multi_transform`` or ``optax.partition``) and nothing that averages the others:
    the params are per-device replicas, and a float leaf no transform syncs drifts apart on
    each device for ever, with no error. A leaf counts as synced where a replica transform's
    ``anchor`` holds it; under a mask, ``jc.gossip`` (no anchor) syncs the leaves its
    per-leaf fields hold (its inner optimizer's, CHOCO's copies), and one with none to read
    is refused (until 2026-11-27 it was accepted, and the leaves outside its mask drifted:
    docs/errors.md, the ``optax.multi_transform`` row). With another jaxcomp exchange in
    ``tx`` (it may average the rest every step) nothing is refused."""
    found = list(_replica_nodes(state))
    if not found or any(isinstance(n, _exchange_states()) for n in _nodes(state)):
        return
    name = _TRANSFORM[type(found[0][0]).__name__]
    synced = set()
    for node, masked in found:
        if not masked:
            return  # a replica transform on every leaf
        leaves = _synced_paths(node, params)
        if leaves is None:
            _refuse_gossip_unread()
        synced |= leaves
    left = [k for k in _float_paths(params) if k not in synced]
    if left:
        raise ValueError(
            f"jc.sharded_init: `tx` runs {name} on some of the params only (optax.masked, "
            f"optax.multi_transform or optax.partition): the float leaves "
            f"{', '.join(map(jax.tree_util.keystr, left[:5]))} are synced by no transform, and "
            "each device's copy of them would drift from the others' for ever. Put the "
            f"per-group optimizers inside `inner` ({name}(optax.multi_transform(..., "
            "labels), ...)), frozen leaves too (optax.set_to_zero() in that multi_transform: "
            "its state cannot be told from a trained group's), or give every group its own "
            "replica transform (or an exchange that averages it every step: "
            "jc.compressed_allreduce(jc.identity(), axis_name) is jax.lax.pmean)."
        )


def _refuse_gossip_unread() -> None:
    raise ValueError(
        "jc.sharded_init: `tx` runs jc.gossip under optax.masked / multi_transform / "
        "partition, and its state records none of the leaves it averages (no anchor; an "
        "inner optimizer without per-leaf state, no codec), so the leaves outside its mask "
        "cannot be checked: they would drift apart on each device for ever if nothing syncs "
        "them. Put the per-group optimizers inside `inner` (jc.gossip(optax.multi_transform("
        "..., labels), axis_name)), or give the gossiped group an inner optimizer with "
        "per-leaf state (optax.sgd(lr, momentum=0.9))."
    )


def _replica_nodes(state: Any):
    """``(state, masked)`` for every replica transform's state in ``state``: ``masked``
    where it sits under ``optax.masked`` / ``multi_transform`` / ``partition``."""
    kinds = replica_states()
    todo = [(state, False)]
    while todo:
        node, masked = todo.pop()
        if isinstance(node, kinds):
            yield node, masked
            continue
        masked = masked or isinstance(node, _MASKS)
        todo.extend((k, masked) for k in _children(node))


def _exchange_states() -> tuple[type, ...]:
    """The jaxcomp states of transforms that average what they are given (every step)."""
    from jaxcomp._src.compressed_allreduce import CompressedAllreduceState
    from jaxcomp._src.delayed import DelayedState
    from jaxcomp._src.demo import DeMoState
    from jaxcomp._src.dgc import DGCState
    from jaxcomp._src.onebit_adam import OneBitAdamState
    from jaxcomp._src.powersgd import PowerSGDState
    from jaxcomp._src.zero_one_adam import ZeroOneAdamState

    return (
        CompressedAllreduceState,
        DelayedState,
        DeMoState,
        DGCState,
        OneBitAdamState,
        PowerSGDState,
        ZeroOneAdamState,
    )


def _refuse_after(kind: str) -> None:
    """The ValueError of :func:`check_replicas_last` for a ``kind`` of state not last."""
    name = _TRANSFORM[kind]
    raise ValueError(
        f"jc.sharded_init: `tx` chains a transform after {name} ({kind}, not last in an "
        "optax.chain): at a sync its update moves each device's params onto the synchronized "
        "params, and a transform after it (a learning rate, weight decay, clipping) changes "
        "each device's move differently, so the replicas would not agree after the sync. Put "
        f"it inside `inner` ({name}(optax.chain(optax.scale_by_adam(), "
        "optax.scale_by_learning_rate(lr)), ...)) or before it in the chain."
    )


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
