"""Decentralized training with gossip: 8 replicas of an MLP, each averaging with its neighbours.

Each device (8 simulated CPU devices when there is no accelerator) keeps its own replica of
a small MLP on scikit-learn's digits (ships offline), steps it on its own share of the batch
with momentum SGD, then mixes with its ring neighbours through ``jax.lax.ppermute``, sending
int8 differences to public copies (CHOCO-SGD, ``jc.gossip(..., codec=jc.int_quant(8))``).
There is no all-reduce: the replicas differ during training and agree at the end. Prints the
mean model's test accuracy, the consensus distance (how far the replicas are apart) and the
bytes each device sends per step, against plain data-parallel ``pmean``::

    python examples/gossip.py                                  # ring, int8
    python examples/gossip.py --topology exponential --steps 500
    python examples/gossip.py --codec none                     # exact gossip (float32)
"""

from __future__ import annotations

import argparse
import math
import sys

from _flags import WithDefaults, bounded  # examples/_flags.py

import jaxcomp as jc
from jaxcomp.cpu import use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "data"
CODECS = {"none": None, "int8": jc.int_quant(8), "int4": jc.int_quant(4)}


def load_digits_split():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    perm = np.random.RandomState(0).permutation(len(x))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def init(key, sizes=(64, 128, 10)):
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (a, b)) * math.sqrt(2.0 / a)
        params[f"b{i}"] = jnp.zeros((b,))
    return params


def logits(params, x):
    h = jax.nn.relu(x @ params["w0"] + params["b0"])
    return h @ params["w1"] + params["b1"]


def loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()


def train(topology: str = "ring", codec: str = "int8", steps: int = 300, batch: int = 256):
    (xtr, ytr), (xte, yte) = load_digits_split()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    params = jax.device_put(init(jax.random.PRNGKey(0)), NamedSharding(mesh, P()))
    tx = jc.gossip(optax.sgd(0.05, momentum=0.9), AXIS, topology=topology, codec=CODECS[codec])
    replicas = jc.replica_params(params, mesh, AXIS)  # (n, *shape), one per device
    state = jc.sharded_init(tx, params, mesh, AXIS)
    specs, rspecs = jc.state_specs(state, AXIS), jc.replica_specs(params, AXIS)

    def step(r, s, x, y):
        p = jc.own(r)  # this device's replica
        g = jax.grad(loss)(p, x, y)  # its own gradient: no all-reduce
        u, s = tx.update(g, s, p)  # local step, then mixing with the neighbours
        return jc.slot(optax.apply_updates(p, u)), s

    step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(rspecs, specs, P(AXIS), P(AXIS)),
            out_specs=(rspecs, specs),
        ),
        donate_argnums=(0, 1),
    )
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    rng = np.random.RandomState(0)
    report = jc.comm_report(step, replicas, state, put(xtr[:batch]), put(ytr[:batch]))
    for t in range(steps):
        idx = rng.randint(0, len(xtr), batch)
        # Block on each step: XLA:CPU collectives deadlock when steps queue up on few cores.
        replicas, state = jax.block_until_ready(step(replicas, state, put(xtr[idx]), put(ytr[idx])))
        if (t + 1) % max(1, steps // 5) == 0:
            distance = float(jc.consensus_distance(replicas))
            print(f"step {t + 1:4d}  consensus distance {distance:.4f}")
    mean = jc.mean_replica(jax.device_get(replicas))  # the model to evaluate
    accuracy = float(jnp.mean(jnp.argmax(logits(mean, xte), -1) == yte))
    d = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    pmean = 2 * (n - 1) / n * 4 * d
    return accuracy, float(jc.consensus_distance(replicas)), report.bytes_per_device, pmean


def compare(sent: float, pmean: float) -> str:
    """Which of gossip and pmean sends more, and by how much (a ratio of at least 1): with
    float32 differences or many neighbours gossip sends more than pmean."""
    if sent <= pmean:
        return f"{pmean / sent:.1f}x more than gossip"
    return f"gossip sends {sent / pmean:.1f}x more"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=WithDefaults)
    ap.add_argument("--topology", choices=jc.TOPOLOGIES, default="ring", help="who mixes with whom")
    ap.add_argument(
        "--codec", choices=list(CODECS), default="int8", help="what the differences are sent in"
    )
    ap.add_argument("--steps", type=bounded(int, 1), default=300, help="training steps")
    args = ap.parse_args(argv)
    accuracy, distance, sent, pmean = train(args.topology, args.codec, args.steps)
    t = jc.topology(args.topology, jax.device_count())
    print(
        f"{args.topology} ({t.neighbours} neighbours, spectral gap {t.spectral_gap():.3f}), "
        f"codec {args.codec}: mean model test accuracy {accuracy:.4f}, consensus distance "
        f"{distance:.4f}, {sent / 1024:.1f} KiB/device/step (plain pmean: {pmean / 1024:.1f} "
        f"KiB, {compare(sent, pmean)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
