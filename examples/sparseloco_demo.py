"""SparseLoCo and DeMo on 8 CPU devices, against AdamW with a per-step pmean.

A small MLP on scikit-learn's digits (ships offline), the same batches for every method:

* ``adamw``: data parallel, the gradients averaged by ``pmean`` every step;
* ``sparseloco``: each device runs AdamW on its own params (``jc.replica_params``); every
  ``--sync-every`` steps the pseudo-gradient goes through decayed error feedback and the
  chunked top-k codec (1.56% of each chunk, 2-bit values) in one all-gather;
* ``demo``: params replicated; each device keeps its momentum, sends the largest DCT
  components of each 64 x 64 block, and every device applies the sign of their mean.

Bytes are read from the compiled steps (``jc.comm_report``; SparseLoCo's sync step's, times
the run's syncs, over its steps).

    python examples/sparseloco_demo.py
    python examples/sparseloco_demo.py --steps 600 --sync-every 30 --averaging all
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

from jaxcomp._src.periodic import at_count, schedule  # noqa: E402

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


def loss(p, x, y):
    logits = jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def compile_step(mesh, tx, specs, pspecs, kind, count=None):
    """The jitted shard_map step: ``replica`` (params per device) or data parallel."""

    def step(p, s, x, y):
        if kind == "replica":
            if count is not None:  # a constant count: only that step's collectives
                s = at_count(s, count)
            own = jc.own(p)
            u, s = tx.update(jax.grad(loss)(own, x, y), s, own)
            return jc.slot(optax.apply_updates(own, u)), s
        g = jax.grad(loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
        if kind == "pmean":
            g = jax.lax.pmean(g, AXIS)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    specs_in = (pspecs, specs, P(AXIS), P(AXIS))
    fn = jax.shard_map(step, mesh=mesh, in_specs=specs_in, out_specs=(pspecs, specs))
    return jax.jit(fn, donate_argnums=(0, 1))


def syncs(steps: int, sync_every: int) -> int:
    """How many of ``steps`` steps sync (the periodic core's schedule: counts ``H-1, 2H-1...``)."""
    return sum(any(schedule(t, sync_every=sync_every)) for t in range(steps))


def check_flags(ap: argparse.ArgumentParser, args) -> None:
    """Usage errors for flags that parse but cannot run, before any training: a run that
    ends before its first sync (no bytes to compare: its replicas never met), and a
    ``--topk`` that ``jc.demo`` refuses (more than a 64 x 64 block's 4096 components)."""
    if args.steps < args.sync_every:
        ap.error(
            f"argument --steps: {args.steps} ends before the first sync "
            f"(--sync-every {args.sync_every})"
        )
    try:
        make("demo", args)
    except ValueError as e:
        ap.error(f"argument --topk: {e}")


def make(method: str, args) -> tuple[str, optax.GradientTransformation]:
    if method == "adamw":
        return "pmean", optax.adamw(args.lr)
    if method == "demo":
        return "demo", jc.demo(args.demo_lr, AXIS, topk=args.topk)
    tx = jc.sparseloco(optax.adamw(args.lr), AXIS, args.sync_every, averaging=args.averaging)
    return "replica", tx


def train(method: str, args) -> tuple[float, float]:
    """(test accuracy, bytes per step per device averaged over the run)."""
    kind, tx = make(method, args)
    return run(tx, kind, args.steps, args.sync_every)


def run(tx, kind: str, steps: int, sync_every: int) -> tuple[float, float]:
    """Train ``tx`` (``kind``: ``"pmean"``, ``"replica"`` or ``"demo"``) for ``steps``:
    (test accuracy, bytes per step per device over the run; a replica step syncs every
    ``sync_every``: the sync step's bytes times the run's syncs, over ``steps``)."""
    (xtr, ytr), (xte, yte) = load_digits()
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(AxisType.Explicit,))
    params = init_params(jax.random.PRNGKey(0))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    state = jc.sharded_init(tx, params, mesh, AXIS)
    specs = jc.state_specs(state, AXIS)
    if kind == "replica":
        p, pspecs = jc.replica_params(params, mesh, AXIS), jc.replica_specs(params, AXIS)
    else:
        p, pspecs = jax.device_put(params, NamedSharding(mesh, P())), P()
    sample = (put(xtr[:256]), put(ytr[:256]))
    if kind == "replica":  # the sync step's bytes, at each of the run's syncs
        sync = compile_step(mesh, tx, specs, pspecs, kind, sync_every - 1)
        per_sync = jc.comm_report(sync, p, state, *sample).bytes_per_device
        per_step = per_sync * syncs(steps, sync_every) / steps
    else:
        fn = compile_step(mesh, tx, specs, pspecs, kind)
        per_step = jc.comm_report(fn, p, state, *sample).bytes_per_device
    step = blocking(compile_step(mesh, tx, specs, pspecs, kind))
    rng = np.random.RandomState(1)
    for _ in range(steps):
        idx = rng.randint(0, len(xtr), 256)
        p, state = step(p, state, put(xtr[idx]), put(ytr[idx]))
    final = jax.device_get(p)
    if kind == "replica":
        final = jc.mean_replica(final)
    logits = jax.nn.relu(xte @ final["w0"] + final["b0"]) @ final["w1"] + final["b1"]
    return float(jnp.mean(jnp.argmax(logits, -1) == yte)), per_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=WithDefaults)
    ap.add_argument("--steps", type=bounded(int, 1), default=300, help="training steps")
    ap.add_argument(
        "--sync-every", type=bounded(int, 1), default=10, help="H: SparseLoCo's inner steps"
    )
    ap.add_argument(
        "--averaging",
        default="senders",
        choices=("all", "senders"),
        help="SparseLoCo's mean of a coordinate: over the devices that sent it, or over all",
    )
    ap.add_argument(
        "--lr",
        type=bounded(float, 0, open_low=True),
        default=1e-3,
        help="AdamW (baseline and inner)",
    )
    ap.add_argument(
        "--demo-lr", type=bounded(float, 0, open_low=True), default=3e-4, help="DeMo's sign step"
    )
    ap.add_argument(
        "--topk", type=bounded(int, 1), default=16, help="DeMo: components per 64x64 block"
    )
    args = ap.parse_args(argv)
    check_flags(ap, args)
    rows = [(m, *train(m, args)) for m in ("adamw", "sparseloco", "demo")]
    base = rows[0][2]
    print(f"{'method':10s} {'accuracy':>9s} {'bytes/step/device':>18s} {'x fewer':>8s}")
    for method, acc, per_step in rows:
        print(f"{method:10s} {acc:>9.4f} {per_step:>18.0f} {base / per_step:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
