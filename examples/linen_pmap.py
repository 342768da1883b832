"""The classic Flax Linen ``TrainState`` step, with a compressed gradient mean, under
``jax.pmap`` or ``jax.shard_map``.

Two ways to drop jaxcomp into an existing training loop:

* ``--variant pmean``: replace ``grads = jax.lax.pmean(grads, "batch")`` by
  ``grads = jc.pmean(grads, "batch", codec)``. One line, stateless, no error feedback.
* ``--variant ef``: chain ``jc.compressed_allreduce`` in front of the optimizer and call
  ``state.apply_gradients(grads=local_grads)``; the error-feedback memory lives in the
  ``TrainState``'s ``opt_state``, one per device.

Per-device memory, by ``--parallel``:

* ``pmap``: every leaf of the ``TrainState`` has a leading device axis; ``jc.replicate``
  stacks the state and the memories diverge as they should.
* ``shard_map``: ``state.replace(opt_state=jc.sharded_init(tx, params, mesh, "batch"))``
  and ``jc.state_specs(state, "batch")`` (a ``TrainState`` of specs: params ``P()``,
  memories ``P("batch")``) as the step's in/out specs; the step passes the params through
  ``jax.lax.pcast(params, "batch", to="varying")`` before ``jax.grad``.

    python examples/linen_pmap.py --variant ef --codec sign
    python examples/linen_pmap.py --variant ef --codec sign --parallel shard_map
    python examples/linen_pmap.py --variant pmean --codec int8 --steps 300
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from _flags import bounded  # examples/_flags.py

import jaxcomp as jc
from jaxcomp.cpu import blocking, use_cpu_devices

if __name__ == "__main__":
    use_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "batch"
VARIANTS = ("plain", "pmean", "ef")
PARALLEL = ("pmap", "shard_map")


def load_digits_split(seed: int = 0):
    """sklearn digits (ships offline), pixels in [0, 1], a fixed 1400/397 train/test split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    perm = np.random.RandomState(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


class MLP(nn.Module):
    hidden: int = 256

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


@dataclass
class Result:
    variant: str
    codec: str
    accuracy: float
    bytes_per_step: float  # ring-model bytes each device sends per step (compiled program)
    baseline_bytes: float  # the same step with lax.pmean

    @property
    def ratio(self) -> float:
        return self.baseline_bytes / self.bytes_per_step


def loss_fn(params, apply_fn, x, y):
    logits = apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(variant: str, codec: jc.Codec | None, pcast: bool = False):
    """One device's step: (state, x, y) -> state. ``pcast``: under ``shard_map``, make the
    replicated params per-device first, so ``jax.grad`` adds no float32 all-reduce."""

    def step(state: train_state.TrainState, x, y):
        params = jax.lax.pcast(state.params, AXIS, to="varying") if pcast else state.params
        grads = jax.grad(loss_fn)(params, state.apply_fn, x, y)
        if variant == "plain":
            grads = jax.lax.pmean(grads, AXIS)  # the line jaxcomp replaces
        elif variant == "pmean":
            key = jax.random.fold_in(jax.random.PRNGKey(0), state.step)  # stochastic codecs
            grads = jc.pmean(grads, AXIS, codec, key=key, min_size=1024)
        # variant "ef": local grads; jc.compressed_allreduce in state.tx averages them
        return state.apply_gradients(grads=grads)

    return step


def make_step(variant: str, codec: jc.Codec | None):
    """The pmapped train step: (state, x, y) -> state, every leaf with a device axis."""
    return blocking(jax.pmap(train_step(variant, codec), axis_name=AXIS, donate_argnums=(0,)))


def make_shard_map_step(variant: str, codec: jc.Codec | None, mesh, specs):
    """The same step under ``jax.shard_map``: ``specs = jc.state_specs(state, AXIS)``."""
    step = jax.shard_map(
        train_step(variant, codec, pcast=True),
        mesh=mesh,
        in_specs=(specs, P(AXIS), P(AXIS)),
        out_specs=specs,
    )
    return blocking(jax.jit(step, donate_argnums=(0,)))


def sharded_state(state: train_state.TrainState, mesh) -> train_state.TrainState:
    """``state`` for a ``shard_map`` step: the optimizer state per device
    (``jc.sharded_init``), everything else replicated on ``mesh``."""
    state = jax.device_put(state, NamedSharding(mesh, P()))
    return state.replace(opt_state=jc.sharded_init(state.tx, state.params, mesh, AXIS))


def make_tx(variant: str, codec: jc.Codec | None, lr: float, momentum: float):
    optimizer = optax.sgd(lr, momentum=momentum)
    if variant != "ef":
        return optimizer
    return optax.chain(jc.compressed_allreduce(codec, AXIS, min_size=1024), optimizer)


def train(
    variant: str = "ef",
    codec_name: str = "sign",
    *,
    steps: int = 500,
    batch: int = 256,
    hidden: int = 256,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    progress: bool = False,
    parallel: str = "pmap",
) -> Result:
    """Train the Linen MLP on digits over all local devices, with ``jax.pmap`` or
    ``jax.shard_map`` (``parallel``)."""
    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}, got {variant!r}")
    if parallel not in PARALLEL:
        raise ValueError(f"`parallel` must be one of {PARALLEL}, got {parallel!r}")
    (xtr, ytr), (xte, yte) = load_digits_split(seed)
    n = jax.local_device_count()
    if batch % n:
        raise ValueError(f"`batch` ({batch}) must be divisible by the {n} local devices")
    codec = None if variant == "plain" else jc.get_codec(codec_name)
    model = MLP(hidden)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 64)))["params"]
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))

    def build(variant):
        tx = make_tx(variant, codec, lr, momentum)
        state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        if parallel == "pmap":  # per-device copies; EF memories then diverge
            return make_step(variant, codec), jc.replicate(state, n)
        state = sharded_state(state, mesh)
        return make_shard_map_step(variant, codec, mesh, jc.state_specs(state, AXIS)), state

    def shard(a):
        if parallel == "pmap":
            return a.reshape(n, -1, *a.shape[1:])
        return jax.device_put(a, NamedSharding(mesh, P(AXIS)))

    step, state = build(variant)
    sample = (shard(xtr[:batch]), shard(ytr[:batch]))
    bytes_step = jc.comm_report(step, state, *sample).bytes_per_device
    base_bytes = jc.comm_report(*build("plain"), *sample).bytes_per_device

    rng = np.random.RandomState(seed)
    iterator = range(steps)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc=f"{variant}/{codec_name}", leave=False)
    for _ in iterator:
        idx = rng.randint(0, len(xtr), batch)
        state = step(state, shard(xtr[idx]), shard(ytr[idx]))
    first = state.params
    if parallel == "pmap":
        first = jax.tree.map(lambda a: a[0], state.params)
        # Every device must hold the same params: the update is the (compressed) mean.
        spread = max(float(jnp.max(jnp.abs(a - a[0]))) for a in jax.tree.leaves(state.params))
        assert spread == 0.0, f"devices disagree on the params by {spread}"
    logits = model.apply({"params": first}, jnp.asarray(xte))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == yte))
    name = "none" if variant == "plain" else codec_name
    return Result(variant, name, accuracy, bytes_step, base_bytes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--variant", default="ef", choices=VARIANTS, help="how jaxcomp enters")
    ap.add_argument("--parallel", default="pmap", choices=PARALLEL, help="jax.pmap or shard_map")
    ap.add_argument(
        "--codec",
        default=None,
        choices=sorted(jc.CODECS),
        help="None: sign (--variant plain sends float32: no codec)",
    )
    ap.add_argument("--steps", type=bounded(int, 1), default=500, help="training steps")
    ap.add_argument(
        "--lr", type=bounded(float, 0, open_low=True), default=0.05, help="SGD learning rate"
    )
    args = ap.parse_args(argv)
    if args.variant == "plain" and args.codec is not None:
        ap.error("argument --codec: --variant plain is jax.lax.pmean in float32, no codec")
    platform = jax.devices()[0].platform
    print(f"devices: {jax.local_device_count()} x {platform}; Linen MLP, {args.parallel}")
    for variant in dict.fromkeys(("plain", args.variant)):  # plain once
        r = train(
            variant,
            args.codec or "sign",
            steps=args.steps,
            lr=args.lr,
            progress=True,
            parallel=args.parallel,
        )
        print(
            f"  {variant:6s} {r.codec:8s} acc {100 * r.accuracy:5.1f}%  "
            f"{jc.format_bytes(r.bytes_per_step)}/step/device  "
            f"{r.ratio:5.1f}x fewer bytes than lax.pmean",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
