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


def _names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def _spec_of(x: Any) -> P:
    """A PartitionSpec from a spec, a ``NamedSharding`` or an array carrying one."""
    if isinstance(x, P):
        return x
    sharding = getattr(x, "sharding", x)
    spec = getattr(sharding, "spec", None)
    return spec if isinstance(spec, P) else P()


def _is_none(x: Any) -> bool:
    return x is None


def _leaf_spec(value: Any, param_spec: P | None, shape: tuple | None, lead: tuple) -> P:
    """``lead`` (the data axes, or nothing) composed with the param's own spec where the
    leaf is shaped like its param (``(1, *shape)`` per device, ``shape`` replicated)."""
    if param_spec is not None and shape is not None:
        got = tuple(getattr(value, "shape", ()))
        if got == (*((1,) if lead else ()), *shape):
            return P(*lead, *param_spec, *([None] * (len(shape) - len(param_spec))))
    return P(*lead)


def _field_specs(value: Any, lead: tuple, params: tuple | None) -> Any:
    """Specs of one state field; per-leaf fields (the params' structure, None allowed) get
    each param's spec composed in."""
    if params is not None:
        treedef, specs, shapes = params
        slots, field_def = jax.tree.flatten(value, is_leaf=_is_none)
        if field_def == treedef:
            return jax.tree.unflatten(
                field_def,
                [
                    None if v is None else _leaf_spec(v, ps, sh, lead)
                    for v, ps, sh in zip(slots, specs, shapes, strict=True)
                ],
            )
    return jax.tree.map(lambda _: P(*lead), value)


def state_specs(state: Any, axis_name: Any, param_specs: Any = None, params: Any = None) -> Any:
    """The ``PartitionSpec`` tree for an optimizer state (a chain that holds jaxcomp states).

    Per-device fields of jaxcomp states get ``P(axis_name)`` on their leading device axis;
    every other leaf ``P()``. Works on concrete states and on ``jax.eval_shape`` results
    alike. For a hierarchical transform (``inner_axis_name=``) pass both axes,
    ``("host", "local")``: every device of the 2-D mesh keeps its own memory,
    ``P(("host", "local"))``.

    Params sharded over other mesh axes (a data x model mesh, ``shard_map`` manual over the
    data axis only): pass ``param_specs`` (a tree like the params of ``PartitionSpec`` or
    ``NamedSharding``, or the sharded params themselves) and ``params`` (for the shapes, if
    ``param_specs`` are not arrays). A per-leaf field shaped like its param then carries the
    param's own spec behind the data axis, ``P("data", *param_spec)`` (replicated fields:
    ``param_spec``), so each device holds only its model shard of every memory.
    """
    lead = tuple(_names(axis_name))
    lead = (lead if len(lead) > 1 else lead[0],)
    context = None
    if param_specs is not None:
        shaped = params if params is not None else param_specs
        specs, treedef = jax.tree.flatten(
            param_specs, is_leaf=lambda x: isinstance(x, P | jax.sharding.Sharding)
        )
        shapes = [tuple(jnp.shape(x)) for x in jax.tree.leaves(shaped)]
        context = (treedef, [_spec_of(x) for x in specs], shapes)

    def spec(node):
        if not is_sharded_state(node):
            return jax.tree.map(lambda _: P(), node)
        per_device = type(node).PER_DEVICE_FIELDS
        # Other fields may hold a wrapped transform's state (jc.accumulate): recurse.
        return type(node)(
            *(
                _field_specs(value, lead, context)
                if f in per_device
                else _field_specs(value, (), context)
                if context is not None and jax.tree.structure(value, is_leaf=_is_none) == context[0]
                else state_specs(value, axis_name, param_specs, params)
                for f, value in zip(node._fields, node, strict=True)
            )
        )

    return jax.tree.map(spec, state, is_leaf=is_sharded_state)


def abstract_init(tx: optax.GradientTransformation, params: Any, mesh: Any, axis_name: Any) -> Any:
    """``jax.eval_shape(tx.init, params)`` with ``axis_name`` bound to its size in ``mesh``,
    per device: the state's structure and per-device shapes, without running anything.

    Some state depends on the number of devices (the two-phase server residual holds the
    chunk a device owns), so the init must see the axis.
    """
    names = _names(axis_name)
    init = tx.init
    for name in reversed(names):
        init = jax.vmap(init, in_axes=None, axis_name=name, axis_size=mesh.shape[name])
    abstract = jax.eval_shape(init, params)
    cut = len(names)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[cut:], s.dtype), abstract)


def sharded_init(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: Any,
    param_specs: Any = None,
) -> Any:
    """``tx.init(params)`` on every device of ``mesh``; per-device fields sharded on ``axis_name``.

    The result feeds a ``shard_map`` step whose state specs are :func:`state_specs` of it
    (with the same ``param_specs`` where params are sharded over other mesh axes: then the
    step is ``jax.shard_map(..., axis_names={axis_name})`` and every per-leaf field keeps its
    param's sharding over the other axes).
    """
    names = _names(axis_name)
    abstract = abstract_init(tx, params, mesh, axis_name)
    manual = state_specs(abstract, axis_name)
    others = set(mesh.axis_names) - set(names)
    init = (
        jax.shard_map(
            tx.init, mesh=mesh, in_specs=P(), out_specs=manual, axis_names=set(names) | set()
        )
        if others
        else jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=manual)
    )
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    state = jax.jit(init)(replicated)
    if param_specs is None:
        return state
    full = state_specs(state, axis_name, param_specs, params)
    return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), full))


def replicate(tree: Any, num_devices: int | None = None) -> Any:
    """Stack ``tree`` ``num_devices`` times along a new leading axis (the ``pmap`` layout)."""
    n = jax.local_device_count() if num_devices is None else num_devices
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)
