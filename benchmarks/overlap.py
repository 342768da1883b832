"""Does the exchange hide behind compute? Step time against compute + exchange and max of both.

On a shaped loopback (the namespace and launcher of :mod:`benchmarks.network`), ``-n`` JAX
processes (gloo, one CPU device each) time, on the MLP of ``common.py`` (25.2M params) with a
batch large enough that compute and exchange are of the same order (``--batch``, per process):

* ``compute``: forward, backward and the SGD update, no collective;
* ``exchange``: the gradient's mean alone (plain ``pmean``; ``int8``: ``jc.pmean`` with
  ``jc.int_quant(8)``);
* ``step``: the data-parallel step (gradient, mean, update) in one program;
* ``delayed``: ``jc.delayed`` — the step exchanges the previous step's gradient, which does
  not depend on this step's compute, so a runtime that runs collectives asynchronously can
  overlap them;
* ``overlapped``: ``jc.overlapped_step`` — the same delayed step as two programs run at once
  on two host threads (exchange and update on a worker thread, forward and backward on the
  main one);
* ``layerwise``: the synchronous step (no staleness) with its backward split into one program
  per layer, from the last; each layer's gradient is exchanged on a worker thread while the
  layer below is computed (wait-free backpropagation, written out for this MLP);
* ``two_programs``: the two programs of ``overlapped`` dispatched back to back from one
  thread, then both awaited (with ``--async-dispatch`` the CPU client returns before they
  finish, so it could run them at once; without, they run one after the other by
  construction).

For each step ``overlap = (compute + exchange - step) / min(compute, exchange)``: 0 when the
step is the sum of its parts, 1 when the shorter part is fully hidden; and
``step / max(compute, exchange)`` (1.0 = perfect overlap). Writes
``benchmarks/results/overlap.json``::

    sudo python -m benchmarks.overlap                  # 1gbit, 2 processes, a few minutes
    sudo python -m benchmarks.overlap --rates 1gbit 10gbit --batch 128
    sudo python -m benchmarks.overlap --async-dispatch   # the CPU client's async dispatch on
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks import common, network

AXIS = "data"


def worker(args) -> None:
    """One process: time the parts and the steps; rank 0 writes ``args.out``."""
    from jaxcomp.launch import initialize

    initialize()
    import jax

    if args.async_dispatch:  # before the first computation creates the CPU client
        jax.config.update("jax_cpu_enable_async_dispatch", True)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    n, rank = jax.device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), (AXIS,))
    rows_sharding, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    rng = np.random.RandomState(rank)
    xb = rng.standard_normal((args.batch, common.MLP[0])).astype(np.float32)
    yb = rng.standard_normal((args.batch, common.MLP[-1])).astype(np.float32)
    bx = jax.make_array_from_callback((n * args.batch, common.MLP[0]), rows_sharding, lambda i: xb)
    by = jax.make_array_from_callback((n * args.batch, common.MLP[-1]), rows_sharding, lambda i: yb)
    params = jax.jit(common.mlp_params, out_shardings=replicated)()
    codec = {"pmean": None, "int8": jc.int_quant(8)}

    def mean(g, name):
        return jax.lax.pmean(g, AXIS) if codec[name] is None else jc.pmean(g, AXIS, codec[name])

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def local_step(p, x, y):  # no collective: each device applies its own gradient
        g = jax.grad(common.mlp_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
        return jax.tree.map(lambda a, b: (a - 1e-3 * b)[None], p, g)

    def per_device_grads(p, x, y):
        g = jax.grad(common.mlp_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
        return jax.tree.map(lambda a: a[None], g)

    grads = smap(per_device_grads, (P(), P(AXIS), P(AXIS)), P(AXIS))(params, bx, by)
    compute = smap(local_step, (P(), P(AXIS), P(AXIS)), P(AXIS))
    result = {"batch": args.batch, "devices": n, "rounds": args.reps, "rows": []}
    for name in ("pmean", "int8"):
        exchange = smap(
            lambda g, name=name: mean(jax.tree.map(lambda a: a[0], g), name), (P(AXIS),), P()
        )
        runs = {
            "compute": lambda: compute(params, bx, by),
            "exchange": lambda exchange=exchange: exchange(grads),
        }
        for kind, step, state in _steps(name, codec[name], params, mesh):
            runs[kind] = _stepper(step, params, state, bx, by)
        ms = _interleaved(runs, args.reps)
        for kind in runs:
            if kind not in ("compute", "exchange"):
                row = _row(name, kind, ms["compute"], ms["exchange"], ms[kind])
                result["rows"].append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
        del runs
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


def _steps(name: str, codec, params, mesh):
    """``(kind, step, state)`` of each way to run the MLP's data-parallel SGD step."""
    import optax

    import jaxcomp as jc

    tx = optax.sgd(1e-3)
    if codec is not None:
        tx = optax.chain(jc.compressed_allreduce(codec, AXIS, error_feedback=None), tx)
    plain = codec is None
    for kind in ("step", "delayed"):
        full = jc.delayed(tx, axis_name=AXIS if plain else None) if kind == "delayed" else tx
        step, state = common.mlp_tx_step(
            full, params, mesh, AXIS, pmean_first=plain and kind == "step"
        )
        yield kind, step, state
    split = jc.overlapped_step(common.mlp_loss, tx, mesh, AXIS, pmean=plain)
    yield "overlapped", split, split.init(params)
    yield "two_programs", _one_thread(split), split.init(params)
    yield "layerwise", _layerwise(codec, mesh), 0


