"""The defaults of ``jc.diloco``'s outer step and ``jc.sparseloco``'s merge: chosen by the
number of replicas and the exchange (the measurements behind them: docs/lm-measurements.md)."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.diloco import default_outer
from jaxcomp._src.sparseloco import clip_factor, resolve_averaging, sparse_feedback

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
    assert inspect.signature(jc.sparseloco).parameters["ef_decay"].default == 0.5
    assert resolve_averaging(None, "allgather") == "senders"
    assert resolve_averaging(None, "two_phase") == "all"
    assert resolve_averaging("all", "allgather") == "all"
    with pytest.raises(ValueError, match="averaging"):
        resolve_averaging("senders", "two_phase")
    with pytest.raises(ValueError, match="averaging"):
        jc.sparseloco(optax.sgd(0.1), "data", 4, averaging="senders", strategy="two_phase")


def test_clip_factor_bounds_the_payload_by_the_pseudo_gradient():
    factor = jax.jit(functools.partial(clip_factor, jc.chunked_top_k(2, chunk=8, bits=None)))
    e = jnp.asarray([3.0, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # C(e) = e: |C(e)| = 5
    d = jnp.asarray([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # |D| = 1
    assert float(factor(e, d)) == pytest.approx(0.2, rel=1e-6)
    assert float(factor(e, 10.0 * d)) == 1.0  # never scaled up
    assert float(factor(jnp.zeros(8), d)) == 1.0  # nothing sent: no NaN
    assert float(factor(e, jnp.zeros(8))) == 0.0  # did not move: sends nothing
    big = 3e38  # norms near float32's range: no overflow, no 0 for a finite D
    assert float(factor(e * (big / 4), d * big)) == pytest.approx(4 / 5, rel=1e-6)
    assert float(factor(e, d * 1e-30)) == pytest.approx(2e-31, rel=1e-5)
    assert np.isnan(float(factor(e, d.at[3].set(jnp.inf))))


def test_clipped_exchange_sends_at_most_each_pseudo_gradient_and_keeps_the_rest():
    """8 devices, one leaf of 64 values: device i's memory holds a stale spike of 8 at
    coordinate i, its pseudo-gradient D_i a fresh 1 at coordinate 32 + i. With clip each
    payload is scaled to |D_i| = 1; the memory keeps the rest; the mean over all devices
    is the mean of what was sent (conservation: sum of memories + n * mean = sum of targets)."""
    codec = jc.chunked_top_k(2, chunk=64, bits=None)
    tx = sparse_feedback(codec, "data", ef_decay=1.0, min_size=0, averaging="all", clip=True)

    def step(d, e):
        out, state = tx.update([d[0]], jc.SparseFeedbackState([e]))
        return out[0][None], state.memory[0]

    fn = per_device(step, (P("data"), P("data")), (P(), P("data")))
    d, e = np.zeros((N, 64), np.float32), np.zeros((N, 64), np.float32)
    for i in range(N):
        d[i, 32 + i], e[i, i] = 1.0, 8.0
    out, mem = fn(shard(d), shard(e))  # each device: its (1, 64) slot of memory
    target = e + d  # C keeps both entries (k = 2): |C(e_i)| = sqrt(65)
    c = 1.0 / np.sqrt(65.0)
    np.testing.assert_allclose(np.asarray(mem), target * (1.0 - c), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out)[0], (c * target).mean(0), rtol=1e-5)
    sent = target - np.asarray(mem)
    np.testing.assert_allclose(np.linalg.norm(sent, axis=1), 1.0, rtol=1e-5)
