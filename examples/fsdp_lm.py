"""FSDP (ZeRO-3) training of a small GPT-style character LM through compressed collectives.

Every weight is sharded over the ``"data"`` axis on its first dimension (each of the ``D``
devices holds ``1/D`` of every leaf), AdamW steps on the shards (its moments sharded the same
way), and each step gathers the weights with ``jc.fsdp_gather``: int8 blocks on the way out
(ZeRO++ qwZ), the gradients reduce-scattered as int4 blocks on the way back (qgZ), optionally
with error feedback (``--ef``). ``--replicas R`` adds a replica axis (a 2-D mesh ``R x D``,
HSDP): FSDP inside each replica group, the shard gradients averaged across groups by
``jc.compressed_allreduce``; ``--replica-transform diloco`` (or ``sparseloco``) lets each
replica group step on its own and syncs the groups every ``--sync-every`` steps instead
(params per group, its state from ``jc.sharded_init(..., param_specs=...)``). The text is
CPython's help() topics (``pydoc_data.topics``; no
download). The baseline is the same run with float32 collectives (``--weights none --grads
none``, and with ``--replicas`` the identity codec across groups: a float32 mean); same seed,
same batches. Bytes per device come from the compiled step (``jc.comm_report``)::

    python examples/fsdp_lm.py --steps 200                   # int8 / int4 against float32
    python examples/fsdp_lm.py --weights int4 --grads int2 --ef
    python examples/fsdp_lm.py --replicas 2 --replica-codec int8
    python examples/fsdp_lm.py --replicas 2 --replica-transform diloco --sync-every 10
    python -m jaxcomp.launch -n 2 --local-devices 2 examples/fsdp_lm.py --multiprocess

With ``--multiprocess`` (under ``jaxcomp.launch`` or a cluster) the mesh spans the devices
of every process, each feeds its slice of the batch, and each prints a SHA-256 of the
gathered params: they must agree.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _flags import WithDefaults, bounded  # examples/_flags.py
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp.cpu import use_cpu_devices

DATA, REPLICA = "data", "replica"
HEADS = 4  # attention heads of every block


def load_text() -> np.ndarray:
    """CPython's help() topics as bytes (about 0.47 MB of English and code)."""
    from pydoc_data.topics import topics

    return np.frombuffer("\n".join(topics.values()).encode("utf-8"), np.uint8)