def _layerwise(codec, mesh):
    """The synchronous step (no staleness) with the backward split into three programs, one
    per layer from the last: each layer's gradient is exchanged on a worker thread while the
    next program computes the layer below (wait-free backpropagation, by hand for the MLP of
    ``common.py``: ``relu(x @ w0 + b0)``, ``relu(. @ w1 + b1)``, ``. @ w2 + b2``, mean squared
    error)."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def stack(g):
        return jax.tree.map(lambda a: a[None], g)

    def last(p, x, y):  # forward, and the backward of the last layer and the loss
        h1 = jax.nn.relu(x @ p["w0"] + p["b0"])
        h2 = jax.nn.relu(h1 @ p["w1"] + p["b1"])
        top = jax.lax.pcast({"w2": p["w2"], "b2": p["b2"]}, AXIS, to="varying")
        _, vjp = jax.vjp(lambda q, h: jnp.mean((h @ q["w2"] + q["b2"] - y) ** 2), top, h2)
        g, ct = vjp(jax.lax.pcast(jnp.ones((), jnp.float32), AXIS, to="varying"))
        return stack(g), ct, h1, h2

    def dense_back(w, h_in, h_out, ct, i):  # relu(h_in @ w + b): gradients and input cotangent
        dz = ct * (h_out > 0)
        return {f"w{i}": h_in.T @ dz, f"b{i}": dz.sum(0)}, dz @ w.T

    def middle(p, h1, h2, ct):
        g, ct = dense_back(p["w1"], h1, h2, ct, 1)
        return stack(g), ct

    def first(p, x, h1, ct):
        return stack(dense_back(p["w0"], x, h1, ct, 0)[0])

    rows, rep = P(AXIS), P()
    last = smap(last, (rep, rows, rows), (rows, rows, rows, rows))
    middle = smap(middle, (rep, rows, rows, rows), (rows, rows))
    first = smap(first, (rep, rows, rows, rows), rows)

    def mean(g):
        g = jax.tree.map(lambda a: a[0], g)
        return jax.lax.pmean(g, AXIS) if codec is None else jc.pmean(g, AXIS, codec)

    exchange = smap(mean, (rows,), rep)
    update = smap(
        lambda p, *ms: {k: v - 1e-3 * m[k] for m in ms for k, v in p.items() if k in m},
        (rep, rep, rep, rep),
        rep,
    )
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def send(g):
        return pool.submit(lambda: jax.block_until_ready(exchange(g)))

    def step(p, state, x, y):
        g2, ct, h1, h2 = jax.block_until_ready(last(p, x, y))
        sent = [send(g2)]
        g1, ct = jax.block_until_ready(middle(p, h1, h2, ct))
        sent.append(send(g1))
        sent.append(send(jax.block_until_ready(first(p, x, h1, ct))))
        return jax.block_until_ready(update(p, *[f.result() for f in sent])), state

    return step


def _stepper(step, params, state, *batch):
    """A call that runs one step from the previous one's output (blocked)."""
    import jax

    box = [params, state]

    def run():
        box[:] = jax.block_until_ready(step(box[0], box[1], *batch))

    return run


