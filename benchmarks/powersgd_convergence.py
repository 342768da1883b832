"""PowerSGD against the uncompressed all-reduce: loss curves on the character transformer of
``benchmarks/char_transformer.py`` and accuracy on sklearn's digits, 8 data-parallel workers.

Every run of one table uses the same initialization, batches, optimizer, learning rate and
number of steps; only the gradient exchange differs: plain ``pmean`` or ``jc.powersgd`` at
rank 1, 2, 4 (and 8, 16), error feedback and warm start on. Each run length (1000, 3000 and
5000 steps in the full run) is a run of its own: the cosine schedule ends at its last step.
The figures are the held-out loss (nats per byte) and its ratio to the uncompressed run of
the same length, the same for the training loss (mean of the last 50 steps), the
steady-state bytes each device sends per step for the gradient exchange (ring model), and
the digits test accuracy::

    python -m benchmarks.powersgd_convergence --workers 8 --optimizers adam  # 6.5 min, H100
    python -m benchmarks.powersgd_convergence --workers 8 --optimizers sgd \
        --out benchmarks/results/powersgd_convergence_sgd.json
    python -m benchmarks.powersgd_convergence --steps 1000       # 8 CPU devices, shard_map
    python -m benchmarks.powersgd_convergence --quick            # smoke run, < 1 min

``--workers 8`` emulates the 8 workers with ``jax.vmap`` over the axis on one device (a GPU
runs a 5000-step run in about 20 s, the two commands above at once in 6.5 min; 8 CPU devices
on 2 cores take about 0.2 s a step). The arithmetic is that of 8 devices
(``tests/test_powersgd.py::test_vmap_workers_match_shard_map``). The full run writes
``benchmarks/results/powersgd_convergence.json`` and ``.png`` (loss curves and ratios);
``--quick`` writes ``powersgd_convergence_quick.json`` and ``.png`` beside them. Every step
is blocked on (``jax.block_until_ready``): XLA:CPU collectives of 8 virtual devices on few
cores deadlock when steps queue up.
"""

from __future__ import annotations

import json
import pathlib
import platform
import shlex
import sys
import time
from typing import Any

import jax

from benchmarks import char_transformer, common

# Variants: label -> (rank or None for plain pmean, extra jc.powersgd options). Every variant
# uses error feedback and warm start (the defaults). "rank 4, matrices only" keeps the byte
# embedding, position table and output head uncompressed (char_transformer.matrices_only).
VARIANTS = {
    "none": (None, {}),
    "rank 1": (1, {}),
    "rank 2": (2, {}),
    "rank 4": (4, {}),
    "rank 8": (8, {}),
    "rank 16": (16, {}),
    "rank 4, matrices only": (4, {"mask": "matrices_only"}),
}
FULL = {
    "steps": (1000, 3000, 5000),
    "batch_per_device": 2,
    "optimizers": ("adam", "sgd"),
    "variants": ("none", "rank 4", "rank 16", "rank 1", "rank 2"),
    "start_step": 10,
    "digits_steps": 200,
}
QUICK = {
    "steps": (20,),
    "batch_per_device": 2,
    "optimizers": ("adam",),
    "variants": ("none", "rank 4"),
    "start_step": 10,
    "digits_steps": 50,
}


def train_digits(
    rank: int | None,
    steps: int = 200,
    lr: float = 0.1,
    progress: bool | str = False,
    workers: int | None = None,
) -> float:
    """Test accuracy of a 64-256-10 MLP on sklearn's digits, trained data-parallel.

    All devices (8 CPU devices here) x 32 examples per step, SGD with momentum 0.9 at ``lr``,
    1400 training and 397 test images. ``rank``: None for the plain ``pmean`` of the
    gradients, else ``jc.powersgd(rank)`` (defaults) in front of the same SGD. ``workers``:
    that many workers emulated on one device (``jax.vmap`` over the axis) instead of one per
    device, as in ``char_transformer.train``.
    """
    import numpy as np
    import optax

    import jaxcomp as jc

    permutation = np.random.default_rng(0).permutation
    (x_train, y_train), (x_test, y_test) = common.load_digits_split(permutation=permutation)
    g = np.random.default_rng(1)
    params = {
        "w1": (0.1 * g.standard_normal((64, 256))).astype(np.float32),
        "b1": np.zeros(256, np.float32),
        "w2": (0.1 * g.standard_normal((256, 10))).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }

    def loss(p, xb, yb):
        logits = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    sgd = optax.sgd(lr, momentum=0.9)
    axis = char_transformer.AXIS
    tx = sgd if rank is None else optax.chain(jc.powersgd(rank, axis), sgd)

    def step(p, s, xb, yb):
        local = p if workers else jax.lax.pcast(p, axis, to="varying")
        grads = jax.grad(loss)(local, xb, yb)
        if rank is None:
            grads = jax.lax.pmean(grads, axis)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step, params, state, put = char_transformer.data_parallel(step, tx, params, workers, batches=2)
    n = workers or jax.device_count()
    batches = np.random.default_rng(2).integers(0, len(x_train), (steps, 32 * n))
    for idx in _progress(batches, progress):
        params, state = jax.block_until_ready(
            step(params, state, put(x_train[idx]), put(y_train[idx]))
        )
    p = jax.device_get(params)
    if workers:
        p = jax.tree.map(lambda a: a[0], p)
    logits = np.maximum(x_test @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"]
    return float((logits.argmax(-1) == y_test).mean())


def _progress(iterable, progress):
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=progress if isinstance(progress, str) else None, leave=False)