def init_params(key: jax.Array, d: int = 128, layers: int = 2, context: int = 64) -> dict:
    """A pre-norm decoder: byte embedding, learned positions, ``layers`` blocks, a head."""
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out)) / np.sqrt(n_in)

    params = {
        "embed": 0.02 * jax.random.normal(next(keys), (256, d)),
        "pos": 0.02 * jax.random.normal(next(keys), (context, d)),
        "ln_f": jnp.ones((d,)),
        "head": dense(d, 256),
    }
    for i in range(layers):
        params[f"block{i}"] = {
            "ln1": jnp.ones((d,)),
            "qkv": dense(d, 3 * d),
            "out": dense(d, d) / np.sqrt(2 * layers),
            "ln2": jnp.ones((d,)),
            "mlp_in": dense(d, 4 * d),
            "mlp_out": dense(4 * d, d) / np.sqrt(2 * layers),
        }
    return params


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return scale * x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def forward(params: dict, tokens: jax.Array, heads: int = HEADS) -> jax.Array:
    """Logits ``[b, t, 256]`` of a causal decoder (RMS norms, 4x GELU MLP)."""
    b, t = tokens.shape
    x = params["embed"][tokens] + params["pos"][:t]
    d = x.shape[-1]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(sum(k.startswith("block") for k in params)):
        p = params[f"block{i}"]
        q, k, v = jnp.split(_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
        split = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
        att = jax.nn.dot_product_attention(split(q), split(k), split(v), mask=mask)
        x = x + att.reshape(b, t, d) @ p["out"]
        x = x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["mlp_in"]) @ p["mlp_out"]
    return _norm(x, params["ln_f"]) @ params["head"]


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
    logits = forward(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def codec(name: str | None):
    return None if name in (None, "none") else jc.get_codec(name)


def make_step(mesh, tx, weights, grads, error_feedback: bool, specs: Any, apart=False, count=None):
    """The jitted FSDP step ``(shards, opt_state, residual, tokens) -> (..., loss)``.
    ``apart``: the replica groups hold their own params (``jc.diloco`` / ``jc.sparseloco``
    over ``REPLICA``: stacked replicas, each device its slot). ``count``: the replica
    transform's step count fixed to this constant (``jc.at_count``: the bytes of that step)."""
    fsdp = mesh.shape[DATA]
    every = tuple(mesh.axis_names)

    def step(reps, opt_state, residual, tokens):
        shards = jc.own(reps) if apart else reps
        if count is not None:
            opt_state = jc.at_count(opt_state, count)

        def objective(shards, residual):
            if REPLICA in every and not apart:  # per-replica gradients: no hidden all-reduce
                shards = jax.lax.pcast(shards, REPLICA, to="varying")
            # HSDP: the exchange over the replicas skips a non-finite step on every device,
            # so every replica's residual is kept with it (skip_axis); apart, the replicas
            # step apart and a non-finite step keeps only its own replica's residuals.
            skip = REPLICA if REPLICA in every and not apart else ()
            params = jc.fsdp_gather(
                shards, DATA, weights=weights, grads=grads, residual=residual, skip_axis=skip
            )
            return loss_fn(params, tokens)

        if error_feedback:
            loss, (g, residual) = jax.value_and_grad(objective, argnums=(0, 1))(shards, residual)
        else:
            loss, g = jax.value_and_grad(objective)(shards, None)
        g = jax.tree.map(lambda x: x / fsdp, g)  # the sum over the data axis -> the mean
        updates, opt_state = tx.update(g, opt_state, shards)
        shards = optax.apply_updates(shards, updates)
        return jc.slot(shards) if apart else shards, opt_state, residual, jax.lax.pmean(loss, every)

    shard_specs, state_specs, residual_specs = specs
    in_specs = (shard_specs, state_specs, residual_specs, P(every))
    out_specs = (shard_specs, state_specs, residual_specs, P())
    # With a replica axis, jaxcomp's step counter and skip flag are reduced over the replica
    # axis only, so the type checker cannot see that they agree over the data axis (the
    # non-finite flag of jc.fsdp_gather is summed over the data axis): check_vma=False.
    check = REPLICA not in every
    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check),
        donate_argnums=(0, 1, 2),
    )


def setup(params, mesh, tx, error_feedback: bool, apart: bool = False):
    """Shards on the mesh, the optimizer state and the residual, and their specs."""
    if apart:
        return setup_apart(params, mesh, tx, error_feedback)
    shard_specs = jax.tree.map(lambda _: P(DATA), params)
    shards = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(DATA))), params)
    abstract = jax.eval_shape(tx.init, params)
    if REPLICA in mesh.axis_names:  # jaxcomp state per device: (replica, *data-sharded block)
        state_specs = jc.state_specs(abstract, REPLICA, shard_specs, params, mesh)
    else:
        state_specs = jax.tree.map(lambda _: P(), abstract)
    # AdamW's moments are sharded like the params (the step is manual over every axis).
    state_specs = jax.tree.map(
        lambda a, sp: P(DATA) if a.ndim and sp == P() else sp, abstract, state_specs
    )
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=(shard_specs,), out_specs=state_specs)
    opt_state = jax.jit(init)(shards)
    residual, residual_specs = None, None
    if error_feedback:
        every = tuple(mesh.axis_names)
        residual_specs = jax.tree.map(lambda _: P(every), params)
        init = jax.shard_map(
            lambda s: jc.fsdp_residual(s, DATA),
            mesh=mesh,
            in_specs=(shard_specs,),
            out_specs=residual_specs,
        )
        residual = jax.jit(init)(shards)
    return shards, opt_state, residual, (shard_specs, state_specs, residual_specs)


