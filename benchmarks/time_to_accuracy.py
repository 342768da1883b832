"""Time to accuracy on a rate-limited link: wall-clock to the uncompressed run's quality.

Uncompressed training, the best recipe of each compression family and torch DDP's PowerSGD
hook, timed until they reach the final quality of the uncompressed run.

The figure users and skeptics ask for (Agarwal et al., MLSys 2022: compression beat a tuned
uncompressed baseline in 6 of 200+ set-ups). On the shaped loopback of
``benchmarks/network.py`` (its network namespace, ``tc ... tbf`` and ``python -m
jaxcomp.launch``; root and iproute2, otherwise skipped with a message, exit 0), ``-n`` (2)
JAX processes with one CPU device each (gloo) train one model data parallel — the global
batch split over the processes, the same seed, initialization and batches for every method
— with each method in turn:

* ``none``: plain ``jax.lax.pmean`` of the gradients + the SGD baseline (momentum 0.9);
* ``adam`` (char only): plain ``pmean`` + Adam, the baseline of the Adam family;
* ``sgd-sign``, ``sgd-topk1%``, ``sgd-int8``: ``jc.sgd(lr, codec, "data")`` (EF-SGDM, the
  recipes of ``benchmarks/convergence.py``);
* ``powersgd4``: ``jc.powersgd(4, "data")`` (10 uncompressed warm-up steps) + the baseline
  optimizer (SGD momentum on the classifiers, Adam on char, as in convergence.py);
* ``onebit_adam``: ``jc.onebit_adam(lr, "data", freeze_step=50)``, the library's defaults
  (``adam_bound=True`` since 2026-11-26: the committed rows, of 2026-11-23, ran without it);
* ``torch-powersgd4`` (the MLPs only): torch ``DistributedDataParallel`` over gloo with its
  PowerSGD hook (rank 4, ``start_powerSGD_iter=2``, one bucket), the same weights, batches
  and SGD momentum, on the same link. The char transformer has no torch twin here (its
  weights and numerics would have to be rebuilt in torch): skipped.

Tasks (``--tasks``):

* ``digits`` — sklearn digits, MLP 64-256-10 (19k params), batch 256, SGD momentum 0.9,
  lr 0.05 (convergence.py's): the honest case, where the link time is negligible;
* ``digits-wide`` — the same data and optimizer on an MLP 64-1024-1024-10 (1.1M params),
  so that the link dominates the step at 1 Gbit/s and 100 Mbit/s;
* ``char`` — the character transformer of ``benchmarks/char_transformer.py`` at its default
  size (2 layers, d_model 128, 0.47M params), 2 sequences of 64 bytes per process, cosine
  schedule: SGD momentum (peak lr 0.2) for the ``jc.sgd`` family, Adam (3e-3) for the Adam
  family; metric: held-out loss in nats per byte (128 sequences).

Every step is blocked and timed; every ``--eval-every`` steps (and after the last) process 0
evaluates its replica (test accuracy, or held-out loss) while the others wait, and the
processes meet at a barrier: evaluation is not counted. Time to target = the summed step
times until the metric first reaches the target: the final value of the family's own
uncompressed run (accuracy >= target; loss <= target * (1 + ``--tol``), 1%), and again
against the best uncompressed run of the task. Speedup = the baseline's time to its own
final quality / the method's time ("not reached" when it never gets there). Bytes per step:
ring-model bytes each device sends, from the lowered step (``collectives`` of
``jc.comm_report``'s ``logical`` kind); for the steps that compile an uncompressed warm-up
branch next to the compressed one (``powersgd4``, ``onebit_adam``) the steady state is that
minus the uncompressed step's bytes (the warm-up branch is the same plain mean).

Writes ``benchmarks/results/time_to_accuracy.json`` (after every rate) and
``time_to_accuracy.png`` (quality against wall-clock per rate and task)::

    sudo python -m benchmarks.time_to_accuracy                 # 1gbit, 100mbit; every task
    sudo python -m benchmarks.time_to_accuracy --quick         # 1gbit, digits, none + sgd-sign
    sudo python -m benchmarks.time_to_accuracy --rates 1gbit --tasks char --steps 200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks import common, network

AXIS = "data"
RATES = ["1gbit", "100mbit"]
TASKS = ("digits", "digits-wide", "char")
SIZES = {"digits": (64, 256, 10), "digits-wide": (64, 1024, 1024, 10)}
STEPS = {"digits": 300, "digits-wide": 300, "char": 300}
EVAL_EVERY = {"digits": 10, "digits-wide": 10, "char": 20}
METHODS = [
    "none",
    "adam",
    "sgd-sign",
    "sgd-topk1%",
    "sgd-int8",
    "powersgd4",
    "onebit_adam",
    "torch-powersgd4",
]
BATCH = 256  # digits: global batch (split over the processes)
CHAR_BATCH_PER_PROCESS = 2  # sequences of CHAR_CONTEXT bytes
CHAR_CONTEXT = 64
CHAR_EVAL_SEQUENCES = 128
TOL = 0.01  # loss targets: reached at <= target * (1 + TOL)
TORCH_POWERSGD_START = network.POWERSGD_START


def family(method: str, task: str) -> str:
    """``"sgd"`` or ``"adam"``: which uncompressed baseline the method is held against."""
    if method in ("adam", "onebit_adam"):
        return "adam"
    if method == "powersgd4":
        return "adam" if task == "char" else "sgd"
    return "sgd"


def baseline_of(method: str, task: str) -> str:
    """The uncompressed run of the method's family: ``none`` (SGD momentum) or ``adam``.
    The classifiers have one baseline (convergence.py's SGD momentum) for every family."""
    return "adam" if task == "char" and family(method, task) == "adam" else "none"


def methods_for(task: str, methods: list[str]) -> list[str]:
    keep = [m for m in methods if not (m == "adam" and task != "char")]
    return [m for m in keep if not (m.startswith("torch") and task == "char")]


# --------------------------------------------------------------------------- worker side


def make_tx(method: str, task: str, steps: int):
    """``(tx, averages)``: the whole optimizer of ``method`` and whether it averages the
    gradients itself (else the step does a plain ``pmean`` first)."""
    import optax

    import jaxcomp as jc
    from benchmarks import convergence

    kind = "char" if task == "char" else "classifier"

    def lr(peak: float):
        if task != "char":
            return peak
        return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 20), steps)

    sgd_lr, adam_lr = convergence.RECIPE_LR["sgd"][kind], convergence.RECIPE_LR["adam"][kind]
    baseline = {
        "sgd": optax.sgd(lr(sgd_lr), momentum=0.9),
        "adam": optax.adam(lr(adam_lr)),
    }
    if method == "none":
        return baseline["sgd"], False
    if method == "adam":
        return baseline["adam"], False
    if method == "powersgd4":
        return optax.chain(jc.powersgd(4, AXIS), baseline[family(method, task)]), True
    if method in convergence.RECIPES:
        return convergence.RECIPES[method](AXIS, lr(convergence.recipe_lr(method, task))), True
    raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def worker(args) -> None:
    """One of the N processes: every task and method in turn; rank 0 writes ``args.out``
    (one JSON record per line, after every run, so a killed run keeps what finished)."""
    from jaxcomp.launch import initialize

    initialize()
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp._src import accounting

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n, rank = jax.device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    def put(batch):  # the same host batch on every process; each device takes its rows
        return jax.make_array_from_callback(batch.shape, sharded, lambda idx: batch[idx])

    def local(tree):  # this process's replica of replicated params
        return jax.tree.map(lambda a: a.addressable_data(0), tree)

    def record(rec: dict) -> None:
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            curve = rec.get("curve") or [[0, 0.0, math.nan]]
            print(
                f"{rec['task']:11s} {rec['method']:16s} final {rec.get('final', math.nan):.4f} "
                f"{curve[-1][1]:.1f} s training, step {rec.get('step_ms', math.nan):.1f} ms, "
                f"{rec.get('bytes_per_step', 0) / 1e3:.1f} kB/step",
                flush=True,
            )

    torch_group = None
    for task in args.tasks:
        steps = args.steps or STEPS[task]
        every = args.eval_every or EVAL_EVERY[task]
        evals = sorted({*range(every, steps + 1, every), steps})
        if task == "char":
            spec = char_task(jax, jnp, np, optax, replicated)
        else:
            spec = mlp_task(task, jax, jnp, np, optax, replicated)
        for method in methods_for(task, args.methods):
            t_start = time.perf_counter()
            if method.startswith("torch"):
                if args.no_torch:
                    continue
                if torch_group is None:
                    torch_group = torch_init(args, n, rank)
                rec = torch_run(task, method, spec, steps, evals, n, rank, args.seed)
                rec["seconds"] = round(time.perf_counter() - t_start, 1)
                record(rec)
                continue
            tx, averages = make_tx(method, task, steps)
            params = spec["init"]()
            state = jc.sharded_init(tx, params, mesh, AXIS)
            specs = jc.state_specs(state, AXIS)
            loss_fn = spec["loss"]

            def step(p, s, *batch, tx=tx, averages=averages, loss_fn=loss_fn):
                loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), *batch)
                if not averages:
                    g = jax.lax.pmean(g, AXIS)
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s, jax.lax.pmean(loss, AXIS)

            nb = spec["batches"]
            fn = jax.jit(
                jax.shard_map(
                    step,
                    mesh=mesh,
                    in_specs=(P(), specs, *[P(AXIS)] * nb),
                    out_specs=(P(), specs, P()),
                ),
                donate_argnums=(0, 1),
            )
            rng = np.random.RandomState(args.seed)
            first = [put(b) for b in spec["batch"](rng)]
            lowered = fn.lower(params, state, *first)
            logical = accounting.parse_stablehlo_collectives(lowered.as_text(), n)
            compiled = lowered.compile()
            multihost_utils.sync_global_devices(f"{task}-{method}-start")
            rng = np.random.RandomState(args.seed)  # the same batches for every method
            times, curve, losses = [], [], []
            for i in range(1, steps + 1):
                batch = [put(b) for b in spec["batch"](rng)]
                t0 = time.perf_counter()
                params, state, loss = jax.block_until_ready(compiled(params, state, *batch))
                times.append(time.perf_counter() - t0)
                losses.append(float(loss))
                if i in evals:
                    if rank == 0:
                        curve.append([i, round(sum(times), 4), spec["metric"](local(params))])
                    multihost_utils.sync_global_devices(f"{task}-{method}-{i}")
            rec = {
                "task": task,
                "method": method,
                "framework": "jaxcomp",
                "family": family(method, task),
                "steps": steps,
                "metric": spec["metric_name"],
                "curve": curve,
                "final": curve[-1][2] if curve else math.nan,
                "final_train_loss": float(np.mean(losses[-20:])),
                "step_ms": 1e3 * float(np.median(times)),
                "train_seconds": float(sum(times)),
                "bytes_per_step": float(sum(c.bytes_per_device for c in logical)),
                "seconds": round(time.perf_counter() - t_start, 1),
            }
            record(rec)
            del params, state, compiled, fn
    if torch_group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


