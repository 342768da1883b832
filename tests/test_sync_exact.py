"""After a local SGD / DiLoCo sync every replica holds the anchor: bit-identical in bf16.

8 devices, each with its own gradients, ``sync_every=2``; after the sync step the replicas
(``optax.apply_updates(p, u)`` per device, as the docs' step does) are compared bit for bit.
bf16 params: every replica equals the anchor rounded to bf16 exactly (the update comes back
in float32, whose ``p + u`` is exact). float32 params: ``p + (anchor - p)`` rounds per device,
so exact equality holds only where ``anchor - p`` is representable (15% of the entries differ
here, by at most one ulp of the leaf's largest value): no float32 update can do better, as
``p + u`` cannot land on every anchor value from every ``p``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, mesh, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SHAPE = (4096,)


def run(tx, dtype):
    """Two steps (local, then the sync) from equal replicas: (replicas after, anchor)."""
    m = mesh()
    params = {"w": (0.1 * np.random.default_rng(0).standard_normal(SHAPE)).astype(dtype)}
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(r, s, g):
        p = jc.own(r)
        u, s = tx.update(jc.own(g), s, p)
        return jc.slot(optax.apply_updates(p, u)), s

    rspec = jc.replica_specs(params, "data")
    f = per_device(step, (rspec, specs, P("data")), (rspec, specs), m)
    replicas = jc.replica_params(params, m, "data")
    rng = np.random.default_rng(1)
    for _ in range(2):
        g = {"w": (rng.standard_normal((N, *SHAPE)) + 0.3).astype(dtype)}
        replicas, state = f(replicas, state, shard(g, m))
    return np.asarray(replicas["w"]), np.asarray(state.anchor["w"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: jc.local_sgd(optax.sgd(0.1), "data", 2),
        lambda: jc.diloco(optax.sgd(0.1), "data", 2),
    ],
    ids=["local_sgd", "diloco"],
)
def test_bf16_replicas_are_the_anchor_bit_for_bit(make):
    replicas, anchor = run(make(), jnp.bfloat16)
    want = anchor.astype(jnp.bfloat16)
    assert replicas.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        replicas.view(np.uint16), np.broadcast_to(want, replicas.shape).view(np.uint16)
    )


def test_f32_replicas_are_the_anchor_to_the_rounding_of_p_plus_u():
    replicas, anchor = run(jc.local_sgd(optax.sgd(0.1), "data", 2), jnp.float32)
    # The rounding of p + (anchor - p): half an ulp of |anchor - p| and of the result.
    ulps = np.abs(replicas - anchor) / np.spacing(np.abs(anchor))
    differ = float((replicas != anchor).mean())
    print(f"f32: {differ:.4f} of entries differ from the anchor, max {ulps.max():.1f} ulp")
    # Where |anchor - p| >> |anchor| (entries near 0) the rounding is many of the anchor's
    # ulps (8192 here), but never more than one ulp of the leaf's largest value.
    assert differ < 0.25
    assert np.abs(replicas - anchor).max() <= np.spacing(np.abs(anchor).max())


# Float64 params under jax_enable_x64 (docs/local-sgd-diloco.md, "Float64 params"): the anchor
# and the pseudo-gradients are float32 (DESIGN.md: float32 inside), so a sync lands every
# replica on the float32 anchor; jc.accumulate sums float64 gradients in float32. Until
# 2026-11-27 the sync's update was the float32 `anchor - float32(p)`, and `p + u` kept the
# digits of `p` below float32's resolution on each replica.
LOCO = {
    "diloco": lambda: jc.diloco(optax.sgd(1.0), "data", 1),
    "local_sgd": lambda: jc.local_sgd(optax.sgd(1.0), "data", 1),
    "sparseloco": lambda: jc.sparseloco(optax.sgd(1.0), "data", 1, min_size=0),
}


@pytest.mark.parametrize("name", sorted(LOCO))
def test_float64_params_sync_to_the_float32_anchor(name):
    tx = LOCO[name]()
    with jax.enable_x64(True):
        # float32 values plus 1e-12 .. 1.5e-11 (below float32's resolution at 1: 1.2e-7)
        params = {"w": jnp.asarray(1.0 + np.arange(16) * 1e-12, jnp.float64)}
        grads = jnp.asarray(np.random.default_rng(1).standard_normal((N, 16)) * 1e-3)

        def step(g):
            u, state = tx.update({"w": g}, tx.init(params), params)
            return u, state, optax.apply_updates(params, u)

        u, state, after = jax.jit(jax.vmap(step, axis_name="data"))(grads)
    anchor = np.asarray(state.anchor["w"])
    assert anchor.dtype == np.float32 and u["w"].dtype == after["w"].dtype == jnp.float64
    # every replica is the float32 anchor, exactly: the float64 digits are gone
    np.testing.assert_array_equal(np.asarray(after["w"]), np.broadcast_to(anchor, (N, 16)))
    if name == "local_sgd":  # the anchor is the mean params, rounded to float32
        exact = np.asarray(params["w"]) - np.asarray(grads).mean(0)
        assert 0 < np.abs(anchor - exact).max() <= 2**-23


def test_accumulate_sums_float64_gradients_in_float32():
    tx = jc.accumulate(optax.identity(), 2)
    with jax.enable_x64(True):
        params = {"w": jnp.ones(4, jnp.float64)}
        state = tx.init(params)
        _, state = tx.update({"w": jnp.ones(4, jnp.float64)}, state, params)
        u, state = tx.update({"w": jnp.full(4, 1e-9, jnp.float64)}, state, params)
    assert state.acc["w"].dtype == jnp.float32
    # 1 + 1e-9 rounds to 1 in float32: the applied mean is 0.5, not 0.5000000005
    np.testing.assert_array_equal(np.asarray(u["w"]), np.full(4, 0.5))
