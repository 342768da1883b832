"""The digits MLP trained data-parallel with Flax NNX: the training runs of scale_bytes.

The same model and step as ``examples/flax_nnx_train.py`` (an MLP 64-256-10 on sklearn's
digits, ``optax.chain(jc.compressed_allreduce(...), opt)`` on the nnx params in
``jax.shard_map`` over every device), with the knobs the benchmarks turn: ``compress_kwargs``
for ``jc.compressed_allreduce`` (``server_feedback``, ``worker_momentum``), ``momentum=None``
(plain SGD after a vote) and learning-rate schedules. The example stays a standalone script;
this is the copy the benchmarks and their tests import. Call
:func:`jaxcomp.cpu.use_cpu_devices` before jax starts for 8 devices on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from benchmarks import common
from jaxcomp.cpu import blocking

AXIS = "data"


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(din, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


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


def make_transform(codec_name: str, strategy: str, error_feedback, optimizer, **kwargs):
    if codec_name == "none":
        return optimizer
    codec = jc.get_codec(codec_name)
    compress = jc.compressed_allreduce(
        codec, AXIS, strategy=strategy, error_feedback=error_feedback, min_size=1024, **kwargs
    )
    return optax.chain(compress, optimizer)


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

    ``compress_kwargs`` go to ``jc.compressed_allreduce`` (e.g. ``server_feedback=False``).
    ``optimizer``: ``"sgd"`` (momentum SGD, the default the tests pin) or ``"adamw"``.
    """
    (xtr, ytr), (xte, yte) = common.load_digits_split(seed)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    replicated = NamedSharding(mesh, P())
    model = MLP(64, hidden, 10, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    inner = make_optimizer(optimizer, lr, momentum)
    tx = make_transform(codec_name, strategy, error_feedback, inner, **(compress_kwargs or {}))

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    def test_loss(p) -> float:
        return float(loss_fn(nnx.merge(graphdef, nnx.State(p)), jnp.asarray(xte), jnp.asarray(yte)))

    def build_step(tx, reduce_plain):
        # The error-feedback memory differs per device: the state lives outside the step as
        # arrays sharded P("data") (jc.sharded_init / jc.state_specs). Params and state are
        # donated, so the memories are updated in place.
        opt_state = jc.sharded_init(tx, params, mesh, AXIS)
        specs = jc.state_specs(opt_state, AXIS)

        def step(p, s, x, y):
            # pcast: params are replicated; make them per-device before grad, so JAX does
            # not insert an implicit f32 all-reduce of every gradient.
            local = nnx.merge(graphdef, nnx.State(jax.lax.pcast(p, AXIS, to="varying")))
            g = nnx.to_pure_dict(nnx.grad(loss_fn)(local, x, y))
            if reduce_plain:
                g = jax.lax.pmean(g, AXIS)
            updates, s = tx.update(g, s, p)  # jc.compressed_allreduce averages g, then opt
            return optax.apply_updates(p, updates), s

        sm = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
        )
        return blocking(jax.jit(sm, donate_argnums=(0, 1))), opt_state

    step, opt_state = build_step(tx, codec_name == "none")
    base_step, base_state = build_step(inner, True)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    p = jax.device_put(params, replicated)
    sample = (put(xtr[:batch]), put(ytr[:batch]))
    bytes_step = jc.comm_report(step, p, opt_state, *sample).bytes_per_device
    base_bytes = jc.comm_report(base_step, p, base_state, *sample).bytes_per_device

    initial_loss = test_loss(params)
    rng = np.random.RandomState(seed)
    iterator = range(steps)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc=codec_name, leave=False)
    for _ in iterator:
        idx = rng.randint(0, len(xtr), batch)
        p, opt_state = step(p, opt_state, put(xtr[idx]), put(ytr[idx]))
    logits = nnx.merge(graphdef, nnx.State(p))(jnp.asarray(xte))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == yte))
    return Result(codec_name, accuracy, bytes_step, base_bytes, test_loss(p), initial_loss)
