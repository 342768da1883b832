"""CPU time of whole training steps, per exchange, as jc.autotune times them: the tie-break.

Two exchanges that move the same bytes can run steps too close to tell apart on the wall
clock of a shared host (``jc.autotune`` then settles the tie by the CPU time per step:
``jaxcomp._src.autotune_steps.settle_tie``). This measures, for each codec, whether the
all-gather or the two phases cost the host less CPU, with the library's own step timer
(``autotune_steps._Timer``): each candidate's step of the MLP of ``benchmarks/network.py``
(25.2M parameters, batch 8 per device, MSE, SGD; its exchange with the error feedback
``jc.autotune`` gives it, params and state donated) is compiled, warmed up and timed
``--reps`` steps, then every candidate ``--reps`` more steps interleaved (one step of each
in turn, so drift on the host hits all alike); the process's CPU seconds (every thread:
compute, codec passes, the collectives' copies) are taken around each step beside its wall
time. ``--devices`` CPU devices of one process share the host's cores, as the network
benchmark's processes do.

Writes ``benchmarks/results/exchange_cpu.json`` and ``exchange_cpu.png``::

    python -m benchmarks.exchange_cpu [--devices 2] [--reps 5] [--codecs fp16 int8] [--label L]
"""

from __future__ import annotations

import math
import os

from benchmarks import common

STRATEGIES = ("allgather", "two_phase")


def candidates(names: list[str]) -> list:
    """Plain ``pmean`` and each codec's all-gather and two-phase candidate, with the error
    feedback ``jc.autotune`` times it with (``candidate_feedback``)."""
    from jaxcomp._src import autotune as tuning
    from jaxcomp._src import buckets

    rows = [tuning.Candidate("none", None, "pmean", buckets.BUCKET_BYTES, 0, 0.0, 0.0, math.nan)]
    for name in names:
        codec = common.make_codec(name)
        for strategy in STRATEGIES:
            rows.append(
                tuning.Candidate(
                    tuning.codec_label(codec), codec, strategy, buckets.BUCKET_BYTES, 0, 0.0,
                    0.0, math.nan, error_feedback=tuning.candidate_feedback(codec),
                )
            )  # fmt: skip
    return rows


def measure(names: list[str], devices: int, batch: int, reps: int) -> list[dict]:
    """Each candidate's step: median and interquartile range of wall and CPU ms."""
    import jax
    import numpy as np
    import optax

    from jaxcomp._src import autotune_steps

    mesh = jax.make_mesh((devices,), ("data",))
    params = jax.jit(common.mlp_params)()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((devices * batch, common.MLP[0])).astype(np.float32)
    y = rng.standard_normal((devices * batch, common.MLP[-1])).astype(np.float32)
    placed = autotune_steps.place_batch((x, y), mesh, "data")
    timer = autotune_steps._Timer(
        params, placed, mesh, "data", common.mlp_loss, optax.sgd(1e-3), reps
    )
    rows = [timer.time(r) for r in candidates(names)]
    failed = [f"{r.name} {r.strategy}: {r.error}" for r in rows if r.error]
    if failed:
        raise RuntimeError("; ".join(failed))
    err = timer.again(rows)
    if err:
        raise RuntimeError(err)
    return [_row(timer.stats(r)) for r in rows]


def _row(r) -> dict:
    return {
        "codec": r.name, "strategy": r.strategy, "error_feedback": r.error_feedback,
        "step_ms": r.step_ms, "step_spread_ms": r.step_spread_ms, "step_reps": r.step_reps,
        "cpu_ms": r.step_cpu_ms, "cpu_spread_ms": r.step_cpu_spread_ms,
    }  # fmt: skip


def verdicts(rows: list[dict]) -> dict:
    """Per codec: the strategy of less CPU per step, the CPU and wall ratios two-phase /
    all-gather, and whether the CPU difference is beyond the noise ``settle_tie`` allows
    (the larger interquartile range, at least ``TIE`` of the less)."""
    from jaxcomp._src.autotune import TIE

    out = {}
    for name in dict.fromkeys(r["codec"] for r in rows if r["codec"] != "none"):
        ag, tp = (next(r for r in rows if r["codec"] == name and r["strategy"] == s)
                  for s in STRATEGIES)  # fmt: skip
        gap = abs(tp["cpu_ms"] - ag["cpu_ms"])
        noise = max(tp["cpu_spread_ms"], ag["cpu_spread_ms"], TIE * min(tp["cpu_ms"], ag["cpu_ms"]))
        out[name] = {
            "less_cpu": "two_phase" if tp["cpu_ms"] < ag["cpu_ms"] else "allgather",
            "cpu_two_phase_over_allgather": tp["cpu_ms"] / ag["cpu_ms"],
            "wall_two_phase_over_allgather": tp["step_ms"] / ag["step_ms"],
            "beyond_noise": gap > noise,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = common.arg_parser(
        __doc__,
        writes="exchange_cpu.json and exchange_cpu.png (`--label L`: exchange_cpu_L.*)",
        takes="about 2 minutes of CPU at the defaults (2 cores)",
    )
    parser.add_argument("--devices", type=int, default=2, help="CPU devices of the process")
    parser.add_argument("--codecs", nargs="+", default=["fp16", "int8"], help="codec names")
    parser.add_argument("--batch", type=int, default=8, help="examples per device")
    parser.add_argument("--reps", type=int, default=5, help="timed steps per round (2 rounds)")
    parser.add_argument("--label", default="", help="write exchange_cpu_LABEL.json (and .png)")
    args = parser.parse_args(argv)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(args.devices)
    load_before = os.getloadavg()[0]
    rows = measure(args.codecs, args.devices, args.batch, args.reps)
    result = {
        "environment": common.environment(), "devices": args.devices, "batch": args.batch,
        "reps": args.reps, "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rows": rows, "verdicts": verdicts(rows),
    }  # fmt: skip
    for r in rows:
        print(f"{r['codec']:6}{r['strategy']:11}step {r['step_ms']:8.1f} ms "
              f"(IQR {r['step_spread_ms']:.1f})  cpu {r['cpu_ms']:8.1f} ms "
              f"(IQR {r['cpu_spread_ms']:.1f})")  # fmt: skip
    print(result["verdicts"])
    name = "exchange_cpu" + (f"_{args.label}" if args.label else "")
    common.write_json(common.result_path(name, False), result)
    _plot(rows, name)
    return result


def _plot(rows: list[dict], name: str = "exchange_cpu") -> None:
    def draw(ax):
        labels = [f"{r['codec']}\n{r['strategy']}" for r in rows]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["step_ms"] for r in rows], 0.4, label="wall")
        ax.bar([x + 0.2 for x in xs], [r["cpu_ms"] for r in rows], 0.4, label="CPU")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("ms per step (median)")
        ax.legend()

    title = "Steps of the 25.2M-parameter MLP per exchange: wall and process CPU time"
    common.plot(common.result_path(name, False, "png"), draw, title)


if __name__ == "__main__":
    main()
