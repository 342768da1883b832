"""Skip a non-finite step on every device at once: the verdict is reduced over the data axis.

``optax.apply_if_finite`` decides from the gradients it sees, and inside ``shard_map`` or
``pmap`` each device sees only its own: with a NaN on one device, that device takes the
"skip" branch of a ``lax.cond`` while the others run the jaxcomp exchange and wait in its
collective for a device that never comes (under ``pmap`` until the collective timeout aborts
the process; under ``shard_map`` jax refuses the branches' types). :func:`apply_if_finite`
runs the inner update on every device, so every device runs the same collectives, and then
keeps or drops its result by a flag summed over the axis: the same verdict everywhere.
:func:`refuse_optax_skip` turns the hang into a trace-time error that names this fix.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.transforms import _conditionality

from jaxcomp._src import collectives, multisteps, shards
from jaxcomp._src.axes import tracks_variance, varying_axes
from jaxcomp._src.codecs.base import check_int

_OPTAX_SKIP_FILE = inspect.getsourcefile(_conditionality)
# optax's skip rules for MultiSteps, each decided from this device's own gradients
_PER_DEVICE_SKIPS = (optax.skip_not_finite, optax.skip_large_updates)


def _rule_name(rule: Any) -> str:
    base = getattr(rule, "func", rule)  # a functools.partial names its function
    return getattr(base, "__name__", type(base).__name__)


def _is_optax_default(rule: Any) -> bool:
    """``optax.MultiSteps``' own rule when none is given: never skip (no ``lax.cond`` branch
    is ever taken on one device only)."""
    code = getattr(rule, "__code__", None)
    return (
        code is not None
        and code.co_filename == multisteps.MULTI_STEPS_FILE
        and code.co_name == "should_skip_update_fn"
    )


def _same_on_every_device(verdict: Any, axis_name: Any) -> bool:
    """Whether jax's types show ``verdict`` identical on every device of the mesh (over
    ``axis_name`` and every other manual axis: a ``shard_axis`` flag is summed over its own):
    only under ``shard_map(..., check_vma=True)``; ``pmap`` and ``check_vma=False`` type
    nothing."""
    if verdict is None or axis_name is None:
        return False
    try:
        if not tracks_variance(axis_name):
            return False
    except NameError:  # an unbound axis: its own check names it
        return False
    return not varying_axes(verdict)


def _multi_steps_skips(frame: Any, axis_name: Any) -> str | None:
    """``optax.MultiSteps(should_skip_update_fn=...)`` whose verdict may differ per device:
    optax's per-device rules always; another rule unless typed identical on every device."""
    rule = getattr(frame.f_locals.get("self"), "_should_skip_update_fn", None)
    if rule is None or _is_optax_default(rule):
        return None
    verdict = frame.f_locals.get("should_skip_update")  # MultiSteps.update's local
    per_device = getattr(rule, "func", rule) in _PER_DEVICE_SKIPS
    if not per_device and _same_on_every_device(verdict, axis_name):
        return None
    return f"optax.MultiSteps(should_skip_update_fn={_rule_name(rule)})"


def _skips_per_device(frame: Any, axis_name: Any = None) -> str | None:
    """The optax wrapper this frame runs, where it decides per device whether to run its
    inner update: ``optax.apply_if_finite``, or ``optax.MultiSteps`` with a skip rule."""
    code = frame.f_code
    if code.co_name == "do_update" and code.co_filename == _OPTAX_SKIP_FILE:
        return "optax.apply_if_finite"
    if multisteps.is_multisteps_update(code):
        return _multi_steps_skips(frame, axis_name)
    return None


def refuse_optax_skip(name: str, axis_name: Any = None) -> None:
    """Raise if this update is traced inside ``optax.apply_if_finite``'s per-device branch
    (or ``optax.MultiSteps``' with a ``should_skip_update_fn``).

    Their ``lax.cond`` is decided by each device's own gradients, so a jaxcomp exchange inside
    it runs on some devices only and hangs (see the module docstring). ``optax.MultiSteps``
    with a rule of the user's own (``lambda u, s, p: optax.skip_not_finite(u, s, p)``) hung
    the same way until 2026-11-27: only optax's two rules were recognised. A rule is let
    through only where jax's types show its verdict the same on every device, over
    ``axis_name`` and every other manual axis (``shard_map(..., check_vma=True)``: a verdict
    from the step count, or reduced over every axis; FSDP shards sum a flag of their own).
    Called at trace time by every jaxcomp transform; nothing of it reaches the compiled step.
    """
    frame = sys._getframe(1)
    while frame is not None:
        wrapper = _skips_per_device(frame, axis_name)
        if wrapper is not None:
            raise ValueError(
                f"jc.{name} is the `inner` transform of {wrapper}, which decides per device "
                "whether to run it: with a NaN on one device that device skips the exchange "
                "and the others wait in its collective for ever. Wrap it in "
                "jc.apply_if_finite(tx, axis_name, max_consecutive_errors) instead (one "
                "verdict, reduced over the axis), or put the optax wrapper around the "
                f"optimizer chained after jc.{name}. (A MultiSteps rule whose verdict is the "
                "same on every device passes under shard_map(..., check_vma=True), where "
                "jax's types show it; gradient accumulation: jc.accumulate(tx, every_k).)"
            )
        frame = frame.f_back


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            f"`inner` must be an optax GradientTransformation (init and update), got {inner!r}"
        )
    return optax.with_extra_args_support(inner)


