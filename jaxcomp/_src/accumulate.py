"""Gradient accumulation that communicates only on the step that applies.

Accumulating ``k`` micro-batches before an update is how large batches fit in memory. With
a communicating transform inside (``jc.compressed_allreduce``, ``jc.dgc``, ``jc.powersgd``)
the all-reduce must run once per *update*, not once per micro-batch, or accumulation saves
no bandwidth at all. :func:`accumulate` does that with ``lax.cond``::

    tx = jc.accumulate(
        optax.chain(jc.compressed_allreduce(jc.sign(), "data"), optax.adamw(1e-3)),
        every_k=4,
    )

On mini-steps ``0 .. k-2`` each device only adds its gradient to a local accumulator and
returns zero updates: the branch holds no collective. On mini-step ``k-1`` the inner
transform gets ``(1/k) sum_j g_j`` (or the sum) and runs its all-reduce once.

Why not ``optax.MultiSteps``? In optax 0.2.8 its ``update`` calls the inner ``update`` on
*every* mini-step (with the running mean) and keeps its result with
``jnp.where(mini_step == k - 1, new, old)``; its only ``lax.cond`` chooses between that and
``should_skip_update_fn``'s skip branch. Under ``shard_map``/``pmap`` the inner collectives
therefore run on every mini-step: ``k`` times the traffic, all of it thrown away but one.
(Collectives inside ``lax.cond`` are fine as long as every device takes the same branch,
which holds here: the predicate comes from the replicated step counter.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src.codecs.base import check_int
from jaxcomp._src.periodic import check_transform
from jaxcomp._src.skeleton import check_fields, varying_like


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      mini_step: int32[], identical on every device: micro-batches since the last apply
      acc: per device: tree like the params, f32[size] (raveled) local gradient sums; None for
        integer leaves (orbax cannot save zero-size arrays)
      inner_state: the wrapped transform's state
    """

    mini_step: jax.Array
    acc: Any
    inner_state: Any

    PER_DEVICE_FIELDS = ("acc",)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _is_none(x: Any) -> bool:
    return x is None


def _mean_scale(mini_step: jax.Array, every_k: int) -> jax.Array:
    """``1 / m``, ``m = mini_step + 1`` the micro-batches in the accumulator on the applying
    call: ``1 / every_k`` (the same constant as ever) unless a state saved with a larger
    ``every_k`` holds more."""
    return jnp.where(
        mini_step == every_k - 1,
        jnp.float32(1.0 / every_k),
        1.0 / (mini_step + 1).astype(jnp.float32),
    )


def accumulate(
    tx: optax.GradientTransformation, every_k: int, *, use_grad_mean: bool = True
) -> optax.GradientTransformationExtraArgs:
    r"""Apply ``tx`` once every ``every_k`` calls, to the accumulated gradient; no traffic between.

    With ``g_1 .. g_k`` the per-device gradients of ``k`` consecutive calls, the ``k``-th call
    returns ``tx.update(G)`` with ``G = (1/k) sum_j g_j`` (``use_grad_mean``, the gradient of
    the ``k``-times larger batch) or ``sum_j g_j``; the other calls return zero updates and
    leave ``tx``'s state untouched. The inner update sits in the true branch of a
    ``lax.cond``, so its collectives run only on the applying call: the wire traffic per
    sample falls by ``k``. Accumulation is local to each device (the sum is per device; the
    inner transform averages over devices), so the accumulator is per-device state. It is
    float32, as jaxcomp's states are: float64 gradients (``jax_enable_x64``) are summed in
    float32.

    A non-finite gradient is not hidden: it reaches the inner transform on the applying call
    (``jc.compressed_allreduce`` then returns NaN and keeps its memory, so
    ``optax.apply_if_finite`` after it skips the update) and the accumulator restarts at zero.

    Unlike ``optax.MultiSteps`` (see the module docstring), which runs the inner update,
    collectives included, on every mini-step.

    Args:
      tx: the transform to apply every ``every_k`` calls, e.g. a chain starting with
        ``jc.compressed_allreduce``.
      every_k: number of calls (micro-batches) per update; static, >= 1. A state restored
        from a run with a larger ``every_k`` that holds ``m >= every_k`` micro-batches applies
        on its next call, to their mean (or sum), and counts from 0 after it.
      use_grad_mean: average the accumulated gradients (default) or sum them.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`AccumulateState`.

    Raises:
      ValueError: at construction, ``every_k`` outside its rule (the message names the argument; the
        rules: docs/errors.md).
      TypeError: at construction, ``every_k``, ``use_grad_mean`` or ``tx`` of the wrong kind.
    """
    tx = check_transform("tx", tx)
    every_k = check_int("every_k", every_k, 1)
    if not isinstance(use_grad_mean, bool):
        raise TypeError(f"`use_grad_mean` must be a bool, got {use_grad_mean!r}")
    inner = optax.with_extra_args_support(tx)

    def zero_acc(params):
        # Typed like its param: an accumulator of FSDP shards (params varying over the data
        # axis, init inside shard_map) is a lax.scan carry whose type the update keeps.
        return jax.tree.map(
            lambda p: (
                varying_like(jnp.zeros((jnp.size(p),), jnp.float32), p) if _is_float(p) else None
            ),
            params,
        )

    def init_fn(params):
        return AccumulateState(jnp.zeros([], jnp.int32), zero_acc(params), inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        # A state of other params or devices (restored on another mesh): named, not a
        # broadcasting error deep in the sum.
        check_fields(
            "accumulate", state, {"acc": jax.eval_shape(zero_acc, updates)}, updates=updates
        )
        acc = jax.tree.map(
            lambda a, g: a if a is None else a + jnp.ravel(g).astype(jnp.float32),
            state.acc,
            updates,
            is_leaf=_is_none,
        )

        def apply(acc, inner_state):
            scale = _mean_scale(state.mini_step, every_k) if use_grad_mean else 1.0
            total = jax.tree.map(
                lambda a, g: (
                    g if a is None else (a * scale).reshape(jnp.shape(g)).astype(jnp.result_type(g))
                ),
                acc,
                updates,
                is_leaf=_is_none,
            )
            out, inner_state = inner.update(total, inner_state, params, **extra_args)
            return out, jax.tree.map(jnp.zeros_like, acc), inner_state

        def hold(acc, inner_state):
            out, new_state = jax.eval_shape(
                lambda s: inner.update(updates, s, params, **extra_args), inner_state
            )
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)
            # Both branches of the cond must agree on what varies per device (vma).
            held = jax.tree.map(varying_like, inner_state, new_state)
            return jax.tree.map(varying_like, zeros, out), acc, held

        # ``>=``: a state saved with a larger ``every_k`` (restored into this one) may hold
        # more micro-batches than ``every_k``; ``==`` never applied it again (zero updates).
        applying = state.mini_step >= every_k - 1
        out, acc, inner_state = jax.lax.cond(applying, apply, hold, acc, state.inner_state)
        mini_step = jnp.where(applying, 0, state.mini_step + 1).astype(jnp.int32)
        return out, AccumulateState(mini_step, acc, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