def setup_apart(params, mesh, tx, error_feedback: bool):
    """:func:`setup` for replica groups that hold their own params (``jc.diloco`` /
    ``jc.sparseloco`` over ``REPLICA``): stacked replicas ``P(REPLICA, DATA)``, the state of
    ``jc.sharded_init`` with the shards' ``param_specs`` (each array laid out like its shard:
    the inner AdamW moments, the anchor, memories), ``jc.state_specs`` of it."""
    data_specs = jax.tree.map(lambda _: P(DATA), params)
    shard_specs = jax.tree.map(lambda _: P(REPLICA, DATA), params)
    reps = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(REPLICA, DATA))),
        jc.replica_params(params, mesh, REPLICA),
    )
    opt_state = jc.sharded_init(tx, params, mesh, REPLICA, param_specs=data_specs)
    state_specs = jc.state_specs(opt_state, REPLICA, data_specs, params, mesh)
    residual, residual_specs = None, None
    if error_feedback:
        residual_specs = jax.tree.map(lambda _: P(tuple(mesh.axis_names)), params)
        init = jax.shard_map(
            lambda r: jc.fsdp_residual(jc.own(r), DATA),
            mesh=mesh,
            in_specs=(shard_specs,),
            out_specs=residual_specs,
        )
        residual = jax.jit(init)(reps)
    return reps, opt_state, residual, (shard_specs, state_specs, residual_specs)


def replica_tx(inner, transform: str, replica_codec: str, sync_every: int):
    """The transform across the replica groups, ``inner`` (AdamW) after or inside it. The
    leaves are shards over DATA, which ``check_vma=False`` does not type: ``shard_axis``."""
    if transform == "allreduce":
        across = jc.compressed_allreduce(jc.get_codec(replica_codec), REPLICA, shard_axis=DATA)
        return optax.chain(across, inner)
    if transform == "diloco":
        codec = None if replica_codec == "identity" else jc.get_codec(replica_codec)
        return jc.diloco(inner, REPLICA, sync_every, codec=codec, shard_axis=DATA)
    return jc.sparseloco(inner, REPLICA, sync_every, shard_axis=DATA)


def shape_error(d_model: int, data: int) -> str | None:
    """Why a ``d_model`` does not fit a data axis of ``data`` devices, or None: every leaf is
    sharded on its first dimension (256 bytes, ``CONTEXT`` positions or ``d_model``) and the
    attention splits ``d_model`` into ``HEADS`` heads."""
    if 64 % data:
        return f"the data axis ({data} devices) must divide the context length 64"
    if d_model % HEADS or d_model % data:
        return f"must be a multiple of {HEADS} (the heads) and of the data axis's {data} devices"
    return None


def make_mesh(replicas: int, devices: int | None = None):
    """``(replica, data)`` over ``devices`` devices (default all), or ``(data,)``."""
    n = devices or jax.device_count()
    if n % replicas:
        raise ValueError(f"`replicas`={replicas} must divide the {n} devices")
    shape, names = ((replicas, n // replicas), (REPLICA, DATA)) if replicas > 1 else ((n,), (DATA,))
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Explicit,) * len(shape), devices=jax.devices()[:n]
    )


def batches(seed: int, text: np.ndarray, size: int, context: int):
    """Random windows of ``context + 1`` bytes, ``size`` per step, the same for every run."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(text) - context - 1, size)
        yield np.stack([text[s : s + context + 1] for s in starts]).astype(np.int32)


def put_batch(batch: np.ndarray, mesh) -> jax.Array:
    """A global batch split over every device (each process feeds its own rows)."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    rows = len(batch) // jax.process_count()
    local = batch[jax.process_index() * rows : (jax.process_index() + 1) * rows]
    return jax.make_array_from_process_local_data(sharding, local, batch.shape)


