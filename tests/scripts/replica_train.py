"""Multi-process training used by tests/test_replicas.py and tests/test_faults.py.

Run under the launcher (one CPU device per process, gloo collectives)::

    python -m jaxcomp.launch -n 4 tests/scripts/replica_train.py families --steps 50
    python -m jaxcomp.launch -n 4 tests/scripts/replica_train.py fault --steps 30 \
        --ckpt DIR --every 10 [--die-rank 2 --die-step 25] [--resume]

``families`` trains a small MLP (gradient descent, ``LR``) with one representative transform
of every codec family (same seed, data drawn per device inside the step; ``--families a,b``
for a subset) and prints ``INIT <sha256>`` of the initial params, ``HASH <family> <sha256>
<finite|nonfinite>`` of the trained ones (identical on every process when the replicas
agree), then ``PAYLOAD <codec>
<same|differ> <leaf>``: whether the payload each device would send for the SAME input is
identical across devices (random-k indices: must be; stochastic rounding: must not be).

``fault`` trains one transform with an orbax checkpoint every ``--every`` steps. With
``--die-rank`` that process ``os._exit(3)``s right after step ``--die-step`` (a crash: no
clean-up, no goodbye to the coordinator). ``--resume`` restores the latest checkpoint and
continues. Prints ``FINAL <sha256>`` at the end. ``--clean-ckpt DIR`` then trains again from
step 0, uninterrupted (checkpoints into DIR), in the same processes (no second start-up) and
prints ``CLEAN <sha256>``: a resumed run must end on it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

from jaxcomp.launch import initialize

initialize()

import jax  # noqa: E402

# A relaunch (the fault test restarts from a checkpoint) reuses the compiled programs.
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomp as jc  # noqa: E402
from jaxcomp._src import collectives  # noqa: E402

AXIS = "data"
IN, HIDDEN, OUT, BATCH = 16, 64, 32, 8
LR = 0.1  # plain gradient descent after the transform
# Every matrix (w1: 1024 floats, w2: 2048) compressed, the bias (64) sent by plain pmean: the
# small-leaf path, and a third less per-leaf codec code to trace and compile in each process.
MIN_SIZE = 128


def say(*parts) -> None:
    print(*parts, flush=True)


def mesh():
    n = jax.device_count()
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))


def families() -> dict[str, optax.GradientTransformation]:
    """One transform per codec family (``MIN_SIZE``: every matrix compressed, the bias not)."""
    ca = lambda codec, **kw: jc.compressed_allreduce(codec, AXIS, min_size=MIN_SIZE, **kw)  # noqa: E731
    flat = lambda codec, **kw: ca(codec, granularity="flat", **kw)  # noqa: E731
    return {
        "sign_ef": ca(jc.sign(), error_feedback="residual", strategy="allgather"),
        "int8_two_phase": ca(jc.int_quant(8), strategy="two_phase"),
        "qsgd": ca(jc.qsgd(16, bucket_size=128)),
        "random_k": ca(jc.random_k(0.1)),
        "top_k": ca(jc.top_k(0.05), error_feedback="residual"),
        "dgc": jc.dgc(0.05, AXIS, momentum=0.9, min_size=MIN_SIZE, warmup_steps=0),
        "powersgd": jc.powersgd(2, AXIS, start_step=3, min_size=MIN_SIZE),
        # One flat bucket each (granularity="flat"): half the compiled code of two leaves.
        "fp16": flat(jc.cast("fp16")),
        "terngrad": flat(jc.terngrad()),
        "natural": flat(jc.natural()),
        "threshold_2bit": flat(jc.threshold_2bit(0.01)),  # t near the gradients' magnitude
        "threshold": flat(jc.threshold(0.01, 64)),
        "majority_vote": flat(jc.sign(None), strategy="majority_vote"),
        "ef21": flat(jc.top_k(0.1), error_feedback="ef21"),
    }


def init_params(m):
    def init():
        k1, k2 = jax.random.split(jax.random.PRNGKey(42))
        return {
            "w1": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
            "b1": jnp.zeros((HIDDEN,)),
            "w2": jax.random.normal(k2, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
        }

    return jax.jit(init, out_shardings=NamedSharding(m, P()))()


def loss(params, x, y):
    """MSE of a tanh MLP; for ``{name: params}`` (several families), the sum of their losses."""
    if "w1" not in params:
        return sum(loss(p, x, y) for p in params.values())
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def make_step(tx, m, state):
    """jit(shard_map) of one SGD step; the batch is drawn on each device from (step, device)."""
    specs = jc.state_specs(state, AXIS)

    def step(params, opt_state, t):
        key = jax.random.fold_in(jax.random.PRNGKey(7), t)
        key = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
        kx, ky = jax.random.split(key)
        x = jax.random.normal(kx, (BATCH, IN))
        y = jax.random.normal(ky, (BATCH, OUT))
        grads = jax.grad(loss)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: -LR * u, updates)
        return optax.apply_updates(params, updates), opt_state

    fn = jax.shard_map(step, mesh=m, in_specs=(P(), specs, P()), out_specs=(P(), specs))
    return jax.jit(fn)


def param_hash(params) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.asarray(leaf.addressable_data(0)).tobytes())
    return h.hexdigest()


def train(tx, m, steps, params=None, state=None, start=0, on_step=None):
    params = init_params(m) if params is None else params
    state = jc.sharded_init(tx, params, m, AXIS) if state is None else state
    step = make_step(tx, m, state)
    t0 = time.perf_counter()
    for t in range(start, steps):
        params, state = jax.block_until_ready(step(params, state, jnp.int32(t)))
        if t == start:
            t1 = time.perf_counter()
        if on_step is not None:
            on_step(t + 1, params, state)
    if os.environ.get("REPLICA_TIMING") and steps > start:
        per_step = (time.perf_counter() - t1) / max(steps - start - 1, 1)
        say(f"TIMING first {t1 - t0:.2f} s, then {per_step * 1e3:.1f} ms/step")
    return params, state


def combined(txs: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One transform over ``{name: params}``: each family trains its own copy of the params,
    all in ONE compiled step (one compile per process instead of one per family)."""

    def init(params):
        return {name: tx.init(params[name]) for name, tx in txs.items()}

    def update(updates, state, params=None):
        out = {
            name: tx.update(updates[name], state[name], None if params is None else params[name])
            for name, tx in txs.items()
        }
        return {n: o[0] for n, o in out.items()}, {n: o[1] for n, o in out.items()}

    return optax.GradientTransformation(init, update)


