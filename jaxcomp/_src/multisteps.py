r"""``optax.MultiSteps`` around a jaxcomp exchange: an accumulator that differs per device.

``optax.MultiSteps(tx, k)`` keeps ``acc_grads``, the running mean of the gradients of the
last micro-steps, and hands it to ``tx`` on every call (keeping ``tx``'s new state on the
``k``-th). Around a jaxcomp exchange those gradients are each device's own, before the
average, so device ``i`` holds

.. math::

    a_i = \frac{1}{m} \sum_{j=1}^{m} g_{i,j},

one value per device. :func:`jaxcomp.state_specs` knows the per-device fields of jaxcomp's
states only: it lays ``acc_grads`` out replicated, ``P()``. Under
``shard_map(..., check_vma=True)`` the step then refuses the accumulated gradients
(:func:`jaxcomp._src.skeleton.check_varying_gradients`); under ``check_vma=False`` it runs,
each device keeping its own buffer, but the state claims to be replicated: a checkpoint, a
read or a reshard between two applying calls keeps device 0's ``a_0`` for every device, and
the next update drops the other devices' micro-batches. ``jc.accumulate(tx, k)`` is the same
accumulation with its accumulator per device and one exchange per update (MultiSteps runs
``tx``, the exchange included, on every call: ``k`` times the bytes).

:func:`warn_inside` says so at trace time, under ``jax.pmap`` too, where no
``jc.sharded_init`` refuses the state. MultiSteps' ``lax.cond`` chooses between skipping a
micro-step (its ``should_skip_update_fn``; the default never skips, and the cond folds away)
and running the inner update, not between accumulating and applying: the inner update and
its collectives run on every micro-step, ``pmap`` and ``shard_map`` alike.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import jax
import optax
from optax.transforms import _accumulation

MULTI_STEPS_FILE = inspect.getsourcefile(_accumulation)


def is_multisteps_update(code: Any) -> bool:
    """Whether ``code`` (a frame's ``f_code``) is ``optax.MultiSteps.update``."""
    return code.co_name == "update" and code.co_filename == MULTI_STEPS_FILE


def _is_multisteps(node: Any) -> bool:
    return isinstance(node, optax.MultiStepsState)


def _is_jaxcomp_state(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "PER_DEVICE_FIELDS")


def exchanges_inside(state: Any) -> list[str]:
    """The type names of the jaxcomp states inside every ``optax.MultiStepsState`` of
    ``state`` (its ``inner_opt_state``): the exchanges whose gradients MultiSteps sums."""
    found = []
    for node in jax.tree.leaves(state, is_leaf=_is_multisteps):
        if _is_multisteps(node):
            inner = jax.tree.leaves(node.inner_opt_state, is_leaf=_is_jaxcomp_state)
            found += [type(s).__name__ for s in inner if _is_jaxcomp_state(s)]
    return sorted(set(found))


def check_not_around_exchange(state: Any, argument: str) -> None:
    """Refuse ``state`` (the state of ``argument``) holding ``optax.MultiSteps`` around a
    jaxcomp transform: its ``acc_grads`` would be laid out replicated (module docstring)."""
    found = exchanges_inside(state)
    if found:
        raise ValueError(
            f"`{argument}` holds optax.MultiSteps around a jaxcomp transform ({', '.join(found)} "
            "in its inner_opt_state): MultiSteps' `acc_grads` sums each device's own "
            "gradients, one value per device, which jc.state_specs would lay out replicated, "
            "P(). Under shard_map(..., check_vma=True) the step is refused; under "
            "check_vma=False it runs, but a checkpoint, a read or a reshard of the state "
            "between two applying calls keeps device 0's accumulator for every device, and the "
            "next update drops the other devices' micro-batches. MultiSteps also runs the "
            "exchange on every call (every_k times the bytes). Use jc.accumulate(tx, every_k): "
            "the same updates, its accumulator per device, one exchange per update."
        )


def _inside_multisteps() -> bool:
    """Whether this trace runs inside ``optax.MultiSteps.update`` (a frame of optax's)."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_multisteps_update(frame.f_code):
            return True
        frame = frame.f_back
    return False


def warn_inside(name: str) -> None:
    """Warn (at trace time) where ``jc.<name>``'s update runs inside ``optax.MultiSteps``:
    MultiSteps calls it on every micro-step and keeps the result of every ``k``-th, so its
    exchange sends ``k`` times the bytes of one update (module docstring)."""
    if _inside_multisteps():
        warnings.warn(
            f"jc.{name} is the inner transform of optax.MultiSteps, which runs its update, "
            "the exchange included, on every micro-step and keeps every every_k-th: every_k "
            "times the bytes of one update (under jax.pmap and jax.shard_map alike). Use "
            "jc.accumulate(tx, every_k): the same updates, one exchange per applied update.",
            UserWarning,
            stacklevel=3,
        )