def char_runs(
    config: dict[str, Any], save=lambda runs: None, workers: int | None = None
) -> list[dict[str, Any]]:
    """Every variant of ``config`` (the first one is the baseline), for every optimizer and
    every run length in ``config["steps"]`` (the cosine schedule ends at each length, so
    each is a run of its own). ``save(runs)`` is called after each run, so an interrupted
    benchmark keeps what it did. ``workers``: see ``char_transformer.train``."""
    runs = []
    for optimizer in config["optimizers"]:
        for steps in config["steps"]:
            base = None
            for label in config["variants"]:
                run = _char_run(char_transformer, config, optimizer, steps, label, workers)
                base = base or run
                _compare(run, base, config["start_step"])
                runs.append(run)
                save(runs)
                print(
                    f"{optimizer:4s} {steps:5d} steps  {label:22s} held-out "
                    f"{run['eval_loss']:.4f}  x{run['eval_loss_ratio_to_first']:.4f}  "
                    f"train x{run['train_loss_ratio_to_first']:.4f}  "
                    f"{run['gradient_bytes_per_device_per_step'] / 2**10:7.1f} KiB/step "
                    f"({run['bytes_saving']:5.1f}x less)  {run['train_seconds']:.0f} s",
                    flush=True,
                )
    return runs


def _char_run(char_transformer, config, optimizer, steps, label, workers) -> dict[str, Any]:
    rank, options = VARIANTS[label]
    options = {"start_step": config["start_step"], **options}
    if options.get("mask") == "matrices_only":
        options["mask"] = char_transformer.matrices_only
    r = char_transformer.train(
        "none" if rank is None else "powersgd",
        steps,
        rank=rank or 4,
        optimizer=optimizer,
        batch_per_device=config["batch_per_device"],
        lr=config.get("lr"),
        powersgd_options=options,
        progress=f"{optimizer} {steps} {label}",
        return_details=True,
        workers=workers,
        seed=config.get("seed", 0),
    )
    curve = r["train_loss"]
    return {
        "optimizer": optimizer,
        "steps": steps,
        "variant": label,
        "rank": rank,
        "start_step": None if rank is None else config["start_step"],
        "eval_loss": r["eval_loss"],
        "train_loss_mean_last_50": sum(curve[-50:]) / len(curve[-50:]),
        "gradient_bytes_per_device_per_step": r["gradient_bytes_per_device"],
        "train_seconds": r["seconds"],
        "train_loss": curve,
    }