def mlp_task(task, jax, jnp, np, optax, replicated) -> dict:
    """The digits MLP of ``SIZES[task]``: He-normal weights, zero biases, cross-entropy."""
    (xtr, ytr), (xte, yte) = common.load_digits_split(0)
    sizes = SIZES[task]

    init_fn, logits_fn, loss_fn = common.classifier_mlp(sizes)

    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(logits_fn(p, xte), -1) == yte))

    def batch(rng):
        idx = rng.randint(0, len(xtr), BATCH)
        return xtr[idx], ytr[idx]

    return {
        "init": lambda: jax.jit(init_fn, out_shardings=replicated)(jax.random.PRNGKey(0)),
        "loss": loss_fn,
        "batches": 2,
        "batch": batch,
        "metric": lambda p: float(accuracy(p)),
        "metric_name": "test_accuracy",
        "higher_is_better": True,
        "sizes": sizes,
        "data": (xtr, ytr, xte, yte),
        "init_numpy": lambda: jax.device_get(init_fn(jax.random.PRNGKey(0))),
    }


def char_task(jax, jnp, np, optax, replicated) -> dict:
    """The character transformer of benchmarks/char_transformer.py at its default size."""
    from flax import nnx

    from benchmarks import char_transformer as ct

    text = ct.load_text()
    split_at = int(0.9 * len(text))
    train_text, eval_text = text[:split_at], text[split_at:]

    def make_model():
        return ct.CharTransformer(context=CHAR_CONTEXT, d=128, layers=2, heads=4, rngs=nnx.Rngs(0))

    graphdef = nnx.graphdef(nnx.eval_shape(make_model))

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def sequences(rng, source, size):
        starts = rng.randint(0, len(source) - CHAR_CONTEXT - 1, size)
        return np.stack([source[s : s + CHAR_CONTEXT + 1] for s in starts]).astype(np.int32)

    eval_tokens = sequences(np.random.RandomState(12345), eval_text, CHAR_EVAL_SEQUENCES)
    held_out = jax.jit(lambda p: loss_fn(p, eval_tokens))
    n = jax.device_count()
    return {
        "init": lambda: jax.jit(lambda: nnx.state(make_model()), out_shardings=replicated)(),
        "loss": loss_fn,
        "batches": 1,
        "batch": lambda rng: (sequences(rng, train_text, n * CHAR_BATCH_PER_PROCESS),),
        "metric": lambda p: float(held_out(p)),
        "metric_name": "eval_loss_nats_per_byte",
        "higher_is_better": False,
    }


