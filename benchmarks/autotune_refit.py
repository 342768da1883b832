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


#: Codec names as the recorded runs used them: every run refitted here predates 2026-11-26,
#: when ``jc.cast("fp16")`` (the registry's "fp16") became the scaled cast; theirs was the
#: unscaled one, the registry's "fp16_unscaled" since.
RECORDED_NAMES = {"fp16": "fp16_unscaled"}


def recorded_codec(name: str):
    """The codec a recorded run called ``name`` (:data:`RECORDED_NAMES`, else the registry's)."""
    return common.make_codec(RECORDED_NAMES.get(name, name))


def model_table(record: dict, sizes: list[int], n: int, widths: dict) -> list:
    """The ``autotune`` record's candidates as :class:`jaxcomp._src.autotune.Candidate` rows
    rebuilt by ``_model_rows`` from its link and codec times, its measured steps attached."""
    from jaxcomp._src import autotune as tuning

    link = {k: tuning.LinkFit(**v) for k, v in record["link"].items()}
    codecs = {name: recorded_codec(name) for name in record["codec_ms"]}
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
    """One recorded run: every table row and benchmark step row, with the prediction the run
    recorded (``old``), the library's now (``new``) and the library's with every timed step
    in one fit (``one_fit``: every row taken as moved at its own width, as before the widened
    codecs were fitted apart)."""
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
    from jaxcomp._src import autotune_steps

    fits = {
        "new": autotune_steps.calibrate_steps(widened),
        "one_fit": autotune_steps.calibrate_steps([r._replace(widen=1.0) for r in widened]),
    }
    table = []
    for i, c in enumerate(tuned["autotune"]):
        row = {
            "candidate": c["name"], "strategy": c["strategy"], "min_size": c["min_size"],
            "error_feedback": c["error_feedback"], "step_ms": c["step_ms"],
            "old_predicted_ms": c["predicted_step_ms"], "old_model_ms": c["model_ms"],
            "new_model_ms": fits["new"][i].model_ms,
            "old_error": _error(c["predicted_step_ms"], c["step_ms"]),
        }  # fmt: skip
        for key, rows in fits.items():
            row[f"{key}_predicted_ms"] = rows[i].predicted_step_ms
            row[f"{key}_error"] = _error(rows[i].predicted_step_ms, c["step_ms"])
        table.append(row)
    steps = _bench_predictions(data["rows"], fits)
    keys = ("old_error", "one_fit_error", "new_error")
    return {
        "run": name, "rate": tuned["rate"], "host_load": tuned.get("host_load"),
        "model_rebuild_error": drift, "table": table, "steps": steps,
        "untimed_vs_twin": _twins(table),
        "max_abs_error": {k: _worst(table + steps, k) for k in keys},
    }  # fmt: skip


def _bench_predictions(data_rows: list[dict], fits: dict) -> list[dict]:
    """Each benchmark step row with its recorded prediction and those of ``fits`` (the plan
    row of its exchange, as ``network.predict_steps`` matches them)."""
    from benchmarks import network

    rows = [r for r in data_rows if r.get("framework") == "jaxcomp" and "step_ms" in r]
    out = [
        {
            "step": r["codec"],
            "strategy": r.get("strategy"),
            "error_feedback": r.get("error_feedback"),
            "step_ms": r["step_ms"],
            "old_predicted_ms": r.get("predicted_step_ms", math.nan),
            "old_error": r.get("step_prediction_error", math.nan),
        }  # fmt: skip
        for r in rows
    ]
    for key, predicted in fits.items():
        fresh = copy.deepcopy(rows)
        recorded = next(r for r in fresh if "autotune" in r)
        for c, r in zip(recorded["autotune"], predicted, strict=True):
            c["predicted_step_ms"] = r.predicted_step_ms
        network.predict_steps(fresh, next(r for r in fresh if r["codec"] == "pmean"))
        for o, r in zip(out, fresh, strict=True):
            o[f"{key}_predicted_ms"] = r.get("predicted_step_ms", math.nan)
            o[f"{key}_error"] = r.get("step_prediction_error", math.nan)
    return [o for o in out if o["new_predicted_ms"] == o["new_predicted_ms"]]


#: Every recorded run with a ``jc.autotune`` table, checked by :func:`tie_check`.
TIE_RUNS = (
    "network_autotune", "network_autotune_repeat", "network_autotune_quiet",
    "network_autotune_10gbit", "network_autotune_quiet2", "network_autotune_10gbit_quiet2",
    "network_autotune_tie", "network_autotune_quiet3", "network_autotune_10gbit_quiet3",
    "network_autotune_10gbit_loaded", "network_autotune_1gbit_step",
    "network_autotune_10gbit_step", "network_autotune_1gbit_step_loaded",
    "network_autotune_10gbit_step_loaded", "network_autotune_steps_1gbit",
    "network_autotune_steps_10gbit",
)  # fmt: skip


