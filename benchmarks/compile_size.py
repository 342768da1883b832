"""Compile time and program size of one compressed step: a 100-leaf tree on 8 CPU devices.

One jitted ``jax.shard_map`` of ``tx.update`` with ``tx = jc.compressed_allreduce(codec,
"data", strategy=...)`` (error feedback on, gradient and state donated) over an 8-device
mesh, for a tree of ``--leaves`` (100) leaves of shape ``--shape`` (64 x 64): how long
lowering and XLA compilation take, how large the optimized HLO is (characters, instructions,
computations), how large the logical StableHLO is, and how many collectives the compiled
program holds (``jc.comm_report``). Codecs sign, int8, top-k 1% (approximate), each with the
default ``strategy="auto"`` and with ``"two_phase"``; plain ``jax.lax.pmean`` of the tree is
the first row. The program must not grow with leaves x devices (issue 14: payload buckets,
one collective per bucket per phase). Writes ``benchmarks/results/compile_size[_LABEL].json``::

    python -m benchmarks.compile_size --label before     # compile_size_before.json
    python -m benchmarks.compile_size                    # compile_size.json
    python -m benchmarks.compile_size --quick            # 10 leaves, sign only (smoke test)
"""

from __future__ import annotations

import os
import re
import sys
import time

from benchmarks import common

AXIS = "data"
DEVICES = 8
CODECS = ["sign", "int8", "topk1%"]
STRATEGIES = ["auto", "two_phase"]
INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?[\w.\-]+\s+=\s")
COMPUTATION = re.compile(r"^(ENTRY\s+)?%?[\w.\-]+\s.*\{\s*$")


def hlo_size(text: str) -> dict:
    """Characters, instruction lines and computations of an HLO module's text."""
    lines = text.splitlines()
    return {
        "hlo_chars": len(text),
        "hlo_instructions": sum(1 for line in lines if INSTRUCTION.match(line)),
        "hlo_computations": sum(1 for line in lines if COMPUTATION.match(line)),
    }


def measure(name: str, strategy: str | None, leaves: int, shape: tuple[int, ...]) -> dict:
    import warnings

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    params = {f"leaf{i:03d}": jnp.zeros(shape, jnp.float32) for i in range(leaves)}
    params = jax.device_put(params, NamedSharding(mesh, P()))
    # Per-device gradients: leading axis n * shape[0], device i holds its own shape block.
    grads = jax.device_put(
        {k: jnp.ones((n * shape[0], *shape[1:]), jnp.float32) for k in params},
        NamedSharding(mesh, P(AXIS)),
    )
    if name == "pmean":
        state, specs = (), ()

        def body(g, s, p):
            return jax.lax.pmean(g, AXIS), s

    else:
        codec = common.make_codec(name)
        tx = jc.compressed_allreduce(codec, AXIS, strategy=strategy)
        state = jc.sharded_init(tx, params, mesh, AXIS)
        specs = jc.state_specs(state, AXIS)

        def body(g, s, p):
            return tx.update(g, s, p)

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), specs, P()), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    t0 = time.perf_counter()
    lowered = fn.lower(grads, state, params)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    row = {
        "codec": name,
        "strategy": strategy or "-",
        "leaves": leaves,
        "shape": list(shape),
        "devices": n,
        "lower_s": t1 - t0,
        "compile_s": t2 - t1,
        **hlo_size(compiled.as_text() or ""),
        "stablehlo_chars": len(lowered.as_text() or ""),
    }
    if name != "pmean":
        size = int(jnp.prod(jnp.array(shape)))
        row["chosen_strategy"] = (
            jc.choose_strategy(codec, size, n) if strategy == "auto" else strategy
        )
    report = jc.comm_report(fn, grads, state, params)
    row["collectives"] = report.count
    row["logical_collectives"] = len(report.logical)
    row["collectives_by_kind"] = {
        k: sum(1 for c in report.collectives if c.kind == k)
        for k in dict.fromkeys(c.kind for c in report.collectives)
    }
    row["bytes_per_device"] = report.bytes_per_device
    return row


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="compile_size.json (`--label L`: compile_size_L.json; `--quick`: *_quick)",
        takes="about 2.5 minutes on the 2-core CPU host (142 s)",
    )
    ap.add_argument("--quick", action="store_true", help="10 leaves, sign only")
    ap.add_argument("--leaves", type=int, default=None, help="number of leaves (default 100)")
    ap.add_argument("--shape", type=int, nargs="+", default=[64, 64], help="each leaf's shape")
    ap.add_argument("--codecs", nargs="+", default=None, help="default: sign int8 topk1%%")
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES, help="default: auto two_phase")
    ap.add_argument("--label", default=None, help="write compile_size_LABEL.json (e.g. before)")
    args = ap.parse_args(argv)
    leaves = args.leaves or (10 if args.quick else 100)
    codecs = args.codecs or (["sign"] if args.quick else CODECS)

    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(DEVICES)
    start = time.perf_counter()
    rows = []
    plan = [("pmean", None)] + [(c, s) for c in codecs for s in args.strategies]
    print(f"{'codec':8s} {'strategy':10s}{'compile s':>10s}{'HLO chars':>11s}{'instr.':>8s}"
          f"{'colls':>7s}")  # fmt: skip
    for name, strategy in plan:
        try:
            row = measure(name, strategy, leaves, tuple(args.shape))
        except Exception as e:  # a strategy a codec does not support: say so, go on
            row = {"codec": name, "strategy": strategy, "error": f"{type(e).__name__}: {e}"}
            print(f"{name:8s} {strategy!s:10s} error: {row['error'][:200]}", flush=True)
            rows.append(row)
            continue
        rows.append(row)
        print(
            f"{name:8s} {row['strategy']:10s}{row['compile_s']:>10.2f}{row['hlo_chars']:>11d}"
            f"{row['hlo_instructions']:>8d}{row['collectives']:>7d}",
            flush=True,
        )
    out = {
        "environment": common.environment(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],  # other work on the host
        "label": args.label,
        "leaves": leaves,
        "shape": args.shape,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    name = "compile_size" + (f"_{args.label}" if args.label else "")
    common.write_json(common.result_path(name, args.quick), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
