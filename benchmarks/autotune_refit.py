"""jc.autotune's step predictions recomputed from recorded runs: the library's model against
the steps measured, leave-one-out, beside the predictions the run itself recorded.

``benchmarks/network.py`` records every ``jc.autotune`` table it makes (the link it fitted,
the codecs' standalone encode, decode and feedback times, and each timed candidate's median
step). This rebuilds each table's model rows from those records with this checkout's
:func:`jaxcomp._src.autotune._model_rows` (the wire widened where XLA:CPU widens a payload
type: :func:`jaxcomp._src.autotune.wire_widths`, probed on 2 CPU devices here, as the runs
had) and predicts every step with :func:`jaxcomp._src.autotune_steps.calibrate_steps`: each
timed row from the other timed rows (leave-one-out), so predicted against measured is a fair
test, and each benchmark step row (``pmean``, ``autotune``, ``int8``,
``fp16@two_phase:none``) from the table row of its exchange, as ``network.predict_steps``
matches them. No timing: the numbers are the recorded ones, the result is deterministic.

Writes ``benchmarks/results/autotune_refit.json`` (and a PNG of error against row)::

    python -m benchmarks.autotune_refit [--runs network_autotune_steps_1gbit ...]
"""

from __future__ import annotations

import copy
import json
import math

from benchmarks import common

#: The recorded whole-step runs (idle host, then loaded) whose tables are refitted.
RUNS = (
    "network_autotune_steps_1gbit",
    "network_autotune_steps_10gbit",
    "network_autotune_1gbit_step_loaded",
    "network_autotune_10gbit_step_loaded",
)


def model_table(record: dict, sizes: list[int], n: int, widths: dict) -> list:
    """The ``autotune`` record's candidates as :class:`jaxcomp._src.autotune.Candidate` rows
    rebuilt by ``_model_rows`` from its link and codec times, its measured steps attached."""
    from jaxcomp._src import autotune as tuning

    link = {k: tuning.LinkFit(**v) for k, v in record["link"].items()}
    codecs = {name: common.make_codec(name) for name in record["codec_ms"]}
    costs = {
        codecs[name]: (enc / 1e3, dec / 1e3, record.get("feedback_ms", {}).get(name, 0.0) / 1e3)
        for name, (enc, dec) in record["codec_ms"].items()
    }
    out = []
    for c in record["autotune"]:
        codec = codecs.get(c["name"])
        cand = (codec, c["strategy"], c["bucket_bytes"], c["min_size"], c["error_feedback"])
        (row,) = tuning._model_rows([cand], sizes, n, link, costs, {}, widths)
        out.append(
            row._replace(step_ms=c["step_ms"], step_spread_ms=c["step_spread_ms"], error=c["error"])
        )
    return out


def refit(name: str, sizes: list[int], widths: dict) -> dict:
    """One recorded run: every table row and benchmark step row, old and new predictions."""
    from benchmarks import network
    from jaxcomp._src import autotune_steps

    data = json.loads((common.RESULTS / f"{name}.json").read_text())
    tuned = next(r for r in data["rows"] if "autotune" in r)
    n = tuned["devices"]
    widened = model_table(tuned, sizes, n, widths)
    unwidened = model_table(tuned, sizes, n, {})
    drift = max(  # the rebuilt model against the recorded one (same link, same codec times)
        min(abs(w.model_ms / c["model_ms"] - 1), abs(u.model_ms / c["model_ms"] - 1))
        for w, u, c in zip(widened, unwidened, tuned["autotune"], strict=True)
        if not c["error"]
    )
    new = autotune_steps.calibrate_steps(widened)
    table = []
    for c, r in zip(tuned["autotune"], new, strict=True):
        table.append({
            "candidate": c["name"], "strategy": c["strategy"], "min_size": c["min_size"],
            "error_feedback": c["error_feedback"], "step_ms": c["step_ms"],
            "old_predicted_ms": c["predicted_step_ms"], "new_predicted_ms": r.predicted_step_ms,
            "old_model_ms": c["model_ms"], "new_model_ms": r.model_ms,
            "old_error": _error(c["predicted_step_ms"], c["step_ms"]),
            "new_error": _error(r.predicted_step_ms, c["step_ms"]),
        })  # fmt: skip
    rows = [r for r in data["rows"] if r.get("framework") == "jaxcomp" and "step_ms" in r]
    fresh = copy.deepcopy(rows)
    recorded = next(r for r in fresh if "autotune" in r)
    for c, r in zip(recorded["autotune"], new, strict=True):
        c["predicted_step_ms"] = r.predicted_step_ms
    base = next(r for r in fresh if r["codec"] == "pmean")
    network.predict_steps(fresh, base)
    steps = [
        {
            "step": old["codec"],
            "strategy": old.get("strategy"),
            "error_feedback": old.get("error_feedback"),
            "step_ms": old["step_ms"],
            "old_predicted_ms": old.get("predicted_step_ms", math.nan),
            "new_predicted_ms": r.get("predicted_step_ms", math.nan),
            "old_error": old.get("step_prediction_error", math.nan),
            "new_error": r.get("step_prediction_error", math.nan),
        }  # fmt: skip
        for old, r in zip(rows, fresh, strict=True)
        if "predicted_step_ms" in r
    ]
    return {
        "run": name, "rate": tuned["rate"], "host_load": tuned.get("host_load"),
        "model_rebuild_error": drift, "table": table, "steps": steps,
        "untimed_vs_twin": _twins(table),
        "max_abs_error": {k: _worst(table + steps, k) for k in ("old_error", "new_error")},
    }  # fmt: skip


