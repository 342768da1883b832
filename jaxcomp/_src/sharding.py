"""Per-device optimizer state under ``jax.shard_map``: specs and sharded init in one line.

Error-feedback memory differs per device. jaxcomp states mark those fields in
``PER_DEVICE_FIELDS``; under ``shard_map`` they get ``P(axis_name)``, so the global array is
the devices' memories concatenated along axis 0 and each device sees exactly its own
``f32[d]``. Every other leaf (keys, step counts, other optax states) is replicated: ``P()``.

    opt_state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(opt_state, "data")
    step = jax.jit(jax.shard_map(step_fn, mesh=mesh,
                                 in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))

Under ``jax.pmap`` every leaf carries a leading device axis instead: build the state with
``jax.pmap(tx.init, axis_name=...)`` on replicated params, or :func:`replicate`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def is_sharded_state(node: Any) -> bool:
    """A jaxcomp state NamedTuple with per-device fields."""
    return isinstance(node, tuple) and hasattr(type(node), "PER_DEVICE_FIELDS")


def state_specs(state: Any, axis_name: Any) -> Any:
    """The ``PartitionSpec`` tree for an optimizer state (a chain that holds jaxcomp states).

    Per-device fields of jaxcomp states get ``P(axis_name)``; every other leaf ``P()``.
    Works on concrete states and on ``jax.eval_shape`` results alike. For a hierarchical
    transform (``inner_axis_name=``) pass both axes, ``("host", "local")``: every device of
    the 2-D mesh keeps its own memory, ``P(("host", "local"))``.
    """
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)

    def spec(node):
        if not is_sharded_state(node):
            return jax.tree.map(lambda _: P(), node)
        per_device = type(node).PER_DEVICE_FIELDS
        # Other fields may hold a wrapped transform's state (jc.accumulate): recurse.
        return type(node)(
            *(
                jax.tree.map(lambda _: P(axis_name), value)
                if f in per_device
                else state_specs(value, axis_name)
                for f, value in zip(node._fields, node, strict=True)
            )
        )

    return jax.tree.map(spec, state, is_leaf=is_sharded_state)


def sharded_init(
    tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh, axis_name: Any
) -> Any:
    """``tx.init(params)`` on every device of ``mesh``; per-device fields sharded on ``axis_name``.

    The result feeds a ``shard_map`` step whose state specs are :func:`state_specs` of it.
    """
    specs = state_specs(jax.eval_shape(tx.init, params), axis_name)
    params = jax.device_put(params, NamedSharding(mesh, P()))
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
    return jax.jit(init)(params)


def replicate(tree: Any, num_devices: int | None = None) -> Any:
    """Stack ``tree`` ``num_devices`` times along a new leading axis (the ``pmap`` layout)."""
    n = jax.local_device_count() if num_devices is None else num_devices
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)
