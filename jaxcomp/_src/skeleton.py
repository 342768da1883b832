"""What every transform shares: checks, per-leaf state, poison-and-freeze.

A jaxcomp transform (``compressed_allreduce``, ``dgc``, ``powersgd``, and every later one) is
an optax ``GradientTransformationExtraArgs`` whose update:

1. checks the gradient tree against the params and the mesh axes (:func:`begin`);
2. groups the leaves (compressed / plain / passthrough, :mod:`jaxcomp._src.layout`);
3. checks its state fields against the leaves (:func:`check_state`);
4. reads each compressed leaf and its memories once, sends, writes the memories once;
5. keeps the old state where the step was not finite (:func:`freeze`) and returns a NaN
   output, so ``optax.apply_if_finite`` skips the step and nothing is lost.

Per-device state (error-feedback memories) is a pytree mirroring the gradient tree, None at
leaves it does not cover; each array has a leading axis of 1 (this device's slot), so that
under ``shard_map`` the global array is ``(n, *leaf.shape)`` with spec
``P(axis_name, *param_spec)`` and under ``pmap`` it stacks like any other state leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp._src import collectives, finite, server
from jaxcomp._src import layout as layouts


def begin(name: str, updates: Any, params: Any, axis_name: Any, inner_axis_name: Any = None) -> int:
    """Trace-time checks every update does first; returns the size of ``axis_name``."""
    finite.refuse_optax_skip(name)
    layouts.check_like_params(updates, params, name)
    n = collectives.axis_size(axis_name)
    collectives.check_inner_axis(axis_name, inner_axis_name)
    return n


def zeros_like_compressed(layout: layouts.Layout, shape_fn: Callable | None = None) -> Any:
    """Per-device float32 zeros for every compressed leaf, None elsewhere.

    ``shape_fn(leaf_shape) -> shape`` (default: ``(1, *leaf_shape)``, a per-device memory);
    a leaf whose ``shape_fn`` returns None gets None.
    """
    shape_fn = shape_fn or (lambda s: (1, *s))
    shapes = [
        shape_fn(s) for s, g in zip(layout.shapes, layout.groups, strict=True) if g == "compressed"
    ]
    return layouts.like_compressed(
        layout, [None if s is None else jnp.zeros(s, jnp.float32) for s in shapes]
    )


def zeros_like_floats(layout: layouts.Layout) -> Any:
    """Per-device float32 zeros ``(1, *shape)`` for every floating leaf (compressed or plain)."""
    zeros = [
        jnp.zeros((1, *s), jnp.float32)
        for s, g in zip(layout.shapes, layout.groups, strict=True)
        if g != layouts.PASSTHROUGH
    ]
    return layouts.like_floats(layout, *layouts.split_floats(layout, zeros))


def like_state(layout: layouts.Layout, vectors: list[jax.Array], per_device: bool = True) -> Any:
    """Per-leaf vectors (one per compressed leaf) as a state field: each reshaped to its
    leaf's shape, with the leading device slot where ``per_device``."""
    shapes = [s for s, g in zip(layout.shapes, layout.groups, strict=True) if g == "compressed"]
    lead = (1,) if per_device else ()
    return layouts.like_compressed(
        layout, [v.reshape(*lead, *s) for v, s in zip(vectors, shapes, strict=True)]
    )


def vectors(field: Any) -> list[jax.Array]:
    """The arrays of a per-leaf state field as float32 vectors (None leaves skipped)."""
    return [jnp.ravel(a) for a in layouts.field_leaves(field)]


def check_fields(name: str, state: Any, expected: dict[str, Any]) -> None:
    """Raise a clear error if a state field does not have the expected structure and shapes.

    ``expected`` maps a field name to a tree of ``jax.ShapeDtypeStruct`` (or None) built for
    the current gradients, e.g. ``jax.eval_shape`` of the init.
    """
    for field, want in expected.items():
        got = getattr(state, field)
        got_s = jax.tree.map(lambda a: tuple(jnp.shape(a)), got)
        want_s = jax.tree.map(lambda a: tuple(a.shape), want)
        if jax.tree.structure(got_s) == jax.tree.structure(want_s) and got_s == want_s:
            continue
        raise ValueError(
            f"{name} state field `{field}` has shapes {_short(got_s)} but these gradients need "
            f"{_short(want_s)}. Was the state initialized for other params, or split wrongly "
            "over devices? Under shard_map, initialize with jc.sharded_init(tx, params, mesh, "
            "axis_name) and use jc.state_specs(state, axis_name) as its specs; under pmap, "
            "build it with jax.pmap(tx.init, axis_name=...) or give every state leaf a "
            "leading device axis (jc.replicate)."
        )


def check_state(
    name: str, state: Any, fields: Callable[[], dict], layout: layouts.Layout, flat: bool = False
) -> None:
    """:func:`check_fields` against ``fields()`` (the init's fields for these gradients,
    traced abstractly); a server residual built outside the mesh (room for whole vectors,
    see :mod:`jaxcomp._src.server`) is accepted as it is."""
    expected = jax.eval_shape(fields)
    if "server_residual" in expected and server.is_whole(state.server_residual, layout, flat):
        expected["server_residual"] = state.server_residual
    check_fields(name, state, expected)


def _short(tree: Any) -> str:
    text = str(tree)
    return text if len(text) < 300 else text[:300] + "..."


def freeze(bad: jax.Array, old: Any, new: Any) -> Any:
    """``new``, or ``old`` where the step was not finite: nothing in memory is corrupted.

    Fused by XLA into the pass that writes each new memory leaf (a select, no extra pass).
    """
    return jax.tree.map(lambda o, n: jnp.where(bad, o, n), old, new)


def plain_means(
    leaves: list[jax.Array], axis_name: Any, bucket_bytes: int
) -> tuple[list[jax.Array], Any]:
    """The plain (uncompressed) leaves averaged with float32 ``pmean`` (bucketed), and the
    non-finite flag of those means: identical on every device (None if there are none)."""
    means, held = collectives.plain_mean(leaves, axis_name, bucket_bytes, with_buckets=True)
    return means, (collectives.local_nonfinite(held) if means else None)
