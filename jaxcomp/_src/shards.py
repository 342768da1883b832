"""Params sharded over other mesh axes: each device compresses its own shard.

In a data x model mesh (``jax.shard_map(..., axis_names={"data"})``, params sharded over a
``"model"`` axis) a gradient leaf of ``f32[1024, 4096]`` sharded ``P(None, "model")`` is, on
each device, a ``1024 x 2048`` block. Flattening the whole leaf into the codec's 1-D vector
would move the blocks between devices (an f32 all-to-all or all-gather over ``"model"`` of
every gradient, and of every memory). Instead a transform's update runs inside a nested
``jax.shard_map`` over the axes that shard the params (given as the transform's
``param_specs``): each device encodes its own block, exchanges payloads over the data axis
only, and keeps its memories sharded like the params. Scales and selections are then per
block, and the bytes per device are those of a block's payload. The non-finite flag is
shared over those axes (one scalar psum), so a NaN in any block poisons the whole step and
freezes every block's memory.

The model axis must be ``AxisType.Auto``. With an ``Explicit`` one, the step's own
``jax.shard_map(..., axis_names={"data"})`` gathers every operand sharded over it at its
boundary, whatever the body does (jax 0.10: a step that only adds 1 to a model-sharded
array sends 2.5 MB per device): on a 4 x 2 mesh the compressed step sent 5.6 MB per device
against 0.10 MB with the params replicated, so it is refused (:func:`check_model_axes`).
Made Auto for the step (``jax.sharding.auto_axes(step, axes="model", out_sharding=...)``)
an Explicit axis costs nothing: the same 0.059 MB as an Auto mesh.
Without ``param_specs`` on a mesh with an Auto axis beside the data axis, the leaves may be
sharded over it where the transform cannot see it (Auto shardings are not in the types): the
compiler then gathers them in float32 (``tests/test_mesh.py``'s 4 x 2 step: 1.24 MB per device
against 0.059 MB with ``param_specs``), so :func:`warn_unseen_axes` warns.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxcomp._src import sharding
from jaxcomp._src.axes import (
    axis_names,
    check_axis_name,
    manual_axes,
    tracks_variance,
    varying_axes,
)

_AXES: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxcomp_shard_axes", default=())
#: The ``shard_axis`` of the transform whose update is being traced (:func:`with_shard_axis`).
_SHARD_AXIS: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxcomp_shard_axis", default=None
)


def _axes_of_type(kind: AxisType) -> frozenset:
    """The axes of the enclosing mesh of type ``kind`` (size > 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return frozenset()
    return frozenset(
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == kind and mesh.shape[a] > 1
    )


def check_model_axes(axes: set) -> None:
    """Refuse params sharded over an ``Explicit`` mesh axis (see the module docstring)."""
    explicit = sorted(set(axes) & _axes_of_type(AxisType.Explicit))
    if explicit:
        raise ValueError(
            f"`param_specs`: the params are sharded over the Explicit mesh axis {explicit}. "
            "A jax.shard_map manual over the data axis only gathers every operand sharded "
            "over an Explicit axis in float32 at its boundary, so each gradient, param and "
            "memory would cross that axis (more bytes than replicated params). Make it "
            "AxisType.Auto, jax.make_mesh(..., axis_types=(AxisType.Explicit, "
            "AxisType.Auto)), or keep it Explicit and make it Auto for the step: "
            f"jax.jit(jax.sharding.auto_axes(jax.shard_map(step, ...), axes={explicit!r}, "
            "out_sharding=...)) under jax.set_mesh(mesh); either way pass param_specs= to "
            "the transform and to jc.sharded_init."
        )


def warn_unseen_axes(data_axes: tuple) -> None:
    """Warn where an Auto mesh axis beside the data axis may shard leaves unseen."""
    unseen = sorted(_axes_of_type(AxisType.Auto) - set(data_axes))
    if unseen:
        warnings.warn(
            f"jaxcomp: the mesh has the Auto axis {unseen} beside the data axis and the "
            "transform has no `param_specs`: leaves sharded over it are compressed whole, "
            "and the compiler gathers them in float32 first (21x the bytes of the step "
            "with param_specs on a 4 x 2 mesh). Pass param_specs= (the params' "
            "PartitionSpecs; P() for replicated leaves) to the transform and jc.sharded_init.",
            stacklevel=4,
        )


def _spec(x: Any) -> P:
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec if isinstance(spec, P) else P()


def _without(spec: P, axes: set) -> P:
    """``spec`` with the mesh axes ``axes`` removed (their dimensions unsharded)."""
    out = []
    for entry in spec:
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in names if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*out)


