"""Top-k selection speed on the default backend, and top-k / DGC wire bytes on 2, 4, 8 devices.

Part 1 — selecting 0.1% of 16M float32 values (k = 16,778), one run, median of ``--reps``:

* ``copy``: ``jnp.copy`` of the array, the memory-bound floor every method is compared to;
* ``exact``: ``jc.top_k(0.001).encode`` — ``jax.lax.top_k`` over all of ``|x|``;
* ``approx``: ``approx=True``, the method :func:`jaxcomp._src.codecs.sparse.check_approx` picks
  for the ratio (``approx_method`` in the JSON);
* ``blocked``: ``approx="blocked"``, the two-stage block-max selection;
* ``sample``: ``approx="sample"`` — DGC's sampled threshold (1% sample, re-adjusted into
  [0.8k, 1.3k]) with the blocked compaction into a fixed capacity;
* ``approx_max_k``: ``approx="approx_max_k"`` (``jax.lax.approx_max_k``: fast on TPU; an
  exact sort elsewhere);
* ``sample_nonzero``: the naive static-shape version of DGC's method, for reference — the same
  sampled threshold, then ``jnp.nonzero(size=k)`` over all of ``x`` (a cumsum over ``d``).

Part 2 — ring-model bytes per device of one step (``jc.comm_report`` on the compiled step) for
a 1,001,000-parameter tree (a 1000x1000 matrix and a 1000 bias) against plain ``pmean``.
Meshes of n = 2 and 4 use the first n of the 8 CPU devices.

Part 2 needs 8 devices of the default backend; with fewer (one GPU) it is skipped, as with
``--no-wire-bytes``. Writes ``benchmarks/results/topk_speed.json`` and
``benchmarks/results/sparse_wire_bytes.json`` (the folder: ``JAXCOMP_BENCH_RESULTS``; ``--out``
another path for part 1)::

    python -m benchmarks.topk_speed [--size 16777216] [--ratio 0.001] [--reps 7]
        [--more-ratios 0.003 0.01]   # also timed (no naive method), under "by_ratio"
    python -m benchmarks.topk_speed --no-wire-bytes --out /tmp/topk_speed_gpu.json
"""

from __future__ import annotations

import json
import math
import pathlib
import platform

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_cpu_enable_async_dispatch", False)  # XLA:CPU collectives on few cores

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import common  # noqa: E402
from jaxcomp._src.accounting import comm_report  # noqa: E402
from jaxcomp._src.codecs import sparse  # noqa: E402
from jaxcomp._src.compressed_allreduce import compressed_allreduce  # noqa: E402
from jaxcomp._src.dgc import dgc  # noqa: E402
from jaxcomp._src.sharding import state_specs  # noqa: E402

RESULTS = common.RESULTS


def median_ms(fn, x, reps: int, pipeline: int = 1) -> float:
    """Median ms of ``fn(x)`` (``pipeline`` calls per sample: common.median_seconds)."""
    return 1e3 * common.median_seconds(lambda: fn(x), reps, pipeline=pipeline)


def naive_sampled_select(x: jax.Array, k: int, key: jax.Array, sample_ratio: float = 0.01):
    """DGC's selection with static shapes, naively: sampled threshold, then the first k indices
    over it by ``jnp.nonzero`` of the whole vector."""
    d = x.shape[0]
    m = max(1, math.ceil(sample_ratio * d))
    sample = jnp.abs(x[jax.random.randint(key, (m,), 0, d)])
    threshold = jax.lax.top_k(sample, max(1, math.ceil(k * m / d)))[0][-1]
    (indices,) = jnp.nonzero(jnp.abs(x) >= threshold, size=k, fill_value=d)
    return indices, x[jnp.minimum(indices, d - 1)]


def speed(size: int, ratio: float, reps: int, naive: bool = True, pipeline: int = 1) -> dict:
    x = jax.random.normal(jax.random.PRNGKey(0), (size,), jnp.float32)
    k = sparse.count_for(ratio, size)
    key = jax.random.PRNGKey(1)

    def codec(approx):
        return jax.jit(lambda x: sparse.top_k(ratio, approx=approx).encode(x, key))

    methods = {
        "copy": jax.jit(jnp.copy),
        "exact": codec(False),
        "approx": codec(True),
        "blocked": codec("blocked"),
        "sample": codec("sample"),
        "approx_max_k": codec("approx_max_k"),
    }
    if naive:
        methods["sample_nonzero"] = jax.jit(lambda x: naive_sampled_select(x, k, key))
    ms = {name: median_ms(fn, x, reps, pipeline) for name, fn in methods.items()}
    chosen = {
        name: set(np.asarray(fn(x)[0]).tolist()) - {size}
        for name, fn in methods.items()
        if name != "copy"
    }
    exact = chosen["exact"]
    return {
        "size": size,
        "ratio": ratio,
        "k": k,
        "block_size": sparse._block_size(size, k),
        "reps": reps,
        "pipeline": pipeline,
        "median_ms": {name: round(v, 2) for name, v in ms.items()},
        "in_copies": {name: round(v / ms["copy"], 2) for name, v in ms.items()},
        "approx_method": sparse.check_approx(True, k / size if size else 0.0),
        "approx_speedup_vs_exact": round(ms["exact"] / ms["approx"], 2),
        "speedup_vs_exact": {n: round(ms["exact"] / v, 2) for n, v in ms.items() if n != "copy"},
        "recall": {name: round(len(c & exact) / k, 4) for name, c in chosen.items()},
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "machine": platform.machine(),
        "jax": jax.__version__,
    }


