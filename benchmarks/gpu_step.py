"""The compressed training step on one device, against the same step with plain ``pmean``.

One data-parallel SGD step of the MLP of ``network.py`` (1024-4096-4096-1024, 25.2M
params, batch ``--batch``, MSE; :func:`common.mlp_train_step`) inside ``jax.shard_map``
over a 1-device mesh: ``optax.chain(jc.compressed_allreduce(codec, "data"), optax.sgd)``
with error feedback on (the default), against ``jax.lax.pmean`` + ``optax.sgd``. On one
device no bytes travel, so the ratio ``step / pmean step`` is what the codec and error
feedback cost on this device (encode, decode, the memory's passes over the gradient): the
price a link must win back. Each step feeds its params and state to the next; the figure
is the median of ``--reps`` samples after ``--warmup`` steps, each blocked until ready
(``--pipeline K``: a sample is K chained steps blocked once, over K; the host's dispatch
then overlaps the device's work, as in a training loop). ``pmean`` is timed first and again
last (the spread of the same step). Runs on whatever backend JAX has (meant for a GPU);
backend and device are recorded. Writes ``benchmarks/results/gpu_step.json`` and
``gpu_step.png`` (``--out``: another JSON path, PNG beside it)::

    python -m benchmarks.gpu_step                 # sign, int8, topk1% (approx), fp16; 25.2M
    python -m benchmarks.gpu_step --quick         # a 1.6M-param MLP, sign and int8 (CPU: <1 min)
    python -m benchmarks.gpu_step --pipeline 10 --out /tmp/gpu_step_h100.json
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

from benchmarks import common

AXIS = "data"
CODECS = ["sign", "int8", "topk1%", "fp16"]
QUICK_CODECS = ["sign", "int8"]
QUICK_MLP = (256, 1024, 1024, 256)


def time_steps(step, params, state, x, y, reps: int, warmup: int, pipeline: int = 1):
    """Seconds per step of ``reps`` samples after ``warmup`` steps (compile included there).

    Each sample is ``pipeline`` chained steps blocked once at the end, over ``pipeline``.
    """
    import jax

    for _ in range(warmup):
        params, state = jax.block_until_ready(step(params, state, x, y))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(pipeline):
            params, state = step(params, state, x, y)
        jax.block_until_ready((params, state))
        times.append((time.perf_counter() - t0) / pipeline)
    return times


def run(codecs, sizes, batch: int, reps: int, warmup: int, pipeline: int = 1, save=None):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp._src import feedback

    mesh = Mesh(np.array(jax.devices()[:1]), (AXIS,), axis_types=(AxisType.Explicit,))
    params = jax.device_put(common.mlp_params(sizes), NamedSharding(mesh, P()))
    n_params = sum(int(a.size) for a in jax.tree.leaves(params))
    rng = np.random.RandomState(0)
    batch_sharding = NamedSharding(mesh, P(AXIS))
    x = jax.device_put(rng.standard_normal((batch, sizes[0])).astype(np.float32), batch_sharding)
    y = jax.device_put(rng.standard_normal((batch, sizes[-1])).astype(np.float32), batch_sharding)
    largest = max(int(a.size) for a in jax.tree.leaves(params))
    rows = []
    for name in ["pmean", *codecs, "pmean"]:
        codec = None if name == "pmean" else common.make_codec(name)
        step, state = common.mlp_train_step(codec, params, mesh, AXIS)
        times = time_steps(step, params, state, x, y, reps, warmup, pipeline)
        row = {
            "codec": name,
            "step_ms": 1e3 * statistics.median(times),
            "step_min_ms": 1e3 * min(times),
            "step_max_ms": 1e3 * max(times),
            "strategy": "-" if codec is None else jc.choose_strategy(codec, largest, 1),
            "error_feedback": None if codec is None else feedback.resolve("auto", codec),
        }
        rows.append(row)
        row["vs_pmean"] = row["step_ms"] / rows[0]["step_ms"]  # the first row is pmean
        print(f"{name:8s} {row['step_ms']:9.3f} ms  {row['vs_pmean']:6.2f}x", flush=True)
        if save is not None:
            save(rows, n_params)
    return rows, n_params


def print_table(rows: list[dict], n_params: int) -> None:
    print(f"\none step, {n_params:,} params, 1 device; median ms and ratio to the first pmean")
    print(f"{'codec':10s}{'strategy':>11s}{'step ms':>10s}{'min ms':>9s}{'vs pmean':>10s}")
    for r in rows:
        print(
            f"{r['codec']:10s}{r['strategy']:>11s}{r['step_ms']:>10.3f}{r['step_min_ms']:>9.3f}"
            f"{r['vs_pmean']:>9.2f}x"
        )


def draw(rows: list[dict], path, title: str) -> None:
    def one(ax):
        names = [r["codec"] for r in rows]
        names[-1] += " (again)" if names[-1] == "pmean" and len(names) > 1 else ""
        ax.bar(range(len(rows)), [r["vs_pmean"] for r in rows], color="tab:blue")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), names)
        ax.set_ylabel("step time / plain pmean step (same run)")

    common.plot(path, one, title)


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="gpu_step.json and .png (`--out`: another path; `--quick`: gpu_step_quick.*)",
        takes="10-20 s on an H100; `--quick` under a minute on a CPU",
    )
    ap.add_argument(
        "--quick", action="store_true", help=f"MLP {QUICK_MLP}, {QUICK_CODECS}".replace("%", "%%")
    )
    ap.add_argument(
        "--codecs", nargs="+", default=None, help=f"default {CODECS}".replace("%", "%%")
    )
    ap.add_argument("--batch", type=int, default=8, help="batch of the one device")
    ap.add_argument("--reps", type=int, default=None, help="timed steps (default 30; quick 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    ap.add_argument("--pipeline", type=int, default=1, help="steps per sample, blocked once")
    ap.add_argument("--out", type=pathlib.Path, help="JSON path (PNG beside it)")
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    codecs = args.codecs or (QUICK_CODECS if args.quick else CODECS)
    sizes = QUICK_MLP if args.quick else common.MLP
    reps = args.reps or (5 if args.quick else 30)
    path = args.out or common.result_path("gpu_step", args.quick)
    start = time.perf_counter()

    def save(rows, n_params, complete=False):  # after every codec: a cut-short run keeps it
        common.write_json(
            path,
            {
                "environment": common.environment(),
                "mlp": list(sizes),
                "params": n_params,
                "batch": args.batch,
                "reps": reps,
                "warmup": args.warmup,
                "pipeline": args.pipeline,
                "complete": complete,
                "seconds": round(time.perf_counter() - start, 1),
                "rows": rows,
            },
            quiet=not complete,
        )

    rows, n_params = run(codecs, sizes, args.batch, reps, args.warmup, args.pipeline, save)
    save(rows, n_params, complete=True)
    print_table(rows, n_params)
    env = common.environment()
    title = f"One training step, {n_params / 1e6:.1f}M params, 1 {env['device']} ({env['backend']})"
    draw(rows, path.with_suffix(".png"), title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
