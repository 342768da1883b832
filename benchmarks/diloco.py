"""Communicate less often: local SGD, post-local SGD, DiLoCo (int4), Streaming DiLoCo and the
one-step-delayed exchange, against per-step ``pmean`` data parallel.

Convergence (default), on 8 CPU devices (or the accelerators there), same seed, same
initialization, same batches and same number of steps (so the same tokens) for every method:

* ``digits`` — scikit-learn digits, MLP 64-256-10, SGD momentum 0.9 lr 0.05, 32 images per
  device per step; metric: test accuracy of the mean replica;
* ``char`` — the character transformer of ``benchmarks/char_transformer.py`` (Adam, 5%
  warm-up then cosine, 2 sequences of 64 bytes per device per step); metric: held-out loss
  in nats per byte of the mean replica.

The inner optimizer of local SGD and DiLoCo is the data-parallel run's optimizer, run by each
device on its own batch; DiLoCo's outer optimizer is the paper's (Nesterov SGD, lr 0.7,
momentum 0.9). Bytes per step are ring-model bytes per device read from the lowered step
program (``jc.comm_report``), averaged over the run: the step is compiled once per distinct
exchange pattern of the schedule (its count fixed, so the compiled program holds only that
step's collectives), and the average weights each pattern by how often it occurs.
``steps_to_target``: the first evaluation (every ``--eval-every`` steps) at which the run
reaches the data-parallel run's final metric (within 1 point / 3%).

Shaped link (``--link``): ``-n`` JAX processes (2 and 4) over gloo in a network namespace
whose loopback is shaped to 100 Mbit/s (``benchmarks/network.py``'s machinery; root and
iproute2), a data-parallel MLP step with ``pmean`` against DiLoCo int4 (and local SGD), wall
clock per 1000 steps extrapolated from timed steps (data parallel: median step; DiLoCo: one
full period of ``H`` steps, its sync included, timed whole). Writes
``benchmarks/results/diloco.json`` / ``diloco_link.json`` and PNGs::

    python -m benchmarks.diloco                      # digits + char, every method
    python -m benchmarks.diloco --quick              # digits, 200 steps, few methods
    sudo python -m benchmarks.diloco --link          # 100mbit, 2 and 4 processes
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import common

AXIS = "data"
TASKS = ("digits", "char")
STEPS = {"digits": 1000, "char": 600}
EVAL_EVERY = {"digits": 50, "char": 100}
# name -> (kind, keyword arguments); kinds: dp (pmean every step), delayed (jc.delayed of
# it), local_sgd, diloco. "post_local" starts local SGD after a quarter of the steps.
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "dp": ("dp", {}),
    "dp-delayed": ("delayed", {}),
    "local_sgd-H4": ("local_sgd", {"sync_every": 4}),
    "post_local_sgd-H4": ("local_sgd", {"sync_every": 4, "start_step": "quarter"}),
    "diloco-H20": ("diloco", {"sync_every": 20}),
    "diloco-int4-H20": ("diloco", {"sync_every": 20, "codec": "int4"}),
    "diloco-int4-H50": ("diloco", {"sync_every": 50, "codec": "int4"}),
    "streaming-int4-H20-F4": ("diloco", {"sync_every": 20, "codec": "int4", "fragments": 4}),
    "streaming-int4-H20-F4-delay2": (
        "diloco",
        {"sync_every": 20, "codec": "int4", "fragments": 4, "delay": 2},
    ),
}
QUICK_METHODS = ["dp", "local_sgd-H4", "diloco-int4-H20", "streaming-int4-H20-F4"]


def make_transform(name: str, inner: Any, steps: int) -> tuple[str, Any, dict]:
    """(kind, the transform, its schedule's keyword arguments)."""
    import jaxcomp as jc

    kind, kw = METHODS[name]
    kw = dict(kw)
    if kw.get("start_step") == "quarter":
        kw["start_step"] = steps // 4
    if "codec" in kw:
        kw["codec"] = common.make_codec(kw["codec"])
    if kind == "dp":
        return kind, inner, {}
    if kind == "delayed":
        return kind, jc.delayed(inner, axis_name=AXIS), {}
    if kind == "diloco":  # the outer step of the recorded runs: the paper's
        import optax

        kw.setdefault("outer", optax.sgd(0.7, momentum=0.9, nesterov=True))
    factory = jc.local_sgd if kind == "local_sgd" else jc.diloco
    schedule = {k: kw[k] for k in ("sync_every", "fragments", "delay", "start_step") if k in kw}
    return kind, factory(inner, AXIS, **kw), schedule


def pattern(count: int, **schedule: Any) -> tuple[bool, ...]:
    """Which fragments exchange at ``count`` (``jaxcomp._src.periodic.schedule``)."""
    from jaxcomp._src.periodic import schedule as exchanges

    return exchanges(count, **{"sync_every": 1, **schedule})


# --------------------------------------------------------------------------- tasks


class Task:
    """Params, loss, batches and the metric of one task (host-side data, numpy)."""

    def __init__(self, name: str, steps: int, seed: int = 0):
        import jax
        import numpy as np
        import optax

        self.name, self.steps, self.seed = name, steps, seed
        n = jax.device_count()
        self.n = n
        if name == "digits":
            (self.xtr, self.ytr), (self.xte, self.yte) = common.load_digits_split(seed)
            self.per_device = 32
            self.inner = optax.sgd(0.05, momentum=0.9)
            sizes = (64, 256, 10)
            key, p = jax.random.PRNGKey(seed), {}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
                key, sub = jax.random.split(key)
                p[f"w{i}"] = np.asarray(jax.random.normal(sub, (a, b)) * math.sqrt(2.0 / a))
                p[f"b{i}"] = np.zeros((b,), np.float32)
            self.params = p
        else:
            from flax import nnx

            from benchmarks import char_transformer as ct

            text = ct.load_text()
            cut = int(0.9 * len(text))
            self.train_text, self.eval_text = text[:cut], text[cut:]
            self.per_device, self.context = 2, 64

            def make_model():
                return ct.CharTransformer(context=64, d=128, layers=2, heads=4, rngs=nnx.Rngs(seed))

            self.graphdef = nnx.graphdef(nnx.eval_shape(make_model))
            self.params = jax.device_get(jax.jit(lambda: nnx.state(make_model()))())
            lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, steps // 20), steps)
            self.inner = optax.adam(lr)
            rng = np.random.default_rng(12345)
            self.eval_tokens = self._sample(rng, self.eval_text, 256)
        self.rng = np.random.default_rng(seed)

    def _sample(self, rng, source, size):
        import numpy as np

        starts = rng.integers(0, len(source) - self.context - 1, size)
        return np.stack([source[s : s + self.context + 1] for s in starts]).astype(np.int32)

    def batch(self) -> tuple:
        """The next global batch (every method draws the same sequence)."""
        size = self.n * self.per_device
        if self.name == "digits":
            idx = self.rng.integers(0, len(self.xtr), size)
            return (self.xtr[idx], self.ytr[idx])
        return (self._sample(self.rng, self.train_text, size),)

    def loss(self, p, *batch):
        import jax
        import optax

        if self.name == "digits":
            x, y = batch
            h = jax.nn.relu(x @ p["w0"] + p["b0"])
            return optax.softmax_cross_entropy_with_integer_labels(h @ p["w1"] + p["b1"], y).mean()
        from flax import nnx

        (tokens,) = batch
        logits = nnx.merge(self.graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def metric(self, p) -> float:
        """Test accuracy (digits) or held-out loss (char) of params ``p``."""
        import jax
        import jax.numpy as jnp

        if self.name == "digits":
            h = jax.nn.relu(self.xte @ p["w0"] + p["b0"])
            return float(jnp.mean(jnp.argmax(h @ p["w1"] + p["b1"], -1) == self.yte))
        return float(jax.jit(self.loss)(p, jnp.asarray(self.eval_tokens)))

    @property
    def higher_is_better(self) -> bool:
        return self.name == "digits"


# --------------------------------------------------------------------------- one run


def train(task_name: str, method: str, steps: int, eval_every: int, seed: int = 0) -> dict:
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    task = Task(task_name, steps, seed)
    mesh = jax.make_mesh((task.n,), (AXIS,), axis_types=(AxisType.Explicit,))
    kind, tx, schedule = make_transform(method, task.inner, steps)
    replicated = kind in ("local_sgd", "diloco")
    state = jc.sharded_init(tx, task.params, mesh, AXIS)
    specs = jc.state_specs(state, AXIS)
    if replicated:
        params = jc.replica_params(task.params, mesh, AXIS)
        pspec = jc.replica_specs(task.params, AXIS)
    else:
        params = jax.device_put(task.params, NamedSharding(mesh, P()))
        pspec = P()

    def make_step(fixed: int | None = None):
        def step(r, s, *batch):
            if fixed is not None:
                s = jc.at_count(s, fixed)
            if replicated:
                p = jc.own(r)
                loss, g = jax.value_and_grad(task.loss)(p, *batch)
                u, s = tx.update(g, s, p)
                return jc.slot(optax.apply_updates(p, u)), s, jax.lax.pmean(loss, AXIS)
            local = jax.lax.pcast(r, AXIS, to="varying")
            loss, g = jax.value_and_grad(task.loss)(local, *batch)
            if kind == "dp":
                g = jax.lax.pmean(g, AXIS)
            u, s = tx.update(g, s, r)
            return optax.apply_updates(r, u), s, jax.lax.pmean(loss, AXIS)

        batch_specs = (P(AXIS),) * len(task.batch())
        return jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(pspec, specs, *batch_specs),
                out_specs=(pspec, specs, P()),
            ),
            donate_argnums=(0, 1),
        )

    put = lambda b: tuple(jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in b)  # noqa: E731
    sample = put(task.batch())
    task.rng = np.random.default_rng(seed)  # every method: the same batches from step 0

    # Bytes per step over the whole run, from the compiled program of each exchange pattern.
    if replicated:
        counts: dict[tuple, list[int]] = {}
        for c in range(steps):
            counts.setdefault(pattern(c, **schedule), []).append(c)
        total = 0.0
        per_pattern = {}
        for key, cs in counts.items():
            report = jc.comm_report(make_step(cs[0]), params, state, *sample)
            per_pattern[str(key)] = report.bytes_per_device
            total += report.bytes_per_device * len(cs)
        bytes_per_step = total / steps
        peak = max(per_pattern.values())
    else:
        bytes_per_step = peak = jc.comm_report(make_step(), params, state, *sample).bytes_per_device
        per_pattern = {"every step": bytes_per_step}

    step = make_step()
    curve, evals = [], []
    start = time.perf_counter()
    for t in range(steps):
        params, state, loss = jax.block_until_ready(step(params, state, *put(task.batch())))
        curve.append(float(loss))
        if (t + 1) % eval_every == 0 or t + 1 == steps:
            host = jax.device_get(params)
            evals.append((t + 1, task.metric(jc.mean_replica(host) if replicated else host)))
    seconds = time.perf_counter() - start
    final = jax.device_get(params)
    if replicated:
        spread = max(
            float(np.abs(a - a.mean(0)).max()) for a in jax.tree.leaves(final) if a.ndim > 0
        )
    else:
        spread = 0.0
    return {
        "task": task_name,
        "method": method,
        "steps": steps,
        "metric": "test_accuracy" if task.higher_is_better else "eval_loss_nats_per_byte",
        "value": evals[-1][1],
        "evals": evals,
        "final_train_loss": float(np.mean(curve[-20:])),
        "curve": curve,
        "bytes_per_step": bytes_per_step,
        "peak_bytes_per_step": peak,
        "bytes_by_pattern": per_pattern,
        "replica_spread": spread,
        "train_seconds": seconds,
        "schedule": schedule,
    }


