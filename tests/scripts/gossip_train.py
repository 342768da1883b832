"""Gossip across processes, used by tests/test_gossip_multihost.py (one CPU device each, gloo).

Run under the launcher::

    python -m jaxcomp.launch -n 2 tests/scripts/gossip_train.py --steps 4

Each process holds its own replica of a small MLP (``jc.replica_params``) and steps it on its
own data; two transforms train side by side in one compiled step: exact gossip on the ring
mixing every 2 steps with ``gamma=1`` (``exact``: on 2 devices a mixing round is the exact
mean, so after an even number of steps the replicas agree) and CHOCO-SGD with int8
(``choco``: the replicas differ, their mean moves by the mean of the local steps). After
every step each process prints, for each transform::

    STEP <t> <name> <consensus distance> <mean error>

``consensus distance``: ``max_i ||x_i - mean|| / ||mean||`` over the processes (in a step
of its own, after the training step); ``mean error``: ``max |mean_t - (mean_{t-1} - LR *
mean_i g_i)|``, the mean of the replicas against the mean of the local SGD steps.
"""

from __future__ import annotations

import argparse
import sys

from jaxcomp.launch import initialize

initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomp as jc  # noqa: E402

AXIS = "data"
IN, HIDDEN, OUT, BATCH = 16, 32, 8, 8
LR = 0.1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ns = ap.parse_args(argv)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    k1, k2 = jax.random.split(jax.random.PRNGKey(42))
    one = {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
    }
    one = jax.device_put(one, NamedSharding(mesh, P()))
    txs = {
        "exact": jc.gossip(optax.sgd(LR), AXIS, every=2),
        "choco": jc.gossip(optax.sgd(LR), AXIS, codec=jc.int_quant(8)),
    }
    replicas = {name: jc.replica_params(one, mesh, AXIS) for name in txs}
    states = {name: jc.sharded_init(tx, one, mesh, AXIS) for name, tx in txs.items()}
    specs = {name: jc.state_specs(s, AXIS) for name, s in states.items()}
    rspecs = {name: jc.replica_specs(one, AXIS) for name in txs}

    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(r, s, t):
        key = jax.random.fold_in(
            jax.random.fold_in(jax.random.PRNGKey(7), t), jax.lax.axis_index(AXIS)
        )
        kx, ky = jax.random.split(key)
        x, y = jax.random.normal(kx, (BATCH, IN)), jax.random.normal(ky, (BATCH, OUT))
        new_r, new_s, expected = {}, {}, {}
        for name, tx in txs.items():
            p = jc.own(r[name])
            g = jax.grad(loss)(p, x, y)
            u, new_s[name] = tx.update(g, s[name], p)
            new_r[name] = jc.slot(optax.apply_updates(p, u))
            # The mean the replicas must have (for the check only: a pmean of the params).
            expected[name] = jax.tree.map(lambda a, b: jax.lax.pmean(a - LR * b, AXIS), p, g)
        return new_r, new_s, expected

    def check(r, expected):
        out = {}
        for name in txs:
            p = jc.own(r[name])
            mean = jax.tree.map(lambda a: jax.lax.pmean(a, AXIS), p)
            diffs = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), mean, expected[name])
            err = jnp.max(jnp.stack(jax.tree.leaves(diffs)))
            out[name] = (jc.consensus_distance(p, AXIS), err)
        return out

    step = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(rspecs, specs, P()), out_specs=(rspecs, specs, P())
        )
    )
    check = jax.jit(jax.shard_map(check, mesh=mesh, in_specs=(rspecs, P()), out_specs=P()))
    for t in range(ns.steps):
        replicas, states, expected = jax.block_until_ready(step(replicas, states, jnp.int32(t)))
        measured = jax.block_until_ready(check(replicas, expected))
        for name, (cd, err) in measured.items():
            cd = float(np.asarray(cd.addressable_data(0)))
            err = float(np.asarray(err.addressable_data(0)))
            print(f"STEP {t + 1} {name} {cd:.3e} {err:.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