def _interleaved(runs: dict, rounds: int) -> dict[str, float]:
    """Median ms of each call in ``runs``, timed in turn ``rounds`` times after two warm-up
    rounds (load that drifts during the run then weighs on every part alike)."""
    import jax
    import numpy as np

    times = {k: [] for k in runs}
    for r in range(rounds + 2):
        for k, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def _one_thread(split):
    """``split``'s two programs dispatched back to back from the calling thread, then awaited."""
    import jax

    from jaxcomp._src.delayed import DelayedState

    def step(params, state, *batch):
        exchange = split._exchange_fn(state)(params, state.inner, state.pending)
        pending, count = split._grads_fn(len(batch))(params, state.count, *batch)
        (params, inner), pending = jax.block_until_ready((exchange, pending))
        return params, DelayedState(pending=pending, inner=inner, count=count)

    return step


def _row(name: str, kind: str, compute: float, exchange: float, step: float) -> dict:
    return {
        "exchange": name, "kind": kind, "compute_ms": compute, "exchange_ms": exchange,
        "step_ms": step, "sum_ms": compute + exchange, "max_ms": max(compute, exchange),
        "overlap": (compute + exchange - step) / min(compute, exchange),
        "step_over_max": step / max(compute, exchange),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="overlap.json (or overlap_LABEL.json with --label)",
        takes="up to --timeout seconds per rate (duration not recorded; needs root and iproute2)",
    )
    ap.add_argument("--rates", nargs="+", default=["1gbit"], help="tc rates to shape the link")
    ap.add_argument("-n", "--num-processes", type=int, default=2, help="JAX processes")
    ap.add_argument("--batch", type=int, default=256, help="examples per process")
    ap.add_argument(
        "--reps",
        type=int,
        default=5,
        help="timed rounds (median); each round times every part in turn",
    )
    ap.add_argument("--label", default=None, help="write overlap_LABEL.json")
    ap.add_argument(
        "--async-dispatch", action="store_true", help="turn the CPU client's async dispatch on"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rate")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    reason = network.skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    load_before = os.getloadavg()[0]
    ns, procs, results = network.Namespace(f"jaxcomp-overlap-{os.getpid()}").open(), [], {}
    try:
        for rate in args.rates:
            ns.shape(rate)
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            argv_w = [
                "--worker",
                "--out",
                out,
                "--batch",
                str(args.batch),
                "--reps",
                str(args.reps),
                *(["--async-dispatch"] if args.async_dispatch else []),
            ]
            code = network.launch(
                ns, rate, __file__, argv_w, args.num_processes, args.timeout, procs
            )
            if code != 0:
                raise RuntimeError(f"workers at {rate} failed with status {code}")
            with open(out) as f:
                results[rate] = json.load(f)
            os.unlink(out)
    finally:
        ns.close()
    name = f"overlap_{args.label}" if args.label else "overlap"
    load = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # other work skews timings
    common.write_json(
        common.RESULTS / f"{name}.json",
        {"environment": common.environment(), "loadavg": load, "rates": results},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
