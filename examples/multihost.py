"""Multi-host data-parallel training with a compressed gradient all-reduce.

Every process runs this same script. ``jaxcomp.launch.initialize()`` joins them: on a
cluster or TPU pod it is ``jax.distributed.initialize()`` with auto-detection (SLURM, Open
MPI, Cloud TPU, ...); under the local launcher it reads the coordinator from the
environment and uses gloo CPU collectives::

    python -m jaxcomp.launch -n 2 examples/multihost.py --steps 20
    python -m jaxcomp.launch -n 2 --local-devices 2 examples/multihost.py --codec int8

The mesh spans the devices of all processes; each process feeds only its own slice of the
global batch (``jax.make_array_from_process_local_data``), params are replicated, the
error-feedback memory is per device. At the end every process prints a SHA-256 of its copy
of the params: they must all be equal (tests/test_multihost.py checks it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _flags import WithDefaults, bounded  # examples/_flags.py
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp.launch import ENV_COORDINATOR, initialize

AXIS = "data"
HOW_TO_LAUNCH = """\
Every process of the run executes this script. Start them with a launcher:

  python -m jaxcomp.launch -n 2 examples/multihost.py --steps 20        # 2 local processes
  python -m jaxcomp.launch -n 2 --local-devices 2 examples/multihost.py # 2 x 2 CPU devices

or on a cluster or TPU pod that jax.distributed.initialize() detects (SLURM, Open MPI,
Cloud TPU, ...), one process per host."""


def join() -> None:
    """``jaxcomp.launch.initialize()`` before any other jax work; run directly, outside a
    launcher and a cluster, exit saying how to launch instead of a bare jax error."""
    if ENV_COORDINATOR in os.environ:
        initialize()
        return
    try:
        initialize()  # jax.distributed.initialize(): cluster auto-detection
    except (ValueError, RuntimeError) as e:
        sys.exit(f"multihost.py: no processes to join ({e})\n\n{HOW_TO_LAUNCH}")


def load_digits_split(seed: int = 0):
    """sklearn digits in [0, 1], a fixed 1400/397 split (the same on every process)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    perm = np.random.RandomState(seed).permutation(len(x))
    return (x[perm][:1400], y[perm][:1400]), (x[perm][1400:], y[perm][1400:])


def init_params(seed: int, hidden: int) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "w1": jax.random.normal(k1, (64, hidden)) / 8.0,
        "b1": jnp.zeros((hidden,)),
        "w2": jax.random.normal(k2, (hidden, 10)) / jnp.sqrt(hidden),
        "b2": jnp.zeros((10,)),
    }


def logits_of(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(p, x), y).mean()


def params_digest(params) -> str:
    """SHA-256 of this process's copy of the (replicated) params, leaf by leaf."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return h.hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=HOW_TO_LAUNCH,
        formatter_class=WithDefaults,
    )
    ap.add_argument("--codec", default="sign", choices=sorted(jc.CODECS), help="gradient codec")
    ap.add_argument("--strategy", default="auto", choices=jc.STRATEGIES, help="the exchange")
    ap.add_argument("--steps", type=bounded(int, 1), default=100, help="training steps")
    ap.add_argument(
        "--batch", type=bounded(int, 1), default=256, help="global batch, over all processes"
    )
    ap.add_argument("--hidden", type=bounded(int, 1), default=128, help="MLP hidden width")
    ap.add_argument(
        "--lr", type=bounded(float, 0, open_low=True), default=0.05, help="SGD learning rate"
    )
    ap.add_argument("--no-report", action="store_true", help="skip comm_report (one compile less)")
    args = ap.parse_args(argv)
    join()

    n, rank, nproc = jax.device_count(), jax.process_index(), jax.process_count()
    if args.batch % n:
        ap.error(f"argument --batch: {args.batch} is not divisible by the {n} devices")
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    try:
        exchange = jc.compressed_allreduce(jc.get_codec(args.codec), AXIS, strategy=args.strategy)
    except ValueError as e:  # e.g. majority_vote for a codec that is not a sign
        ap.error(f"argument --strategy: {e}")
    tx = optax.chain(exchange, optax.sgd(args.lr, momentum=0.9))
    params = jax.device_put(init_params(0, args.hidden), NamedSharding(mesh, P()))
    opt_state = jc.sharded_init(tx, params, mesh, AXIS)
    specs = jc.state_specs(opt_state, AXIS)

    def step(p, s, x, y):
        g = jax.grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
        ),
        donate_argnums=(0, 1),  # params and state are updated in place
    )
    batch_sharding = NamedSharding(mesh, P(AXIS))
    local = args.batch // nproc  # this process's rows of the global batch

    def global_batch(x, y):
        mine = slice(rank * local, (rank + 1) * local)
        return (
            jax.make_array_from_process_local_data(batch_sharding, x[mine]),
            jax.make_array_from_process_local_data(batch_sharding, y[mine]),
        )

    (xtr, ytr), (xte, yte) = load_digits_split()
    rng = np.random.RandomState(0)  # the same sequence on every process: one global batch
    wire = ""
    if not args.no_report:
        sample = global_batch(xtr[: args.batch], ytr[: args.batch])
        report = jc.comm_report(step, params, opt_state, *sample)
        wire = f", {jc.format_bytes(report.bytes_per_device)}/step/device"
    print(
        f"process {rank}/{nproc}: {jax.local_device_count()} of {n} devices, "
        f"codec {args.codec}{wire}",
        flush=True,
    )
    for t in range(args.steps):
        idx = rng.randint(0, len(xtr), args.batch)
        params, opt_state = jax.block_until_ready(
            step(params, opt_state, *global_batch(xtr[idx], ytr[idx]))
        )
        if t % 10 == 0 or t == args.steps - 1:
            loss = loss_fn(jax.tree.map(lambda a: a.addressable_data(0), params), xte, yte)
            print(f"step {t:4d}  test loss {float(loss):.4f}", flush=True)
    local_params = jax.tree.map(lambda a: a.addressable_data(0), params)
    acc = float(jnp.mean(jnp.argmax(logits_of(local_params, xte), -1) == yte))
    print(f"test accuracy {100 * acc:.1f}%", flush=True)
    print(f"params sha256 {params_digest(params)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
