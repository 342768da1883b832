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
    sudo python -m benchmarks.lm_link --baseline-lr 4.5e-3   # against AdamW at its best lr
    python -m benchmarks.lm_link --rate none --baseline-lr 6e-3 --recipes   # adamw alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time

from benchmarks import common, lm, lm_demo, lm_diloco, lm_sparse, network

RECIPES = [
    "demo-3e-3-sign-end1-decay0.95-k18-b4:450",
    "diloco-int4-H30-innerconst:900",
    "onebit_adam:450",
    "zero_one_adam:450",
]
GLOBAL_BATCH = 16  # the cpu config's: 8 devices x 2 sequences
UNSHAPED = "none"  # --rate none: the loopback left as it is (compute and protocol only)


def _recipes() -> dict:
    return {**lm.RECIPES, **lm_sparse.RECIPES, **lm_diloco.RECIPES, **lm_demo.RECIPES}


def parse_recipe(spec: str, default_steps: int) -> tuple[str, int]:
    """``"name:steps"`` -> ``(name, steps)``; ``"name"`` -> ``(name, default_steps)``."""
    name, _, steps = spec.partition(":")
    if steps and not (steps.isdigit() and int(steps) > 0):
        raise ValueError(f"`--recipes` entry {spec!r}: steps after ':' must be a positive integer")
    return name, int(steps) if steps else default_steps


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


def train_on_link(
    task: lm.Task,
    name: str,
    steps: int,
    lr: float,
    eval_every: int,
    baseline_lr: float | None = None,
) -> dict:
    """Train ``name`` for ``steps``; process 0's clock and held-out loss at each evaluation.
    ``baseline_lr``: the ``adamw`` row's peak lr (None: ``lr``; the recipes keep ``lr``)."""
    import jax

    recipe = _recipes()[name]
    run = lm.Run(steps=steps, lr=lr, devices=task.n, baseline_lr=baseline_lr)
    t0 = time.perf_counter()
    fn, params, state, put = _build(task, recipe, run)
    task.reset()
    compiled = fn.lower(params, state, put(task.batch())).compile()
    task.reset()
    setup = time.perf_counter() - t0
    clock, cpu, points, curve, walls = 0.0, 0.0, [], [], []
    for t in range(steps):
        batch = put(task.batch())
        start, start_cpu = time.perf_counter(), time.process_time()
        params, state, loss = jax.block_until_ready(compiled(params, state, batch))
        cpu += time.process_time() - start_cpu
        walls.append(time.perf_counter() - start)
        clock += walls[-1]
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
        "median_step_ms": 1e3 * sorted(walls)[steps // 2],
        "cpu_ms_per_step": 1e3 * cpu / steps,
        "setup_seconds": setup,
        "final_train_loss": sum(curve[-20:]) / len(curve[-20:]),
    }