def _compare(run: dict[str, Any], base: dict[str, Any], start_step: int) -> None:
    """Ratios of ``run`` to the baseline run of the same optimizer and length."""
    run["eval_loss_ratio_to_first"] = run["eval_loss"] / base["eval_loss"]
    run["train_loss_ratio_to_first"] = (
        run["train_loss_mean_last_50"] / base["train_loss_mean_last_50"]
    )
    run["bytes_saving"] = (
        base["gradient_bytes_per_device_per_step"] / run["gradient_bytes_per_device_per_step"]
    )
    if run["rank"] is not None and base["rank"] is None:
        # Over all the steps: the first start_step send the uncompressed gradient.
        steps = run["steps"]
        warm = min(start_step, steps)
        sent = (
            warm * base["gradient_bytes_per_device_per_step"]
            + (steps - warm) * run["gradient_bytes_per_device_per_step"]
        )
        run["bytes_saving_all_steps"] = steps * base["gradient_bytes_per_device_per_step"] / sent


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Per optimizer: smoothed training-loss curves of the longest runs and, when there are
    several run lengths, the held-out loss ratio to uncompressed against the length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["char_transformer"]
    optimizers = list(dict.fromkeys(r["optimizer"] for r in runs))
    lengths = sorted({r["steps"] for r in runs})
    cols = 1 + (len(lengths) > 1)
    fig, axes = plt.subplots(
        len(optimizers), cols, figsize=(7 * cols, 4.6 * len(optimizers)), squeeze=False
    )
    for row, optimizer in zip(axes, optimizers, strict=True):
        mine = [r for r in runs if r["optimizer"] == optimizer]
        _plot_curves(row[0], [r for r in mine if r["steps"] == max(r["steps"] for r in mine)])
        row[0].set_title(f"char transformer, {optimizer}: held-out loss (ratio)")
        if cols > 1:
            _plot_ratios(row[1], mine)
            row[1].set_title(f"{optimizer}: held-out loss / uncompressed, same steps")
    digits = result["digits_mlp"]
    fig.suptitle(
        f"PowerSGD, {result['workers']} workers, same batches and steps.\nDigits MLP test "
        f"accuracy: uncompressed {digits['none']:.4f}, rank 4 {digits['rank_4']:.4f}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _color(variant: str) -> str:
    """The same matplotlib color for a variant in every panel."""
    return f"C{list(VARIANTS).index(variant) % 10}"


def _plot_curves(ax, runs: list[dict[str, Any]]) -> None:
    import numpy as np

    for r in runs:
        curve = np.asarray(r["train_loss"])
        width = max(1, min(25, len(curve) // 10))
        smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
        label = "uncompressed" if r["rank"] is None else r["variant"]
        label += f": {r['eval_loss']:.3f} (x{r['eval_loss_ratio_to_first']:.3f})"
        x = np.arange(len(smooth)) + width - 1
        ax.plot(x, smooth, label=label, lw=1.2, color=_color(r["variant"]))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, moving average)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _plot_ratios(ax, runs: list[dict[str, Any]]) -> None:
    for label in dict.fromkeys(r["variant"] for r in runs if r["rank"] is not None):
        mine = sorted(
            (r["steps"], r["eval_loss_ratio_to_first"]) for r in runs if r["variant"] == label
        )
        ax.plot(*zip(*mine, strict=True), marker="o", label=label, color=_color(label))
    ax.axhline(1.03, color="k", ls="--", lw=0.8, label="+3%")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xlabel("steps (each its own run, cosine schedule to 0)")
    ax.set_ylabel("held-out loss / uncompressed")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def main() -> None:
    parser = common.arg_parser(
        __doc__,
        writes="powersgd_convergence.json and .png (`--out`: another path; `--quick`: *_quick)",
        takes=(
            "about 6.5 minutes on an H100 (387 s); on 2 CPU cores far longer; `--quick` 1-5 minutes"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="smoke run (< 1 min)")
    parser.add_argument(
        "--steps", type=int, nargs="+", help="override the run lengths (one run per length)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=tuple(VARIANTS), help="variants to run (None: all)"
    )
    parser.add_argument("--optimizers", nargs="+", choices=("adam", "sgd"), help="(None: both)")
    parser.add_argument("--batch-per-device", type=int, help="sequences per device per step")
    parser.add_argument("--lr", type=float, help="peak learning rate (None: Adam 3e-3, SGD 0.2)")
    parser.add_argument(
        "--start-step", type=int, help="PowerSGD's uncompressed warm-up steps (None: 10)"
    )
    parser.add_argument("--seed", type=int, help="seed of the initialization and batches (None: 0)")
    parser.add_argument("--devices", type=int, default=8, help="CPU devices when no accelerator")
    parser.add_argument(
        "--workers",
        type=int,
        help="emulate this many workers on one device (jax.vmap over the axis; e.g. 8 on a GPU)",
    )
    parser.add_argument("--out", type=pathlib.Path, help="JSON path (PNG beside it)")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # XLA:CPU collectives
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on a GPU
    workers = args.workers or jax.device_count()

    config = dict(QUICK if args.quick else FULL)
    keys = ("steps", "variants", "optimizers", "batch_per_device", "start_step", "lr", "seed")
    for key in keys:
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    out = args.out or common.RESULTS / f"powersgd_convergence{'_quick' if args.quick else ''}.json"
    start = time.perf_counter()
    digits = {
        label: train_digits(rank, config["digits_steps"], progress=label, workers=args.workers)
        for label, rank in (("none", None), ("rank_4", 4))
    }
    print(f"digits MLP test accuracy: none {digits['none']:.4f}, rank 4 {digits['rank_4']:.4f}")
    command = shlex.join(["python", "-m", "benchmarks.powersgd_convergence", *sys.argv[1:]])
    result = {
        "benchmark": "powersgd_convergence",
        "command": command,
        "config": config,
        "model": "char transformer: 2 layers, d_model 128, 4 heads, context 64, byte vocab",
        "data": "pydoc_data.topics (90% train / 10% held out, 256 held-out sequences)",
        "batch": f"{workers} workers x {config['batch_per_device']} sequences, 64 bytes",
        "schedule": "5% linear warm-up, cosine decay to 0; Adam lr 3e-3 / SGD-Nesterov 0.2",
        "powersgd": f"jc.powersgd(rank, 'data', start_step={config['start_step']}), else defaults",
        "digits_mlp": {**digits, "steps": config["digits_steps"], "optimizer": "sgd 0.1 m0.9"},
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "device": str(jax.devices()[0].device_kind),
        "workers": workers,
        "emulated": args.workers is not None,
        "machine": platform.platform(),
    }

    def save(runs, final=False):
        result.update(complete=final, seconds=time.perf_counter() - start, char_transformer=runs)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))

    save(char_runs(config, save, args.workers), final=True)
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
