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

from jaxcomp._src import collectives, finite, multisteps, server
from jaxcomp._src import layout as layouts
from jaxcomp._src.axes import (  # noqa: F401  (tracks_variance, varying_axes: re-exported)
    manual_axes,
    tracks_variance,
    varying_axes,
)


def begin(name: str, updates: Any, params: Any, axis_name: Any, inner_axis_name: Any = None) -> int:
    """Trace-time checks every update does first; returns the size of ``axis_name``."""
    finite.refuse_optax_skip(name, axis_name)
    multisteps.warn_inside(name)
    layouts.check_like_params(updates, params, name)
    n = collectives.axis_size(axis_name)
    collectives.check_inner_axis(axis_name, inner_axis_name)
    check_varying_gradients(name, updates, axis_name)
    check_real(name, updates)
    return n


def check_real(name: str, updates: Any) -> None:
    """Refuse complex gradient leaves: every exchange averages real floating leaves only, so
    a complex one would pass through unaveraged (each device applying its own gradient, the
    replicas drifting apart with no error)."""
    paths = jax.tree_util.tree_leaves_with_path(updates)
    bad = [
        jax.tree_util.keystr(p) or "<root>"
        for p, x in paths
        if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating)
    ]
    if bad:
        raise TypeError(
            f"{name}: the gradients (`updates`) at {_short(bad)} are complex: jaxcomp "
            "transforms handle real floating leaves only, and a complex leaf would pass through "
            "untouched (unaveraged: each device keeping its own gradient). Hold the param as "
            "two real leaves (its real and imaginary parts), or leave it out of this transform "
            "(optax.masked / optax.multi_transform) and average its gradient with "
            "jax.lax.pmean."
        )