def recorded_rows(table: list[dict]) -> list:
    """A recorded table's rows as :class:`jaxcomp._src.autotune.Candidate` (fields the
    record lacks keep their defaults; the codec from its name, None for plain)."""
    from jaxcomp._src import autotune as tuning

    fields = tuning.Candidate._fields
    return [
        tuning.Candidate(**{
            **{k: v for k, v in c.items() if k in fields},
            "codec": None if c["name"] == "none" else recorded_codec(c["name"]),
        })
        for c in table
    ]  # fmt: skip


def tie_check(name: str) -> dict:
    """One recorded run: the row its plan chose, the row the selection rule here chooses
    (:func:`jaxcomp._src.autotune.select`: whole steps by
    :func:`jaxcomp._src.autotune_steps.select_step`, exchanges by ``TIE`` and ``MARGIN``),
    the rows tied with the fastest, and the benchmark's own step of each where the run timed
    one (same codec and strategy, and feedback where both record it): which was faster."""
    from jaxcomp._src import autotune as tuning
    from jaxcomp._src import autotune_steps

    data = json.loads((common.RESULTS / f"{name}.json").read_text())
    tuned = next(r for r in data["rows"] if "autotune" in r)
    rows = recorded_rows(tuned["autotune"])
    stepped = any(r.step_ms == r.step_ms for r in rows)
    if stepped:
        tied = autotune_steps.tied_steps(rows)
    else:
        fastest = min(r.measured_ms for r in rows if r.codec is not None and not r.error)
        tied = [
            r for r in rows if r.codec is not None and r.measured_ms <= (1 + tuning.TIE) * fastest
        ]  # fmt: skip
        tied = tied if len(tied) > 1 else []
    new, old = tuning.select(rows), rows[0]
    bench = _bench_steps(data["rows"], old)
    fed = all("error_feedback" in c for c in tuned["autotune"])  # older tables lack it

    def label(r) -> dict:
        steps = [
            v for (key, ef), v in bench.items()
            if key == (r.name, r.strategy) and (not fed or ef in ("?", r.error_feedback))
        ]  # fmt: skip
        return {"candidate": r.name, "strategy": r.strategy, "min_size": r.min_size,
                "timed_ms": r.step_ms if stepped else r.measured_ms,
                "bench_step_ms": min(steps) if steps else math.nan}  # fmt: skip

    picks = {"recorded": label(old), "now": label(new)}
    known = {  # the tied exchanges the benchmark also timed, one per codec and strategy
        (p["candidate"], p["strategy"]): p["bench_step_ms"]
        for p in map(label, tied)
        if p["bench_step_ms"] == p["bench_step_ms"]
    }
    verdict = "no tie" if not tied else "no benchmark pair"
    if len(known) > 1 and (new.name, new.strategy) in known:
        fastest = min(known, key=known.get)
        verdict = "faster" if fastest == (new.name, new.strategy) else "slower"
    return {"run": name, "rate": tuned["rate"], "host_load": tuned.get("host_load"),
            "stepped": stepped, "tied": [label(r) for r in tied], **picks,
            "now_in_benchmark": verdict}  # fmt: skip


def _bench_steps(rows: list[dict], chosen) -> dict:
    """``{((codec, strategy), error_feedback): step_ms}`` of the run's jaxcomp step rows
    (``autotune``'s under the codec and strategy its plan chose)."""
    out = {}
    for r in rows:
        if r.get("framework") != "jaxcomp" or "step_ms" not in r:
            continue
        if r["codec"] == "pmean":
            key = ("none", "pmean")
        elif r["codec"] == "autotune":
            key = (chosen.name, chosen.strategy)
        else:
            key = (r["codec"].partition(":")[0].partition("@")[0], r.get("strategy"))
        out[(key, r.get("error_feedback", "?"))] = r["step_ms"]
    return out


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
    for which in ("old", "one_fit", "new"):
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
    codecs = {name: recorded_codec(name) for name in sorted(names)}
    widths = tuning.wire_widths(list(codecs.values()), mesh, "data")
    result = {
        "environment": common.environment(),
        "widths": {name: widths[c] for name, c in codecs.items()},
        "runs": [refit(name, sizes, widths) for name in args.runs],
        "ties": [tie_check(name) for name in TIE_RUNS],
    }
    for run in result["runs"]:
        worst = run["max_abs_error"]
        print(run["run"], "max |error| recorded", f"{worst['old_error']:.0%}", "one fit",
              f"{worst['one_fit_error']:.0%}", "now", f"{worst['new_error']:.0%}")  # fmt: skip
        for r in run["table"] + run["steps"]:
            label = r.get("candidate") or r["step"]
            print(f"  {label:22}{str(r['strategy']):11}{r['step_ms']:9.1f}" + "".join(
                f"{r[k + '_predicted_ms']:9.1f} {r[k + '_error']:+6.0%}"
                for k in ("old", "one_fit", "new")))  # fmt: skip
    for t in result["ties"]:
        tied = ", ".join(f"{r['candidate']} {r['strategy']} {r['timed_ms']:.0f}" for r in t["tied"])
        print(f"{t['run']:38} recorded {t['recorded']['candidate']} {t['recorded']['strategy']}"
              f"  now {t['now']['candidate']} {t['now']['strategy']}  tied: {tied or '-'}"
              f"  benchmark: {t['now_in_benchmark']}")  # fmt: skip
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
