"""Time to AdamW data parallel's loss on a shaped link: the LM benchmark over N processes.

The model, text, batches and recipes of :mod:`benchmarks.lm` (and the SparseLoCo / DeMo rows
of :mod:`benchmarks.lm_sparse`), trained for real by ``-n`` JAX processes (gloo, one CPU
device each) on the rate-limited loopback of :mod:`benchmarks.network` (a network namespace,
``tc tbf``). The global batch is the cpu config's (16 sequences of 64 bytes: 16 / n per
process), so every run sees the tokens of ``benchmarks/results/lm.json``'s runs; per-replica
recipes run one replica per process (M = n).

Per recipe, process 0 records its wall clock (compile and evaluation excluded) and the
held-out loss every ``--eval-every`` steps (a multiple of the sync period, so a replica
recipe is evaluated right after a sync, when every replica holds the same model). Then:

* ``time_to_target_s``: the wall clock at the first evaluation whose loss is at most
  ``adamw``'s final held-out loss (None: not reached in the run);
* ``speedup_to_target``: ``adamw``'s time over it (>= 20 is the aim at 100 Mbit/s, 4
  processes);
* ``speedup_at_own_loss``: at the recipe's own final loss ``L``, the time ``adamw`` took to
  first reach ``L`` (linear between its evaluations) over the recipe's whole run: how much
  sooner the recipe gets where it gets.

Writes ``benchmarks/results/lm_link.json`` (``--label L``: ``lm_link_L.json``) and a PNG of
held-out loss against wall clock::

    sudo python -m benchmarks.lm_link                                   # 100mbit, 4 processes
    sudo python -m benchmarks.lm_link --rate 1gbit -n 2 --label 1gbit_n2
    sudo python -m benchmarks.lm_link --recipes diloco-int4-H30 --recipe-steps 600
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks import common, lm, lm_sparse, network

RECIPES = ["diloco-int4-H30", "sparseloco-H30", "demo-1e-3", "onebit_adam"]
GLOBAL_BATCH = 16  # the cpu config's: 8 devices x 2 sequences


def _recipes() -> dict:
    return {**lm.RECIPES, **lm_sparse.RECIPES}


def _put_global(mesh, spec, host):
    """A global array from the same host value on every process (``host[idx]`` per shard)."""
    import jax
    from jax.sharding import NamedSharding

    return jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda i: host[i])


def _build(task: lm.Task, recipe: lm.Recipe, run: lm.Run):
    """``(step, params, state, put, mesh)`` as :func:`benchmarks.lm.build`, with every array
    made from host values on each process (no single-process ``device_put``)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    n = task.n
    host = jax.tree.map(np.asarray, task.params)
    if recipe.kind == "dp":
        mesh = jax.make_mesh((n,), (lm.AXIS,), axis_types=(AxisType.Explicit,))
        tx, axis, pspec, batch_spec = recipe.make(run, lm.AXIS), lm.AXIS, P(), P(lm.AXIS)
        params = jax.tree.map(lambda a: _put_global(mesh, P(), a), host)
    else:
        mesh = jax.make_mesh((n, 1), (lm.REPLICA, lm.AXIS), axis_types=(AxisType.Explicit,) * 2)
        tx, axis = recipe.make(run, lm.REPLICA), lm.REPLICA
        pspec, batch_spec = P(lm.REPLICA), P((lm.REPLICA, lm.AXIS))
        params = jax.tree.map(
            lambda a: _put_global(mesh, pspec, np.broadcast_to(a, (n, *a.shape))), host
        )
    state = jc.sharded_init(tx, host, mesh, axis)
    specs = jc.state_specs(state, axis)

    def step(p, s, tokens):
        if recipe.kind == "dp":
            loss, g = jax.value_and_grad(task.loss)(jax.lax.pcast(p, lm.AXIS, to="varying"), tokens)
            if not recipe.averages:
                g = jax.lax.pmean(g, lm.AXIS)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, jax.lax.pmean(loss, lm.AXIS)
        own = jc.own(p)
        loss, g = jax.value_and_grad(task.loss)(jax.lax.pcast(own, lm.AXIS, to="varying"), tokens)
        g = jax.lax.pmean(g, lm.AXIS)
        u, s = tx.update(g, s, own)
        new = jc.slot(optax.apply_updates(own, u))
        return new, s, jax.lax.pmean(loss, (lm.REPLICA, lm.AXIS))

    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(pspec, specs, batch_spec), out_specs=(pspec, specs, P())
        ),
        donate_argnums=(0, 1),
    )
    return fn, params, state, lambda b: _put_global(mesh, batch_spec, b)