def _named(spec: P) -> set:
    out = set()
    for entry in spec:
        if entry is None:
            continue
        out |= set(entry) if isinstance(entry, tuple) else {entry}
    return out


def _given_specs(param_specs: Any, updates: Any, state: Any, params: Any) -> tuple:
    sharding.check_param_specs(param_specs, updates)
    specs = jax.tree.map(
        sharding.spec_of,
        param_specs,
        is_leaf=lambda x: isinstance(x, P | jax.sharding.Sharding),
    )
    return (
        specs,
        sharding.block_specs(state, param_specs, updates),
        None if params is None else specs,
    )


def over_shards(update: Callable, param_specs: Any = None, data_axes: tuple = ()) -> Callable:
    """``update(updates, state, params=None, **extra)`` run per block of the mesh axes that
    shard the params: ``param_specs`` (a tree like the params of ``PartitionSpec`` or
    ``NamedSharding``, over ``AxisType.Auto`` axes). ``data_axes`` (the transform's own axes)
    never count. Nothing changes where no param is sharded; params sharded over an Explicit
    axis (in ``param_specs`` or in the inputs' types) are refused."""

    @functools.wraps(update)
    def wrapped(updates, state, params=None, **extra_args):
        args = (updates, state, params)
        if param_specs is not None:
            specs = _given_specs(param_specs, updates, state, params)
            axes = set().union(*(_named(s) for s in jax.tree.leaves(specs[0])), set())
            axes -= set(data_axes)
        else:
            warn_unseen_axes(data_axes)
            specs = jax.tree.map(lambda x: _without(_spec(x), set(data_axes)), args)
            axes = set().union(*(_named(s) for s in jax.tree.leaves(specs)), set())
        check_model_axes(axes)
        if not axes:
            return update(updates, state, params, **extra_args)

        def body(updates, state, params):
            token = _AXES.set(_AXES.get() + tuple(sorted(axes)))
            try:
                return update(updates, state, params, **extra_args)
            finally:
                _AXES.reset(token)

        return jax.shard_map(
            body,
            in_specs=specs,
            out_specs=(specs[0], specs[1]),
            axis_names=set(axes),
            # Leaves replicated over these axes share buckets with sharded ones: their
            # values are identical on every block, their types say "varying".
            check_vma=False,
        )(*args)

    return wrapped


def any_block(flag: jax.Array) -> jax.Array:
    """``flag`` or-ed over the blocks of :func:`over_shards` (itself outside of it) and over
    the shards of :func:`any_shard`."""
    axes = _AXES.get()
    if axes:
        flag = jax.lax.psum(flag.astype(jnp.int32), axes) > 0
    return any_shard(flag)


def any_shard(flag: jax.Array, keep: tuple = (), shard_axis: Any = None) -> jax.Array:
    """``flag`` or-ed over the manual mesh axes it still differs on, ``keep`` excepted.

    A step's non-finite flag, or-ed over the transform's own axis, still differs per device
    where the leaves are shards of one model over another manual axis (FSDP over ``"data"``
    inside a replica of ``jc.diloco(..., "replica")``, params ``P("replica", "data")``): a
    non-finite shard must freeze every shard's state, as one model's (and ``lax.cond``'s
    branches must agree on the flag's type). One scalar ``psum``; none where the flag is the
    same everywhere already. Where jax does not type it (``pmap``, ``check_vma=False``) the
    axes are those the user names as ``shard_axis`` (the transforms' argument: given here, or
    that of the update being traced, :func:`with_shard_axis`), or none.
    """
    extra = shard_axes(flag, keep, shard_axis)
    if not extra:
        return flag
    return jax.lax.psum(flag.astype(jnp.int32), extra) > 0


def shard_axes(x: jax.Array, keep: Any = (), shard_axis: Any = None) -> tuple:
    """The manual mesh axes over which ``x`` still differs as a shard of one model, ``keep``
    excepted: those jax types it as varying over, and where jax does not type it, those of
    ``shard_axis`` (given here, or that of the update being traced). What :func:`any_shard`
    ors a flag over; a per-leaf statistic of the whole model (a mean over its shards) is
    reduced over them too."""
    extra = set(varying_axes(x))
    if shard_axis is None:
        shard_axis = _SHARD_AXIS.get()
    if shard_axis and not tracks_variance(shard_axis):
        extra |= set(axis_names(shard_axis))
    return tuple(sorted(extra - set(axis_names(keep)), key=str))


