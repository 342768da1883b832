"""A character-level transformer on Python's own documentation, trained data-parallel with
PowerSGD (or any jaxcomp transform) in front of Adam, against the uncompressed all-reduce.

The text is ``pydoc_data.topics.topics`` (the help() pages shipped with CPython, ~0.47 MB of
English and code): no download. Bytes are the vocabulary (256). The model is a small
pre-norm Flax NNX transformer: 2 layers, d_model 128, 4 heads, context 64.

The model, data and data-parallel step of the convergence benchmarks
(``benchmarks.powersgd_convergence``, the ``char`` task of ``benchmarks.convergence``). Run on
its own it trains on 8 CPU devices (or whatever accelerators are there)::

    python -m benchmarks.char_transformer --steps 300

Both runs use the same seed, the same batches and the same number of steps; the output is
the held-out loss (nats per byte) of each and the bytes each step puts on the wire. What
PowerSGD reaches at 1000 to 5000 steps is on the docs' "Choosing a codec" page, generated
from ``benchmarks/results/powersgd_convergence*.json``. Thousands of steps take minutes on a
GPU with ``--workers 8`` (8 workers emulated with ``jax.vmap`` on one device, the same
arithmetic as 8 devices).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from benchmarks import common
from jaxcomp._src.powersgd import plan_of, powersgd

AXIS = "data"


def load_text() -> np.ndarray:
    """The help() topics of CPython as one uint8 array."""
    from pydoc_data.topics import topics

    return np.frombuffer("\n".join(topics.values()).encode("utf-8"), np.uint8)


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and a 4x MLP."""

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(d, 4 * d, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
        split = lambda a: a.reshape(b, t, self.heads, d // self.heads)
        mask = jnp.tril(jnp.ones((t, t), bool))
        att = jax.nn.dot_product_attention(split(q), split(k), split(v), mask=mask)
        x = x + self.out(att.reshape(b, t, d))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))


class CharTransformer(nnx.Module):
    def __init__(
        self, *, context: int, d: int, layers: int, heads: int, rngs: nnx.Rngs, vocab: int = 256
    ):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (context, d)))
        self.blocks = nnx.List([Block(d, heads, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)  # vocab > 256: rows no byte uses

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def matrices_only(params: Any) -> Any:
    """PowerSGD mask: compress the blocks' matrices, send the byte embedding, the position
    table and the output head (the vocabulary-facing matrices) through plain ``pmean``."""
    vocabulary = ("['embed']", "['pos']", "['head']")
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not jax.tree_util.keystr(path).startswith(vocabulary), params
    )


def make_tx(
    compression: str | Callable[[str], Any],
    *,
    rank: int,
    optimizer: str,
    lr: float,
    steps: int,
    schedule: str,
    powersgd_options: dict[str, Any] | None = None,
) -> tuple[optax.GradientTransformation, bool]:
    """(the gradient transform, whether it already averages over the axis)."""
    if schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), steps)
    elif schedule != "constant":
        raise ValueError(f"`schedule` must be 'cosine' or 'constant', got {schedule!r}")
    if optimizer == "recipe":  # compression(axis, lr) is the whole optimizer (jc.sgd, ...)
        if not callable(compression):
            raise ValueError("`optimizer`='recipe' needs a factory (axis, lr) -> optimizer")
        return compression(AXIS, lr), True
    if optimizer == "adam":
        opt = optax.adam(lr)
    elif optimizer == "sgd":
        opt = optax.sgd(lr, momentum=0.9, nesterov=True)
    elif optimizer == "plain_sgd":  # for transforms with momentum of their own (jc.dgc)
        opt = optax.sgd(lr)
    else:
        raise ValueError(
            f"`optimizer` must be 'adam', 'sgd', 'plain_sgd' or 'recipe', got {optimizer!r}"
        )
    if compression == "none":
        return opt, False
    if compression == "powersgd":
        return optax.chain(powersgd(rank, AXIS, **(powersgd_options or {})), opt), True
    return optax.chain(compression(AXIS), opt), True


@functools.cache
def model_programs(context: int, d_model: int, layers: int, heads: int, seed: int) -> tuple:
    """``(graphdef, init, loss_fn, eval_loss)`` of one model configuration: ``init()`` its
    params in one compiled call (eager NNX init compiles every small op on its own),
    ``loss_fn(params, tokens)`` the next-byte cross-entropy and ``eval_loss`` it jitted. Built
    once per configuration, so runs of the same model (a baseline and a compressed run)
    compile the initialization and the held-out loss once."""

    def make_model():
        return CharTransformer(
            context=context, d=d_model, layers=layers, heads=heads, rngs=nnx.Rngs(seed)
        )

    graphdef = nnx.graphdef(nnx.eval_shape(make_model))

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return graphdef, jax.jit(lambda: nnx.state(make_model())), loss_fn, jax.jit(loss_fn)