def train(
    steps: int = 200,
    *,
    weights: str | None = "int8",
    grads: str | None = "int4",
    error_feedback: bool = False,
    replicas: int = 1,
    replica_codec: str = "int8",
    replica_transform: str = "allreduce",
    sync_every: int = 10,
    lr: float = 3e-3,
    batch_per_device: int = 4,
    d_model: int = 128,
    layers: int = 2,
    context: int = 64,
    seed: int = 0,
    eval_sequences: int = 256,
    devices: int | None = None,
    report_bytes: bool = True,
    verbose: bool = False,
) -> dict:
    """Train for ``steps`` and return ``eval_loss`` (held-out nats per byte), the train loss
    curve, ``bytes_per_device`` of one step (``jc.comm_report``), ``seconds`` and ``digest``
    (SHA-256 of the final params). ``devices``: use the first that many devices (default
    all); ``report_bytes=False`` skips ``comm_report`` (one compile less; bytes NaN).
    ``replica_transform``: across the replica groups, ``"allreduce"`` (HSDP: every step) or
    ``"diloco"`` / ``"sparseloco"`` (every ``sync_every`` steps; the bytes are the mean
    over a period, and the model evaluated is the mean of the groups')."""
    mesh = make_mesh(replicas, devices)
    text = load_text()
    split = int(0.9 * len(text))
    params = jax.jit(lambda: init_params(jax.random.PRNGKey(seed), d_model, layers, context))()
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), max(2, steps))
    tx = optax.adamw(schedule, weight_decay=0.01)
    apart = replicas > 1 and replica_transform != "allreduce"
    if replicas > 1:
        tx = replica_tx(tx, replica_transform, replica_codec, sync_every)
    shards, opt_state, residual, specs = setup(params, mesh, tx, error_feedback, apart)
    step_args = (mesh, tx, codec(weights), codec(grads), error_feedback, specs, apart)
    step = make_step(*step_args)
    data = batches(seed, text[:split], mesh.size * batch_per_device, context)
    tokens = put_batch(next(data), mesh)
    nbytes = float("nan")
    if report_bytes:
        nbytes = step_bytes(step_args, sync_every, (shards, opt_state, residual, tokens))
    curve, start = [], time.perf_counter()
    for i in range(steps):
        if i:
            tokens = put_batch(next(data), mesh)
        # Block every step: XLA:CPU collectives on few cores deadlock when steps queue up.
        shards, opt_state, residual, loss = jax.block_until_ready(
            step(shards, opt_state, residual, tokens)
        )
        curve.append(float(loss))
        if verbose and (i % 50 == 0 or i == steps - 1):
            print(f"  step {i:4d}  loss {curve[-1]:.4f}  {time.perf_counter() - start:.1f} s")
    seconds = time.perf_counter() - start
    # Replicated on every device: each process reads its own copy.
    full = gather_params(shards, mesh, apart)
    full = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), full)
    held_out = next(batches(12345, text[split:], eval_sequences, context))
    digest = hashlib.sha256(b"".join(a.tobytes() for a in jax.tree.leaves(full))).hexdigest()
    return {
        "eval_loss": float(jax.jit(loss_fn)(full, held_out)),
        "train_loss": curve,
        "bytes_per_device": nbytes,
        "seconds": seconds,
        "digest": digest,
        "params": sum(a.size for a in jax.tree.leaves(full)),
    }


def step_bytes(step_args: tuple, sync_every: int, operands: tuple) -> float:
    """Bytes per device per step of the compiled step (``jc.comm_report``); apart, the mean
    over a period of ``sync_every`` steps, its sync step and a local step each compiled with
    the count fixed (``jc.at_count``)."""
    if not step_args[-1]:
        return jc.comm_report(make_step(*step_args), *operands).bytes_per_device
    local, sync = (
        jc.comm_report(make_step(*step_args, count=c), *operands).bytes_per_device
        for c in (0, sync_every - 1)
    )
    return (sync + (sync_every - 1) * local) / sync_every


def gather_params(shards: Any, mesh, apart: bool = False) -> Any:
    """The full params on every process (uncompressed), to evaluate and compare; apart, the
    mean of the replica groups' params (``jc.mean_replica``)."""
    if apart:
        replicated = NamedSharding(mesh, P())
        return jax.jit(jc.mean_replica, out_shardings=replicated)(shards)
    return jax.jit(
        jax.shard_map(
            lambda s: jax.tree.map(
                lambda a: jax.lax.all_gather(a, DATA, tiled=True, to="invarying"), s
            ),
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: P(DATA), shards),),
            out_specs=P(),
        )
    )(shards)


def per_step(nbytes: float) -> str:
    """``nbytes`` a step in KiB, or "bytes not measured" for ``--no-report``'s NaN."""
    return "bytes not measured" if np.isnan(nbytes) else f"{nbytes / 2**10:.1f} KiB/device/step"


