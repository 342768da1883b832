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

``--recipes``: one row per recipe a language-model user runs (:data:`RECIPE_ROWS`, built by
``benchmarks/lm.py``'s recipe registry and its ``build``, the cpu config's 300-step schedule):
the whole jitted training step (gradient, exchange, optimizer), lowered and compiled, not
run. ``--model tree``: the loss ``sum_l mean(p_l^2) * mean(batch)`` over the tree above;
``--model lm``: ``benchmarks/lm.py``'s decoder at its cpu config (2 layers, d_model 128).
Writes ``compile_size_recipes_MODEL[_LABEL].json``::

    python -m benchmarks.compile_size --recipes --model tree
    python -m benchmarks.compile_size --recipes --model lm --label before
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
# Row name -> benchmarks/lm.py (and lm_sparse.py) recipe: what a language-model user runs.
RECIPE_ROWS = {
    "onebit_adam": "onebit_adam",
    "zero_one_adam": "zero_one_adam",
    "sparseloco": "sparseloco-H30",
    "diloco(int4)": "diloco-int4-H30",
    "demo": "demo-3e-3",
    "powersgd4+adamw": "powersgd4-adamw",
    "int8+adamw": "int8-adamw",
    "adamw": "adamw",
}
COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\("
)
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


def compiled_collectives(text: str) -> dict:
    """How many collectives of each kind the compiled HLO text holds (every branch of every
    conditional counted: what the compiler compiles, not what one step runs)."""
    kinds = [m.group(1) for m in COLLECTIVE.finditer(text)]
    return {k: kinds.count(k) for k in dict.fromkeys(kinds)}


class TreeTask:
    """``benchmarks/lm.py``'s task interface over a tree of ``leaves`` leaves of ``shape``: the
    loss ``sum_l mean(p_l^2) * mean(batch)`` (a gradient for every leaf), batches of int32."""

    def __init__(self, leaves: int, shape: tuple[int, ...], n: int):
        import numpy as np

        rng = np.random.default_rng(0)
        self.params = {
            f"leaf{i:03d}": rng.standard_normal(shape).astype(np.float32) for i in range(leaves)
        }
        self.n = n

    def loss(self, p, tokens):
        import jax
        import jax.numpy as jnp

        scale = jnp.mean(tokens.astype(jnp.float32))
        return sum(jnp.mean(x * x) for x in jax.tree.leaves(p)) * scale

    def batch(self):
        import numpy as np

        return np.ones((2 * self.n, 65), np.int32)


def lm_task(n: int):
    """``benchmarks/lm.py``'s task at its cpu config (the text, the decoder, the batches)."""
    from benchmarks import lm

    return lm.Task(lm.parse([]), n)


def measure_recipe(row: str, task, label: str) -> dict:
    """Lower and compile one training step of ``RECIPE_ROWS[row]`` on ``task`` (not run)."""
    import warnings

    import jax

    from benchmarks import lm, lm_sparse

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    recipes = {**lm.RECIPES, **lm_sparse.RECIPES}
    n = jax.device_count()
    run = lm.Run(lm.CONFIGS["cpu"]["steps"], lm.CONFIGS["cpu"]["lr"], n)
    fn, params, state, put = lm.build(task, recipes[RECIPE_ROWS[row]], run)
    batch = put(task.batch())
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = fn.lower(params, state, batch)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    text = compiled.as_text() or ""
    return {
        "recipe": row,
        "lm_recipe": RECIPE_ROWS[row],
        "model": label,
        "leaves": len(jax.tree.leaves(params)),
        "devices": n,
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        # CPU seconds of this process (every thread): less disturbed by a loaded host
        "lower_cpu_s": round(c1 - c0, 2),
        "compile_cpu_s": round(c2 - c1, 2),
        **hlo_size(text),
        "stablehlo_chars": len(lowered.as_text() or ""),
        "collectives": compiled_collectives(text),
        "loadavg_1min": round(os.getloadavg()[0], 2),  # other work on the host, after compile
    }


def row_in_subprocess(row: str, args, jaxcomp_dir: str | None) -> dict:
    """:func:`measure_recipe` of ``row`` in a fresh process whose ``jaxcomp`` is imported from
    ``jaxcomp_dir`` (None: this tree's), its row read back from its last output line."""
    import json
    import subprocess

    path = [str(common.ROOT)] if jaxcomp_dir is None else [jaxcomp_dir, str(common.ROOT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "benchmarks.compile_size", "--recipes", row, "--one-row"]
    cmd += ["--model", args.model, "--shape", *map(str, args.shape)]
    cmd += ["--leaves", str(args.leaves)] if args.leaves else []
    # cwd: not the tree's root, whose jaxcomp would come before PYTHONPATH's (sys.path[0]).
    done = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_recipes(args) -> int:
    """``--recipes``: one row per recipe of :data:`RECIPE_ROWS` on ``--model``; with
    ``--against DIR`` each row twice, alternating, in fresh processes: the jaxcomp in ``DIR``
    (``before``) and this tree's (``after``), under the same load."""
    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(DEVICES)  # the environment recorded says what the rows ran on
    if args.against:
        rows = []
        for row in args.rows or list(RECIPE_ROWS):
            for label, where in (("before", args.against), ("after", None)):
                r = {**row_in_subprocess(row, args, where), "code": label}
                rows.append(r)
                write_recipes(args, rows, quiet=True)  # a bounded run keeps what finished
                print(
                    f"{row:16s}{label:8s}{r['lower_s']:>9.2f}{r['compile_s']:>10.2f}"
                    f"{r['hlo_instructions']:>9d}",
                    flush=True,
                )
        return write_recipes(args, rows)
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)  # XLA:CPU collectives
    n = jax.device_count()
    leaves = args.leaves or 100
    if args.model == "lm":
        task, label = lm_task(n), "lm cpu config"
    else:
        task, label = TreeTask(leaves, tuple(args.shape), n), f"{leaves} x {args.shape}"
    if args.one_row:  # row_in_subprocess: the row as the last line of the output
        import json

        print(json.dumps(measure_recipe(args.rows[0], task, label)))
        return 0
    rows = []
    print(f"{'recipe':16s}{'lower s':>9s}{'compile s':>10s}{'instr.':>9s}", flush=True)
    for row in args.rows or list(RECIPE_ROWS):
        r = measure_recipe(row, task, label)
        rows.append(r)
        print(
            f"{row:16s}{r['lower_s']:>9.2f}{r['compile_s']:>10.2f}{r['hlo_instructions']:>9d}",
            flush=True,
        )
    return write_recipes(args, rows)


def write_recipes(args, rows: list, quiet: bool = False) -> int:
    out = {
        "environment": common.environment(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],  # other work on the host
        "label": args.label,
        "model": args.model,
        "against": args.against,
        "rows": rows,
    }
    name = f"compile_size_recipes_{args.model}" + (f"_{args.label}" if args.label else "")
    common.write_json(common.result_path(name, args.quick), out, quiet=quiet)
    return 0


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


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


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
    ap.add_argument(
        "--recipes",
        dest="rows",
        nargs="*",
        default=None,
        help=f"one training step per recipe instead (none named: {' '.join(RECIPE_ROWS)})",
    )
    ap.add_argument(
        "--model", choices=("tree", "lm"), default="tree", help="--recipes: the tree or the LM"
    )
    ap.add_argument(
        "--against",
        default=None,
        help="--recipes: also each row with the jaxcomp package in this folder (e.g. a "
        "`git archive` of an older commit), alternating, labelled before / after",
    )
    ap.add_argument("--one-row", action="store_true", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.rows is not None:
        return run_recipes(args)
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
