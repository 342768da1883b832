"""DiLoCo with int4 pseudo-gradients on 8 CPU devices, against per-step pmean.

A small MLP on scikit-learn's digits (ships offline). Each device keeps its own copy of the
params (``jc.replica_params``: stacked ``(n, *shape)``, sharded over ``"data"``) and runs
momentum SGD on its own batch; every ``--sync-every`` steps the pseudo-gradient (the global
params minus this device's) is averaged through the codec with error feedback and an outer
Nesterov step moves the global params, from which every device restarts. ``--fragments``
streams the sync in parts at staggered steps; ``--delay`` lets each exchange land that many
steps later. The baseline averages the gradients with ``pmean`` every step. Both see the
same batches. Bytes are read from the compiled steps (``jc.comm_report``): DiLoCo sends
only on sync steps.

    python examples/diloco.py                         # int4, H = 20
    python examples/diloco.py --codec none --sync-every 50
    python examples/diloco.py --fragments 4 --delay 2
"""

from __future__ import annotations

import argparse
import sys

from _flags import WithDefaults, bounded  # examples/_flags.py

import jaxcomp as jc
from jaxcomp.cpu import blocking, use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxcomp._src.periodic import schedule  # noqa: E402

AXIS = "data"


def load_digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    perm = np.random.RandomState(0).permutation(len(x))
    return (x[perm[:1400]], y[perm[:1400]]), (x[perm[1400:]], y[perm[1400:]])


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "w0": jax.random.normal(k1, (64, 256)) * np.sqrt(2 / 64),
        "b0": jnp.zeros(256),
        "w1": jax.random.normal(k2, (256, 10)) * np.sqrt(2 / 256),
        "b1": jnp.zeros(10),
    }


def logits(p, x):
    return jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]


def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()


def exchanges(steps: int, **when) -> list[int]:
    """The steps of a run of ``steps`` at which an exchange lands (``when``: the schedule's
    ``sync_every``, ``fragments``, ``delay``)."""
    return [t for t in range(steps) if any(schedule(t, **when))]


def train(
    method: str, steps: int, sync_every: int, codec: str, fragments: int, delay: int
) -> tuple[float, float]:
    """(test accuracy, bytes per step per device averaged over the run's ``steps``)."""
    (xtr, ytr), (xte, yte) = load_digits()
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(AxisType.Explicit,))
    params = init_params(jax.random.PRNGKey(0))
    inner = optax.sgd(0.05, momentum=0.9)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731

    if method == "pmean":
        state = jc.sharded_init(inner, params, mesh, AXIS)
        specs = jc.state_specs(state, AXIS)

        def dp_step(p, s, x, y):
            g = jax.grad(loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
            u, s = inner.update(jax.lax.pmean(g, AXIS), s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(
            jax.shard_map(
                dp_step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
            ),
            donate_argnums=(0, 1),
        )
        p = jax.device_put(params, NamedSharding(mesh, P()))
        per_step = jc.comm_report(step, p, state, put(xtr[:256]), put(ytr[:256])).bytes_per_device
    else:
        tx = jc.diloco(
            inner,
            AXIS,
            sync_every,
            codec=None if codec == "none" else jc.get_codec(codec),
            fragments=fragments,
            delay=delay,
        )
        state = jc.sharded_init(tx, params, mesh, AXIS)  # per-device inner state, P("data")
        specs = jc.state_specs(state, AXIS)
        pspecs = jc.replica_specs(params, AXIS)

        def make_step(count=None):
            def replica_step(replicas, s, x, y):
                if count is not None:  # a constant count: only that step's collectives
                    s = jc.at_count(s, count)
                p = jc.own(replicas)  # this device's params
                u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
                return jc.slot(optax.apply_updates(p, u)), s

            return jax.jit(
                jax.shard_map(
                    replica_step,
                    mesh=mesh,
                    in_specs=(pspecs, specs, P(AXIS), P(AXIS)),
                    out_specs=(pspecs, specs),
                ),
                donate_argnums=(0, 1),
            )

        step = make_step()
        p = jc.replica_params(params, mesh, AXIS)
        sample = (put(xtr[:256]), put(ytr[:256]))
        # The bytes of each step of the run that exchanges (the compiled program of its
        # position in a period after the first), over the run's steps (the others send
        # nothing; in the first period a delayed exchange has not landed yet).
        when = dict(sync_every=sync_every, fragments=fragments, delay=delay)
        sends = [c for c in range(sync_every) if any(schedule(c + sync_every, **when))]
        sent = {
            c: jc.comm_report(make_step(c + sync_every), p, state, *sample).bytes_per_device
            for c in sends
        }
        runs = exchanges(steps, **when)
        per_step = sum(sent[t % sync_every] for t in runs) / steps
    step = blocking(step)
    rng = np.random.RandomState(1)
    for _ in range(steps):
        idx = rng.randint(0, len(xtr), 256)
        p, state = step(p, state, put(xtr[idx]), put(ytr[idx]))
    final = jax.device_get(p)
    if method != "pmean":
        final = jc.mean_replica(final)  # replicas agree after a full sync; else the mean
    accuracy = float(jnp.mean(jnp.argmax(logits(final, xte), -1) == yte))
    return accuracy, per_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=WithDefaults)
    ap.add_argument("--steps", type=bounded(int, 1), default=400, help="training steps")
    ap.add_argument(
        "--sync-every", type=bounded(int, 1), default=20, help="H: inner steps per outer step"
    )
    ap.add_argument(
        "--codec",
        default="int4",
        choices=["none", *sorted(jc.CODECS)],
        help="pseudo-gradient codec (none: float32)",
    )
    ap.add_argument(
        "--fragments", type=bounded(int, 1), default=1, help="Streaming DiLoCo fragments"
    )
    ap.add_argument(
        "--delay", type=bounded(int, 0), default=0, help="steps before an exchange lands"
    )
    args = ap.parse_args(argv)
    if args.fragments > args.sync_every or args.delay >= args.sync_every:
        ap.error("argument --fragments / --delay: at most / less than --sync-every")
    when = dict(sync_every=args.sync_every, fragments=args.fragments, delay=args.delay)
    if not exchanges(args.steps, **when):
        ap.error(f"argument --steps: {args.steps} ends before the first exchange lands")
    rows = []
    for method in ("pmean", "diloco"):
        acc, per_step = train(
            method, args.steps, args.sync_every, args.codec, args.fragments, args.delay
        )
        rows.append((method, acc, per_step))
    base = rows[0][2]
    print(f"{'method':8s} {'accuracy':>9s} {'bytes/step/device':>18s} {'x fewer':>8s}")
    for method, acc, per_step in rows:
        print(f"{method:8s} {acc:>9.4f} {per_step:>18.0f} {base / per_step:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
