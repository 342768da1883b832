"""Gossip (jc.gossip): topologies, the bytes model against the compiled step, mixing, CHOCO.

The contract items shared by every transform whose params are per-device replicas (NaN
freezes the state, orbax, pmap, sharded init, bad arguments) are rows of
tests/test_contract_replicas.py; here is what is particular to gossip. Each step is compiled
once (module cache) on a tiny tree.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Blocking, N, mesh, per_device, shard
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.topology import grid_shape

SHAPES = {"w": (32, 16), "b": (16,)}
LR = 0.1


def params() -> dict:
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def grads(n: int, t: int) -> dict:
    rng = np.random.default_rng(100 + t)
    return {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}


# --------------------------------------------------------------------------- topologies


@pytest.mark.parametrize("name", jc.TOPOLOGIES)
def test_topologies_are_doubly_stochastic_permutations(name):
    for n in range(1, 18):
        t = jc.topology(name, n)
        w = t.matrix()
        np.testing.assert_allclose(w.sum(0), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
        assert (w >= 0).all() and 0.0 <= t.spectral_gap() <= 1.0 + 1e-12
        for dest in t.dests:  # each a permutation without fixed points
            assert sorted(dest) == list(range(n)) and all(i != j for i, j in enumerate(dest))
        assert len(set(t.dests)) == t.neighbours
        if name == "ring":
            assert t.neighbours == min(2, n - 1)
        elif name == "torus":
            assert t.neighbours <= 4 and math.prod(t.grid) == n
        else:
            assert t.neighbours == (math.ceil(math.log2(n)) if n > 1 else 0)


def test_spectral_gaps_and_grid_shapes():
    gap = lambda name, n: jc.topology(name, n).spectral_gap()  # noqa: E731
    assert gap("ring", 8) == pytest.approx((2 / 3) * (1 - math.cos(2 * math.pi / 8)))
    assert gap("ring", 2) == pytest.approx(1.0)  # one edge, weights 1/2: exact in one round
    assert gap("exponential", 8) == pytest.approx(0.5)
    assert gap("torus", 16) == pytest.approx(0.4)
    for n in (8, 16, 32):  # the exponential graph mixes faster than the ring
        assert gap("exponential", n) > 2 * gap("ring", n)
    assert grid_shape(8) == (2, 4) and grid_shape(16) == (4, 4) and grid_shape(12) == (3, 4)
    assert jc.topology("torus", 7).dests == jc.topology("ring", 7).dests  # prime: the ring


# --------------------------------------------------------------------------- bytes model


def test_bytes_model_is_flat_in_n_and_a_third_of_pmean_for_int8():
    tree = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    d = 1024 * 1024
    codec = jc.int_quant(8)
    ring = {n: jc.gossip_bytes(tree, n, codec=codec) for n in (4, 8, 16, 64)}
    assert ring[8] == 2 * codec.payload_bytes(d) + 2 * 7 / 8 * 4
    assert max(ring.values()) - min(ring.values()) < 8  # only the 4-byte flag's all-reduce
    pmean = 2 * 7 / 8 * 4 * d
    assert ring[8] <= pmean / 3
    torus = {n: jc.gossip_bytes(tree, n, codec=codec, topology="torus") for n in (16, 64)}
    assert torus[16] == pytest.approx(torus[64], abs=8)  # 4 neighbours on both grids
    expo = [jc.gossip_bytes(tree, n, codec=codec, topology="exponential") for n in (4, 8, 16)]
    assert np.diff(expo) == pytest.approx([codec.payload_bytes(d)] * 2, abs=8)  # log2 n
    assert jc.gossip_bytes(tree, 8, every=4) == pytest.approx(2 * 4 * d / 4 + 7, abs=1e-9)


class Step:
    """A jitted shard_map gossip step over ``n`` devices on :func:`params` replicas."""

    def __init__(self, n: int, **kw):
        self.mesh = mesh(n)
        self.n = n
        self.tx = jc.gossip(optax.sgd(LR), "data", **kw)
        self.replicas = jc.replica_params(params(), self.mesh, "data")
        self.state = jc.sharded_init(self.tx, params(), self.mesh, "data")
        specs = jc.state_specs(self.state, "data")
        rspecs = jc.replica_specs(params(), "data")
        tx = self.tx

        def step(r, s, g):
            p = jc.own(r)
            u, s = tx.update(jc.own(g), s, p)
            return jc.slot(optax.apply_updates(p, u)), s, jc.consensus_distance(p, "data")

        self.jitted = jax.jit(
            jax.shard_map(
                step,
                mesh=self.mesh,
                in_specs=(rspecs, specs, P("data")),
                out_specs=(rspecs, specs, P()),
            )
        )
        self.run = Blocking(self.jitted)

    def put(self, g: dict) -> dict:
        return jax.device_put(g, NamedSharding(self.mesh, P("data")))

    def __call__(self, r, s, g):
        return self.run(r, s, self.put(g))


@functools.cache
def step_of(n: int, topology: str = "ring", codec=None, every: int = 1) -> Step:
    return Step(n, topology=topology, codec=codec, every=every)


def test_bytes_model_equals_comm_report():
    """Ring int8 on 4 devices (on 8: a row of tests/test_contract_replicas.py; the
    exponential graph's equality is measured by benchmarks/gossip.py, its permutations are
    checked above)."""
    n, topology, codec = 4, "ring", jc.int_quant(8)
    s = step_of(n, topology, codec)
    report = jc.comm_report(s.jitted, s.replicas, s.state, s.put(grads(n, 0)))
    # The consensus distance of this test step adds a pmean and a pmax: count the gossip only.
    gossip = [c for c in report.collectives if c.kind == "collective-permute"]
    flag = [c for c in report.collectives if c.kind == "all-reduce" and c.array_bytes == 4]
    got = sum(c.bytes_per_device for c in gossip) + flag[0].bytes_per_device
    assert got == pytest.approx(jc.gossip_bytes(params(), n, topology=topology, codec=codec))
    # One collective-permute per neighbour per bucket (int8 codes and f32 scales: 2 buckets).
    assert len(gossip) == 2 * jc.topology(topology, n).neighbours
    size = sum(math.prod(v) for v in SHAPES.values())
    assert all(c.array_bytes < 2 * size for c in report.collectives if c.kind == "all-gather")


# --------------------------------------------------------------------------- mixing


def test_choco_preserves_the_mean_and_contracts():
    n = 4  # the step of test_bytes_model_equals_comm_report: compiled once
    s = step_of(n, "ring", jc.int_quant(8))
    r, state = s.replicas, s.state
    expected = {k: np.asarray(v, np.float64) for k, v in params().items()}
    for t in range(3):
        g = grads(n, t)
        r, state, _ = s(r, state, g)
        for k in SHAPES:
            expected[k] = expected[k] - LR * g[k].mean(0)
    mean = jc.mean_replica(r)
    for k in SHAPES:
        np.testing.assert_allclose(mean[k], expected[k], atol=2e-6)
    spread = float(jc.consensus_distance(r))
    zero = {k: np.zeros((n, *v), np.float32) for k, v in SHAPES.items()}
    distances = []
    for _ in range(4):
        r, state, cd = s(r, state, zero)
        distances.append(float(cd))  # of the replicas before the step, in the step
    assert distances[0] == pytest.approx(spread, rel=1e-5)
    assert all(b < a for a, b in zip(distances, distances[1:], strict=False)), distances
    for k in SHAPES:  # mixing alone never moves the mean
        np.testing.assert_allclose(jc.mean_replica(r)[k], expected[k], atol=2e-6)


def test_exact_gossip_on_two_devices_agrees_after_every_rounds():
    """Ring of 2, gamma 1, no codec: each mixing round is the exact mean; with every=2 the
    replicas drift for a step, then agree (and the mean moved by the mean of the steps)."""
    s = step_of(2, every=2)
    r, state = s.replicas, s.state
    g0, g1 = grads(2, 0), grads(2, 1)
    r, state, _ = s(r, state, g0)
    w = np.asarray(r["w"])
    assert np.abs(w[0] - w[1]).max() > 1e-3  # a local step only
    r, state, _ = s(r, state, g1)
    w = np.asarray(r["w"])
    # Equal up to rounding: each device applies its update x' - x to its own x.
    np.testing.assert_allclose(w[0], w[1], rtol=0, atol=6e-8)
    want = params()["w"] - LR * (g0["w"] + g1["w"]).mean(0)
    np.testing.assert_allclose(w[0], want, atol=1e-6)
    assert float(jc.consensus_distance(r)) < 1e-6


def test_consensus_distance():
    x = {"w": jnp.array([[1.0, 1.0], [3.0, 3.0]]), "i": jnp.array([1, 2])}
    assert float(jc.consensus_distance(x)) == pytest.approx(0.5)
    assert float(jc.consensus_distance({"w": jnp.zeros((3, 2))})) == 0.0


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_consensus_distance_of_tiny_and_huge_params(scale):
    """Scaled norms: the plain norm gave 0 at 1e-30 (squares underflow) and NaN at 1e30."""
    x = {"w": jnp.array([[1.0, 1.0], [3.0, 3.0]]) * scale}
    assert float(jc.consensus_distance(x)) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_consensus_distance_of_a_nonfinite_replica_is_nan(bad):
    """A diverged replica was reported as agreement (0.0): the NaN mean failed norm > 0."""
    x = np.ones((N, 64), np.float32)
    x[3, 5] = bad
    assert np.isnan(float(jc.consensus_distance({"w": jnp.asarray(x)})))
    fn = per_device(lambda p: jc.consensus_distance(p[0], "data")[None], P("data"), P("data"))
    assert np.all(np.isnan(np.asarray(fn(shard(x)))))


# --------------------------------------------------------------------------- another topology


def test_choco_restored_into_another_topology_restarts_its_copies_and_agrees():
    """CHOCO (int8) run 4 steps on the ring of 4 devices, then 6 steps with zero gradients
    by the step of the exponential graph: its copies ``s_i = sum_j w_ij x_hat_j`` belong to
    the ring's matrix, so the state's ``topology`` restarts them from zero (CHOCO's own
    initialization, no exchange). The old code kept them: the replicas drifted apart (here
    0.23 -> 0.47; 8 devices, 30 steps: 0.56 -> 0.59 torus, 0.77 exponential)."""
    n, codec = 4, jc.int_quant(8)
    ring, other = step_of(n, "ring", codec), step_of(n, "exponential", codec)
    r, state = ring.replicas, ring.state
    for t in range(4):
        r, state, _ = ring(r, state, grads(n, t))
    start, mean = float(jc.consensus_distance(r)), jc.mean_replica(r)
    zero = {k: np.zeros((n, *v), np.float32) for k, v in SHAPES.items()}
    rr, ss = r, state
    for _ in range(6):
        rr, ss, _ = other(rr, ss, zero)
    assert float(jc.consensus_distance(rr)) < 1e-2 * start  # 3.1e-4 from 0.23 (old: 0.47)
    assert (int(state.topology), int(ss.topology)) == (0, jc.TOPOLOGIES.index("exponential"))
    for k in SHAPES:  # mixing alone never moves the mean
        np.testing.assert_allclose(jc.mean_replica(rr)[k], mean[k], atol=2e-6)


def test_choco_state_saved_without_its_topology_runs_as_before():
    """A CHOCO state built the old way (5 fields, ``topology`` None: what a checkpoint of
    the old layout restores) runs as before: the same bits as the state with the field."""
    from helpers import assert_trees_equal

    n, codec = 4, jc.int_quant(8)
    s = step_of(n, "ring", codec)
    old_state = jc.GossipState(*s.state[:5])
    specs = jc.state_specs(old_state, "data")
    rspecs = jc.replica_specs(params(), "data")

    def step(r, st, g):
        p = jc.own(r)
        u, st = s.tx.update(jc.own(g), st, p)
        return jc.slot(optax.apply_updates(p, u)), st

    fn = jax.jit(
        jax.shard_map(
            step, mesh=s.mesh, in_specs=(rspecs, specs, P("data")), out_specs=(rspecs, specs)
        )
    )
    r_old, r_new, new = s.replicas, s.replicas, s.state
    for t in range(3):
        r_old, old_state = jax.block_until_ready(fn(r_old, old_state, s.put(grads(n, t))))
        r_new, new, _ = s(r_new, new, grads(n, t))
    assert old_state.topology is None
    assert_trees_equal(r_old, r_new)
    assert_trees_equal(old_state._replace(topology=new.topology), new)
