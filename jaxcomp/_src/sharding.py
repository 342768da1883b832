"""Per-device optimizer state under ``jax.shard_map``: specs and sharded init in one line.

Error-feedback memory differs per device. jaxcomp states mark those fields in
``PER_DEVICE_FIELDS``; each of their arrays carries a leading device slot of 1, and under
``shard_map`` gets ``P(axis_name)``: the global array stacks the devices' memories along
axis 0 (a ``(64, 48)`` leaf's memory is ``(n, 64, 48)``) and each device sees exactly its
own. Every other leaf (keys, step counts, other optax states) is replicated: ``P()``. With
params sharded over other mesh axes, ``param_specs`` lays each memory out like its param.

    opt_state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(opt_state, "data")
    step = jax.jit(jax.shard_map(step_fn, mesh=mesh,
                                 in_specs=(P(), specs, P("data")), out_specs=(P(), specs)))

Under ``jax.pmap`` every leaf carries a leading device axis instead: build the state with
``jax.pmap(tx.init, axis_name=...)`` on replicated params, or :func:`replicate`.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import (
    fragments,
    multisteps,
    optax_leaf_specs,
    plain_init,
    replicas,
    whole_leaf,
    whole_leaf_in_step,
)
from jaxcomp._src.axes import check_axis_name


def is_sharded_state(node: Any) -> bool:
    """A jaxcomp state NamedTuple with per-device fields."""
    return isinstance(node, tuple) and hasattr(type(node), "PER_DEVICE_FIELDS")


def _names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)


def check_mesh_axes(mesh: Any, axis_name: Any, argument: str = "axis_name") -> None:
    """Raise a ValueError naming ``argument`` if ``mesh`` lacks one of the axes in ``axis_name``."""
    names = _names(axis_name)
    missing = [a for a in names if a not in mesh.axis_names]
    if not names or missing:
        raise ValueError(
            f"`{argument}`={axis_name!r} names {missing or 'no'} axis that the mesh does not have "
            f"(the mesh's axes: {tuple(mesh.axis_names)}); pass the data axis of the mesh, "
            f"e.g. {argument}={mesh.axis_names[0]!r}."
        )


def spec_of(x: Any) -> P:
    """A PartitionSpec from a spec, a ``NamedSharding`` or an array carrying one."""
    if isinstance(x, P):
        return x
    sharding = getattr(x, "sharding", x)
    spec = getattr(sharding, "spec", None)
    return spec if isinstance(spec, P) else P()


def _is_none(x: Any) -> bool:
    """An empty slot of a per-leaf field (``optax.MaskedNode``), or a None field."""
    return x is None or isinstance(x, optax.MaskedNode)


def _axes_of(spec: P) -> tuple:
    """The mesh axes a spec shards over, in order (flattened)."""
    out: tuple = ()
    for entry in spec:
        if entry is not None:
            out += tuple(entry) if isinstance(entry, tuple) else (entry,)
    return out


def _leaf_spec(value: Any, param_spec: P, shapes: tuple, lead: tuple) -> P:
    """The spec of one per-leaf state array belonging to a param with ``param_spec``.

    ``lead``: the data axes for per-device fields (a leading device slot), ``()`` for
    replicated ones. Shaped like the param (``(k, *shape)`` per device, ``shape``
    replicated; ``shapes``: the param's global and per-block shapes): the param's own spec
    behind ``lead``. Other shapes (a server residual's owned chunk, PowerSGD's ``Q``) hold
    one block's values per shard of the param: their first axis after ``lead`` is laid out
    over every axis that shards the param; a per-device one of one axis, raveled without a
    slot, over ``lead`` and those axes together.
    """
    got = tuple(getattr(value, "shape", ()))
    body = got[1:] if lead else got
    if lead and len(got) == 0:
        return P()
    if any(body == tuple(s) for s in shapes):
        return P(*lead, *param_spec, *([None] * (len(body) - len(param_spec))))
    axes = _axes_of(param_spec)
    if axes and lead and not body:
        # a per-device leaf raveled, without a device slot (``jc.accumulate``'s ``acc``):
        # its one axis holds the devices of ``lead``, each its own block of the param
        names = tuple(a for a in (*lead, *axes) if a is not None)
        return P(names if len(names) > 1 else names[0])
    if not axes or not body:
        return P(*lead)
    return P(*lead, axes if len(axes) > 1 else axes[0], *([None] * (len(body) - 1)))


def _field_specs(value: Any, lead: tuple, params: tuple | None) -> Any:
    """Specs of one state field; per-leaf fields (the params' structure, None allowed) get
    each param's spec composed in, and so does each per-leaf tree inside another structure
    (a nested optax state: the inner optimizer's ``mu`` / ``nu`` / ``trace`` of
    ``jc.diloco``'s per-device ``inner``); the rest ``P(*lead)``."""
    if params is None:
        return jax.tree.map(lambda _: P(*lead), value)
    treedef, specs, shapes = params
    slots, field_def = jax.tree.flatten(value, is_leaf=_is_none)
    if field_def == treedef:
        return jax.tree.unflatten(
            field_def,
            [
                v if _is_none(v) else _leaf_spec(v, ps, sh, lead)
                for v, ps, sh in zip(slots, specs, shapes, strict=True)
            ],
        )
    like = lambda x: _like_params(x, params)  # noqa: E731
    return jax.tree.map(
        lambda x: _field_specs(x, lead, params) if like(x) else P(*lead), value, is_leaf=like
    )


def _block_shape(shape: tuple, spec: P, mesh: Any) -> tuple:
    """The shape each device holds of an array of ``shape`` laid out by ``spec`` on ``mesh``."""
    out = list(shape)
    for i, entry in enumerate(spec):
        for a in () if entry is None else (entry if isinstance(entry, tuple) else (entry,)):
            out[i] //= mesh.shape[a]
    return tuple(out)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P | jax.sharding.Sharding)


def check_param_specs(param_specs: Any, params: Any) -> None:
    """Refuse ``param_specs`` that is not a tree like ``params``, one spec per leaf (an empty
    slot of ``params``, None or ``optax.MaskedNode``, may face a spec; a None slot None): a
    spec tree of other keys or leaves, or one ``P()`` for a subtree, failed deep inside
    (IndexError, "zip() argument 2 is shorter", jax's "pytree structure error ... shard_map
    in_specs"), naming neither the argument nor the params."""

    def one(spec: Any, sub: Any) -> None:
        leaves = jax.tree.leaves(sub)
        if leaves and not jax.tree_util.treedef_is_leaf(jax.tree.structure(sub)):
            raise ValueError(f"one spec, {spec}, for a subtree of {len(leaves)} leaves")

    try:
        jax.tree.map(one, param_specs, params, is_leaf=_is_spec)
    except ValueError as e:
        got = jax.tree.structure(param_specs, is_leaf=_is_spec)
        raise ValueError(
            f"`param_specs` must be a tree like the params, one PartitionSpec (or "
            f"NamedSharding) per leaf: it has the tree structure {_short(got)} but the params "
            f"have {_short(jax.tree.structure(params))} ({_short(e)}). Build it from the "
            "params, e.g. jax.tree.map(lambda a: a.sharding.spec, params) for params placed "
            "on the mesh, P() for each replicated leaf."
        ) from None


def _short(x: Any) -> str:
    text = str(x).replace("\n", " ")
    return text if len(text) < 300 else text[:300] + "..."


def _is_slot(x: Any) -> bool:
    return _is_none(x) or _is_spec(x)


def _check_shapes_given(param_specs: Any) -> None:
    """``param_specs`` without ``params`` must carry the params' shapes (the sharded params
    themselves): a ``PartitionSpec`` or a ``NamedSharding`` has none. Until 2026-11-27 the
    spec was read as an array, ``jnp.shape(P(None, "model"))`` = ``(2,)``, and the memory
    of a ``(16, 32)`` leaf of ``P(None, "model")`` got ``P("data", "model", None)`` where
    ``jc.sharded_init`` had laid it out ``P("data", None, "model")``, with no error (also
    through ``jc.nnx_state_specs(optimizer, axis_name, param_specs)``, as docs/flax.md
    said to call it)."""
    bare = [
        s
        for s in jax.tree.leaves(param_specs, is_leaf=_is_slot)
        if _is_spec(s) and any(a is not None for a in spec_of(s))
    ]
    if bare:
        raise ValueError(
            f"`param_specs` of PartitionSpecs (or NamedShardings: {bare[0]}) carry no shapes: "
            "pass `params` too (the params or their jax.ShapeDtypeStruct), or the sharded "
            "params themselves as `param_specs`"
        )


def _param_context(param_specs: Any, params: Any, mesh: Any = None) -> tuple:
    """(treedef, spec per param slot, (global shape, block shape) per param slot).

    The slots are the params' leaves and empty slots (None, ``optax.MaskedNode``), as a
    per-leaf state field holds them (``_field_specs``): an empty slot gets ``P()`` and shape
    ``()``, whether ``param_specs`` holds None or a spec there."""
    if params is not None:
        check_param_specs(param_specs, params)
    else:
        _check_shapes_given(param_specs)
    shaped = params if params is not None else param_specs
    slots, treedef = jax.tree.flatten(shaped, is_leaf=_is_slot)
    given = treedef.flatten_up_to(param_specs)
    specs = [P() if _is_none(s) else spec_of(s) for s in given]
    shapes = [() if _is_none(x) else tuple(jnp.shape(x)) for x in slots]
    if mesh is not None:
        shapes = [(s, _block_shape(s, p, mesh)) for s, p in zip(shapes, specs, strict=True)]
    else:
        shapes = [(s,) for s in shapes]
    return treedef, specs, shapes


def state_specs(
    state: Any, axis_name: Any, param_specs: Any = None, params: Any = None, mesh: Any = None
) -> Any:
    """The ``PartitionSpec`` tree for an optimizer state (a chain that holds jaxcomp states).

    Per-device fields of jaxcomp states get ``P(axis_name)`` on their leading device axis;
    every other leaf ``P()``. Works on concrete states and on ``jax.eval_shape`` results
    alike. For a hierarchical transform (``inner_axis_name=``) pass both axes in its order,
    ``(axis_name, inner_axis_name)``, e.g. ``("host", "local")``: every device of the 2-D
    mesh keeps its own memory, ``P(("host", "local"))``. Given ``mesh``, the other order is
    refused where the sizes tell it (a two-phase server residual's ``server_grid``).

    Params sharded over other mesh axes (a data x model mesh, ``shard_map`` manual over the
    data axis only): pass ``param_specs`` (a tree like the params of ``PartitionSpec`` or
    ``NamedSharding``, or the sharded params themselves) and ``params`` (for the shapes, if
    ``param_specs`` are not arrays). A per-leaf field shaped like its param then carries the
    param's own spec behind the data axis, ``P("data", *param_spec)`` (replicated fields:
    ``param_spec``), so each device holds only its model shard of every memory; so does an
    optax state's array shaped like its param (momentum, Adam's moments): ``param_spec``.

    Flax NNX: an ``nnx.Optimizer`` gives :func:`jaxcomp.nnx_state_specs` of it (the
    ``nnx.StateSharding`` for ``nnx.shard_map``), and ``optimizer.opt_state`` its spec tree;
    the state of ``nnx.split`` / ``nnx.state`` is refused (NNX has flattened the state's
    types into dicts: the per-device fields cannot be told apart).

    Args:
      state: the optimizer state (concrete or ``jax.eval_shape``'s), or an ``nnx.Optimizer``.
      axis_name: the data axis (a name, or a tuple of names).
      param_specs: None, or the params' specs over the other mesh axes (above).
      params: the params, for the shapes where ``param_specs`` are not arrays.
      mesh: the mesh, checked to have ``axis_name`` (in a hierarchical state's order);
        with ``param_specs``, it gives each device's block shape of the params.

    Returns:
      A tree like ``state`` of ``PartitionSpec``.

    Raises:
      ValueError: ``axis_name``, ``state`` or ``param_specs`` outside its rule, or
        ``params`` not given where ``param_specs`` are specs that shard a leaf (they carry no
        shapes), or ``mesh`` not given where ``state`` holds a Streaming DiLoCo state of
        several fragments and ``param_specs`` shard a leaf (its fragments were cut by each
        device's block sizes; the message names the argument; the rules: docs/errors.md);
        ``state`` holding ``optax.MultiSteps`` around a jaxcomp transform, whose
        ``acc_grads`` differ per device (``jaxcomp._src.multisteps``; ``jc.accumulate``);
        ``state`` from ``tx.init(params)``, its per-device fields one slot on one device
        (``jaxcomp._src.plain_init``; build it with :func:`sharded_init`).
    """
    check_axis_name(axis_name)  # None or a non-str: named
    if mesh is not None:
        check_mesh_axes(mesh, axis_name, "axis_name")
    nnx = sys.modules.get("flax.nnx")  # imported by the caller, or not needed
    if nnx is not None and isinstance(state, nnx.Optimizer):
        from jaxcomp._src.nnx import nnx_state_specs

        return nnx_state_specs(state, axis_name, param_specs, params, mesh)
    state = _unwrap_nnx(state, axis_name)
    multisteps.check_not_around_exchange(state, "state")
    specs = specs_of_state(state, axis_name, param_specs, params, mesh)
    plain_init.check_not_plain_init(state, specs, axis_name)
    return specs


def specs_of_state(
    state: Any, axis_name: Any, param_specs: Any = None, params: Any = None, mesh: Any = None
) -> Any:
    """:func:`state_specs` of a state that is not an NNX one, with no check of what wraps
    the jaxcomp states (:func:`sharded_init` checks its ``tx`` after its own checks)."""
    if mesh is not None:
        check_grid_order(state, mesh, axis_name)
    lead = tuple(_names(axis_name))
    lead = (lead if len(lead) > 1 else lead[0],)
    context = None if param_specs is None else _param_context(param_specs, params, mesh)
    return _specs(state, lead, context)


def _grids(state: Any) -> list[tuple]:
    """The shapes of the ``server_grid`` fields of every jaxcomp state in ``state``
    (hierarchical exchanges, nested ones included)."""
    found = []
    for node in jax.tree.leaves(state, is_leaf=is_sharded_state):
        if is_sharded_state(node):
            grid = getattr(node, "server_grid", None)
            found += [] if grid is None else [tuple(jnp.shape(grid))]
            found += _grids(
                [v for f, v in zip(node._fields, node, strict=True) if f != "server_grid"]
            )
    return found


def check_grid_order(state: Any, mesh: Any, axis_name: Any) -> None:
    """Refuse an ``axis_name`` whose sizes on ``mesh``, in its order, are not the grid a
    hierarchical exchange's server residual was laid out for (its ``server_grid``, ``(H, L)``
    of ``(axis_name, inner_axis_name)``): the axes in the other order (``("local", "data")``
    for ``("data", "local")``) hand each device another device's row, and nothing inside the
    ``shard_map`` can see the order. Seen only where the sizes differ (``H != L``)."""
    names = _names(axis_name)
    sizes = tuple(mesh.shape[a] for a in names)
    bad = [g for g in _grids(state) if g != sizes]
    if len(names) != 2 or not bad:
        return
    raise ValueError(
        f"`axis_name`={axis_name!r} has sizes {sizes} on this mesh, but the state holds a "
        f"hierarchical exchange's server residual laid out for {bad[0][0]} x {bad[0][1]} "
        "devices (its `server_grid`): list the axes as the exchange names them, "
        "(axis_name, inner_axis_name), e.g. ('data', 'local'); a state of another mesh "
        "restores only onto a mesh of its sizes (docs/checkpoints.md)."
    )


def _from_nnx(x: Any) -> bool:
    return type(x).__module__.startswith("flax.nnx")


def _unwrap_nnx(state: Any, axis_name: Any) -> Any:
    """The state with Flax NNX Variables taken off its arrays (``optimizer.opt_state``); a
    flattened NNX state (``nnx.split`` / ``nnx.state`` of an optimizer: NNX turned the state's
    NamedTuples into dicts, so per-device fields cannot be told apart) is refused."""

    def is_variable(x):  # an nnx.Optimizer's state wrapper (OptState / OptVariable), not a
        # Param of an nnx.State params tree that a transform's state mirrors (kept as it is)
        return _from_nnx(x) and any(c.__name__ == "OptState" for c in type(x).__mro__)

    nodes = jax.tree.leaves(state, is_leaf=lambda x: is_variable(x) or is_sharded_state(x))
    if not any(is_variable(x) for x in nodes):
        return state
    if not any(is_sharded_state(x) for x in nodes):
        raise ValueError(
            "jc.state_specs: `state` holds Flax NNX variables (nnx.split / nnx.state of an "
            "nnx.Optimizer) and no jaxcomp state: NNX flattened the state's NamedTuples into "
            "dicts, so the per-device fields (error-feedback memories) cannot be told from "
            "replicated ones and would all get P(). Pass the optimizer itself: "
            f"jc.nnx_state_specs(optimizer, {axis_name!r}) (or jc.state_specs(optimizer, "
            f"{axis_name!r})), the optimizer built by jc.nnx_optimizer(model, tx, mesh, "
            f"{axis_name!r})."
        )
    return jax.tree.map(
        lambda x: x.get_value() if is_variable(x) else x, state, is_leaf=is_variable
    )


def _like_params(node: Any, context: tuple | None) -> bool:
    """Whether ``node``, not a jaxcomp state, is a per-param field of another optax state
    (``optax.sgd``'s momentum ``trace``, Adam's ``mu`` / ``nu``): a tree like the params."""
    return (
        context is not None
        and not is_sharded_state(node)
        and jax.tree.structure(node, is_leaf=_is_none) == context[0]
    )


def _optax_field_specs(value: Any, context: tuple) -> Any:
    """Specs of a per-param field of an optax state: each array shaped like its param (the
    global or the block shape) takes the param's spec, any other array ``P()``.

    Until 2026-11-27 every optax array got ``P()``: with ``param_specs`` that shard a leaf
    (a model axis, or FSDP's data axis in a step manual over it) ``jc.sharded_init`` of
    ``optax.chain(jc.compressed_allreduce(...), optax.adam(...))`` failed in jax's
    "out_specs ... mu['a'] is P()" (each device's moment is its block), and
    ``jc.state_specs`` gave the step's ``shard_map`` those ``P()``."""
    treedef, specs, shapes = context
    slots = treedef.flatten_up_to(value)
    return jax.tree.unflatten(
        treedef,
        [
            v
            if _is_none(v)
            else ps
            if any(tuple(getattr(v, "shape", ())) == tuple(s) for s in sh)
            else P()
            for v, ps, sh in zip(slots, specs, shapes, strict=True)
        ],
    )


def _one_field(name: str, value: Any, node: Any, lead: tuple, context: tuple | None) -> Any:
    """Specs of the field ``name`` of the jaxcomp state ``node``: per device (``lead``
    first), replicated like the params, or a nested state (``jc.accumulate``'s wrapped one)."""
    if name in type(node).PER_DEVICE_FIELDS:
        return _field_specs(value, lead, context)
    if context is not None and jax.tree.structure(value, is_leaf=_is_none) == context[0]:
        return _field_specs(value, (), context)
    return _specs(value, lead, context)


def _fragment_contexts(node: Any, context: tuple) -> list | None:
    """One param context per fragment of a periodic state (``FRAGMENT_FIELDS``: tuples of one
    entry per fragment, each holding lists of that fragment's float leaves, in order), or
    None where it has no such field set. The fragments are those the transform's init cut
    (:func:`jaxcomp._src.fragments.partition` of the float leaves' block sizes); float
    leaves are the slots where the anchor is not None."""
    values = [getattr(node, f) for f in type(node).FRAGMENT_FIELDS]
    values = [v for v in values if v is not None]
    if not values:
        return None
    treedef, specs, shapes = context
    anchor = treedef.flatten_up_to(node.anchor)
    floats = [i for i, a in enumerate(anchor) if not _is_none(a)]
    count = len(values[0])
    sharded = any(_axes_of(specs[i]) for i in floats)
    if count > 1 and sharded and len(shapes[floats[0]]) < 2:
        raise ValueError(
            f"`mesh` is needed: a periodic state of {count} fragments with `param_specs` "
            "that shard a leaf; its fragments were cut by each device's block sizes. Pass "
            "mesh= (the mesh of the step) to jc.state_specs."
        )
    sizes = [int(np.prod(shapes[i][-1])) for i in floats]
    out = []
    for group in fragments.partition(sizes, count):
        slots = [floats[j] for j in group]
        out.append(
            (
                jax.tree.structure([0] * len(slots)),
                [specs[i] for i in slots],
                [shapes[i] for i in slots],
            )
        )
    return out


def _state_specs(node: Any, lead: tuple, context: tuple | None) -> Any:
    """Specs of a jaxcomp state NamedTuple, field by field; with ``param_specs``, each entry
    of a per-fragment field against its fragment's params (:func:`_fragment_contexts`)."""
    frag = getattr(type(node), "FRAGMENT_FIELDS", ())
    subs = _fragment_contexts(node, context) if context is not None and frag else None
    return type(node)(
        *(
            tuple(_one_field(f, v, node, lead, c) for v, c in zip(value, subs, strict=True))
            if subs is not None and f in frag and value is not None
            else _one_field(f, value, node, lead, context)
            for f, value in zip(node._fields, node, strict=True)
        )
    )


def _specs(state: Any, lead: tuple, context: tuple | None) -> Any:
    def spec(node):
        if _like_params(node, context):
            return _optax_field_specs(node, context)
        if not is_sharded_state(node):
            return jax.tree.map(lambda _: P(), node)
        return _state_specs(node, lead, context)

    return jax.tree.map(
        spec, state, is_leaf=lambda x: is_sharded_state(x) or _like_params(x, context)
    )


def block_specs(state: Any, param_specs: Any, like: Any) -> Any:
    """Specs of a transform's state over the axes that shard its params, inside a
    ``shard_map`` that is manual over the data axis: the device slot unsharded, the rest laid
    out as :func:`state_specs` does (``like``: a tree shaped like the params)."""
    return _specs(state, (None,), _param_context(param_specs, like))


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

    The result feeds a ``shard_map`` step whose state specs are :func:`state_specs` of it.

    Params sharded over other mesh axes (``param_specs``: a tree like the params of
    ``PartitionSpec`` or ``NamedSharding``; a data x model mesh whose step is
    ``jax.shard_map(..., axis_names={axis_name})``, the model axis ``AxisType.Auto``): each
    device then inits the state of its own block of every param, and every state array is
    laid out over the mesh by :func:`state_specs` with those ``param_specs``: memories
    ``P(axis_name, *param_spec)``, so no device holds more than its block. An optax array
    of another shape than its param (SM3's per-dimension accumulators, Adafactor's factored
    means) is laid out as ``tx.init`` of the whole params builds it
    (:mod:`jaxcomp._src.optax_leaf_specs`). The step's
    ``shard_map`` specs are still ``state_specs(state, axis_name)`` (the manual axis only;
    the arrays carry their model sharding).

    Args:
      tx: the optax transform (a jaxcomp transform, or a chain that holds them).
      params: the params (arrays or ``jax.ShapeDtypeStruct``).
      mesh: the mesh of the step.
      axis_name: the data axis (a name, or a tuple of names for a hierarchical transform:
        ``(axis_name, inner_axis_name)`` in that order, refused in the other where a
        two-phase server residual's ``server_grid`` tells it).
      param_specs: None (params replicated over the other axes) or a tree like the params of
        ``PartitionSpec`` / ``NamedSharding`` (above).

    Returns:
      The state, its per-device fields ``(n, ...)`` sharded ``P(axis_name)`` on ``mesh``.

    ``param_specs`` that split a leaf which an optax transform in ``tx`` reads whole
    (``optax.contrib.muon``'s 2-D leaves, ``optax.adafactor``, ``optax.novograd``,
    ``optax.sm3``: told by their state types), over a mesh axis that is not
    ``AxisType.Auto``, warn (naming ``param_specs``, the leaves and the transforms): the step
    steps each device's block as the leaf (``jaxcomp._src.whole_leaf``).

    Several processes: the state's replicated keys and counts are compared across
    them (:func:`check_same_on_every_process`), so a ``tx`` built with a per-process ``seed``
    is refused rather than left to desynchronise the replicas.

    Raises:
      ValueError: ``axis_name`` or ``param_specs`` outside its rule (the message names the
        argument; the rules: docs/errors.md); ``tx`` built differently on different processes (a
        replicated state leaf that differs between them, named); ``tx`` an ``optax.chain``
        with a transform after ``jc.local_sgd``, ``jc.diloco``, ``jc.sparseloco`` or
        ``jc.gossip``, which would move the replicas apart at a sync, or with
        ``jc.local_sgd`` / ``jc.diloco`` / ``jc.sparseloco`` on some float params only
        (``optax.masked``, ``optax.multi_transform``) and nothing averaging the others, or
        ``optax.MultiSteps`` around a jaxcomp transform (its ``acc_grads`` differ per device:
        ``jc.accumulate(tx, every_k)``); with ``param_specs`` that shard a leaf, an optax
        state array of ``tx`` that no spec lays out as the whole params' init builds it (a
        dimension of no param's sizes; a replicated shape the blocks filled differently).
      TypeError: ``tx`` not an optax transform, or ``mesh`` not a ``jax.sharding.Mesh``
        (the arguments swapped: the message names the argument and their order).
    """
    check_init_arguments(tx, mesh)
    state = init_state(tx, params, mesh, axis_name, param_specs)
    if param_specs is not None:
        specs = _param_context(param_specs, params, mesh)[1]
        split = whole_leaf.split_leaves(state, params, specs, mesh, _is_slot)
        whole_leaf.warn_split_leaves(split)
    check_grid_order(state, mesh, axis_name)
    replicas.check_replicas_last(state, params)
    replicas.check_replicas_cover(state, params)
    multisteps.check_not_around_exchange(state, "tx")
    check_same_on_every_process(state)
    return state


def check_init_arguments(tx: Any, mesh: Any) -> None:
    """A TypeError naming ``tx`` or ``mesh`` where :func:`sharded_init` got something else
    (its arguments swapped, a mesh axis's name for the mesh): jax's own error would be an
    AttributeError deep inside, naming neither."""
    order = "the arguments are (tx, params, mesh, axis_name)"
    if not callable(getattr(tx, "init", None)):  # only tx.init runs here
        raise TypeError(
            f"`tx` must be an optax GradientTransformation (its init builds the state), got "
            f"{type(tx).__name__}: {order}"
        )
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh (jax.make_mesh(...)), got "
            f"{type(mesh).__name__} {mesh!r:.80}: {order}"
        )


def init_state(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: Any,
    param_specs: Any = None,
) -> Any:
    """:func:`sharded_init` without the comparison across processes: for callers that build
    the same ``tx`` on every process themselves (``jc.autotune``, whose candidate stages must
    run no collective a failed process would not enter)."""
    program, operands = init_program(tx, params, mesh, axis_name, param_specs)
    with whole_leaf_in_step.quiet():  # manual over Auto axes too: read from the specs
        state = program(*operands)
    if param_specs is None:
        return state
    state, differs = state
    optax_leaf_specs.check_agreed(differs, state, is_sharded_state)
    return state


def init_program(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: Any,
    param_specs: Any = None,
) -> tuple:
    """``(program, operands)``: :func:`init_state` is ``program(*operands)``, a jitted
    ``shard_map`` of ``tx.init`` over ``mesh`` and the params placed on it, with no
    zero-element array among the operands (:func:`without_empty`). With ``param_specs``
    the program returns ``(state, differs)``: the flags of
    :func:`jaxcomp._src.optax_leaf_specs.agreed`, which :func:`init_state` checks."""
    names = _names(axis_name)
    check_mesh_axes(mesh, axis_name, "axis_name")
    if param_specs is None:
        abstract = abstract_init(tx, params, mesh, axis_name)
        manual = specs_of_state(abstract, axis_name)
        placed = jax.device_put(params, NamedSharding(mesh, P()))
        fill, operands = without_empty(tx.init, (placed,))
        if set(mesh.axis_names) - set(names):
            init = jax.shard_map(
                fill, mesh=mesh, in_specs=P(), out_specs=manual, axis_names=set(names)
            )
        else:
            init = jax.shard_map(fill, mesh=mesh, in_specs=P(), out_specs=manual)
        return jax.jit(init), operands
    treedef, specs, shapes = _param_context(param_specs, params, mesh)
    spec_tree = jax.tree.unflatten(treedef, specs)
    blocks = jax.tree.unflatten(
        treedef,
        [
            x if _is_none(x) else jax.ShapeDtypeStruct(sh[1], jnp.result_type(x))
            for sh, x in zip(shapes, jax.tree.leaves(params, is_leaf=_is_none), strict=True)
        ],
    )
    abstract = abstract_init(tx, blocks, mesh, axis_name)
    full = specs_of_state(abstract, axis_name, param_specs, params, mesh)
    whole = abstract_init(tx, _abstract(params), mesh, axis_name)
    full = optax_leaf_specs.refine(
        full, abstract, whole, (treedef, specs, shapes), is_sharded_state
    )
    placed = jax.tree.map(
        lambda p, x: x if _is_none(x) else jax.device_put(x, NamedSharding(mesh, p)),
        spec_tree,
        params,
        is_leaf=_is_spec,
    )
    fill, operands = without_empty(tx.init, (placed,))

    def agreeing(*given: Any) -> tuple:  # replicated optax arrays: one value, checked
        return optax_leaf_specs.agreed(fill(*given), full, is_sharded_state)

    init = jax.shard_map(agreeing, mesh=mesh, in_specs=(spec_tree,), out_specs=(full, P()))
    return jax.jit(init), operands


def _abstract(params: Any) -> Any:
    """``params`` as ``jax.ShapeDtypeStruct`` of their global shapes (None slots kept)."""
    return jax.tree.map(
        lambda x: x if _is_none(x) else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
        params,
        is_leaf=_is_none,
    )


def _is_empty(x: Any) -> bool:
    """An array (or ``jax.ShapeDtypeStruct``) with no elements: a zero-length axis."""
    return not _is_none(x) and 0 in tuple(getattr(x, "shape", ()))


def drop_empty(tree: Any) -> Any:
    """``tree`` with its zero-element arrays set to None: the operands of a ``shard_map``
    program built by :func:`without_empty`."""
    return jax.tree.map(lambda x: None if _is_empty(x) else x, tree, is_leaf=_is_none)


def _zeros_like_block(x: Any) -> Any:
    """Zeros of the block of ``x`` (an empty array laid out by a ``NamedSharding``) that one
    device holds inside a ``shard_map`` manual over the axes its spec names, varying over
    them as that operand would."""
    # a traced array (jc.sharded_init under jax.eval_shape) carries its sharding in its type
    sharding = jax.typeof(x).sharding if isinstance(x, jax.core.Tracer) else x.sharding
    zeros = jnp.zeros(sharding.shard_shape(x.shape), x.dtype)
    axes = _axes_of(sharding.spec)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def without_empty(fn: Any, args: tuple) -> tuple:
    """``(fill, operands)``: inside a ``shard_map`` (manual over the axes the leaves'
    shardings name), ``fill(*operands)`` is ``fn(*args)`` with no zero-element array among
    the operands.

    ``operands`` is :func:`drop_empty` of ``args`` (arrays or ``jax.ShapeDtypeStruct`` with a
    ``NamedSharding``); ``fill`` puts back, inside the program, zeros of each empty leaf's
    per-device block and dtype. An array with no elements has no values, so ``fn`` sees the
    same arrays. Why: XLA:CPU in jaxlib 0.11.2 segfaults compiling a ``shard_map`` that takes
    a zero-element operand beside another one and reads it
    (``shard_map(lambda a, b: (a + 1, b + 1))(zeros((0,)), zeros((1,)))`` on 2 devices); a
    zero-element array made inside the program compiles (docs/errors.md).
    """
    leaves, treedef = jax.tree.flatten(args, is_leaf=_is_none)
    empty = [x if _is_empty(x) else None for x in leaves]
    if all(e is None for e in empty):
        return fn, args

    def fill(*operands: Any) -> Any:
        given = treedef.flatten_up_to(operands)
        full = [x if e is None else _zeros_like_block(e) for x, e in zip(given, empty, strict=True)]
        return fn(*jax.tree.unflatten(treedef, full))

    return fill, drop_empty(args)


def fingerprint(x: Any) -> np.ndarray:
    """``uint32[2]``: the first 8 bytes of the SHA-256 of ``x``'s dtype, shape and bits (a
    PRNG key: its key data), read on the host."""
    if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    digest = hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).digest()
    return np.frombuffer(digest[:8], np.uint32).copy()


def _checked(x: Any) -> bool:
    """The leaves compared across processes: fully replicated arrays of integers, bools or
    PRNG keys (keys and step counts: a few words each, read on the host without compiling
    anything). Float leaves (moments, anchors) are not read: a per-process ``seed`` shows
    in the key it seeds, which every jaxcomp state that draws from it keeps."""
    return (
        isinstance(x, jax.Array)
        and x.size > 0
        and x.sharding.is_fully_replicated
        and not jnp.issubdtype(x.dtype, jnp.floating)
        and not jnp.issubdtype(x.dtype, jnp.complexfloating)
    )


def _held_fingerprint(x: jax.Array) -> np.ndarray:
    """``uint32[3]``: :func:`fingerprint` of this process's copy of ``x`` and 1, or zeros
    where this process holds no copy (a mesh without its devices)."""
    if not x.addressable_shards:
        return np.zeros(3, np.uint32)
    return np.append(fingerprint(x.addressable_data(0)), np.uint32(1))


def _gather_fingerprints(local: Any) -> Any:
    """``[processes, leaves, 3]``: every process's fingerprints (one small host all-gather;
    ``local[None]`` in a single process)."""
    if jax.process_count() == 1:
        return local[None]
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(local)


def check_same_on_every_process(state: Any, gather: Any = None) -> None:
    """Refuse a state whose replicated leaves differ between processes (multi-process only).

    A replicated leaf of the state (a PRNG key, a step count) is one value on every device;
    ``tx.init`` makes it inside the program from its closure, so a transform built with a
    per-process argument (``seed=jax.process_index()``) gives each process its own value under
    a replicated sharding, unchecked by jax: random-k's indices then differ between processes
    and the replicas drift apart silently (docs/multihost.md). Each process fingerprints its
    copy of every fully replicated integer, bool or key leaf on the host (:func:`fingerprint`,
    :func:`_checked`) and one host all-gather of those compares them.

    ``gather`` stands in for the all-gather (``local -> [processes, leaves, 3]``: fingerprint,
    held) in tests; a process that holds no copy of a leaf is left out of its comparison.

    Raises:
      ValueError: naming the leaves that differ and the likely cause.
    """
    if gather is None:
        if jax.process_count() == 1:
            return
        gather = _gather_fingerprints
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    leaves = [(path, x) for path, x in flat if _checked(x)]
    if not leaves:
        return
    local = np.stack([_held_fingerprint(x) for _, x in leaves])
    every = np.asarray(gather(local))
    differ = [
        jax.tree_util.keystr(path)
        for j, (path, _) in enumerate(leaves)
        if len({tuple(f[:2]) for f in every[:, j] if f[2]}) > 1
    ]
    if differ:
        raise ValueError(
            f"the state's replicated leaves at {differ[:5]}{' ...' if len(differ) > 5 else ''} "
            f"differ between the {len(every)} processes: the transform was built with "
            "different arguments on different processes (e.g. `seed`=jax.process_index(): the "
            "PRNG key each process would draw its own random-k indices or sparseloco masks from, "
            "so the replicas would drift apart silently). Build the same transform on every "
            "process: the same `seed`, learning rate and options."
        )


def replicate(tree: Any, num_devices: int | None = None) -> Any:
    """Stack ``tree`` ``num_devices`` times along a new leading axis (the ``pmap`` layout).

    Args:
      tree: a pytree of arrays.
      num_devices: the copies, an int >= 1; default ``jax.local_device_count()``.

    Raises:
      ValueError: ``num_devices`` below 1 (0 gave empty stacks, with no device's copy).
    """
    if num_devices is not None and not num_devices >= 1:
        raise ValueError(f"`num_devices` must be >= 1, got {num_devices!r}")
    n = jax.local_device_count() if num_devices is None else num_devices
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), tree)
