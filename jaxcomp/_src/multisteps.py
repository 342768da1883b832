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
"""

from __future__ import annotations

from typing import Any

import jax
import optax


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