def check_shard_axis(shard_axis: Any) -> Any:
    """Construction-time check of a transform's ``shard_axis``: None, ``()`` (the params are
    whole: no shard axis) or a mesh axis name (a str) or a tuple of them."""
    if shard_axis is None or (isinstance(shard_axis, tuple) and not shard_axis):
        return shard_axis
    return check_axis_name(shard_axis, "shard_axis")


def check_shard_axis_bound(name: str, axis_name: Any, shard_axis: Any) -> None:
    """Trace-time check of a transform's ``shard_axis``: every axis bound here (a misspelt
    one was jax's bare "unbound axis name" from inside the update) and none of them the
    transform's own (``axis_name``, ``inner_axis_name``: the replicas exchange over it; they
    are not shards of one model there), else a ValueError naming ``shard_axis``."""
    names = axis_names(shard_axis)
    unbound = [a for a in names if not _is_bound(a)]
    if unbound:
        raise ValueError(
            f"{name}: `shard_axis` {shard_axis!r} is not bound here ({unbound[0]!r}): name "
            "the manual mesh axis of the jax.shard_map the update runs in over which the "
            "params are shards of one model (FSDP inside each replica), or () for whole params"
        )
    shared = sorted(set(names) & set(axis_names(axis_name)), key=str)
    if shared:
        raise ValueError(
            f"{name}: `shard_axis` {shard_axis!r} holds the transform's own axis "
            f"{shared[0]!r}: the replicas exchange over it; name the axis the params are "
            "shards of one model over (FSDP inside each replica), or () for whole params"
        )


def _is_bound(axis: Any) -> bool:
    """Whether the mesh axis ``axis`` is bound where this is traced."""
    try:
        jax.lax.axis_size(axis)
    except NameError:
        return False
    return True


def warn_untyped_shards(name: str, axis_name: Any, shard_axis: Any) -> None:
    """Warn, while tracing, where FSDP shards inside the replicas cannot be told from whole
    params and ``shard_axis`` is not given: jax types no variance (``check_vma=False``) and
    another manual axis of size > 1 is bound beside ``axis_name``. Shards would then flag a
    non-finite value on their own devices only: that shard's sync skipped, the others' run,
    the model's shards apart with no error. The model axes of :func:`over_shards`'
    ``param_specs`` blocks are not such axes (:func:`any_block` ors the flags over them)."""
    own = set(axis_names(axis_name))
    # the model axes of over_shards' blocks are known: any_block ors the flags over them
    bound = manual_axes() - set(_AXES.get())
    if shard_axis is not None or not own <= bound or tracks_variance(axis_name):
        return  # an unbound axis is the transform's own check to name
    if isinstance(axis_name, tuple) and len(axis_name) == 1:
        axis_name = axis_name[0]
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    others = sorted(a for a in bound - own if shape.get(a, 1) > 1)
    if others:
        warnings.warn(
            f"jaxcomp: {name} over {axis_name!r} with the manual axes {others} bound beside "
            "it, where jax does not type which values differ per device (check_vma=False, "
            "pmap): if the params are FSDP shards over them, pass shard_axis="
            f"{others[0] if len(others) == 1 else tuple(others)!r} so that a non-finite shard "
            "skips the sync of every shard (without it only that shard's devices skip it and "
            "the model's shards go apart); if they are whole on every device there (data "
            "parallel inside), pass shard_axis=() to say so.",
            stacklevel=5,
        )


def check_traced(name: str, own_axes: Any, shard_axis: Any) -> None:
    """The trace-time checks of a transform's ``shard_axis``: :func:`check_shard_axis_bound`,
    then :func:`warn_untyped_shards`, over ``own_axes`` (the transform's axes)."""
    check_shard_axis_bound(name, own_axes, shard_axis)
    warn_untyped_shards(name, own_axes, shard_axis)


def with_shard_axis(update: Callable, name: str, own_axes: tuple, shard_axis: Any) -> Callable:
    """``update`` traced with ``shard_axis`` in force for :func:`any_shard` (the flags of
    every collective inside are or-ed over it where jax types no variance), after
    :func:`check_traced` of ``own_axes`` (the transform's axes, inner axis included)."""

    @functools.wraps(update)
    def wrapped(updates, state, params=None, **extra_args):
        check_traced(name, own_axes, shard_axis)
        token = _SHARD_AXIS.set(shard_axis)
        try:
            return update(updates, state, params, **extra_args)
        finally:
            _SHARD_AXIS.reset(token)

    return wrapped
