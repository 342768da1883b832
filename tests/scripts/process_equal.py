"""The same 8-device programs on 1 process and on 2 processes x 4 devices (gloo): same numbers.

Run by ``tests/test_multiprocess_equal.py`` twice: in the test's own process (8 CPU devices,
``compute(out_dir, ckpt_in, ckpt_out)``), and under ``jaxcomp.launch -n 2`` with 4 devices
each (``python process_equal.py OUT CKPT_IN CKPT_OUT``). Each run writes ``OUT/p<rank>.npz``:

* ``fsdp``: 3 steps of a tanh layer through ``jc.fsdp_gather`` (int8 weights, int4 gradients,
  error feedback), the shards gathered whole, and the residual;
* ``scatter``: ``jc.psum_scatter`` of per-device vectors with int8 (two-phase) and top-k;
* ``diloco``, ``sparseloco``: 4 steps of ``jc.diloco(optax.sgd, "data", 2, codec=int8)`` and
  of ``jc.sparseloco`` on 8 replicas (the replica axis across the processes);
* ``hsdp``: ``jc.fsdp_gather`` over "host" (the processes) with ``inner_axis_name="local"``;
* ``sgd``: ``jc.sgd`` with int8 restored from ``CKPT_IN`` (orbax, saved by the other kind of
  run), 2 more steps, the params and memories; then params and state saved to ``CKPT_OUT``;
* ``resize``: a live ``jc.sgd`` int8 state on the 8 devices moved by ``jc.resize_state`` to
  4 devices (2 of each process), one more step;
* ``bytes_*``: ``jc.comm_report``'s bytes per device of the FSDP and ``jc.sgd`` steps;
* ``plan``: ``jc.autotune``'s choice and table (codec, strategy, min_size, measured ms);
* ``skewed_plan``: its choice and timed rows where process 1's clock is 1000 s ahead.
"""

from __future__ import annotations

import sys

N = 8
LR = 0.5
D_IN, ROWS = 24, 64  # the FSDP weight: (ROWS, D_IN), ROWS / 8 rows per device


def _data(seed, shape):
    import numpy as np

    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _global(mesh, spec, value):
    """``value`` (the whole array, on every process) laid out by ``spec``: each process fills
    only its own devices' blocks."""
    import jax
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def _host(x):
    """The whole array on every process."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _fsdp(mesh, results):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    def loss(w, e, x):
        full = jc.fsdp_gather(w, "data", weights=jc.int_quant(8), grads=jc.int_quant(4), residual=e)
        return jnp.mean(jnp.tanh(x @ full.T) ** 2)

    def step(w, e, x):
        g, e = jax.grad(loss, argnums=(0, 1))(w, e, x)
        return w - LR * g, e

    spec = P("data")
    init = jax.jit(
        jax.shard_map(
            lambda w: jc.fsdp_residual(w, "data"), mesh=mesh, in_specs=spec, out_specs=spec
        )
    )
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec))
    )
    w = _global(mesh, spec, _data(0, (ROWS, D_IN)))
    e = jax.block_until_ready(init(w))
    for t in range(3):
        x = _global(mesh, spec, _data(10 + t, (N * 4, D_IN)))
        if t == 0:
            results["bytes_fsdp"] = jc.comm_report(run, w, e, x).bytes_per_device
        w, e = jax.block_until_ready(run(w, e, x))
    results["fsdp_w"], results["fsdp_e"] = _host(w), _host(e)


def _scatter(mesh, results):
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    spec = P("data")
    x = _global(mesh, spec, _data(20, (N, N * 96)))
    for name, codec in (("int8", jc.int_quant(8)), ("topk", jc.top_k(0.25))):
        fn = jax.jit(
            jax.shard_map(
                lambda v, codec=codec: jc.psum_scatter(v[0], "data", codec)[None],
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
            )
        )
        results[f"scatter_{name}"] = _host(jax.block_until_ready(fn(x)))


def _fsdp_hierarchical(results):
    """``jc.fsdp_gather`` over a (2, 4) mesh whose rows are the processes: int8 / int4 over
    "host" (across the processes), jax.lax over "local" (inside each), error feedback."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    mesh = jax.make_mesh((2, 4), ("host", "local"))
    spec = P(("host", "local"))

    def loss(w, e, x):
        full = jc.fsdp_gather(w, "host", inner_axis_name="local", residual=e)
        return jnp.mean(jnp.tanh(x @ full.T) ** 2)

    def step(w, e, x):
        g, e = jax.grad(loss, argnums=(0, 1))(w, e, x)
        return w - LR * g, e

    residual = jax.shard_map(
        lambda w: jc.fsdp_residual(w, "host", "local"), mesh=mesh, in_specs=spec, out_specs=spec
    )
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, spec))
    )
    w = _global(mesh, spec, _data(70, (ROWS, D_IN)))
    e = jax.block_until_ready(jax.jit(residual)(w))
    for t in range(3):
        w, e = jax.block_until_ready(run(w, e, _global(mesh, spec, _data(80 + t, (N * 4, D_IN)))))
    results["hsdp_w"], results["hsdp_e"] = _host(w), _host(e)