def _local_model(params, kind: str):
    """Process 0's model: the replicated params, or its own replica (after a sync: all)."""
    import jax
    import numpy as np

    first = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
    return first if kind == "dp" else jax.tree.map(lambda a: a[0], first)


def train_on_link(task: lm.Task, name: str, steps: int, lr: float, eval_every: int) -> dict:
    """Train ``name`` for ``steps``; process 0's clock and held-out loss at each evaluation."""
    import jax

    recipe = _recipes()[name]
    run = lm.Run(steps=steps, lr=lr, devices=task.n)
    t0 = time.perf_counter()
    fn, params, state, put = _build(task, recipe, run)
    task.reset()
    compiled = fn.lower(params, state, put(task.batch())).compile()
    task.reset()
    setup = time.perf_counter() - t0
    clock, points, curve = 0.0, [], []
    for t in range(steps):
        batch = put(task.batch())
        start = time.perf_counter()
        params, state, loss = jax.block_until_ready(compiled(params, state, batch))
        clock += time.perf_counter() - start
        curve.append(float(loss.addressable_data(0)))
        if (t + 1) % eval_every == 0 or t + 1 == steps:
            points.append((t + 1, clock, task.eval_loss(_local_model(params, recipe.kind))))
    return {
        "recipe": name,
        "kind": recipe.kind,
        "steps": steps,
        "evals": points,
        "final_eval_loss": points[-1][2],
        "train_seconds": clock,
        "ms_per_step": 1e3 * clock / steps,
        "setup_seconds": setup,
        "final_train_loss": sum(curve[-20:]) / len(curve[-20:]),
    }


