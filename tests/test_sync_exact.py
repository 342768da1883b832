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