def _diloco(mesh, results):
    import optax

    import jaxcomp as jc

    _replicas(
        mesh,
        results,
        "diloco",
        jc.diloco(optax.sgd(0.1), "data", 2, codec=jc.int_quant(8), min_size=0),
    )
    sparse = jc.sparseloco(optax.sgd(0.1), "data", 2, density=1 / 16, chunk=16, min_size=0)
    _replicas(mesh, results, "sparseloco", sparse)


def _replicas(mesh, results, name, tx):
    """4 steps of ``tx`` (params per device) on 8 replicas; their weights and biases."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    params = {"w": jnp.asarray(_data(30, (16, 8))), "b": jnp.zeros(8)}
    replicas = jc.replica_params(params, mesh, "data")
    state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(state, "data")

    def step(r, s, x):
        p = jc.own(r)
        g = jax.grad(lambda p: jnp.mean(jnp.tanh(x[0] @ p["w"] + p["b"]) ** 2))(p)
        u, s = tx.update(g, s, p)
        return jc.slot(optax.apply_updates(p, u)), s

    rspec = jc.replica_specs(params, "data")
    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(rspec, specs, P("data")), out_specs=(rspec, specs))
    )
    for t in range(4):
        x = _global(mesh, P("data"), _data(40 + t, (N, 4, 16)))
        replicas, state = jax.block_until_ready(run(replicas, state, x))
    results[f"{name}_w"], results[f"{name}_b"] = _host(replicas["w"]), _host(replicas["b"])


def sgd_setup(mesh):
    """``(tx, params, step)`` of the checkpointed ``jc.sgd`` run."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    tx = jc.sgd(0.1, jc.int_quant(8), "data", min_size=0)
    params = jax.device_put(
        {"w": jnp.asarray(_data(50, (16, 8))), "b": jnp.zeros(8)}, NamedSharding(mesh, P())
    )
    specs = jc.state_specs(jc.sharded_init(tx, params, mesh, "data"), "data")

    def step(p, s, x):
        local = jax.lax.pcast(p, "data", to="varying")
        g = jax.grad(lambda q: jnp.mean(jnp.tanh(x @ q["w"] + q["b"]) ** 2))(local)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    )
    return tx, params, specs, run


def sgd_batch(mesh, t):
    from jax.sharding import PartitionSpec as P

    return _global(mesh, P("data"), _data(60 + t, (N * 4, 16)))


def save(path, tree):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, tree)
        ckpt.wait_until_finished()


def restore(path, like):
    import jax
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, like))


def _sgd(mesh, results, ckpt_in, ckpt_out):
    import jax

    import jaxcomp as jc

    tx, params, specs, run = sgd_setup(mesh)
    like = {"params": params, "opt_state": jc.sharded_init(tx, params, mesh, "data")}
    saved = restore(ckpt_in, like)
    p, s = saved["params"], saved["opt_state"]
    results["bytes_sgd"] = jc.comm_report(run, p, s, sgd_batch(mesh, 2)).bytes_per_device
    for t in (2, 3):
        p, s = jax.block_until_ready(run(p, s, sgd_batch(mesh, t)))
    results["sgd_w"], results["sgd_memory_w"] = _host(p["w"]), _host(s[0].memory["w"])
    save(ckpt_out, {"params": p, "opt_state": s})