def finish(runs: list[dict]) -> None:
    """Ratios against the ``dp`` run of the same task; steps to reach dp's final metric."""
    for r in runs:
        base = next((b for b in runs if b["task"] == r["task"] and b["method"] == "dp"), None)
        if base is None:
            continue
        r["bytes_ratio"] = base["bytes_per_step"] / max(r["bytes_per_step"], 1e-9)
        r["delta"] = r["value"] - base["value"]
        higher = r["metric"] == "test_accuracy"
        r["relative_delta"] = r["delta"] / base["value"]
        # dp's final quality, within the tolerance (1 point; 3% of the loss)
        target = base["value"] - 0.01 if higher else base["value"] * 1.03
        hits = [s for s, v in r["evals"] if (v >= target if higher else v <= target)]
        r["steps_to_target"] = hits[0] if hits else None
        r["target"] = target


def print_table(runs: list[dict]) -> None:
    print(
        f"\n{'task':7s} {'method':30s}{'metric':>9s}{'delta':>9s}{'B/step':>11s}"
        f"{'x fewer':>9s}{'peak B':>10s}{'to tgt':>8s}"
    )
    for r in runs:
        print(
            f"{r['task']:7s} {r['method']:30s}{r['value']:>9.4f}{r.get('delta', math.nan):>+9.4f}"
            f"{r['bytes_per_step']:>11.0f}{r.get('bytes_ratio', math.nan):>8.1f}x"
            f"{r['peak_bytes_per_step']:>10.0f}{str(r.get('steps_to_target')):>8s}"
        )