def check_floating(name: str, updates: Any) -> None:
    """Refuse gradient leaves that are not floating (integer, bool, or ``float0``: what
    ``jax.grad(..., allow_int=True)`` gives for an integer param) in an optimizer recipe,
    whose update is the step added to the params.

    The exchange transforms (``compressed_allreduce``, ``dgc``, ``powersgd``, ``delayed``)
    pass such leaves through untouched, as optax transforms do; a recipe also keeps Adam's
    moments or scales by the learning rate, which a ``float0`` cannot take (optax refuses it
    too: "Called multiply with a float0 array") and which would move an integer param by
    its integer "gradient"."""
    paths = jax.tree_util.tree_leaves_with_path(updates)
    bad = [
        f"{jax.tree_util.keystr(p) or '<root>'}: {_dtype_name(x)}"
        for p, x in paths
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    if bad:
        raise TypeError(
            f"{name}: the gradients (`updates`) at {_short(', '.join(bad))} are not floating: an "
            "integer param (a step counter, an index table) has no gradient to step by "
            "(jax.grad(..., allow_int=True) gives it float0, which optax.apply_updates "
            "refuses too). Keep integer leaves out of the tree this optimizer updates: take "
            "the gradient of the floating params only and update those, the integers held "
            "beside them (Flax NNX: nnx.Optimizer(model, tx, wrt=nnx.Param) or "
            "jc.nnx_optimizer, whose default wrt is nnx.Param). The exchange transforms "
            "(jc.compressed_allreduce, jc.dgc, jc.powersgd) pass integer leaves through."
        )


def _dtype_name(x: Any) -> str:
    dtype = jnp.result_type(x)
    return "float0" if dtype == jax.dtypes.float0 else str(dtype)


# --------------------------------------------------------------------------- varying axes (vma)


def varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` typed as varying over the manual axes ``like`` varies over (``jax.lax.pcast``
    of the missing ones), e.g. so that the branches of a ``cond`` agree."""
    return varying_over(x, varying_axes(like))


def varying_over(x: jax.Array, axes: Any) -> jax.Array:
    """``x`` typed as varying over the manual mesh ``axes`` too (``jax.lax.pcast`` of the
    ones it does not vary over yet)."""
    missing = tuple(sorted((frozenset(axes) & manual_axes()) - varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def tree_pmean(tree: Any, axis_name: Any) -> Any:
    r"""``jax.lax.pmean(tree, axis_name)`` in each leaf's dtype, its empty leaves left out of
    the collective: an empty leaf is its own mean, ``x_i = x = []``.

    XLA:CPU (jaxlib 0.11) crashes compiling a program whose all-reduces include a
    zero-element one, and a tree of params or gradients may hold an empty leaf. The empty
    mean is typed as ``pmean`` types it: varying over the leaf's other manual axes only.

    Args:
      tree: a pytree of arrays (each device's values).
      axis_name: the mesh axis, or a tuple of axes, to average over.

    Returns:
      The tree of means, ``mean_i x_i`` per leaf.

    Example::

      mean = skeleton.tree_pmean({"w": w, "empty": jnp.zeros((0, 4))}, "data")
    """
    return _non_empty(_pmean_divided_first, tree, axis_name)


def _pmean_divided_first(leaves: list, axis_name: Any) -> list:
    """``jax.lax.pmean`` of ``leaves``, floating (and complex) ones divided by ``n`` before
    the sum: ``jax.lax.pmean`` sums first, so ``n`` finite values near float32's largest gave
    an inf mean where the mean fits (``jc.local_sgd`` / ``jc.diloco``'s plain sync made every
    replica NaN until 2026-11-27). For ``n`` a power of two the same bits (the division is
    exact, the adds the same). Integer leaves keep ``jax.lax.pmean``'s own division."""
    if not leaves:
        return []
    inexact = [jnp.issubdtype(a.dtype, jnp.inexact) for a in leaves]
    sums = collectives.mean_divided_first(
        [a for a, f in zip(leaves, inexact, strict=True) if f], axis_name
    )
    means = jax.lax.pmean([a for a, f in zip(leaves, inexact, strict=True) if not f], axis_name)
    sums, means = iter(sums), iter(means)
    return [next(sums) if f else next(means) for f in inexact]


def tree_psum(tree: Any, axis_name: Any) -> Any:
    r"""``jax.lax.psum(tree, axis_name)``, its empty leaves left out of the collective (an
    empty leaf is its own sum, ``sum_i x_i = []``), as :func:`tree_pmean`.

    Args:
      tree: a pytree of arrays (each device's values).
      axis_name: the mesh axis, or a tuple of axes, to sum over.

    Returns:
      The tree of sums, ``sum_i x_i`` per leaf.

    Example::

      total = skeleton.tree_psum({"w": w, "empty": jnp.zeros((0, 4))}, "data")
    """
    return _non_empty(jax.lax.psum, tree, axis_name)


def _non_empty(collective: Callable, tree: Any, axis_name: Any) -> Any:
    """``collective(tree, axis_name)`` over the non-empty leaves; an empty leaf is zeros of
    its shape, typed as the collective types its output (varying over its other axes)."""
    leaves, treedef = jax.tree.flatten(tree)
    reduced = iter(collective([a for a in leaves if a.size], axis_name))
    names = set(collectives.axis_names(axis_name))

    def empty(a):
        return varying_over(jnp.zeros(a.shape, a.dtype), varying_axes(a) - names)

    return treedef.unflatten([next(reduced) if a.size else empty(a) for a in leaves])


def invariant_leaves(tree: Any, names: tuple) -> list[str]:
    """Paths of the non-scalar floating leaves of ``tree`` typed invariant over ``names``."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact) or jnp.ndim(leaf) == 0:
            continue
        if not set(names) <= varying_axes(leaf):
            out.append(jax.tree_util.keystr(path))
    return out


def invariant_gradients(updates: Any, axis_name: Any) -> list[str]:
    """Paths of the gradients typed identical on every device of ``axis_name`` (already
    the mean or the sum); none where jax does not type it (``pmap``, ``vmap``,
    ``check_vma=False``)."""
    if not tracks_variance(axis_name):
        return []
    return invariant_leaves(updates, collectives.axis_names(axis_name))


def check_varying_gradients(name: str, updates: Any, axis_name: Any) -> None:
    """Refuse gradients already identical on every device (``check_vma=True`` only).

    Params that enter ``shard_map`` replicated (``P()``) are invariant over the data axis;
    ``jax.grad`` of them transposes the implicit ``pcast`` into a float32 ``psum``: every
    device then holds the SUM of all gradients, sends that same sum through the codec, and
    the mean that comes back is the sum — a step ``n`` times too large, after a full
    uncompressed all-reduce. Refused rather than divided by ``n``: the division would hide
    that all-reduce. With ``check_vma=False`` jax adds no such all-reduce (each device's
    gradient is its own) and nothing is checked.
    """
    bad = invariant_gradients(updates, axis_name)
    if bad:
        error = ValueError(
            f"{name}: the gradients (`updates`) at {_short(bad)} are identical on every device of "
            f"axis {axis_name!r} (jax's varying-axes type: invariant). They were already "
            "summed over the devices: params passed to shard_map as P() and differentiated "
            "directly get an implicit float32 all-reduce of their gradients, so every device "
            "would send the same sum and the step would come out n times too large. Make the "
            f"params per-device before the gradient: jax.lax.pcast(params, {axis_name!r}, "
            f"to='varying') (Flax NNX: differentiate the model of `with jc.nnx_local(model, "
            f"{axis_name!r}) as local:`, whose nnx.Param state is pcast: docs/flax.md). Gradients "
            "meant to be equal on every device need no exchange: use the plain optax optimizer; "
            "a second jaxcomp exchange chained after a first (optax.chain(jc.sgd(...), "
            "jc.compressed_allreduce(...))) receives the first one's mean: exchange once. "
            "A wrapper whose accumulator entered the step replicated does the same: "
            "optax.MultiSteps' `acc_grads` passed P() (jc.sharded_init and jc.state_specs "
            "refuse MultiSteps around a jaxcomp transform); "
            "use jc.accumulate(tx, every_k), whose accumulator is per device and which "
            "exchanges once per update (MultiSteps runs the exchange on every mini-step)."
        )
        raise marked(INVARIANT_GRADIENTS, error)


#: The refusal of :func:`check_varying_gradients`, as its ValueError's ``jaxcomp_refusal``.
INVARIANT_GRADIENTS = "invariant_gradients"


def marked(refusal: str, error: ValueError) -> ValueError:
    """``error`` with ``error.jaxcomp_refusal = refusal``: a caller (``jc.delayed``) tells this
    refusal from other ValueErrors by :func:`is_refusal`, not by its text, and the type stays
    exactly ValueError (the type docs/errors.md documents and the tests check)."""
    error.jaxcomp_refusal = refusal
    return error


def is_refusal(error: BaseException, refusal: str) -> bool:
    """Whether ``error`` is jaxcomp's ``refusal`` (:func:`marked`)."""
    return getattr(error, "jaxcomp_refusal", None) == refusal


def check_per_device(name: str, state: Any, axis_name: Any) -> None:
    """Refuse a per-device state field that entered the step replicated (``check_vma=True``).

    Per-device fields (``PER_DEVICE_FIELDS``: error-feedback memories, per-device momenta)
    must enter ``shard_map`` with ``P(axis_name)``; entered as ``P()`` every device starts
    from one copy and only one device's copy leaves the step. With ``check_vma=False`` this
    cannot be seen (docs/flax.md says what goes wrong then).
    """
    fields = getattr(type(state), "PER_DEVICE_FIELDS", ())
    if not fields or not tracks_variance(axis_name):
        return
    names = collectives.axis_names(axis_name)
    for field in fields:
        bad = invariant_leaves(getattr(state, field), names)
        if bad:
            raise ValueError(
                f"{name} state field `{field}` (one value per device) entered the step "
                f"replicated over axis {axis_name!r} (at {_short(bad)}): every device would "
                "start from the same copy and only one device's copy would be kept. Build the "
                f"state with jc.sharded_init(tx, params, mesh, {axis_name!r}) and pass "
                f"jc.state_specs(state, {axis_name!r}) as its in_specs and out_specs; with "
                f"Flax NNX, jc.nnx_optimizer(model, tx, mesh, {axis_name!r}) and "
                f"jc.nnx_state_specs(optimizer, {axis_name!r}) for nnx.shard_map."
            )


def check_per_host(name: str, state: Any, axis_name: Any, inner_axis_name: Any) -> None:
    """Refuse per-device fields that vary over ``inner_axis_name`` where the transform keeps
    one value per device of ``axis_name`` (``check_vma=True``): DGC and PowerSGD average
    the gradients over the inner axis first, so their memories, and PowerSGD's replicated
    ``Q``, are the same on every device of a host; built over both axes they would leave
    the step typed per device, an output ``shard_map`` cannot return replicated."""
    fields = getattr(type(state), "PER_DEVICE_FIELDS", ())
    if inner_axis_name is None or not fields or not tracks_variance(inner_axis_name):
        return
    inner = set(collectives.axis_names(inner_axis_name))
    for field in fields:
        leaves = jax.tree_util.tree_flatten_with_path(getattr(state, field))[0]
        bad = [jax.tree_util.keystr(p) for p, a in leaves if inner & varying_axes(a)]
        if bad:
            raise ValueError(
                f"{name} state field `{field}` varies over `inner_axis_name`="
                f"{inner_axis_name!r} (at {_short(bad)}), but {name} averages the gradients "
                f"over {inner_axis_name!r} first and keeps one state per device of "
                f"`axis_name`={axis_name!r}. Build the state over {axis_name!r} only: "
                f"jc.sharded_init(tx, params, mesh, {axis_name!r}) and "
                f"jc.state_specs(state, {axis_name!r}) (not both axes)."
            )


def zeros_like_compressed(
    layout: layouts.Layout, shape_fn: Callable | None = None, dtype: Any = jnp.float32
) -> Any:
    """Per-device zeros (float32 unless ``dtype``) for every compressed leaf, None elsewhere.

    ``shape_fn(leaf_shape) -> shape`` (default: ``(1, *leaf_shape)``, a per-device memory);
    a leaf whose ``shape_fn`` returns None gets None.
    """
    shape_fn = shape_fn or (lambda s: (1, *s))
    shapes = [
        shape_fn(s) for s, g in zip(layout.shapes, layout.groups, strict=True) if g == "compressed"
    ]
    return layouts.like_compressed(
        layout, [None if s is None else jnp.zeros(s, dtype) for s in shapes]
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


def check_trees(name: str, state: Any, expected: dict[str, Any], updates: Any) -> None:
    """Refuse gradients (``updates``) of another tree than the params the state was built
    for: each field of ``expected`` that mirrors ``updates`` leaf for leaf (a per-leaf field,
    None where a leaf has no slot) must mirror the state's field too. A bare array against a
    state of ``{"w": ...}`` has the same shapes, so only the key paths tell them apart."""
    mine = layouts.leaf_paths(updates)
    for field, want in expected.items():
        got = getattr(state, field)
        if got is None or want is None or layouts.leaf_paths(want) != mine:
            continue
        layouts.check_same_tree(name, updates, got, f"the state field `{field}`")


def check_fields(
    name: str, state: Any, expected: dict[str, Any], axis_name: Any = None, updates: Any = None
) -> None:
    """Raise a clear error if a state field does not have the expected structure and shapes.

    ``expected`` maps a field name to a tree of ``jax.ShapeDtypeStruct`` (or None) built for
    the current gradients, e.g. ``jax.eval_shape`` of the init. Given ``updates``, a state
    of another params tree is named as such first (:func:`check_trees`). Given
    ``axis_name``, the per-device fields must also vary over it (:func:`check_per_device`).
    """
    if updates is not None:
        check_trees(name, state, expected, updates)
    for field, want in expected.items():
        got = getattr(state, field)
        got_s = jax.tree.map(lambda a: tuple(jnp.shape(a)), got)
        want_s = jax.tree.map(lambda a: tuple(a.shape), want)
        # Leaves compared, not the trees: `==` on a custom pytree node without `__eq__`
        # (jax.tree_util.register_pytree_node) is identity, False for equal shapes.
        if _same_shapes(got_s, want_s):
            continue
        raise ValueError(
            f"{name} state field `{field}` has shapes {_short(got_s)} but these gradients need "
            f"{_short(want_s)}. Was the state initialized for other params, or split wrongly "
            "over devices? Under shard_map, initialize with jc.sharded_init(tx, params, mesh, "
            "axis_name) and use jc.state_specs(state, axis_name) as its specs; under pmap, "
            "build it with jax.pmap(tx.init, axis_name=...) or give every state leaf a "
            "leading device axis (jc.replicate)."
        )
    if axis_name is not None:
        check_per_device(name, state, axis_name)


def _same_shapes(got: Any, want: Any) -> bool:
    """Whether two trees of shapes have the same structure and the same shapes, leaf by leaf."""
    return jax.tree.structure(got) == jax.tree.structure(want) and jax.tree.leaves(
        got
    ) == jax.tree.leaves(want)


def check_state(
    name: str,
    state: Any,
    fields: Callable[[], dict],
    layout: layouts.Layout,
    flat: bool = False,
    axis_name: Any = None,
    updates: Any = None,
) -> None:
    """:func:`check_fields` against ``fields()`` (the init's fields for these gradients,
    traced abstractly); a server residual built outside the mesh (room for whole vectors,
    see :mod:`jaxcomp._src.server`) is accepted as it is. Given ``updates``, a state of
    another params tree is refused first (:func:`check_trees`)."""
    expected = jax.eval_shape(fields)
    if updates is not None:  # before the server residual is read for its slots
        check_trees(name, state, expected, updates)
    if "server_residual" in expected and server.is_whole(state.server_residual, layout, flat):
        expected["server_residual"] = state.server_residual
        if "server_grid" in expected:  # no grid outside the mesh: each row holds whole vectors
            expected["server_grid"] = state.server_grid
    check_fields(name, state, expected, axis_name)


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
