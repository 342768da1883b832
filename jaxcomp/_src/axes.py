"""Mesh axis arguments: flattening them, and the checks that name a bad one.

Every public factory that takes an ``axis_name`` checks it here at construction (None, an
empty tuple, a non-str), and the functions that take a mesh check that the mesh has it, so
a misspelt or missing axis is a ValueError naming the argument, never jax's bare
``KeyError`` or "unbound axis name: None" deep inside a trace.
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which ``x`` may differ between devices: jax's
    varying-manual-axes type (``jax.typeof(x).vma``), empty where jax does not track it."""
    aval = jax.typeof(x)  # also reads a ShapeDtypeStruct (e.g. from jax.eval_shape)
    vma = getattr(aval, "vma", None)
    for kind in ("manual_axis_type", "mat"):  # the names of jax 0.10+
        if vma is None:
            vma = getattr(getattr(aval, kind, None), "varying", None)
    return frozenset(vma or ())


def tracks_variance(axis_name: Any) -> bool:
    """True inside ``jax.shard_map(..., check_vma=True)`` over every axis of ``axis_name``:
    there a value's type says whether it differs per device. ``pmap``, ``vmap`` and
    ``check_vma=False`` do not track it (``axis_index`` is then typed invariant)."""
    return all(a in varying_axes(jax.lax.axis_index(a)) for a in axis_names(axis_name))


def manual_axes() -> frozenset:
    """The mesh axes that are manual where this is traced (inside ``jax.shard_map`` or
    ``jax.pmap``). An axis bound by ``jax.vmap(..., axis_name=...)`` (devices emulated on one)
    is not one: jax tracks no varying types there and refuses ``jax.lax.pcast`` and
    ``all_gather(..., to="invarying")`` ("pvary should be called under jax.shard_map"),
    type annotations that move no data, so jaxcomp leaves them out for such axes."""
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def split_over(x: Any, excluded: Any) -> tuple:
    """The manual axes of size > 1, not in ``excluded``, that ``x`` is typed as differing
    over (sorted): where each device holds a block or a value of its own."""
    found = varying_axes(x) - set(excluded)
    manual = manual_axes()
    return tuple(sorted(a for a in found if a in manual and int(jax.lax.axis_size(a)) > 1))


def check_not_mixed(axis_name: Any, name: str = "axis_name") -> None:
    """Refuse a tuple ``axis_name`` that mixes axes bound by ``jax.vmap(..., axis_name=...)``
    with manual ``jax.shard_map`` axes under ``check_vma=True`` (trace time).

    jax reduces over no such tuple there: ``jax.lax.psum`` raises its own ValueError about
    varying types, and ``jax.lax.all_gather`` (jaxcomp's ``allgather`` and ``two_phase``)
    failed with a bare AssertionError and no message. With ``check_vma=False`` (or ``pmap``
    inside ``vmap``) the same tuple works, and jaxcomp gives the numbers of a 2-D mesh.
    """
    names = axis_names(axis_name)
    manual = [a for a in names if a in manual_axes()]
    batched = [a for a in names if a not in manual_axes()]
    if manual and batched and tracks_variance(tuple(manual)):
        raise ValueError(
            f"`{name}` {axis_name!r} mixes axes bound by jax.vmap ({batched}) with manual axes "
            f"of jax.shard_map ({manual}) under check_vma=True, where jax cannot reduce over "
            "both at once (jax.lax.psum refuses it too): pass check_vma=False to "
            "jax.shard_map, or reduce over each kind of axis in its own call"
        )


def gather_to(axis_name: Any) -> str:
    """``to=`` of an ``all_gather`` over ``axis_name`` whose result every device holds the
    same: ``"invarying"`` over manual mesh axes, ``"varying"`` (jax's default, the same
    values) where ``jax.vmap`` binds the axis (:func:`manual_axes`)."""
    return "invarying" if set(axis_names(axis_name)) <= manual_axes() else "varying"


def axis_names(*axes: Any) -> tuple:
    """Flatten axis names (a name, a tuple of names, or None) into one tuple."""
    out: tuple = ()
    for a in axes:
        if a is None:
            continue
        out += tuple(a) if isinstance(a, tuple | list) else (a,)
    return out


def check_axis_name(axis_name: Any, name: str = "axis_name") -> Any:
    """Construction-time check of a mesh axis argument: a name (str) or a tuple of names.

    ``None`` would reduce over no axis at all (``jax.lax.psum(x, ())`` is ``x``): refused with
    a ValueError, as is an empty tuple; any other type with a TypeError naming ``name``.
    """
    if axis_name is None or (isinstance(axis_name, tuple | list) and not axis_name):
        raise ValueError(
            f"`{name}` is required: a mesh axis name such as 'data' (the name given to "
            f"jax.make_mesh and bound by jax.shard_map or jax.pmap), got {axis_name!r}"
        )
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    if not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"`{name}` must be a mesh axis name (a str such as 'data') or a tuple of them, "
            f"got {type(axis_name).__name__} {axis_name!r}"
        )
    return axis_name


def check_mesh_axis(mesh: Any, axis_name: Any, name: str = "axis_name") -> Any:
    """``axis_name`` must name axes of ``mesh`` (a ValueError listing the mesh's axes if not)."""
    check_axis_name(axis_name, name)
    missing = [a for a in axis_names(axis_name) if a not in tuple(mesh.axis_names)]
    if missing:
        raise ValueError(
            f"`{name}` {axis_name!r} is not an axis of the mesh: {missing} missing from its "
            f"axes {tuple(mesh.axis_names)}; pass one of those (the data-parallel axis)"
        )
    return axis_name


def check_axes(axis_name: Any, inner_axis_name: Any = None) -> None:
    """Construction-time check of a transform's ``axis_name`` and optional ``inner_axis_name``."""
    check_axis_name(axis_name)
    if inner_axis_name is not None:
        check_axis_name(inner_axis_name, "inner_axis_name")
