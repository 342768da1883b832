"""The defaults of ``jc.diloco``'s outer step and ``jc.sparseloco``'s merge: chosen by the
number of replicas and the exchange (the measurements behind them: docs/lm.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.diloco import default_outer
from jaxcomp._src.sparseloco import resolve_averaging

DELTAS = [jnp.asarray([0.5, -2.0, 0.0]), jnp.asarray([1.0, 0.25, -1.0])]  # two outer steps


def outer_steps(m: int) -> np.ndarray:
    """The updates of :func:`default_outer` over two outer steps on ``m`` replicas (``vmap``
    binds the axis: its size is what the outer step reads)."""
    tx = default_outer("replica")

    def run(_):
        state, outs = tx.init(DELTAS[0]), []
        for d in DELTAS:
            u, state = tx.update(d, state)
            outs.append(u)
        return jnp.stack(outs)

    return np.asarray(jax.vmap(run, axis_name="replica")(jnp.zeros(m))[0])


def test_outer_step_is_plain_averaging_on_two_replicas_and_nesterov_on_more():
    # M = 2: x <- x - Delta, no momentum (and the velocity stays unused).
    np.testing.assert_array_equal(outer_steps(2), -np.stack(DELTAS))
    # M = 8: Nesterov, lr 0.7, momentum 0.6: v1 = D1, u1 = -0.7 (D1 + 0.6 v1) = -1.12 D1;
    # v2 = 0.6 D1 + D2, u2 = -0.7 (D2 + 0.6 v2).
    d1, d2 = (np.asarray(d) for d in DELTAS)
    want = np.stack([-0.7 * 1.6 * d1, -0.7 * (d2 + 0.6 * (0.6 * d1 + d2))])
    np.testing.assert_allclose(outer_steps(8), want, rtol=1e-6)
    ref = optax.sgd(0.7, momentum=0.6, nesterov=True)
    s = ref.init(DELTAS[0])
    for d, got in zip(DELTAS, outer_steps(8), strict=True):
        u, s = ref.update(d, s)
        np.testing.assert_allclose(got, u, rtol=1e-6)


def test_sparseloco_merges_over_senders_unless_two_phase():
    assert resolve_averaging(None, "allgather") == "senders"
    assert resolve_averaging(None, "two_phase") == "all"
    assert resolve_averaging("all", "allgather") == "all"
    with pytest.raises(ValueError, match="averaging"):
        resolve_averaging("senders", "two_phase")
    with pytest.raises(ValueError, match="averaging"):
        jc.sparseloco(optax.sgd(0.1), "data", 4, averaging="senders", strategy="two_phase")