def check_shapes(parser: argparse.ArgumentParser, args: argparse.Namespace, devices: int):
    """A usage error naming the flag where ``--d-model`` or ``--devices`` cannot be sharded."""
    why = shape_error(args.d_model, devices // args.replicas)
    if why:
        flag = "--d-model" if why.startswith("must") else "--devices"
        parser.error(f"argument {flag}: {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=WithDefaults
    )
    parser.add_argument("--steps", type=bounded(int, 1), default=200, help="training steps")
    codecs = ["none", *sorted(jc.CODECS)]
    parser.add_argument("--weights", default="int8", choices=codecs, help="weight codec")
    parser.add_argument("--grads", default="int4", choices=codecs, help="gradient codec")
    parser.add_argument("--ef", action="store_true", help="error feedback on the gradients")
    parser.add_argument(
        "--replicas", type=bounded(int, 1), default=1, help="replica axis size (HSDP)"
    )
    parser.add_argument(
        "--replica-codec",
        default=None,
        choices=sorted(jc.CODECS),
        help="codec across the replica groups (with --replicas > 1; default int8)",
    )
    parser.add_argument(
        "--replica-transform",
        default="allreduce",
        choices=["allreduce", "diloco", "sparseloco"],
        help="across the replica groups: every step (HSDP) or every --sync-every steps",
    )
    parser.add_argument(
        "--sync-every", type=bounded(int, 1), default=10, help="steps between syncs (diloco)"
    )
    parser.add_argument("--d-model", type=bounded(int, 1), default=128, help="model width")
    parser.add_argument("--layers", type=bounded(int, 1), default=2, help="decoder blocks")
    parser.add_argument(
        "--devices", type=bounded(int, 1), default=8, help="CPU devices (one process)"
    )
    parser.add_argument("--multiprocess", action="store_true", help="join jaxcomp.launch")
    parser.add_argument("--no-baseline", action="store_true", help="only the compressed run")
    parser.add_argument("--no-report", action="store_true", help="skip comm_report (a compile)")
    args = parser.parse_args(argv)
    if not args.multiprocess and args.devices % args.replicas:
        parser.error(f"argument --replicas: must divide --devices ({args.devices})")
    if args.replica_codec is not None and args.replicas == 1:
        parser.error("argument --replica-codec: needs --replicas > 1 (no replica axis to cross)")
    if args.replica_transform != "allreduce" and args.replicas == 1:
        parser.error("argument --replica-transform: needs --replicas > 1 (no replica axis)")
    if args.replica_codec is not None and args.replica_transform == "sparseloco":
        parser.error("argument --replica-codec: sparseloco sends its own top-k payloads")
    if args.ef and args.grads in ("none", "identity"):
        parser.error(f"argument --ef: --grads {args.grads} is float32, nothing to feed back")
    if not args.multiprocess:
        check_shapes(parser, args, args.devices)
    if args.multiprocess:
        from jaxcomp.launch import initialize

        initialize()
        if jax.device_count() % args.replicas:
            parser.error(f"argument --replicas: must divide the {jax.device_count()} devices")
        check_shapes(parser, args, jax.device_count())
    elif __name__ == "__main__":  # run as a script: before jax creates its backends
        use_cpu_devices(args.devices)
    replica_codec = args.replica_codec or "int8"
    runs = {"compressed": (args.weights, args.grads, args.ef, replica_codec)}
    if not args.no_baseline:  # float32 everywhere, across the replica groups too
        runs["float32"] = ("none", "none", False, "identity")
    results = {}
    for name, (w, g, ef, rc) in runs.items():
        r = results[name] = train(
            args.steps,
            weights=w,
            grads=g,
            error_feedback=ef,
            replicas=args.replicas,
            replica_codec=rc,
            replica_transform=args.replica_transform if name == "compressed" else "allreduce",
            sync_every=args.sync_every,
            d_model=args.d_model,
            layers=args.layers,
            report_bytes=not args.no_report,
        )
        tag = f"[{jax.process_index()}] " if args.multiprocess else ""
        how = args.replica_transform if name == "compressed" else "allreduce"
        across = f" replicas {rc}" if args.replicas > 1 else ""
        if how != "allreduce":
            codec_name = "" if how == "sparseloco" else f" {rc}"
            across = f" replicas {how}{codec_name} every {args.sync_every} steps"
        print(
            f"{tag}{name}: weights {w} grads {g} ef {ef}{across}: "
            f"held-out loss {r['eval_loss']:.4f}, "
            f"train loss {r['train_loss'][0]:.3f} -> {r['train_loss'][-1]:.3f}, "
            f"{per_step(r['bytes_per_device'])}, {r['params']} params"
        )
        print(f"{tag}params sha256 {r['digest']}", flush=True)
    if "float32" in results:
        c, b = results["compressed"], results["float32"]
        print(
            f"compressed / float32: held-out loss {c['eval_loss'] / b['eval_loss']:.4f}, "
            + (
                f"bytes {c['bytes_per_device'] / b['bytes_per_device']:.3f}"
                if not args.no_report
                else "bytes not measured (--no-report)"
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