def run_config(args, n: int) -> dict:
    """The cpu config over ``n`` processes (the global batch split among them), ``adamw``'s
    steps, and ``baseline_lr`` where ``--baseline-lr`` sets ``adamw``'s peak lr."""
    config = dict(lm.CONFIGS["cpu"], batch_per_device=GLOBAL_BATCH // n, data="pydoc", seed=0)
    config["steps"] = args.steps
    if args.baseline_lr is not None:
        config["baseline_lr"] = args.baseline_lr
    return config


def worker(args) -> None:
    from jaxcomp.launch import initialize

    initialize()
    import warnings

    import jax

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n = jax.device_count()
    config = run_config(args, n)
    task = lm.Task(argparse.Namespace(**config), n)
    runs = []
    default = args.recipe_steps or args.steps
    for name, steps in [("adamw", args.steps), *(parse_recipe(r, default) for r in args.recipes)]:
        try:
            r = train_on_link(task, name, steps, config["lr"], args.eval_every, args.baseline_lr)
        except Exception as e:  # a trace-time error is raised on every process alike
            if name == "adamw":
                raise
            r = {"recipe": name, "steps": steps, "error": f"{type(e).__name__}: {e}"}
        runs.append(r)
        if jax.process_index() == 0:
            print(json.dumps({k: v for k, v in r.items() if k != "evals"}), flush=True)
            with open(args.out, "w") as f:  # after every recipe: a bounded run keeps them
                json.dump({"config": config, "devices": n, "runs": runs}, f)


def _crossing(points: list, target: float) -> float | None:
    """The first ``x`` of ``(x, loss)`` points with loss <= ``target``, linear between
    points (from ``x = 0``, loss taken as above every target before the first); None if
    never reached."""
    prev_x, prev_l = 0.0, None
    for x, loss in points:
        if loss <= target:
            if prev_l is None or prev_l == loss:
                return x
            return prev_x + (x - prev_x) * (prev_l - target) / (prev_l - loss)
        prev_x, prev_l = x, loss
    return None


def time_to(evals: list, target: float) -> float | None:
    """Seconds at the first evaluation with loss <= ``target``, linear between evaluations
    (from the run's start, loss taken as above every target before the first); None if
    never reached."""
    return _crossing([(s, loss) for _, s, loss in evals], target)


def steps_to(evals: list, target: float) -> float | None:
    """As :func:`time_to`, in steps."""
    return _crossing([(t, loss) for t, _, loss in evals], target)


def summarize(runs: list[dict]) -> None:
    """Add the time-to-loss figures to every run (against ``adamw``'s)."""
    base = next(r for r in runs if r["recipe"] == "adamw")
    target = base["final_eval_loss"]
    t_base = time_to(base["evals"], target)
    for r in runs:
        if "error" in r:
            continue
        r["target_loss"] = target
        r["time_to_target_s"] = time_to(r["evals"], target)
        ok = r["time_to_target_s"]
        r["speedup_to_target"] = t_base / ok if ok else None
        own = r["final_eval_loss"]
        t_dp = time_to(base["evals"], own)
        r["adamw_time_to_own_loss_s"] = t_dp
        r["speedup_at_own_loss"] = t_dp / r["train_seconds"] if t_dp else None


def link_ms(r: dict, n: int, bits_per_s: float, steps: float) -> float:
    """The link's milliseconds per step over a row's first ``steps`` steps: every process's
    bytes cross the one shaped queue, ``n x bytes per step x 8 / rate``."""
    each = r.get("bytes_each_step")
    b = sum(each[: math.ceil(steps)]) / math.ceil(steps) if each else r["bytes_per_step"]
    return 1e3 * n * b * 8 / bits_per_s


def split(runs: list[dict], unshaped: list[dict], n: int, bits_per_s: float) -> None:
    """Split every step into compute and exchange; project the time to target onto a host
    where each process has a core of its own.

    Per run with a row of the same recipe in ``unshaped`` (the same processes on the
    loopback left unshaped):

    * ``compute_ms_per_step``: the unshaped step's wall time, ``exchange_ms_per_step``: the
      shaped step's excess over it (both move with the host's load between the two runs);
    * ``cpu_ms_per_step_unshaped``: the unshaped step's CPU time (process 0, all its
      threads): the step's compute when no process waits for a core;
    * ``steps_to_target``: steps to ``adamw``'s final held-out loss (linear between
      evaluations);
    * with ``bytes_per_step`` (:func:`row_bytes`): ``link_ms_per_step``, the link model
      over those steps (:func:`link_ms`); ``projected_time_to_target_s`` = steps x (CPU +
      link) and ``projected_speedup_to_target`` = ``adamw``'s over it;
      ``link_speedup_to_target``: the same with no compute (the bound of a faster host).
    """
    by_name = {r["recipe"]: r for r in unshaped if "error" not in r}
    for r in runs:
        u = by_name.get(r["recipe"])
        if u is None or "error" in r:
            continue
        r["compute_ms_per_step"] = u["ms_per_step"]
        r["exchange_ms_per_step"] = max(0.0, r["ms_per_step"] - u["ms_per_step"])
        r["cpu_ms_per_step_unshaped"] = u["cpu_ms_per_step"]
        s = r["steps_to_target"] = steps_to(r["evals"], r["target_loss"])
        if s and "bytes_per_step" in r:
            r["link_ms_per_step"] = link_ms(r, n, bits_per_s, s)
            r["projected_time_to_target_s"] = (
                s * (u["cpu_ms_per_step"] + r["link_ms_per_step"]) / 1e3
            )
            r["link_time_to_target_s"] = s * r["link_ms_per_step"] / 1e3
    base = next(r for r in runs if r["recipe"] == "adamw")
    for r in runs:
        for key, out in [
            ("projected_time_to_target_s", "projected_speedup_to_target"),
            ("link_time_to_target_s", "link_speedup_to_target"),
        ]:
            if key in base and "compute_ms_per_step" in r:
                ok = r.get(key) and base[key]
                r[out] = base[key] / r[key] if ok else None


def print_split(runs: list[dict]) -> None:
    print(
        f"{'recipe':40s}{'unshaped':>9s}{'exchange':>9s}{'CPU':>7s}{'link':>8s}{'to target':>10s}"
        f"{'projected':>10s}{'link only':>10s}"
    )
    nan = float("nan")
    for r in (r for r in runs if "compute_ms_per_step" in r):
        projected, link = r.get("projected_speedup_to_target"), r.get("link_speedup_to_target")
        print(
            f"{r['recipe']:40s}{r['compute_ms_per_step']:9.1f}{r['exchange_ms_per_step']:9.1f}"
            f"{r['cpu_ms_per_step_unshaped']:7.1f}{r.get('link_ms_per_step', nan):8.1f}"
            f"{r['steps_to_target'] or nan:10.0f}{projected or nan:9.2f}x{link or nan:9.1f}x"
        )


def print_table(runs: list[dict]) -> None:
    print(
        f"{'recipe':40s}{'steps':>6s}{'ms/step':>9s}{'CPU ms':>8s}{'final':>8s}"
        f"{'to target s':>13s}{'speedup':>9s}{'at own loss':>12s}"
    )

    def fmt(v, spec, unit=""):
        width = len(format(0.0, spec)) + len(unit)
        return (format(v, spec) + unit) if v is not None else "never".rjust(width)

    for r in runs:
        if "error" in r:
            print(f"{r['recipe']:40s} failed: {r['error']}")
            continue
        print(
            f"{r['recipe']:40s}{r['steps']:>6d}{r['ms_per_step']:>9.1f}"
            f"{r.get('cpu_ms_per_step', float('nan')):>8.1f}{r['final_eval_loss']:>8.4f}"
            f"{fmt(r['time_to_target_s'], '13.1f')}{fmt(r['speedup_to_target'], '8.1f', 'x')}"
            f"{fmt(r['speedup_at_own_loss'], '11.1f', 'x')}"
        )


def draw(runs: list[dict], path, title: str) -> None:
    def one(ax):
        for r in (r for r in runs if "evals" in r):
            ax.plot([p[1] for p in r["evals"]], [p[2] for p in r["evals"]], "o-", label=r["recipe"])
        ax.axhline(runs[0]["target_loss"], color="black", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("wall clock on the shaped link (s, compile and evaluation excluded)")
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.legend(fontsize=7)

    common.plot(path, one, title)


def _launch(args, rate: str, recipes: list[str], steps: int) -> dict:
    """One launch of the workers on a fresh namespace, its loopback shaped to ``rate``
    (``"none"``: the host's loopback, no namespace): ``adamw`` for ``steps``, then
    ``recipes``; what finished."""
    ns, procs = None, []
    if rate != UNSHAPED:
        ns = network.Namespace(f"jaxcomp-lm-{os.getpid()}")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv_w = ["--worker", "--out", out, "--eval-every", str(args.eval_every)]
    argv_w += ["--steps", str(steps), "--recipes", *recipes]
    argv_w += ["--recipe-steps", str(args.recipe_steps)] if args.recipe_steps else []
    argv_w += ["--baseline-lr", str(args.baseline_lr)] if args.baseline_lr is not None else []
    try:
        if ns is not None:
            ns.open().shape(rate)
        code = network.launch(ns, rate, __file__, argv_w, args.num_processes, args.timeout, procs)
        if os.path.getsize(out) == 0:
            raise RuntimeError(f"workers failed with status {code} before adamw finished")
        with open(out) as f:
            data = json.load(f)
        if code != 0:
            print(f"lm_link.py: workers ended with status {code}: the recipes that finished")
            data["incomplete"] = f"workers ended with status {code}"
    finally:
        if ns is not None:
            ns.close()
        os.unlink(out)
    return data


def row_bytes(path, n: int) -> None:
    """Add to every row of the result file ``path`` the ring-model bytes each process sends
    per step (``benchmarks.lm.step_bytes`` on ``n`` CPU devices of this process, the row's
    own steps and schedule; lowering, no training): ``bytes_per_step`` (the run's mean) and,
    for a step with branches (1-bit Adam's warm-up, 0/1 Adam's rounds), ``bytes_each_step``."""
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(n)
    data = json.loads(path.read_text())
    config = argparse.Namespace(**data["config"])
    task = lm.Task(config, n)
    for r in (r for r in data["runs"] if "error" not in r):
        recipe = _recipes()[r["recipe"]]
        run = lm.Run(r["steps"], config.lr, n, getattr(config, "baseline_lr", None))
        fn, params, state, put = lm.build(task, recipe, run)
        task.reset()
        wire = lm.step_bytes(task, recipe, run, fn, params, state, put(task.batch()))
        r["bytes_per_step"] = wire["slow_bytes_per_step"]
        if recipe.branches:
            each = wire["regime_bytes"]
            r["bytes_each_step"] = [each[recipe.regime(run, t)] for t in range(run.steps)]
        print(f"{r['recipe']}: {r['bytes_per_step']:.0f} B/step", flush=True)
    common.write_json(path, data)


def _short(spec: str, steps: int) -> str:
    """``"name[:s]"`` -> ``"name:steps"`` (the unshaped launch's step count)."""
    return f"{parse_recipe(spec, steps)[0]}:{steps}"


def _write(data: dict, name: str, title: str) -> None:
    print_table(data["runs"])
    if "unshaped" in data:
        print_split(data["runs"])
    common.write_json(common.RESULTS / f"{name}.json", data)
    draw(data["runs"], common.RESULTS / f"{name}.png", title)


def _parser() -> argparse.ArgumentParser:
    ap = common.arg_parser(
        __doc__,
        writes="lm_link.json and .png (`--label L`: lm_link_L.*)",
        takes="20-40 minutes at 100mbit with 4 processes on a loaded 2-core host "
        "(needs root and iproute2)",
    )
    ap.add_argument(
        "--rate", default="100mbit", help="tc rate of the loopback ('none': left unshaped)"
    )
    ap.add_argument("-n", "--num-processes", type=int, default=4, help="JAX processes")
    ap.add_argument(
        "--recipes",
        nargs="*",
        default=RECIPES,
        help="rows of lm / lm_sparse / lm_diloco / lm_demo, each NAME or NAME:STEPS "
        "(none given: adamw alone)",
    )
    ap.add_argument("--steps", type=int, default=300, help="adamw's steps (the cpu config's)")
    ap.add_argument(
        "--baseline-lr",
        type=float,
        default=None,
        help="adamw's peak lr, recorded as the config's baseline_lr (None: the cpu config's "
        "3e-3; the recipes keep theirs)",
    )
    ap.add_argument(
        "--recipe-steps", type=int, default=None, help="steps of the recipes (None: --steps)"
    )
    ap.add_argument("--eval-every", type=int, default=30, help="steps between held-out losses")
    ap.add_argument(
        "--unshaped-steps",
        type=int,
        default=0,
        help="then every row again for this many steps on the unshaped loopback: the step "
        "split into compute and exchange (0: not run)",
    )
    ap.add_argument(
        "--split-from",
        default=None,
        help="no training: split the rows of lm_link[_LABEL].json with the unshaped rows of "
        "lm_link_SPLIT_FROM.json (a --rate none run) and rewrite it",
    )
    ap.add_argument(
        "--bytes",
        action="store_true",
        help="no training: add the bytes per step of every row of lm_link[_LABEL].json "
        "(lowered on -n CPU devices of one process)",
    )
    ap.add_argument("--label", default=None, help="write lm_link_LABEL.json")
    ap.add_argument("--timeout", type=float, default=3000.0, help="seconds, bounded")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap


def _check(ap: argparse.ArgumentParser, args) -> None:
    try:
        names = [parse_recipe(r, args.steps)[0] for r in args.recipes]
    except ValueError as e:
        ap.error(str(e))
    unknown = [r for r in names if r not in _recipes()]
    if unknown or GLOBAL_BATCH % args.num_processes:
        ap.error(f"unknown recipes {unknown} or -n not dividing {GLOBAL_BATCH}")
    if args.baseline_lr is not None and not args.baseline_lr > 0:
        ap.error(f"--baseline-lr must be positive, got {args.baseline_lr}")
    if args.rate != UNSHAPED:
        network.rate_bits(args.rate)


def _shaped_then_unshaped(args, path) -> dict:
    """The shaped launch (saved to ``path`` at once), then the unshaped one if asked."""
    load = [os.getloadavg()[0]]
    data = _launch(args, args.rate, args.recipes, args.steps)
    summarize(data["runs"])
    data.update(rate=args.rate, num_processes=args.num_processes, tbf=" ".join(network.TBF))
    data["loadavg"] = [round(x, 2) for x in (*load, os.getloadavg()[0])]
    common.write_json(path, {**data, "environment": common.environment()}, quiet=True)
    if args.unshaped_steps:
        k = args.unshaped_steps
        other = _launch(args, UNSHAPED, [_short(r, k) for r in args.recipes], k)
        data["unshaped"] = {"runs": other["runs"], "loadavg": [round(os.getloadavg()[0], 2)]}
        split(data["runs"], other["runs"], args.num_processes, network.rate_bits(args.rate))
    return data


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    name = "lm_link" + (f"_{args.label}" if args.label else "")
    title = f"LM on {args.rate}, {args.num_processes} processes"
    if args.bytes:
        row_bytes(common.RESULTS / f"{name}.json", args.num_processes)
        return 0
    if args.split_from:
        data = json.loads((common.RESULTS / f"{name}.json").read_text())
        other = json.loads((common.RESULTS / f"lm_link_{args.split_from}.json").read_text())
        data["unshaped"] = {"runs": other["runs"], "loadavg": other.get("loadavg")}
        data["unshaped"]["command"] = other["environment"]["command"]
        split(data["runs"], other["runs"], data["num_processes"], network.rate_bits(data["rate"]))
        _write(data, name, title)
        return 0
    _check(ap, args)
    reason = network.skip_reason() if args.rate != UNSHAPED else None
    if reason:
        print(f"lm_link.py: skipped: {reason}")
        return 0

    def on_signal(signum, frame):  # the namespace is deleted on the way out
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        data = _shaped_then_unshaped(args, common.RESULTS / f"{name}.json")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    data["environment"] = common.environment()
    _write(data, name, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