def _resize(mesh, results):
    """A live ``jc.sgd`` int8 state of 2 steps on the 8 devices (over both processes when
    there are two) moved by ``jc.resize_state`` to 4 devices, 2 of each process's, and
    stepped once there: its params and memories."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    tx, params, _, run = sgd_setup(mesh)
    p, s = params, jc.sharded_init(tx, params, mesh, "data")
    for t in (0, 1):
        p, s = jax.block_until_ready(run(p, s, sgd_batch(mesh, t)))
    devices = np.array(sorted(jax.devices(), key=lambda d: d.id))
    mesh4 = Mesh(devices[[0, 1, 4, 5]], ("data",))
    tx, params, _, run4 = sgd_setup(mesh4)
    p = jax.device_put(jax.tree.map(_host, p), NamedSharding(mesh4, P()))
    s = jc.resize_state(s, tx, p, mesh4, "data")
    results["resize_memory_w0"] = _host(s[0].memory["w"])
    p, s = jax.block_until_ready(run4(p, s, sgd_batch(mesh4, 2)))
    results["resize_w"], results["resize_memory_w"] = _host(p["w"]), _host(s[0].memory["w"])


def _plan(mesh, results):
    import numpy as np

    import jaxcomp as jc

    plan = jc.autotune(
        {"w": np.zeros((64, 256), np.float32), "b": np.zeros(64, np.float32)},
        mesh,
        "data",
        codecs=[None, jc.int_quant(8), jc.sign()],
        strategies=["two_phase", "allgather"],
        min_sizes=[0],
        check=2,
        reps=1,
        link_sizes=(1024, 8192),
    )
    rows = [(r.name, r.strategy, r.min_size, r.measured_ms, r.error) for r in plan.table]
    results["plan"] = np.array(repr((plan.codec, plan.strategy, plan.min_size, rows)))


def _skewed_plan(mesh, results):
    """``jc.autotune`` where process 1's clock reads 1000 s more after autotune's first
    reading: as if it had entered autotune 1000 s before process 0 and waited for it in the
    first collective. Both must spend the same budget (the max over processes): before
    2026-11-27 process 1 alone found its 60 s spent and stopped after plain ``pmean`` while
    process 0 went on to time the next candidate, alone in its collectives."""
    import itertools
    import time
    import types

    import jax
    import numpy as np

    import jaxcomp as jc
    from jaxcomp._src import autotune as tuning

    reads, skew = itertools.count(), 1000.0 * (jax.process_index() == 1)
    tuning.time = types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + (skew if next(reads) else 0.0)
    )
    try:
        plan = jc.autotune(
            {"w": np.zeros((64, 256), np.float32)},
            mesh,
            "data",
            codecs=[None, jc.int_quant(8)],
            strategies=["allgather"],
            min_sizes=[0],
            check=2,
            reps=1,
            link_sizes=(1024, 8192),
        )
    finally:
        tuning.time = time
    timed = [r.name for r in plan.table if r.measured_ms == r.measured_ms]  # not NaN
    results["skewed_plan"] = np.array(repr((plan.codec, timed)))


def compute(mesh, out_dir, ckpt_in, ckpt_out, plan=True):
    """Every probe above on ``mesh`` (8 devices over axis "data"); ``OUT/p<rank>.npz``
    (``plan``: run jc.autotune too; its timings differ from run to run, so the test compares
    its plan between the processes of one run only)."""
    import jax
    import numpy as np

    results: dict = {}
    _fsdp(mesh, results)
    _scatter(mesh, results)
    _diloco(mesh, results)
    _fsdp_hierarchical(results)
    _sgd(mesh, results, ckpt_in, ckpt_out)
    _resize(mesh, results)
    if plan:
        _plan(mesh, results)
        _skewed_plan(mesh, results)
    np.savez(f"{out_dir}/p{jax.process_index()}.npz", **results)


def main(argv) -> int:
    out_dir, ckpt_in, ckpt_out = argv
    from jaxcomp.launch import initialize

    initialize(local_devices=4)
    import jax

    mesh = jax.make_mesh((N,), ("data",))
    print(f"process {jax.process_index()} of {jax.process_count()}: {mesh.size} devices")
    compute(mesh, out_dir, ckpt_in, ckpt_out)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