def nonfinite_anywhere(trees: tuple, axis_name: Any) -> jax.Array:
    """True on every device when any floating entry of ``trees`` is NaN or inf on any device
    of ``axis_name``: one int32 scalar summed over the axis."""
    local = collectives.local_nonfinite(trees)
    return jax.lax.psum(local.astype(jnp.int32), axis_name) > 0


def apply_if_finite(
    inner: optax.GradientTransformation,
    axis_name: Any,
    max_consecutive_errors: int,
    *,
    shard_axis: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""``optax.apply_if_finite`` that skips a non-finite step on every device at once.

    Each step runs ``inner``'s update on every device (so every device runs the same
    collectives), then checks this device's gradients and the update it got, and sums that
    flag over ``axis_name``:

    .. math::

        \text{bad} = \Big[\sum_{i=1}^{n} \mathbb{1}[\,g_i \text{ or } u_i
            \text{ has a NaN or an inf}\,] > 0\Big]

    Where bad (and at most ``max_consecutive_errors`` bad steps in a row), every device
    returns a zero update and keeps ``inner``'s state as it was: the run then equals a run
    that never saw that step, bit for bit. After more bad steps in a row the update goes
    through, as in ``optax.apply_if_finite`` (jaxcomp's own transforms then give a NaN update
    and keep their memories). The cost: one 4-byte all-reduce per step, and the exchange
    still runs on a skipped step. Works with every jaxcomp transform (and any optax one)
    under ``jax.shard_map`` and ``jax.pmap``; ``jc.state_specs`` reads the wrapped state.

    Args:
      inner: the transform to guard, e.g. ``jc.sgd(0.1, jc.int_quant(8), "data")`` or a
        chain that starts with a jaxcomp exchange.
      axis_name: the data axis (or tuple of axes) the verdict is reduced over: every axis
        the inner transform communicates over.
      max_consecutive_errors: how many non-finite steps in a row are skipped before one is
        let through (an int >= 0).
      shard_axis: the mesh axis (or tuple) over which the gradients are shards of one model
        (FSDP over ``"data"`` inside each replica of ``axis_name``), as
        :func:`jaxcomp.compressed_allreduce`'s: the verdict is or-ed over it too (one more
        scalar ``psum``), so a non-finite shard skips the step of every shard. Under
        ``check_vma=True`` jax's types tell (None works); under ``check_vma=False`` they do
        not, and with another manual axis bound beside ``axis_name`` the update warns where
        this is None. ``()``: the leaves are whole, no warning. (Naming every axis in
        ``axis_name`` does the same.)

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is
      ``optax.ApplyIfFiniteState`` (``notfinite_count``, ``last_finite``,
      ``total_notfinite``: identical on every device; ``inner_state``).

    Raises:
      ValueError: at construction, ``axis_name`` or ``max_consecutive_errors`` outside its rule (the
        message names the argument; the rules: docs/errors.md).
      TypeError: at construction, ``inner``, ``max_consecutive_errors`` or ``shard_axis`` of
        the wrong kind.

    Example::

        tx = jc.apply_if_finite(jc.sgd(0.1, jc.int_quant(8), "data"), "data", 3)
        state = jc.sharded_init(tx, params, mesh, "data")
        specs = jc.state_specs(state, "data")

    References:
      The rule of ``optax.apply_if_finite`` (optax), with the decision made as DESIGN's
      rule asks: "from a value reduced over the axis, never from one device's own input".
    """
    inner = _check_inner(inner)
    if axis_name is None:
        raise ValueError("`axis_name` must name the data axis the verdict is reduced over")
    limit = check_int("max_consecutive_errors", max_consecutive_errors, 0)
    shard_axis = shards.check_shard_axis(shard_axis)

    def init_fn(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        collectives.axis_size(axis_name)  # a clear error where the axis is not bound
        new, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        bad = nonfinite_anywhere((updates, new), axis_name)
        bad = shards.any_shard(bad, shard_axis=shard_axis)  # every shard of one model too
        count = jnp.where(bad, optax.safe_increment(state.notfinite_count), 0)
        skip = bad & (count <= limit)
        new = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new)
        inner_state = jax.tree.map(
            lambda old, fresh: jnp.where(skip, old, fresh), state.inner_state, inner_state
        )
        return new, optax.ApplyIfFiniteState(
            notfinite_count=count,
            last_finite=~bad,
            total_notfinite=jnp.where(
                bad, optax.safe_increment(state.total_notfinite), state.total_notfinite
            ),
            inner_state=inner_state,
        )

    def checked_update(updates, state, params=None, **extra_args):
        shards.check_traced("jc.apply_if_finite", axis_name, shard_axis)
        return update_fn(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, checked_update)