def train(
    compression: str | Callable[[str], Any] = "powersgd",
    steps: int = 200,
    *,
    rank: int = 4,
    optimizer: str = "adam",
    lr: float | None = None,
    schedule: str = "cosine",
    batch_per_device: int = 2,
    context: int = 64,
    d_model: int = 128,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    eval_sequences: int = 256,
    powersgd_options: dict[str, Any] | None = None,
    verbose: bool = False,
    progress: bool | str = False,
    return_details: bool = False,
    report_bytes: bool = False,
    workers: int | None = None,
) -> float | dict[str, Any]:
    """Train for ``steps`` and return the held-out loss (nats per byte).

    Args:
      compression: ``"none"`` (plain ``pmean`` of the gradients), ``"powersgd"`` (rank
        ``rank`` with error feedback, the defaults of :func:`jaxcomp._src.powersgd`), or a factory
        ``axis_name -> optax transform`` that returns the mean gradient (e.g.
        ``lambda ax: jc.compressed_allreduce(jc.sign(), ax)``).
      steps: optimizer steps. Same batches and initialization for every ``compression``.
      rank: the PowerSGD rank (``compression="powersgd"``).
      optimizer: ``"adam"``, ``"sgd"`` (Nesterov momentum 0.9) or ``"plain_sgd"`` (no
        momentum: for ``jc.dgc``, which applies its own), after the compression; or
        ``"recipe"``: ``compression(axis_name, lr)`` is the whole optimizer (``jc.sgd``).
      lr: peak learning rate (default 3e-3 for Adam, 0.2 for SGD).
      schedule: ``"cosine"`` (5% linear warm-up, cosine decay to 0 at ``steps``) or
        ``"constant"``.
      batch_per_device: sequences per device per step (the global batch is times the number
        of devices).
      powersgd_options: keyword arguments of :func:`jaxcomp._src.powersgd` besides the rank
        (e.g. ``{"start_step": 100}``); the defaults otherwise.
      progress: show a tqdm progress bar (a string: its description).
      return_details: return a dict with the loss curve and the training time as well.
      report_bytes: add the step's wire bytes (:func:`jaxcomp.comm_report`) to the details.
      workers: None (default) runs one data-parallel worker per device, ``shard_map`` over
        all devices. An int runs that many workers on one device instead, as
        ``jax.vmap(step, axis_name="data")``: the collectives become sums over the vmapped
        axis, so the arithmetic is that of ``workers`` devices (same batches, same result up
        to float rounding) and a single GPU can stand in for 8 devices in long runs.
    """
    t0 = time.perf_counter()
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)):
        raise TypeError(f"`workers` must be None or an int, got {workers!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"`workers` must be >= 1, got {workers}")
    if workers is not None and report_bytes:
        raise ValueError("`report_bytes` needs the shard_map program: leave `workers` at None")
    n_dev = workers or jax.device_count()
    text = load_text()
    split_at = int(0.9 * len(text))
    train_text, eval_text = text[:split_at], text[split_at:]

    _, init, loss_fn, eval_loss = model_programs(context, d_model, layers, heads, seed)
    params = init()
    if lr is None:
        lr = 3e-3 if optimizer == "adam" else 0.2
    tx, averages = make_tx(
        compression,
        rank=rank,
        optimizer=optimizer,
        lr=lr,
        steps=steps,
        schedule=schedule,
        powersgd_options=powersgd_options,
    )

    def step(p, opt_state, tokens):
        # pcast: per-device gradients, no implicit all-reduce by grad (vmap needs none).
        local = p if workers is not None else jax.lax.pcast(p, AXIS, to="varying")
        loss, grads = jax.value_and_grad(loss_fn)(local, tokens)
        if not averages:
            grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, jax.lax.pmean(loss, AXIS)

    step, params, opt_state, put = data_parallel(step, tx, params, workers, outputs=1)

    def batch(rng, source, size):
        starts = rng.integers(0, len(source) - context - 1, size)
        return np.stack([source[s : s + context + 1] for s in starts]).astype(np.int32)

    data_rng = np.random.default_rng(seed)
    first = put(batch(data_rng, train_text, n_dev * batch_per_device))
    report = jc.comm_report(step, params, opt_state, first) if report_bytes else None
    curve = []
    if verbose:
        print(f"  set-up {time.perf_counter() - t0:.1f} s")
    start = time.perf_counter()
    tokens = first
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=progress if isinstance(progress, str) else None, leave=False)
    for i in range(steps):
        if i:
            tokens = put(batch(data_rng, train_text, n_dev * batch_per_device))
        # Block every step: XLA:CPU collectives on few cores deadlock when steps queue up.
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state, tokens))
        curve.append(float(loss if workers is None else loss[0]))
        if bar is not None:
            bar.update()
            if i % 20 == 0:
                bar.set_postfix(loss=f"{curve[-1]:.3f}")
        if verbose and (i % 50 == 0 or i == steps - 1):
            print(f"  step {i:4d}  train loss {curve[-1]:.4f}  {time.perf_counter() - start:.1f} s")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start

    eval_tokens = jnp.asarray(batch(np.random.default_rng(12345), eval_text, eval_sequences))
    if workers is not None:  # every worker holds the same params
        params = jax.tree.map(lambda x: x[0], params)
    held_out = float(eval_loss(jax.device_get(params), eval_tokens))
    if not return_details:
        return held_out
    details = {"eval_loss": held_out, "train_loss": curve, "seconds": seconds}
    if report is not None:
        details.update(
            bytes_per_device=report.bytes_per_device,
            collectives=report.count,
            branch_bytes=report.branch_bytes(),  # per lax.cond / switch branch
            report=report,
        )
    # Steady-state bytes of the gradient exchange (ring model), whatever the warm-up.
    floats = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    if compression == "powersgd":
        options = {
            k: v
            for k, v in (powersgd_options or {}).items()
            if k in ("min_size", "min_compression_rate", "mask")
        }
        plan = plan_of(params, rank, **options)
        floats = plan.p_size + plan.q_size + plan.plain_size
    details["gradient_bytes_per_device"] = 2 * (n_dev - 1) / n_dev * 4 * floats
    return details


