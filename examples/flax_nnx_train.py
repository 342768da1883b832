"""Data-parallel Flax NNX training with a compressed gradient all-reduce.

A small MLP on scikit-learn's digits (ships offline), data-parallel with ``nnx.shard_map``
under ``nnx.jit`` over all devices (8 simulated CPU devices when there is no accelerator).
The model is updated by an ``nnx.Optimizer`` holding the recipe ``jc.sgd(lr, codec, "data")``
(momentum SGD, the default: each device's momentum goes through the codec, with error
feedback) or ``optax.chain(jc.compressed_allreduce(codec, "data"), optax.adamw(...))``.
``jc.nnx_optimizer`` builds the optimizer with one error-feedback memory per device (laid out
``P("data")``), ``jc.nnx_state_specs`` gives its specs for ``nnx.shard_map``; the step
donates model and optimizer. Bytes on the wire come from the compiled step
(``jc.comm_report``).

    python examples/flax_nnx_train.py --codec sign           # one run
    python examples/flax_nnx_train.py --codec int8 --optimizer adamw --strategy two_phase
    python examples/flax_nnx_train.py --demo                 # the `make demo` table
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "data"
DEMO_CODECS = ["none", "fp16", "int8", "int4", "sign", "qsgd", "natural", "terngrad"]


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def load_digits_split(seed: int = 0):
    """sklearn digits, pixels in [0, 1], a fixed 1400/397 train/test split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    perm = np.random.RandomState(seed).permutation(len(x))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


@dataclass
class Result:
    codec: str
    accuracy: float
    bytes_per_step: float  # ring-model bytes each device sends per step (compiled program)
    baseline_bytes: float  # the same step with plain pmean
    test_loss: float  # cross-entropy on the test split after training ...
    initial_test_loss: float  # ... and before

    @property
    def ratio(self) -> float:
        return self.baseline_bytes / self.bytes_per_step


def make_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    """``"sgd"``: momentum SGD; ``"adamw"``: AdamW (weight decay 1e-4)."""
    if name == "sgd":
        return optax.sgd(lr, momentum=momentum)
    if name == "adamw":
        return optax.adamw(lr, weight_decay=1e-4)
    raise ValueError(f"`optimizer` must be 'sgd' or 'adamw', got {name!r}")


def make_transform(
    codec_name: str, strategy: str, error_feedback, optimizer, *, recipe=None, **kwargs
):
    """The optimizer with ``codec_name``'s exchange. Momentum SGD uses the recipe
    ``jc.sgd`` (``recipe``: ``(lr, momentum)``): each device's momentum goes through the
    codec; AdamW follows ``jc.compressed_allreduce`` (the mean gradient)."""
    if codec_name == "none":
        return optimizer
    codec = jc.get_codec(codec_name)
    options = dict(strategy=strategy, error_feedback=error_feedback, min_size=1024, **kwargs)
    if recipe is not None:
        lr, momentum = recipe
        return jc.sgd(lr, codec, AXIS, momentum=momentum, **options)
    return optax.chain(jc.compressed_allreduce(codec, AXIS, **options), optimizer)


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def make_step(mesh, opt_specs, reduce_plain: bool):
    """The train step (model, optimizer, x, y) -> mean loss, updating both in place.

    ``opt_specs``: ``jc.nnx_state_specs(optimizer, "data")``. ``jc.nnx_local`` makes the
    replicated ``nnx.Param`` state per-device before ``nnx.grad`` (``jax.lax.pcast``): without
    it jax would all-reduce every gradient in float32 (and jaxcomp refuses the summed
    gradients); what the forward writes elsewhere (RNG counts, BatchNorm statistics,
    averaged) is written back to ``model``, which a pcast of the whole model would drop.
    ``reduce_plain``: the uncompressed baseline, ``lax.pmean`` of the gradients before a
    plain optax optimizer.
    """

    @nnx.jit(donate_argnums=(0, 1))
    @nnx.shard_map(mesh=mesh, in_specs=(P(), opt_specs, P(AXIS), P(AXIS)), out_specs=P())
    def step(model, optimizer, x, y):
        with jc.nnx_local(model, AXIS) as local:  # per-device Params; the rest written back
            loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)
        if reduce_plain:
            grads = jax.lax.pmean(grads, AXIS)
        optimizer.update(model, grads)  # jaxcomp's exchange averages the gradients
        return jax.lax.pmean(loss, AXIS)

    return step