def worker(args) -> None:
    from jaxcomp.launch import initialize

    initialize()
    import warnings

    import jax

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n = jax.device_count()
    config = dict(lm.CONFIGS["cpu"], batch_per_device=GLOBAL_BATCH // n, data="pydoc", seed=0)
    config["steps"] = args.steps
    task = lm.Task(argparse.Namespace(**config), n)
    runs = []
    for name in ["adamw", *args.recipes]:
        steps = args.steps if name == "adamw" else args.recipe_steps or args.steps
        r = train_on_link(task, name, steps, config["lr"], args.eval_every)
        runs.append(r)
        if jax.process_index() == 0:
            print(json.dumps({k: v for k, v in r.items() if k != "evals"}), flush=True)
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump({"config": config, "devices": n, "runs": runs}, f)


def time_to(evals: list, target: float) -> float | None:
    """Seconds at the first evaluation with loss <= ``target``, linear between evaluations
    (from the run's start, loss taken as above every target before the first); None if
    never reached."""
    prev_s, prev_l = 0.0, None
    for _, s, loss in evals:
        if loss <= target:
            if prev_l is None or prev_l == loss:
                return s
            return prev_s + (s - prev_s) * (prev_l - target) / (prev_l - loss)
        prev_s, prev_l = s, loss
    return None


def summarize(runs: list[dict]) -> None:
    """Add the time-to-loss figures to every run (against ``adamw``'s)."""
    base = next(r for r in runs if r["recipe"] == "adamw")
    target = base["final_eval_loss"]
    t_base = time_to(base["evals"], target)
    for r in runs:
        r["target_loss"] = target
        r["time_to_target_s"] = time_to(r["evals"], target)
        ok = r["time_to_target_s"]
        r["speedup_to_target"] = t_base / ok if ok else None
        own = r["final_eval_loss"]
        t_dp = time_to(base["evals"], own)
        r["adamw_time_to_own_loss_s"] = t_dp
        r["speedup_at_own_loss"] = t_dp / r["train_seconds"] if t_dp else None


def print_table(runs: list[dict]) -> None:
    print(
        f"{'recipe':22s}{'steps':>6s}{'ms/step':>9s}{'final':>8s}{'to target s':>13s}"
        f"{'speedup':>9s}{'at own loss':>12s}"
    )
    for r in runs:

        def fmt(v, spec):
            return format(v, spec) if v is not None else "never".rjust(len(format(0.0, spec)))

        print(
            f"{r['recipe']:22s}{r['steps']:>6d}{r['ms_per_step']:>9.1f}{r['final_eval_loss']:>8.4f}"
            f"{fmt(r['time_to_target_s'], '13.1f')}{fmt(r['speedup_to_target'], '8.1f')}x"
            f"{fmt(r['speedup_at_own_loss'], '11.1f')}x"
        )


def draw(runs: list[dict], path, title: str) -> None:
    def one(ax):
        for r in runs:
            ax.plot([p[1] for p in r["evals"]], [p[2] for p in r["evals"]], "o-", label=r["recipe"])
        ax.axhline(runs[0]["target_loss"], color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("wall clock on the shaped link (s, compile and evaluation excluded)")
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.legend(fontsize=7)

    common.plot(path, one, title)


def main(argv: list[str] | None = None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="lm_link.json and .png (`--label L`: lm_link_L.*)",
        takes="10-20 minutes at 100mbit with 4 processes (needs root and iproute2)",
    )
    ap.add_argument("--rate", default="100mbit", help="tc rate of the loopback")
    ap.add_argument("-n", "--num-processes", type=int, default=4, help="JAX processes")
    ap.add_argument("--recipes", nargs="+", default=RECIPES, help="rows of lm / lm_sparse")
    ap.add_argument("--steps", type=int, default=300, help="adamw's steps (the cpu config's)")
    ap.add_argument(
        "--recipe-steps", type=int, default=None, help="steps of the recipes (None: --steps)"
    )
    ap.add_argument("--eval-every", type=int, default=30, help="steps between held-out losses")
    ap.add_argument("--label", default=None, help="write lm_link_LABEL.json")
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds, bounded")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    unknown = [r for r in args.recipes if r not in _recipes()]
    if unknown or GLOBAL_BATCH % args.num_processes:
        ap.error(f"unknown recipes {unknown} or -n not dividing {GLOBAL_BATCH}")
    network.rate_bits(args.rate)
    reason = network.skip_reason()
    if reason:
        print(f"lm_link.py: skipped: {reason}")
        return 0
    ns, procs = network.Namespace(f"jaxcomp-lm-{os.getpid()}"), []
    load_before = os.getloadavg()[0]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv_w = ["--worker", "--out", out, "--eval-every", str(args.eval_every)]
    argv_w += ["--steps", str(args.steps)]
    argv_w += ["--recipes", *args.recipes]
    argv_w += ["--recipe-steps", str(args.recipe_steps)] if args.recipe_steps else []
    try:
        ns.open().shape(args.rate)
        code = network.launch(
            ns, args.rate, __file__, argv_w, args.num_processes, args.timeout, procs
        )
        if code != 0 or os.path.getsize(out) == 0:
            raise RuntimeError(f"workers failed with status {code}")
        with open(out) as f:
            data = json.load(f)
    finally:
        ns.close()
        os.unlink(out)
    summarize(data["runs"])
    print_table(data["runs"])
    data.update(rate=args.rate, num_processes=args.num_processes, tbf=" ".join(network.TBF))
    data["loadavg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    data["environment"] = common.environment()
    name = "lm_link" + (f"_{args.label}" if args.label else "")
    common.write_json(common.RESULTS / f"{name}.json", data)
    what = f"LM on {args.rate}, {args.num_processes} processes"
    draw(data["runs"], common.RESULTS / f"{name}.png", what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