def data_parallel(step, tx, params, workers=None, batches=1, outputs=0):
    """Compile ``step(params, opt_state, *batch) -> (params, opt_state, *out)`` over ``AXIS``.

    ``workers=None``: one worker per device, ``shard_map`` over all devices (params
    replicated, each of the ``batches`` batch arguments split on its first axis, the
    ``outputs`` extra outputs replicated). An int: that many workers on the default device,
    ``jax.vmap(step, axis_name=AXIS)``; every leaf of the params, the state and the outputs
    then has a leading worker axis (equal copies where replicated). Returns ``(step, params,
    opt_state, put)``, ``put(batch)`` placing one host batch of all workers.
    """
    if workers is not None:
        params = jax.tree.map(lambda x: jnp.broadcast_to(x, (workers, *x.shape)), params)
        opt_state = jax.jit(jax.vmap(tx.init))(params)
        step = jax.jit(jax.vmap(step, axis_name=AXIS), donate_argnums=(0, 1))
        return step, params, opt_state, lambda b: jnp.asarray(b.reshape(workers, -1, *b.shape[1:]))
    mesh = jax.make_mesh(
        (jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    opt_state = jc.sharded_init(tx, params, mesh, AXIS)
    specs = jc.state_specs(opt_state, AXIS)
    in_specs = (P(), specs, *[P(AXIS)] * batches)
    out_specs = (P(), specs, *[P()] * outputs)
    step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
        donate_argnums=(0, 1),
    )
    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch_sharding = NamedSharding(mesh, P(AXIS))
    return step, params, opt_state, lambda b: jax.device_put(b, batch_sharding)


def main(argv: list[str] | None = None) -> None:
    parser = common.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Writes no file: prints the held-out loss of each run (the convergence "
        "benchmarks call train() and write the results). 300 steps take a few minutes on "
        "8 CPU devices.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument(
        "--optimizer", choices=("adam", "sgd", "plain_sgd"), default="adam", help="the optimizer"
    )
    parser.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (None: the optimizer's)"
    )
    parser.add_argument("--start-step", type=int, default=10, help="PowerSGD warm-up steps")
    parser.add_argument(
        "--batch-per-device", type=int, default=2, help="sequences per device per step"
    )
    parser.add_argument("--devices", type=int, default=8, help="CPU devices when no accelerator")
    parser.add_argument(
        "--workers", type=int, help="emulate this many workers on one device (jax.vmap)"
    )
    args = parser.parse_args(argv)
    # Only used where there is no accelerator; must come before any other use of jax.
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # XLA:CPU collectives
    results = {}
    for name in ("none", "powersgd"):
        print(f"{name}:")
        results[name] = r = train(
            name,
            args.steps,
            rank=args.rank,
            optimizer=args.optimizer,
            lr=args.lr,
            batch_per_device=args.batch_per_device,
            powersgd_options={"start_step": args.start_step},
            workers=args.workers,
            verbose=True,
            return_details=True,
        )
        print(
            f"  held-out loss {r['eval_loss']:.4f}  {r['seconds']:.1f} s  gradient exchange "
            f"{r['gradient_bytes_per_device'] / 2**10:.1f} KiB/device/step"
        )
    base, comp = results["none"]["eval_loss"], results["powersgd"]["eval_loss"]
    print(f"powersgd / none held-out loss: {comp / base:.4f}")


if __name__ == "__main__":
    main()