def draw(runs: list[dict], quick: bool) -> None:
    def one(ax):
        for r in runs:
            steps, values = zip(*r["evals"], strict=True)
            style = "-" if r["task"] == "digits" else "--"
            ax.plot(steps, values, style, label=f"{r['task']} {r['method']}")
        ax.set_xlabel("step")
        ax.set_ylabel("digits: test accuracy (solid); char: held-out loss (dashed)")
        ax.legend(fontsize=6, ncol=2)

    common.plot(
        common.result_path("diloco", quick, "png"),
        one,
        "local SGD / DiLoCo vs per-step pmean, same tokens",
    )


# --------------------------------------------------------------------------- shaped link

LINK_RATE = "100mbit"
LINK_MLP = (1024, 1024, 1024, 1024)  # 3.1M params: a pmean at 100 Mbit/s takes seconds
LINK_METHODS = ["dp", "local_sgd-H4", "diloco-int4-H20", "diloco-int4-H50"]


def link_worker(args) -> None:
    """One of the N processes: time each method's steps; rank 0 writes ``args.out``."""
    from jaxcomp.launch import initialize

    initialize()
    import warnings

    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n, rank = jax.device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    sharded = NamedSharding(mesh, P(AXIS))
    host = jax.device_get(common.mlp_params(LINK_MLP))
    rng = np.random.RandomState(rank)
    xb = rng.standard_normal((8, LINK_MLP[0])).astype(np.float32)
    yb = rng.standard_normal((8, LINK_MLP[-1])).astype(np.float32)
    bx = jax.make_array_from_callback((n * 8, LINK_MLP[0]), sharded, lambda i: xb)
    by = jax.make_array_from_callback((n * 8, LINK_MLP[-1]), sharded, lambda i: yb)
    rows = []
    for method in args.methods:
        t0 = time.perf_counter()
        kind, tx, schedule = make_transform(method, optax.sgd(1e-3), 1000)
        replicated = kind in ("local_sgd", "diloco")
        state = jc.sharded_init(tx, host, mesh, AXIS)
        specs = jc.state_specs(state, AXIS)
        if replicated:
            pspec = jc.replica_specs(host, AXIS)
            params = jax.tree.map(
                lambda a: jax.make_array_from_callback((n, *a.shape), sharded, lambda i: a[None]),
                host,
            )
        else:
            pspec = P()
            params = jax.device_put(host, NamedSharding(mesh, P()))

        def make_step(fixed=None, tx=tx, replicated=replicated, pspec=pspec, specs=specs):
            def body(r, s, x, y):
                if fixed is not None:
                    s = jc.at_count(s, fixed)
                if replicated:
                    p = jc.own(r)
                    g = jax.grad(common.mlp_loss)(p, x, y)
                    u, s = tx.update(g, s, p)
                    return jc.slot(optax.apply_updates(p, u)), s
                g = jax.grad(common.mlp_loss)(jax.lax.pcast(r, AXIS, to="varying"), x, y)
                g = jax.lax.pmean(g, AXIS)
                u, s = tx.update(g, s, r)
                return optax.apply_updates(r, u), s

            fn = jax.shard_map(
                body, mesh=mesh, in_specs=(pspec, specs, P(AXIS), P(AXIS)), out_specs=(pspec, specs)
            )
            return jax.jit(fn, donate_argnums=(0, 1))

        step = make_step()
        row = {"method": method, "devices": n, "schedule": schedule}
        if replicated:
            h = schedule["sync_every"]
            sync = [c for c in range(h) if any(pattern(c, **schedule))][0]
            row["sync_bytes_per_device"] = jc.comm_report(
                make_step(sync), params, state, bx, by
            ).bytes_per_device
            row["bytes_per_step"] = row["sync_bytes_per_device"] / h
            for _ in range(h):  # warm-up: one whole period (compiles, first sync)
                params, state = jax.block_until_ready(step(params, state, bx, by))
            periods = []
            for _ in range(args.periods):
                start = time.perf_counter()
                for _ in range(h):
                    params, state = jax.block_until_ready(step(params, state, bx, by))
                periods.append(time.perf_counter() - start)
            row["period_s"] = float(np.median(periods))
            row["ms_per_step"] = 1e3 * row["period_s"] / h
        else:
            row["bytes_per_step"] = jc.comm_report(step, params, state, bx, by).bytes_per_device
            for _ in range(2):
                params, state = jax.block_until_ready(step(params, state, bx, by))
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                params, state = jax.block_until_ready(step(params, state, bx, by))
                times.append(time.perf_counter() - start)
            row["ms_per_step"] = 1e3 * float(np.median(times))
        row["seconds_per_1000_steps"] = row["ms_per_step"]
        row["setup_and_timing_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del step, state, params
    if rank == 0:
        n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(host))
        with open(args.out, "w") as f:
            json.dump({"params": n_params, "rows": rows}, f)