def wire_bytes(sizes=(2, 4, 8)) -> list[dict]:
    params = {"w": jnp.zeros((1000, 1000)), "b": jnp.zeros((1000,))}
    d = sum(a.size for a in jax.tree.leaves(params))
    rows = []
    for n in sizes:
        mesh = Mesh(np.array(jax.devices()[:n]), ("data",), axis_types=(AxisType.Explicit,))

        def abstract(tree, specs, mesh=mesh, stacked=False, n=n):
            def one(leaf, spec):
                shape = leaf.shape
                if spec == P("data"):
                    shape = (n, *shape) if stacked else (n * shape[0], *shape[1:])
                return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

            return jax.tree.map(one, tree, specs)

        grads = abstract(params, jax.tree.map(lambda _: P("data"), params), stacked=True)
        plain = jax.jit(
            jax.shard_map(
                lambda g: jax.tree.map(lambda a: jax.lax.pmean(a[0], "data"), g),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )
        baseline = comm_report(plain, grads).bytes_per_device
        transforms = {
            "top_k 1% allgather": compressed_allreduce(
                sparse.top_k(0.01, approx=True), "data", strategy="allgather"
            ),
            "top_k 1% two_phase": compressed_allreduce(
                sparse.top_k(0.01, approx=True), "data", strategy="two_phase"
            ),
            # The steady state: the default density warm-up's stages are branches of their own.
            "dgc 0.1% allgather": dgc(0.001, "data", strategy="allgather", warmup_steps=0),
            "dgc 0.1% two_phase": dgc(0.001, "data", strategy="two_phase", warmup_steps=0),
        }
        for name, tx in transforms.items():
            state = jax.eval_shape(tx.init, params)
            specs = state_specs(state, "data")
            step = jax.jit(
                jax.shard_map(
                    lambda g, s, tx=tx: tx.update(jax.tree.map(lambda a: a[0], g), s),
                    mesh=mesh,
                    in_specs=(P("data"), specs),
                    out_specs=(P(), specs),
                )
            )
            report = comm_report(step, grads, abstract(state, specs))
            rows.append(
                {
                    "devices": n,
                    "method": name,
                    "params": d,
                    "bytes_per_device": report.bytes_per_device,
                    "pmean_bytes_per_device": baseline,
                    "saving": round(baseline / report.bytes_per_device, 1),
                    "by_kind": report.by_kind(),
                }
            )
    return rows


def main() -> None:
    parser = common.arg_parser(
        __doc__,
        writes=(
            "topk_speed.json (`--out`: another path) and sparse_wire_bytes.json (unless "
            "`--no-wire-bytes`)"
        ),
        takes="a few minutes on the 2-core CPU host (not recorded)",
    )
    parser.add_argument("--size", type=int, default=1 << 24, help="values to select from")
    parser.add_argument("--ratio", type=float, default=0.001, help="k / size")
    parser.add_argument("--reps", type=int, default=7, help="timed calls (median)")
    parser.add_argument(
        "--more-ratios",
        nargs="*",
        type=float,
        default=[0.003, 0.01],
        help="also time these ratios (where approx=True switches from blocked to sample)",
    )
    parser.add_argument("--out", type=pathlib.Path, help="JSON path of part 1 (top-k speed)")
    parser.add_argument("--no-wire-bytes", action="store_true", help="skip part 2")
    parser.add_argument("--pipeline", type=int, default=1, help="calls per sample, blocked once")
    args = parser.parse_args()
    out = args.out or RESULTS / "topk_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    result = speed(args.size, args.ratio, args.reps, pipeline=args.pipeline)
    result["by_ratio"] = [
        speed(args.size, r, args.reps, naive=False, pipeline=args.pipeline)
        for r in args.more_ratios
    ]
    for r in result["by_ratio"]:
        print(f"ratio {r['ratio']:g}: in copies {r['in_copies']}")
    result["environment"] = common.environment()
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {common.show_path(out)}")
    print(f"top-k of {args.ratio:g} of {args.size:,} floats (k = {result['k']:,}), median ms:")
    for name, ms in result["median_ms"].items():
        print(f"  {name:<14}{ms:>10.1f} ms  {result['in_copies'][name]:>6.2f} copies")
    print(f"  approx is {result['approx_speedup_vs_exact']:.2f}x faster than exact")
    print(f"  recall of the exact top-k: {result['recall']}")

    if args.no_wire_bytes or jax.device_count() < 8:
        print(f"\nwire bytes skipped ({jax.device_count()} {jax.default_backend()} devices)")
        return
    rows = wire_bytes()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sparse_wire_bytes.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\nwire bytes per device per step, {rows[0]['params']:,} params (ring model):")
    print(f"  {'n':>2}  {'method':<20}{'bytes':>12}{'pmean':>12}{'saving':>9}")
    for r in rows:
        print(
            f"  {r['devices']:>2}  {r['method']:<20}{r['bytes_per_device']:>12,.0f}"
            f"{r['pmean_bytes_per_device']:>12,.0f}{r['saving']:>8.1f}x"
        )


if __name__ == "__main__":
    main()
