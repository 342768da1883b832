"""One-step-delayed exchange: step t's gradients are exchanged in step t + 1's program."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import collectives, periodic, skeleton


class DelayedState(NamedTuple):
    """State of :func:`delayed`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      pending: per device: the previous step's gradients, [1, *leaf.shape], leaf dtype
      inner: the wrapped transform's state
      count: int32[]: number of updates applied
    """

    pending: Any
    inner: Any
    count: jax.Array

    PER_DEVICE_FIELDS = ("pending",)


def delayed(
    tx: optax.GradientTransformation, *, axis_name: Any = None
) -> optax.GradientTransformationExtraArgs:
    r"""Delay the exchange by one step, so that it overlaps the next forward and backward.

    ``tx`` is a data-parallel transform that averages the gradients over the devices (e.g.
    ``optax.chain(jc.compressed_allreduce(jc.int_quant(8), "data"), optax.sgd(0.1))``).
    ``delayed(tx)`` feeds it the gradients of the previous step, kept in the state::

        out_t = tx(g_{t-1})          (t >= 1);      out_0 = 0

    Within one compiled step the exchange then depends only on the state, not on the
    forward and backward computed in the same program, so XLA can run the collectives while
    the gradients of step ``t`` are computed (where its runtime overlaps them: XLA:CPU runs a
    program's collectives in turn with its other work; :func:`jaxcomp.overlapped_step` runs
    this step as two programs on two host threads, which overlap there). The price is
    staleness 1: each update is computed on params one step older than the ones it is
    applied to (PipeDream-style weight staleness). With ``axis_name`` the delayed gradients
    are first averaged with a ``pmean`` in the params' dtypes (plain data parallel, delayed:
    ``jc.delayed(optax.sgd(0.1), axis_name="data")``).

    Integer and bool gradient leaves are delayed like the others and reach ``tx`` in their
    dtype (the ``pmean`` of ``axis_name`` passes them through untouched, as
    :func:`jaxcomp.pmean` does); a ``float0`` gradient (``jax.grad(..., allow_int=True)`` of
    an integer param) holds no value and reaches ``tx`` as the same ``float0``: ``delayed(tx)``
    takes what ``tx`` takes.

    A non-finite gradient reaches ``tx`` one step later: that step's output is non-finite
    and ``tx`` keeps its own state as its contract says (jaxcomp transforms leave their
    memories as they were); chain ``optax.apply_if_finite`` inside ``tx`` as usual.

    Args:
      tx: the transform that exchanges and applies the gradients.
      axis_name: None (``tx`` averages), or the data axis to ``pmean`` the gradients over
        before ``tx``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`DelayedState`.

    Raises:
      ValueError: at construction, ``axis_name`` outside its rule (the message names the argument;
        the rules: docs/errors.md).
      TypeError: at construction, ``tx`` or ``axis_name`` of the wrong kind.

    Example::

        tx = jc.delayed(optax.chain(jc.compressed_allreduce(jc.sign(), "data"),
                                    optax.sgd(0.05, momentum=0.9)))

    References:
      Harlap et al., "PipeDream: Fast and Efficient Pipeline Parallel DNN Training", 2018;
      Zhu et al., "Delayed Gradient Averaging: Tolerate the Communication Latency for
      Federated Learning", NeurIPS 2021.
    """
    tx = periodic.check_transform("tx", tx)
    if axis_name is not None:
        collectives.check_axis_name(axis_name)

    def zero_pending(params):
        return jax.tree.map(lambda p: jnp.zeros((1, *jnp.shape(p)), jnp.result_type(p)), params)

    def init_fn(params):
        return DelayedState(
            pending=zero_pending(params), inner=tx.init(params), count=jnp.zeros([], jnp.int32)
        )

    def update_fn(updates, state, params=None, **extra_args):
        # A state of other params or devices: refused (a[0] would read one of its rows).
        want = jax.eval_shape(zero_pending, updates)
        skeleton.check_fields("delayed", state, {"pending": want}, updates=updates)
        previous = jax.tree.map(
            lambda g, a: float0_like(g) if is_float0(g) else a[0], updates, state.pending
        )

        def exchange(ops):
            previous, inner = ops
            if axis_name is None:
                return tx.update(previous, inner, params, **extra_args)
            previous = floating_pmean(previous, axis_name)
            try:
                return tx.update(previous, inner, params, **extra_args)
            except ValueError as e:
                if not skeleton.is_refusal(e, skeleton.INVARIANT_GRADIENTS):
                    raise
                raise ValueError(
                    f"delayed: `axis_name`={axis_name!r} averages the gradients before `tx`, "
                    "and `tx` exchanges them itself (it refused gradients already equal on "
                    "every device): leave `axis_name` out, delayed(tx) with a jaxcomp exchange "
                    f"inside `tx` delays that exchange. ({str(e).splitlines()[0][:160]} ...)"
                ) from None

        def first(ops):
            out, inner = jax.eval_shape(exchange, ops)
            return jax.tree.map(zeros_typed_as, out), ops[1]

        out, inner = jax.lax.cond(state.count == 0, first, exchange, (previous, state.inner))
        pending = jax.tree.map(
            lambda g, old: old if is_float0(g) else jnp.asarray(g, old.dtype)[None],
            updates,
            state.pending,
        )
        return out, DelayedState(pending=pending, inner=inner, count=state.count + 1)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_float0(x: Any) -> bool:
    """Whether ``x`` is a ``float0`` array: the gradient ``jax.grad(..., allow_int=True)``
    gives an integer param, which holds no value (nothing to delay)."""
    return jnp.result_type(x) == jax.dtypes.float0


def float0_like(x: Any) -> np.ndarray:
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def floating_pmean(tree: Any, axis_name: Any) -> Any:
    """``jax.lax.pmean`` of the floating (and complex) leaves of ``tree``; integer, bool and
    ``float0`` leaves pass through untouched, as in :func:`jaxcomp.pmean` (``jax.lax.pmean``
    turns an int32 leaf into float32, and refuses a ``float0``)."""
    leaves, treedef = jax.tree.flatten(tree)
    reduce = [jnp.issubdtype(jnp.result_type(a), jnp.inexact) for a in leaves]
    means = iter(
        skeleton.tree_pmean([a for a, r in zip(leaves, reduce, strict=True) if r], axis_name)
    )
    return treedef.unflatten([next(means) if r else a for a, r in zip(leaves, reduce, strict=True)])


def zeros_typed_as(like: jax.ShapeDtypeStruct) -> Any:
    """Zeros of ``like``'s shape and dtype, varying over the manual axes it varies over (the
    first step's output must type as the exchange's: an integer leaf ``tx`` passes through
    is each device's own, varying); a ``float0`` as itself."""
    if like.dtype == jax.dtypes.float0:
        return float0_like(like)
    return skeleton.varying_over(jnp.zeros(like.shape, like.dtype), skeleton.varying_axes(like))