def train(
    codec_name: str = "none",
    *,
    steps: int = 1000,
    batch: int = 256,
    hidden: int = 256,
    lr: float = 0.05,
    momentum: float = 0.9,
    strategy: str = "auto",
    error_feedback="auto",
    seed: int = 0,
    progress: bool = False,
    compress_kwargs: dict | None = None,
    optimizer: str = "sgd",
) -> Result:
    """Train the MLP data-parallel; return test accuracy and wire bytes per step.

    ``compress_kwargs`` go to the exchange (e.g. ``server_feedback=False``).
    ``optimizer``: ``"sgd"`` (momentum SGD through the recipe ``jc.sgd``, the default the
    tests pin) or ``"adamw"`` (after ``jc.compressed_allreduce``).
    """
    (xtr, ytr), (xte, yte) = load_digits_split(seed)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    inner = make_optimizer(optimizer, lr, momentum)
    tx = make_transform(
        codec_name,
        strategy,
        error_feedback,
        inner,
        recipe=(lr, momentum) if optimizer == "sgd" else None,
        **(compress_kwargs or {}),
    )

    def build(tx, reduce_plain):
        model = MLP(64, hidden, 10, rngs=nnx.Rngs(seed))
        opt = jc.nnx_optimizer(model, tx, mesh, AXIS)  # per-device memories, P("data")
        step = blocking(make_step(mesh, jc.nnx_state_specs(opt, AXIS), reduce_plain))
        return step, model, opt

    step, model, opt = build(tx, codec_name == "none")
    base_step, base_model, base_opt = build(inner, True)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    sample = (put(xtr[:batch]), put(ytr[:batch]))
    bytes_step = jc.comm_report(step, model, opt, *sample).bytes_per_device
    base_bytes = jc.comm_report(base_step, base_model, base_opt, *sample).bytes_per_device

    xte, yte = jnp.asarray(xte), jnp.asarray(yte)
    initial_loss = float(loss_fn(model, xte, yte))
    rng = np.random.RandomState(seed)
    iterator = range(steps)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc=codec_name, leave=False)
    for _ in iterator:
        idx = rng.randint(0, len(xtr), batch)
        step(model, opt, put(xtr[idx]), put(ytr[idx]))
    accuracy = float(jnp.mean(jnp.argmax(model(xte), -1) == yte))
    return Result(
        codec_name, accuracy, bytes_step, base_bytes, float(loss_fn(model, xte, yte)), initial_loss
    )


def print_table(results: list[Result]) -> None:
    base = next((r.accuracy for r in results if r.codec == "none"), None)
    header = ("codec", "bytes/step/device", "vs pmean", "test acc", "delta")
    print("\n{:10s} {:>18s} {:>9s} {:>9s} {:>7s}".format(*header))
    for r in results:
        delta = "" if base is None else f"{100 * (r.accuracy - base):+.1f}"
        print(
            f"{r.codec:10s} {jc.format_bytes(r.bytes_per_step):>18s} "
            f"{r.ratio:>8.1f}x {100 * r.accuracy:>8.1f}% {delta:>7s}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--codec",
        default=None,
        choices=["none", *sorted(jc.CODECS)],
        help="None: sign (with --demo: the demo's codecs, refused here)",
    )
    ap.add_argument("--strategy", default="auto", choices=jc.STRATEGIES, help="the exchange")
    ap.add_argument(
        "--error-feedback",
        default="auto",
        choices=["auto", "residual", "ef21", "none"],
        help="error-feedback kind",
    )
    ap.add_argument("--steps", type=bounded(int, 1), default=1000, help="training steps per codec")
    ap.add_argument(
        "--optimizer", default="sgd", choices=["sgd", "adamw"], help="the optax optimizer"
    )
    ap.add_argument(
        "--lr",
        type=bounded(float, 0, open_low=True),
        default=None,
        help="None: sgd 0.05, adamw 0.002",
    )
    ap.add_argument("--demo", action="store_true", help="compare several codecs (make demo)")
    args = ap.parse_args(argv)
    if args.demo and args.codec is not None:
        ap.error(f"argument --codec: --demo trains its own codecs {DEMO_CODECS}")
    ef = None if args.error_feedback == "none" else args.error_feedback
    lr = args.lr if args.lr is not None else {"sgd": 0.05, "adamw": 2e-3}[args.optimizer]
    names = DEMO_CODECS if args.demo else list(dict.fromkeys(["none", args.codec or "sign"]))
    recipe = (lr, 0.9) if args.optimizer == "sgd" else None
    for name in names:  # an exchange that cannot carry the codec: refused before any training
        try:
            make_transform(name, args.strategy, ef, optax.identity(), recipe=recipe)
        except ValueError as e:
            flag = "--error-feedback" if "`error_feedback`" in str(e) else "--strategy"
            ap.error(f"argument {flag}: {e}")
    print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; digits MLP 64-256-10")
    results = []
    for name in names:
        r = train(
            name,
            steps=args.steps,
            lr=lr,
            optimizer=args.optimizer,
            strategy=args.strategy,
            error_feedback=ef,
            progress=True,
        )
        results.append(r)
        print(f"  {name:10s} acc {100 * r.accuracy:5.1f}%  {r.ratio:5.1f}x fewer bytes", flush=True)
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