def payload_agreement(codecs, m, d=1000) -> dict[str, list[tuple[str, bool]]]:
    """For the same x on every device: is each payload leaf identical on all devices?"""
    x = jax.random.normal(jax.random.PRNGKey(3), (d,))
    step_key = jax.random.PRNGKey(11)

    def same_everywhere(codec):
        key = collectives.device_key(step_key, codec, AXIS)
        payload = codec.encode(x, key)
        # Per device: does my leaf equal everybody's? Then the verdict of all devices.
        return jax.tree.map(
            lambda a: jax.lax.pmin(
                jnp.all(jax.lax.all_gather(a, AXIS, to="invarying") == a[None]).astype(jnp.int32),
                AXIS,
            ),
            payload,
        )

    def verdict(_):
        return {name: same_everywhere(codec) for name, codec in codecs.items()}

    fn = jax.jit(jax.shard_map(verdict, mesh=m, in_specs=P(), out_specs=P()))
    dummy = jax.device_put(jnp.zeros(()), NamedSharding(m, P()))
    out = jax.block_until_ready(fn(dummy))
    return {
        name: [
            (f"leaf{i}", bool(np.asarray(v.addressable_data(0))))
            for i, v in enumerate(jax.tree.leaves(tree))
        ]
        for name, tree in out.items()
    }


def run_families(ns) -> None:
    m = mesh()
    txs = families()
    if ns.families:
        txs = {name: txs[name] for name in ns.families.split(",")}
    one = init_params(m)
    params = {name: one for name in txs}
    t0 = time.perf_counter()
    params, _ = train(combined(txs), m, ns.steps, params)
    say(f"TRAINED {len(txs)} families, {ns.steps} steps, {time.perf_counter() - t0:.1f} s")
    say(f"INIT {param_hash(one)}")
    for name in txs:
        finite = all(
            bool(np.isfinite(leaf.addressable_data(0)).all())
            for leaf in jax.tree.leaves(params[name])
        )
        say(f"HASH {name} {param_hash(params[name])} {'finite' if finite else 'nonfinite'}")
    codecs = {
        "qsgd": jc.qsgd(16),
        "int8_sr": jc.int_quant(8, stochastic=True),
        "random_k": jc.random_k(0.1),
    }
    for name, leaves in payload_agreement(codecs, m).items():
        for leaf, same in leaves:
            say(f"PAYLOAD {name} {'same' if same else 'differ'} {leaf}")


def run_fault(ns) -> None:
    say(f"FINAL {fault_run(ns, ns.ckpt, ns.resume)}")
    if ns.clean_ckpt:
        say(f"CLEAN {fault_run(ns, ns.clean_ckpt, resume=False)}")


def fault_run(ns, ckpt, resume) -> str:
    """Train ``ns.family`` for ``ns.steps`` with checkpoints into ``ckpt``; the params' hash."""
    import orbax.checkpoint as ocp

    m = mesh()
    tx = families()[ns.family]
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=ns.every, max_to_keep=3, enable_async_checkpointing=False
    )
    manager = ocp.CheckpointManager(os.path.abspath(ckpt), options=options)
    params = init_params(m)
    state = jc.sharded_init(tx, params, m, AXIS)
    start = 0
    if resume:
        start = manager.latest_step()
        if start is None:
            raise SystemExit("--resume: no checkpoint found")
        # jaxcomp state saves as it is (unused fields are None); restore with its shardings.
        template = {"params": params, "opt": state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        tree = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        params, state = tree["params"], tree["opt"]
        say(f"RESUMED at step {start}")
    rank = jax.process_index()

    def on_step(t, p, s):
        if manager.should_save(t):
            manager.save(t, args=ocp.args.StandardSave({"params": p, "opt": s}))
            manager.wait_until_finished()
            say(f"SAVED step {t}")
        if ns.die_rank == rank and ns.die_step == t:
            say(f"DYING at step {t}")
            os._exit(3)

    params, _ = train(tx, m, ns.steps, params, state, start, on_step)
    manager.close()
    return param_hash(params)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("families", "fault"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--family", default="sign_ef")
    parser.add_argument("--families", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-step", type=int, default=-1)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--clean-ckpt", default=None, help="then an uninterrupted run")
    ns = parser.parse_args(argv)
    if ns.mode == "families":
        run_families(ns)
    else:
        run_fault(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
