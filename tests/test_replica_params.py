"""Replicated params per device (jc.replica_params, own, slot, mean_replica, replica_specs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import N, mesh
from jax.sharding import PartitionSpec as P

import jaxcomp as jc


def test_replicas_round_trip_through_a_shard_map_step():
    m = mesh()
    params = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(3)}
    replicas = jc.replica_params(params, m, "data")
    assert replicas["w"].shape == (N, 2, 3)
    assert replicas["w"].sharding.spec == P("data")
    specs = jc.replica_specs(params, "data")

    def step(r):
        p = jc.own(r)
        i = jax.lax.axis_index("data").astype(jnp.float32)
        return jc.slot({"w": p["w"] + i, "step": p["step"]})

    out = jax.jit(jax.shard_map(step, mesh=m, in_specs=(specs,), out_specs=specs))(replicas)
    out = jax.block_until_ready(out)
    w = np.asarray(out["w"])
    for i in range(N):
        np.testing.assert_array_equal(w[i], params["w"] + i)
    mean = jc.mean_replica(out)
    np.testing.assert_allclose(mean["w"], params["w"] + (N - 1) / 2)
    assert mean["w"].dtype == jnp.float32 and int(mean["step"]) == 3


def test_replica_params_names_a_missing_axis():
    with pytest.raises(ValueError, match="`axis_name`"):
        jc.replica_params({"w": jnp.zeros(3)}, mesh(), "model")