def run_link(args) -> int:
    from benchmarks import network

    reason = network.skip_reason()
    if reason:
        print(f"diloco.py --link: skipped: {reason}")
        return 0
    ns, procs, results = network.Namespace(f"jaxcomp-diloco-{os.getpid()}"), [], []
    start = time.perf_counter()
    try:
        ns.open()
        ns.shape(args.rate)
        for n in args.processes:
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                out = f.name
            cmd = [
                "ip", "netns", "exec", ns.name, sys.executable, "-m", "jaxcomp.launch",
                "-n", str(n), "--timeout", str(args.timeout), os.path.abspath(__file__),
                "--link-worker", "--out", out, "--reps", str(args.reps),
                "--periods", str(args.periods), "--methods", *args.methods,
            ]  # fmt: skip
            print(f"\n== {args.rate}, {n} processes", flush=True)
            path = os.pathsep.join(p for p in (str(common.ROOT), os.environ.get("PYTHONPATH")) if p)
            proc = subprocess.Popen(
                cmd, start_new_session=True, cwd=common.ROOT, env={**os.environ, "PYTHONPATH": path}
            )
            procs.append(proc)
            try:
                code = proc.wait(timeout=args.timeout + 60)
                if code != 0 or os.path.getsize(out) == 0:
                    raise RuntimeError(f"workers with {n} processes failed with status {code}")
                with open(out) as f:
                    data = json.load(f)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                ns.kill_all()
                procs.remove(proc)
                os.unlink(out)
            base = next(r for r in data["rows"] if r["method"] == "dp")
            for r in data["rows"]:
                r.update(rate=args.rate, processes=n, mlp_params=data["params"])
                r["speedup_vs_dp"] = base["ms_per_step"] / r["ms_per_step"]
                r["bytes_ratio_vs_dp"] = base["bytes_per_step"] / r["bytes_per_step"]
                results.append(r)
    finally:
        for p in list(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        ns.close()
    print(f"\n{'procs':>5s} {'method':18s}{'ms/step':>10s}{'s/1000 steps':>14s}{'speedup':>9s}")
    for r in results:
        print(
            f"{r['processes']:>5d} {r['method']:18s}{r['ms_per_step']:>10.1f}"
            f"{r['seconds_per_1000_steps']:>14.1f}{r['speedup_vs_dp']:>8.1f}x"
        )
    out = {
        "environment": common.environment(),
        "rate": args.rate,
        "tbf": " ".join(network.TBF),
        "mlp": list(LINK_MLP),
        "loadavg": round(os.getloadavg()[0], 2),
        "seconds": round(time.perf_counter() - start, 1),
        "rows": results,
    }
    common.write_json(common.result_path("diloco_link", args.quick), out)

    def one(ax):
        import numpy as np

        names = list(dict.fromkeys(r["method"] for r in results))
        for i, n in enumerate(args.processes):
            vals = [
                next(
                    (
                        r["speedup_vs_dp"]
                        for r in results
                        if r["processes"] == n and r["method"] == m
                    ),
                    0,
                )
                for m in names
            ]
            ax.bar(np.arange(len(names)) + 0.4 * i, vals, 0.4, label=f"{n} processes")
        ax.set_xticks(np.arange(len(names)) + 0.2, names)
        ax.set_yscale("log")
        ax.set_ylabel("wall clock per step: speedup over pmean data parallel (same run)")
        ax.legend()

    common.plot(
        common.result_path("diloco_link", args.quick, "png"), one, f"{args.rate} shaped loopback"
    )
    return 0


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes=(
            "diloco.json and .png (`--label L`: diloco_L.*; `--quick`: diloco_quick.*; `--link`: "
            "diloco_link.*)"
        ),
        takes=(
            "about 26 minutes on the 2-core CPU host (1,578 s); `--quick` 3 minutes (161 s); "
            "`--link` (root) 6-8 minutes"
        ),
    )
    ap.add_argument("--quick", action="store_true", help="digits, 200 steps, few methods")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=None, help="tasks (None: all)")
    ap.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=None, help="methods (None: all)"
    )
    ap.add_argument("--steps", type=int, default=None, help=f"default per task: {STEPS}")
    ap.add_argument("--eval-every", type=int, default=None, help=f"default: {EVAL_EVERY}")
    ap.add_argument("--devices", type=int, default=8, help="CPU devices when no accelerator")
    ap.add_argument("--label", default=None, help="write diloco_LABEL.json")
    ap.add_argument("--link", action="store_true", help="shaped-link wall clock (root)")
    ap.add_argument("--rate", default=LINK_RATE, help="link rate (tc units)")
    ap.add_argument(
        "--processes", type=int, nargs="+", default=[2, 4], help="--link: process counts"
    )
    ap.add_argument("--reps", type=int, default=3, help="timed data-parallel steps")
    ap.add_argument("--periods", type=int, default=1, help="timed DiLoCo periods")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per launch, bounded")
    ap.add_argument("--link-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.link_worker:
        link_worker(args)
        return 0
    if args.link:
        args.methods = args.methods or LINK_METHODS
        if "dp" not in args.methods:
            args.methods = ["dp", *args.methods]
        return run_link(args)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(args.devices)
    tasks = args.tasks or (["digits"] if args.quick else list(TASKS))
    methods = args.methods or (QUICK_METHODS if args.quick else list(METHODS))
    if "dp" not in methods:
        methods = ["dp", *methods]
    runs: list[dict] = []
    name = "diloco" + (f"_{args.label}" if args.label else "")
    path = common.result_path(name, args.quick)
    start = time.perf_counter()
    for task in tasks:
        steps = args.steps or (200 if args.quick else STEPS[task])
        every = args.eval_every or EVAL_EVERY[task]
        for method in methods:
            t0 = time.perf_counter()
            r = train(task, method, steps, every)
            runs.append(r)
            finish(runs)
            print(
                f"{task} {method}: {r['metric']} {r['value']:.4f}, "
                f"{r['bytes_per_step']:.0f} B/step, {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            common.write_json(
                path,
                {"environment": common.environment(), "runs": runs, "partial": True},
                quiet=True,
            )
    finish(runs)
    print_table(runs)
    common.write_json(
        path,
        {
            "environment": common.environment(),
            "seconds": round(time.perf_counter() - start, 1),
            "runs": runs,
        },
    )
    draw(runs, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