def _twins(table: list[dict]) -> dict:
    """Untimed rows against the measured step of their timed twin (same codec, strategy and
    feedback, another ``min_size``: on the MLP only its biases, 9,216 of 25.2M floats, fall
    under 4096): mean and max |error| of the recorded and the new predictions."""
    key = ("candidate", "strategy", "error_feedback")
    measured = {
        tuple(r[k] for k in key): r["step_ms"] for r in table if r["step_ms"] == r["step_ms"]
    }
    pairs = [
        (r, measured[tuple(r[k] for k in key)])
        for r in table
        if r["step_ms"] != r["step_ms"] and tuple(r[k] for k in key) in measured
    ]
    out = {"rows": len(pairs)}
    for which in ("old", "new"):
        errors = [abs(r[f"{which}_predicted_ms"] / m - 1) for r, m in pairs]
        out[which] = {"mean": sum(errors) / len(errors), "max": max(errors)} if errors else {}
    return out


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1 if measured == measured and predicted == predicted else math.nan


def _worst(rows: list[dict], key: str) -> float:
    return max(abs(r[key]) for r in rows if r[key] == r[key])


def main(argv: list[str] | None = None) -> dict:
    parser = common.arg_parser(
        __doc__,
        writes="autotune_refit.json and autotune_refit.png",
        takes="seconds (no timing: the recorded runs' numbers)",
    )
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="result names to refit")
    args = parser.parse_args(argv)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(2)  # the runs' 2 processes: the same backend's widening
    import jax

    from jaxcomp._src import autotune as tuning

    sizes = [int(math.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(common.mlp_params))]
    mesh = jax.make_mesh((2,), ("data",))
    names = {c for name in args.runs for c in _codec_names(name)}
    codecs = {name: common.make_codec(name) for name in sorted(names)}
    widths = tuning.wire_widths(list(codecs.values()), mesh, "data")
    result = {
        "environment": common.environment(),
        "widths": {name: widths[c] for name, c in codecs.items()},
        "runs": [refit(name, sizes, widths) for name in args.runs],
    }
    for run in result["runs"]:
        print(run["run"], "max |error| old", f"{run['max_abs_error']['old_error']:+.0%}",
              "new", f"{run['max_abs_error']['new_error']:+.0%}")  # fmt: skip
        for r in run["table"] + run["steps"]:
            label = r.get("candidate") or r["step"]
            print(f"  {label:22}{str(r['strategy']):11}{r['step_ms']:9.1f}"
                  f"{r['old_predicted_ms']:9.1f} {r['old_error']:+6.0%}"
                  f"{r['new_predicted_ms']:9.1f} {r['new_error']:+6.0%}")  # fmt: skip
    common.write_json(common.result_path("autotune_refit", False), result)
    _plot(result)
    return result


def _codec_names(name: str) -> list[str]:
    data = json.loads((common.RESULTS / f"{name}.json").read_text())
    return list(next(r for r in data["rows"] if "autotune" in r)["codec_ms"])


def _plot(result: dict) -> None:
    def draw(ax):
        for i, run in enumerate(result["runs"]):
            rows = [r for r in run["table"] if r["new_error"] == r["new_error"]]
            for key, marker in (("old_error", "x"), ("new_error", "o")):
                ax.scatter([i] * len(rows), [100 * r[key] for r in rows], marker=marker,
                           label=key.split("_")[0] if i == 0 else None)  # fmt: skip
        ax.axhline(25, color="grey", linestyle=":")
        ax.axhline(-25, color="grey", linestyle=":")
        ax.set_xticks(range(len(result["runs"])), [r["run"][17:] for r in result["runs"]])
        ax.set_ylabel("predicted / measured step - 1 (%)")
        ax.legend()

    title = "jc.autotune step predictions, leave-one-out: recorded (x) and now (o)"
    common.plot(common.result_path("autotune_refit", False, "png"), draw, title)


if __name__ == "__main__":
    main()