def torch_init(args, n: int, rank: int):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group(
        "gloo", store=dist.FileStore(args.torch_store, n), rank=rank, world_size=n
    )
    return dist.group.WORLD


def torch_run(
    task: str, method: str, spec: dict, steps: int, evals: list, n: int, rank: int, seed: int
):
    """torch DDP (gloo, one bucket) with its PowerSGD hook on the same MLP, initial weights,
    batches and SGD momentum as the jaxcomp runs; process 0 evaluates every ``evals`` step."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    sizes = spec["sizes"]
    xtr, ytr, xte, yte = spec["data"]
    init = spec["init_numpy"]()
    layers: list = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        lin = nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(np.asarray(init[f"w{i}"]).T.copy()))
            lin.bias.copy_(torch.from_numpy(np.asarray(init[f"b{i}"])))
        layers += [lin] + ([nn.ReLU()] if i < len(sizes) - 2 else [])
    model = DDP(nn.Sequential(*layers), bucket_cap_mb=network.BUCKET_MB)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=TORCH_POWERSGD_START
    )
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x_test, y_test = torch.from_numpy(xte), torch.from_numpy(yte.astype(np.int64))
    half = BATCH // n
    rng = np.random.RandomState(seed)
    times, curve, losses = [], [], []
    dist.barrier()
    for i in range(1, steps + 1):
        idx = rng.randint(0, len(xtr), BATCH)[rank * half : (rank + 1) * half]
        x, y = torch.from_numpy(xtr[idx]), torch.from_numpy(ytr[idx].astype(np.int64))
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if i in evals:
            if rank == 0:
                with torch.no_grad():
                    acc = float((model.module(x_test).argmax(-1) == y_test).float().mean())
                curve.append([i, round(sum(times), 4), acc])
            dist.barrier()
    return {
        "task": task,
        "method": method,
        "framework": "torch",
        "torch": torch.__version__,
        "family": "sgd",
        "steps": steps,
        "metric": "test_accuracy",
        "curve": curve,
        "final": curve[-1][2] if curve else math.nan,
        "final_train_loss": float(np.mean(losses[-20:])),  # process 0's half batch
        "step_ms": 1e3 * float(np.median(times)),
        "train_seconds": float(sum(times)),
        "bytes_per_step": network.torch_ring_bytes(n, "torch-powersgd4", 4, sizes),
        "powersgd_start_iter": TORCH_POWERSGD_START,
    }


# --------------------------------------------------------------------------- driver side


def reached(curve: list, target: float, higher: bool, tol: float) -> float | None:
    """Training seconds at the first evaluation that meets ``target`` (None: never)."""
    for _, seconds, value in curve:
        if (value >= target) if higher else (value <= target * (1.0 + tol)):
            return seconds
    return None


def summarize(runs: list[dict], tol: float) -> None:
    """Targets, times to target and speedups, per rate and task, in place."""
    for r in runs:
        same = [b for b in runs if b["rate"] == r["rate"] and b["task"] == r["task"]]
        higher = r["metric"] == "test_accuracy"
        bases = {b["method"]: b for b in same if b["method"] in ("none", "adam")}
        if not bases:
            continue
        better = max if higher else min
        best = better(bases.values(), key=lambda b: b["final"])
        own = bases.get(baseline_of(r["method"], r["task"]))
        if r["method"] in ("powersgd4", "onebit_adam") and own is not None:
            r["steady_bytes_per_step"] = r["bytes_per_step"] - own["bytes_per_step"]
        for key, base in (("own", own), ("best", best)):
            if base is None:
                continue
            base_time = reached(base["curve"], base["final"], higher, tol)
            time_to = reached(r["curve"], base["final"], higher, tol)
            r[f"baseline_{key}"] = base["method"]
            r[f"target_{key}"] = base["final"]
            r[f"time_to_target_{key}"] = time_to
            r[f"speedup_{key}"] = None if time_to is None else base_time / time_to
        r["bytes_saving"] = (own or best)["bytes_per_step"] / r.get(
            "steady_bytes_per_step", r["bytes_per_step"]
        )


def print_table(runs: list[dict]) -> None:
    print(
        f"\n{'rate':>8s} {'task':11s} {'method':16s}{'base':>6s}{'target':>8s}{'t->tgt':>9s}"
        f"{'speedup':>9s}{'vs best':>9s}{'final':>8s}{'step ms':>9s}{'kB/step':>10s}"
    )
    for r in runs:
        t = r.get("time_to_target_own")
        s, sb = r.get("speedup_own"), r.get("speedup_best")
        kb = r.get("steady_bytes_per_step", r["bytes_per_step"]) / 1e3
        print(
            f"{r['rate']:>8s} {r['task']:11s} {r['method']:16s}{r.get('baseline_own', '-'):>6s}"
            f"{r.get('target_own', math.nan):>8.4f}"
            f"{'never' if t is None else f'{t:.1f}s':>9s}"
            f"{'-' if s is None else f'{s:.2f}x':>9s}{'-' if sb is None else f'{sb:.2f}x':>9s}"
            f"{r['final']:>8.4f}{r['step_ms']:>9.1f}{kb:>10.1f}"
        )


def draw(runs: list[dict], path) -> None:
    panels = list(dict.fromkeys((r["rate"], r["task"]) for r in runs))

    def one(ax, rate, task):
        for r in runs:
            if (r["rate"], r["task"]) != (rate, task) or not r["curve"]:
                continue
            _, secs, vals = zip(*r["curve"], strict=True)
            base = r["method"] in ("none", "adam")
            ax.plot(
                secs,
                vals,
                label=r["method"],
                color={"none": "black", "adam": "grey"}.get(r["method"]),
                linewidth=2 if base else 1,
            )
            if base:
                ax.axhline(r["final"], color=ax.lines[-1].get_color(), linestyle=":", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training wall-clock (s), evaluation excluded")
        ax.set_ylabel(runs[0]["metric"] if task != "char" else "held-out nats/byte")
        if task == "char":
            lo = min(r["final"] for r in runs if (r["rate"], r["task"]) == (rate, task))
            ax.set_ylim(lo * 0.97, lo * 1.6)
        else:
            ax.set_ylim(0.8, 1.0)
        ax.set_title(f"{rate}, {task}", fontsize=9)
        ax.legend(fontsize=6)

    common.plot_grid(
        path,
        [lambda ax, p=p: one(ax, *p) for p in panels],
        "quality against wall-clock, 2 processes over gloo on a shaped loopback",
        ncols=len(dict.fromkeys(t for _, t in panels)),
    )


def run_rate(ns, rate: str, args, procs: list) -> list[dict]:
    ns.shape(rate)
    fd, out = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    store_dir = tempfile.mkdtemp(prefix="jaxcomp-torch-store-")
    argv = [
        "--worker", "--out", out, "--tasks", *args.tasks, "--methods", *args.methods,
        "--steps", str(args.steps or 0), "--eval-every", str(args.eval_every or 0),
        "--seed", str(args.seed), "--torch-store", os.path.join(store_dir, "store"),
        *(["--no-torch"] if args.no_torch else []),
    ]  # fmt: skip
    try:
        code = network.launch(ns, rate, __file__, argv, args.num_processes, args.timeout, procs)
        with open(out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if code != 0:
            print(f"time_to_accuracy.py: workers at {rate} exited with {code}: kept {len(rows)}")
        for r in rows:
            r["rate"] = rate
        return rows
    finally:
        os.unlink(out)
        shutil.rmtree(store_dir, ignore_errors=True)


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="time_to_accuracy.json and .png (after every rate)",
        takes="about 1 hour for both rates (3,516 s; needs root and iproute2 for the shaped link)",
    )
    ap.add_argument("--quick", action="store_true", help="1gbit, digits, none + sgd-sign")
    ap.add_argument("--rates", nargs="+", default=None, help=f"default {' '.join(RATES)}")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=None, help="tasks (None: all)")
    ap.add_argument(
        "--methods", nargs="+", default=None, help=f"default {' '.join(METHODS)}".replace("%", "%%")
    )
    ap.add_argument("--steps", type=int, default=None, help=f"per task default {STEPS}")
    ap.add_argument("--eval-every", type=int, default=None, help=f"default {EVAL_EVERY}")
    ap.add_argument("--tol", type=float, default=TOL, help="loss targets: <= target*(1+tol)")
    ap.add_argument("-n", "--num-processes", type=int, default=2, help="JAX processes")
    ap.add_argument("--seed", type=int, default=0, help="initialization and batches")
    ap.add_argument("--no-torch", action="store_true", help="no torch DDP PowerSGD runs")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds per rate, bounded")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--torch-store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.steps = args.steps or None
        args.eval_every = args.eval_every or None
        worker(args)
        return 0
    args.methods = args.methods or (["none", "sgd-sign"] if args.quick else METHODS)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]
    args.tasks = args.tasks or (["digits"] if args.quick else list(TASKS))
    if args.quick:
        args.steps = args.steps or 30
    rates = args.rates or (["1gbit"] if args.quick else RATES)
    for r in rates:
        network.rate_bits(r)
    reason = network.skip_reason()
    if reason:
        print(f"time_to_accuracy.py: skipped: {reason}")
        return 0
    if not args.no_torch and not network.torch_available():
        print(f"time_to_accuracy.py: torch not importable: skipped; {network.TORCH_INSTALL}")
        args.no_torch = True

    ns, procs = network.Namespace(f"jaxcomp-tta-{os.getpid()}"), []

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    start, load_before = time.perf_counter(), os.getloadavg()
    path = common.result_path("time_to_accuracy", args.quick)
    runs: list[dict] = []

    def save(complete: bool) -> None:
        summarize(runs, args.tol)
        out = {
            "environment": common.environment(),
            "complete": complete,
            "num_processes": args.num_processes,
            "tbf": " ".join(network.TBF),
            "tol": args.tol,
            "eval_every": {t: args.eval_every or EVAL_EVERY[t] for t in args.tasks},
            "models": {
                "digits": "MLP 64-256-10 (19k params), batch 256, SGD momentum 0.9 lr 0.05",
                "digits-wide": "MLP 64-1024-1024-10 (1.12M params), batch 256, same optimizer",
                "char": (
                    "char transformer, 2 layers, d_model 128, 4 heads, context 64 (0.47M "
                    f"params), {CHAR_BATCH_PER_PROCESS} sequences per process, cosine schedule; "
                    "SGD momentum 0.9 peak lr 0.2 (none, jc.sgd family), Adam 3e-3 (adam, "
                    "powersgd4, onebit_adam)"
                ),
            },
            "onebit_freeze_step": 50,
            "torch_note": (
                "char: no torch DDP twin of the char transformer (skipped)"
                if not args.no_torch
                else "torch runs skipped"
            ),
            "loadavg": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "seconds": round(time.perf_counter() - start, 1),
            "runs": runs,
        }
        common.write_json(path, out)

    try:
        try:
            ns.open()
        except subprocess.CalledProcessError as e:
            print(f"time_to_accuracy.py: skipped: cannot create a network namespace ({e})")
            return 0
        for rate in rates:
            runs += run_rate(ns, rate, args, procs)
            save(complete=False)
    finally:
        for p in list(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        ns.close()
        for s, h in old.items():
            signal.signal(s, h)
    save(complete=True)
    print_table(runs)
    draw(runs, common.result_path("time_to_accuracy", args.quick, "png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
