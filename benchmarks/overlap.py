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
  overlap them.

For each step ``overlap = (compute + exchange - step) / min(compute, exchange)``: 0 when the
step is the sum of its parts, 1 when the shorter part is fully hidden; and
``step / max(compute, exchange)`` (1.0 = perfect overlap). Writes
``benchmarks/results/overlap.json``::

    sudo python -m benchmarks.overlap                  # 1gbit, 2 processes, a few minutes
    sudo python -m benchmarks.overlap --rates 1gbit 10gbit --batch 128
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
    import numpy as np
    import optax
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

    def timed(fn, *a):
        out = jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        del out
        return 1e3 * float(np.median(ts))

    def timed_steps(step, p, s):  # each step feeds the next (delayed: count > 0, pending)
        for _ in range(2):
            p, s = jax.block_until_ready(step(p, s, bx, by))
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            p, s = jax.block_until_ready(step(p, s, bx, by))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts))

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def local_step(p, x, y):  # no collective: each device applies its own gradient
        g = jax.grad(common.mlp_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
        return jax.tree.map(lambda a, b: (a - 1e-3 * b)[None], p, g)

    grads = smap(
        lambda p, x, y: jax.tree.map(
            lambda a: a[None], jax.grad(common.mlp_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
        ),
        (P(), P(AXIS), P(AXIS)),
        P(AXIS),
    )(params, bx, by)
    result = {"batch": args.batch, "devices": n, "rows": []}
    compute = timed(smap(local_step, (P(), P(AXIS), P(AXIS)), P(AXIS)), params, bx, by)
    for name in ("pmean", "int8"):
        exchange = timed(
            smap(lambda g, name=name: mean(jax.tree.map(lambda a: a[0], g), name), (P(AXIS),), P()),
            grads,
        )
        tx = optax.sgd(1e-3)
        for kind in ("step", "delayed"):
            inner = (
                tx
                if codec[name] is None
                else optax.chain(
                    jc.compressed_allreduce(codec[name], AXIS, error_feedback=None), tx
                )
            )
            full = (
                jc.delayed(inner, axis_name=AXIS if codec[name] is None else None)
                if (kind == "delayed")
                else inner
            )
            step, state = common.mlp_tx_step(
                full, params, mesh, AXIS, pmean_first=codec[name] is None and kind == "step"
            )
            ms = timed_steps(step, params, state)
            result["rows"].append(_row(name, kind, compute, exchange, ms))
            if rank == 0:
                print(json.dumps(result["rows"][-1]), flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


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
    ap.add_argument("--reps", type=int, default=5, help="timed calls (median)")
    ap.add_argument("--label", default=None, help="write overlap_LABEL.json")
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
