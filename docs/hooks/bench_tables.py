"""The measured tables of the docs pages, rendered from ``benchmarks/results/*.json``.

The numbers on the docs pages are never typed by hand. A marker pair names a result file
without its extension (``wire_bytes`` reads ``wire_bytes.json``, or ``wire_bytes_quick.json``
when only a quick run exists)::

    <!-- bench:wire_bytes -->
    (the table, written by the command below)
    <!-- /bench:wire_bytes -->

A missing file becomes a note saying which command produces it; ``<!-- bench:others -->``
lists every result file that no marker on any page names, each as a generic table.

The tables are committed inside the Markdown, so the pages read the same on GitHub as on the
built site. After a benchmark run rewrites a result file, render them again::

    python -m docs.hooks.bench_tables --write     # rewrite every stale table in docs/*.md
    python -m docs.hooks.bench_tables --check     # exit 1 and name the stale pages

A lone begin marker (no end marker yet) is filled on ``--write``. As an mkdocs hook this
module changes nothing: it warns about a stale page, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import re
import sys
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
# Markers stand on lines of their own (a marker quoted inside a sentence is text).
MARKER = re.compile(r"^<!--\s*bench:([A-Za-z0-9_.-]+)\s*-->[ \t]*$", re.MULTILINE)
# A begin marker, and the table up to its end marker when the page already holds one.
BLOCK = re.compile(
    r"^<!--\s*bench:(?P<name>[A-Za-z0-9_.-]+)\s*-->[ \t]*$"
    r"(?:(?P<body>.*?)^<!--\s*/bench:(?P=name)\s*-->[ \t]*$)?",
    re.DOTALL | re.MULTILINE,
)
WRITE_COMMAND = "python -m docs.hooks.bench_tables --write"
log = logging.getLogger("mkdocs.hooks.bench_tables")
MAX_GENERIC_ROWS = 40

Table = tuple[list[str], list[list[str]]]


def _load(name: str) -> tuple[Any, pathlib.Path] | None:
    for candidate in (f"{name}.json", f"{name}_quick.json"):
        path = RESULTS / candidate
        if path.exists():
            return json.loads(path.read_text()), path
    return None


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or x is None:
        return "–" if x is None else str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if math.isnan(x):
            return "–"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        return f"{x:.{digits}g}"
    return str(x).replace("|", "\\|")


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _markdown(table: Table) -> str:
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _source(path: pathlib.Path, data: Any, command: str | None) -> str:
    env = data.get("environment", {}) if isinstance(data, dict) else {}
    where = ", ".join(
        f"{k} {env[k]}"
        for k in ("backend", "device", "device_count", "cpu_cores", "jax", "date_utc")
        if k in env
    )
    quick = " (a `--quick` run)" if path.stem.endswith("_quick") else ""
    rel = path.relative_to(ROOT)
    by = f"written by `{command}`" if command else "assembled from the runs' own outputs"
    return f"*Source: `{rel}`{quick}, {by}.{' ' + where + '.' if where else ''}*"


# ------------------------------------------------------------------------- wire_bytes


def _wire_bytes(data: dict[str, Any], path: pathlib.Path) -> str:
    rows = data["rows"]
    out = []
    for tree in dict.fromkeys(r["tree"] for r in rows):
        tr = [r for r in rows if r["tree"] == tree]
        base = {r["devices"]: r["bytes_per_device"] for r in tr if r["codec"] == "pmean"}
        ns = sorted(base)
        n_pick = 8 if 8 in ns else ns[-1]
        strategies = ["allreduce", "allgather", "two_phase", "auto"]
        codecs = [c for c in dict.fromkeys(r["codec"] for r in tr) if c != "pmean"]

        def saving(codec: str, strategy: str, n: int, tr=tr, base=base) -> str:
            hit = [
                r
                for r in tr
                if r["codec"] == codec and r["strategy"] == strategy and r["devices"] == n
            ]
            if not hit or not hit[0]["bytes_per_device"]:
                return "–"
            r = hit[0]
            extra = f" ({r['resolved']})" if strategy == "auto" and r.get("resolved") else ""
            return f"{base[n] / r['bytes_per_device']:.1f}x{extra}"

        params = tr[0].get("params")
        out.append(
            f"**{tree}** ({_fmt(params)} parameters), n = {n_pick} devices: bytes of plain "
            f"`pmean` ({_bytes(base[n_pick])} per device per step) divided by the codec's."
        )
        body = [[f"`{c}`", *(saving(c, s, n_pick) for s in strategies)] for c in codecs]
        out.append(_markdown((["codec", *strategies], body)))
        if len(ns) > 1:
            out.append(f"**{tree}**, strategy `auto`, saving against n:")
            body = [[f"`{c}`", *(saving(c, "auto", n).split(" ")[0] for n in ns)] for c in codecs]
            out.append(_markdown((["codec", *(f"n = {n}" for n in ns)], body)))
    out.append(_source(path, data, "python -m benchmarks.wire_bytes"))
    return "\n\n".join(out)


# ------------------------------------------------------------------ sparse_wire_bytes


def _sparse_wire_bytes(data: list[dict[str, Any]], path: pathlib.Path) -> str:
    methods = list(dict.fromkeys(r["method"] for r in data))
    ns = sorted({r["devices"] for r in data})
    cell = {(r["method"], r["devices"]): r for r in data}
    body = []
    for m in methods:
        row = [m]
        for n in ns:
            r = cell.get((m, n))
            row.append(f"{r['saving']:.1f}x ({_bytes(r['bytes_per_device'])})" if r else "–")
        body.append(row)
    params = _fmt(data[0]["params"])
    head = (
        f"Sparse codecs on a {params}-parameter tree: saving against plain `pmean` "
        "(bytes per device per step)."
    )
    table = _markdown((["method", *(f"n = {n}" for n in ns)], body))
    return f"{head}\n\n{table}\n\n" + _source(path, data, "python -m benchmarks.topk_speed")


# ------------------------------------------------------------------------ topk_speed


def _on(data: dict[str, Any]) -> str:
    """``cpu`` or ``gpu (NVIDIA H100 80GB HBM3)``, and how calls were timed when pipelined."""
    env = data.get("environment", data)
    where = str(env.get("backend", "?"))
    if where != "cpu" and env.get("device"):
        where += f" ({env['device']})"
    pipeline = data.get("pipeline", 1)
    if pipeline > 1:
        where += f", {pipeline} calls back to back per sample, blocked once"
    return where


def _topk_speed(data: dict[str, Any], path: pathlib.Path) -> str:
    runs = [data, *data.get("by_ratio", [])]
    methods = list(data["median_ms"])
    body = [
        [f"`{m}`"]
        + [
            f"{r['median_ms'][m]:.3g} ({r['in_copies'][m]:.2f})" if m in r["median_ms"] else "–"
            for r in runs
        ]
        for m in methods
    ]
    body.append(["`approx=True` picks"] + [f"`{r['approx_method']}`" for r in runs])
    head = (
        f"Selecting the top k of {_fmt(data['size'])} values on {_on(data)}: median ms of "
        f"{data['reps']} runs, in brackets the same time in copies of the array."
    )
    header = ["method", *(f"ratio {r['ratio']} (k = {_fmt(r['k'])})" for r in runs)]
    table = _markdown((header, body))
    return f"{head}\n\n{table}\n\n" + _source(path, data, "python -m benchmarks.topk_speed")


# ------------------------------------------------------------- powersgd_convergence


def _powersgd(data: dict[str, Any], path: pathlib.Path) -> str:
    runs = data["char_transformer"]
    cfg = data["config"]
    steps = lambda r: r.get("steps", cfg["steps"])  # one length per file before 2026-11
    base = {(r["optimizer"], steps(r)): r for r in runs if r["rank"] is None}
    body = []
    for r in runs:
        b = base[r["optimizer"], steps(r)]
        train = r["train_loss_mean_last_50"] / b["train_loss_mean_last_50"]
        body.append(
            [
                r["optimizer"],
                str(steps(r)),
                r["variant"],
                _fmt(r["eval_loss"], 4),
                f"{r['eval_loss'] / b['eval_loss']:.3f}",
                f"{train:.3f}",
                f"{r['bytes_saving']:.1f}x",
                _bytes(r["gradient_bytes_per_device_per_step"]),
            ]
        )
    header = [
        "optimizer",
        "steps",
        "variant",
        "held-out loss",
        "vs none",
        "train loss vs none",
        "saving",
        "bytes/step",
    ]
    if any("bytes_saving_all_steps" in r for r in runs):  # the warm-up steps counted
        header.insert(7, "saving, all steps")
        for row, r in zip(body, runs, strict=True):
            row.insert(7, f"{r.get('bytes_saving_all_steps', r['bytes_saving']):.1f}x")
    if data.get("emulated"):
        where = f"{data['workers']} workers emulated with jax.vmap on one {data['device']}"
    else:
        where = f"{data['devices']} {data['backend']} devices"
    head = f"{data['model']}; {data['data']}; {data['batch']}; {where}; {data['schedule']}."
    out = f"{head}\n\n{_markdown((header, body))}"
    digits = data.get("digits_mlp")
    if digits:
        out += (
            f"\n\nDigits MLP ({digits['steps']} steps, {digits['optimizer']}): test accuracy "
            f"{digits['none']:.4f} uncompressed, {digits['rank_4']:.4f} with rank 4."
        )
    return out + "\n\n" + _source(path, data, "python -m benchmarks.powersgd_convergence")


# ----------------------------------------------------------------------- codec_speed


def _codec_speed(data: dict[str, Any], path: pathlib.Path) -> str:
    rows = data["rows"]
    sizes = sorted({r["size"] for r in rows})
    cell = {(r["codec"], r["size"]): r for r in rows}
    body = []
    for codec in dict.fromkeys(r["codec"] for r in rows):
        ratio = next(r["compression"] for r in rows if r["codec"] == codec)
        times = [cell.get((codec, s)) for s in sizes]
        body.append(
            [f"`{codec}`", f"{ratio:.1f}x"] + [f"{t['in_copies']:.1f}" if t else "–" for t in times]
        )
    env = data.get("environment", {})
    on = _on(data) if env.get("backend") != "cpu" else f"cpu ({env.get('cpu_cores', '?')} cores)"
    head = (
        "Encode + decode time of one vector, in copies of the same array (same run, "
        f"median of {data.get('reps', '?')}), on {on}, and the codec's compression of float32."
    )
    header = ["codec", "compression", *(f"d = {_fmt(s)}" for s in sizes)]
    return f"{head}\n\n{_markdown((header, body))}\n\n{_codec_speed_runs(data)}" + _source(
        path, data, "python -m benchmarks.codec_speed"
    )


def _codec_speed_runs(data: dict[str, Any]) -> str:
    """Which run timed which codecs' rows, where ``--merge`` joined several (the source line
    names the last run's environment only); empty for a file one run wrote."""
    runs = data.get("runs", [])
    if len(runs) < 2:
        return ""
    later: set[str] = set()
    said: list[str] = []
    for run in reversed(runs[1:]):
        mine = [c for c in run["codecs"] if c not in later]
        later |= set(mine)
        if mine:
            codecs = ", ".join(f"`{c}`" for c in mine)
            said.insert(0, f"{codecs} from `{run['command']}` ({run['date_utc']})")
    first = runs[0]
    others = len([c for c in first["codecs"] if c not in later])
    return (
        f"Rows timed in {len(runs)} runs joined by `--merge`, each against the copy of its own "
        f"run: {'; '.join(said)}; the other {others} codecs from `{first['command']}` "
        f"({first['date_utc']}).\n\n"
    )


# -------------------------------------------------------------------------- gpu_step


def _gpu_step(data: dict[str, Any], path: pathlib.Path) -> str:
    body = [
        [
            f"`{r['codec']}`" + (" (again)" if i and r["codec"] == "pmean" else ""),
            str(r.get("strategy", "-")),
            str(r.get("error_feedback") or "–"),
            _fmt(r["step_ms"], 3),
            f"{r['vs_pmean']:.2f}x",
        ]
        for i, r in enumerate(data["rows"])
    ]
    head = (
        f"One SGD step of a {_fmt(data['params'])}-parameter MLP (batch {data['batch']}) in "
        f"`shard_map` over one device on {_on(data)}: median of {data['reps']} samples; "
        "ratio to the plain `pmean` step of the same run (above 1: the codec's cost)."
    )
    header = ["codec", "strategy", "error feedback", "step ms", "vs pmean"]
    return f"{head}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "python -m benchmarks.gpu_step"
    )


# --------------------------------------------------------------------------- network


def _network(data: dict[str, Any], path: pathlib.Path) -> str:
    rows = data["rows"]
    has_step = any("step_ms" in r for r in rows)
    header = ["rate", "n", "codec", "strategy", "saving", "all-reduce ms", "speedup"]
    header += ["codec ms", "link ms"] + (["step ms", "step speedup"] if has_step else [])
    body = []
    for r in rows:
        codec_ms = r.get("encode_ms", 0.0) + r.get("decode_ms", 0.0)
        has_allreduce = "allreduce_ms" in r  # step-only rows: torch DDP peers, powersgd
        row = [
            str(r.get("rate", "?")),
            str(r.get("devices", "?")),
            f"`{r['codec']}`",
            str(r.get("strategy", "-")),
            f"{r.get('bytes_saving', 1.0):.1f}x" if has_allreduce else "–",
            _fmt(r.get("allreduce_ms"), 4),
            f"{r.get('allreduce_speedup', 1.0):.2f}x" if has_allreduce else "–",
            _fmt(codec_ms, 3) if codec_ms else "–",
            _fmt(r.get("link_ms"), 4),
        ]
        if has_step:
            row += [_fmt(r.get("step_ms"), 4), _fmt(r.get("step_speedup"), 3)]
        body.append(row)
    head = (
        f"{data.get('num_processes', '?')} JAX processes over gloo on a loopback shaped with "
        f"`tc ... tbf rate RATE {data.get('tbf', '')}`; all-reduce of a float32 gradient, "
        "median time; speedup = plain `pmean` time / codec time (below 1: slower); codec ms = "
        "encode + decode on one device; link ms = the time the bytes need at the shaped rate."
    )
    return f"{head}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "sudo python -m benchmarks.network"
    )


def _network_autotune(data: dict[str, Any], path: pathlib.Path) -> str:
    """The network table, then each ``autotune`` row's candidates: predicted (calibrated),
    the uncalibrated model and measured exchange ms."""
    parts = [_network(data, path)]
    for r in data["rows"]:
        if "autotune" not in r:
            continue
        if any(_num(c.get("step_ms")) for c in r["autotune"]):
            parts += [_autotune_steps(r), _predicted_steps(data["rows"], r.get("rate"), True)]
            continue
        body = []
        for c in r["autotune"]:
            meas = c.get("measured_ms", math.nan)
            err = (c["predicted_ms"] / meas - 1) if meas == meas and meas else math.nan
            body.append(
                [
                    *_candidate_cells(c),
                    _fmt(meas, 4),
                    "–" if err != err else f"{100 * err:+.0f}%",
                ]
            )
        header = ["candidate", "strategy", "feedback", "min_size", "bytes/device", "model ms"]
        header += ["predicted ms", "measured ms", "error"]
        load = r.get("host_load")
        step = ""
        if "predicted_step_ms" in r:
            step = (
                f" Predicted step {r['predicted_step_ms']:.0f} ms (plain step's compute + "
                f"predicted exchange) against {r['step_ms']:.0f} ms measured "
                f"({100 * r['step_prediction_error']:+.0f}%)."
            )
        parts.append(
            f"`jc.autotune` at {r.get('rate', '?')} (host load {load}; chose "
            f"`{r.get('chosen')}`): exchange of the MLP's gradient, every candidate.{step}\n\n"
            + _markdown((header, body))
        )
        parts.append(_predicted_steps(data["rows"], r.get("rate")))
    return "\n\n".join(p for p in parts if p)


def _candidate_cells(c: dict[str, Any]) -> list[str]:
    """An autotune candidate's first cells: name (and why it failed), strategy, feedback,
    min_size, bytes per device, model ms and predicted exchange ms."""
    return [
        f"`{c['name']}`" + (f" (failed: {c['error']})" if c.get("error") else ""),
        c["strategy"],
        str(c.get("error_feedback") or "–"),
        _fmt(c["min_size"]),
        _bytes(c["bytes_per_device"]),
        _fmt(c.get("model_ms", math.nan), 4),
        _fmt(c["predicted_ms"], 4),
    ]


def _num(x: Any) -> bool:
    """``x`` is a finite number (JSON writes NaN for an untimed row)."""
    return isinstance(x, int | float) and math.isfinite(x)


def _autotune_steps(r: dict[str, Any]) -> str:
    """A plan that timed whole steps: every candidate's predicted and measured step."""
    body = []
    cpu = any(_num(c.get("step_cpu_ms")) for c in r["autotune"])  # recorded since ties used it
    for c in r["autotune"]:
        step, pred = c.get("step_ms", math.nan), c.get("predicted_step_ms", math.nan)
        err = pred / step - 1 if _num(step) and _num(pred) and c["name"] != "none" else math.nan
        spread = f" ± {c['step_spread_ms'] / 2:.0f} ({c['step_reps']})" if _num(step) else ""
        cells = [_fmt(pred, 4), _fmt(step, 4) + spread, "–" if err != err else f"{100 * err:+.0f}%"]
        if cpu:
            cells.append(
                f"{_fmt(c['step_cpu_ms'], 4)} ± {c['step_cpu_spread_ms'] / 2:.0f}"
                if _num(c.get("step_cpu_ms"))
                else "–"
            )
        body.append([*_candidate_cells(c), *cells])
    header = ["candidate", "strategy", "feedback", "min_size", "bytes/device", "model ms"]
    header += ["exchange ms", "predicted step ms", "step ms ± IQR/2 (steps)", "error"]
    header += ["CPU ms per step ± IQR/2"] if cpu else []
    return (
        f"`jc.autotune` at {r.get('rate', '?')} (host load {r.get('host_load')}; chose "
        f"`{r.get('chosen')}`), timing whole steps of the MLP: every candidate. model ms: the "
        "link model and the standalone codec passes; exchange ms: its share of the predicted "
        "step (scaled on the timed steps); predicted step: the compute fitted on plain "
        "`pmean`'s step plus the exchange, each timed row predicted from the other timed rows "
        "(plain `pmean` is the anchor).\n\n" + _markdown((header, body))
    )


def _predicted_steps(rows: list[dict[str, Any]], rate: Any, stepped: bool = False) -> str:
    """Predicted against measured step of every row with a prediction at ``rate`` (rows
    written before predictions covered every codec have one on ``autotune`` only)."""
    have = [r for r in rows if r.get("rate") == rate and "predicted_step_ms" in r]
    if len(have) < 2:
        return ""
    body = [
        [
            f"`{r['codec']}`",
            str(r.get("strategy", "-")),
            str(r.get("error_feedback") or "–"),
            _fmt(r["predicted_step_ms"], 4),
            _fmt(r["step_ms"], 4),
            f"{100 * r['step_prediction_error']:+.0f}%",
        ]
        for r in have
    ]
    header = ["step", "strategy", "feedback", "predicted ms", "measured ms", "error"]
    how = (
        "the plan's predicted step of the same codec, strategy and error feedback (for "
        "`pmean`, the plan's own timing of the plain step), against the benchmark's step of "
        "it in the same run"
        if stepped
        else "the plain step's compute (its step less the plan's measured plain exchange) plus "
        "the plan's predicted exchange path of the same codec, strategy and error feedback"
    )
    return f"Step predictions at {rate}: {how}.\n\n" + _markdown((header, body))


REFIT_HEADER = ["step", "strategy", "feedback", "min_size", "measured ms", "recorded",
                "error", "one fit", "error", "now", "error"]  # fmt: skip


def _pct(x: Any) -> str:
    return f"{100 * x:+.0f}%" if _num(x) else "–"


def _refit_run(run: dict[str, Any]) -> str:
    """One recorded run's rows: measured, recorded, one-fit and current predictions."""
    body = [
        [
            f"`{r.get('candidate') or r.get('step')}`" + (" (bench)" if "step" in r else ""),
            str(r.get("strategy") or "-"),
            str(r.get("error_feedback") or "–"),
            _fmt(r.get("min_size", "–")),
            _fmt(r["step_ms"], 4),
            *[
                x
                for k in ("old", "one_fit", "new")
                for x in (_fmt(r.get(f"{k}_predicted_ms", "–"), 4), _pct(r.get(f"{k}_error")))
            ],
        ]
        for r in run["table"] + run["steps"]
        if _num(r["step_ms"]) and _num(r["new_error"])
    ]
    worst, twins = run["max_abs_error"], run.get("untimed_vs_twin", {})

    def twin(k: str) -> str:
        return f"{100 * twins[k]['mean']:.0f}% (max {100 * twins[k]['max']:.0f}%)"

    twin_text = (
        f" Untimed rows against the measured step of their twin (another `min_size`), "
        f"{twins['rows']} rows: mean |error| recorded {twin('old')}, one fit "
        f"{twin('one_fit')}, now {twin('new')}."
        if twins.get("rows") and "one_fit" in twins
        else ""
    )
    return (
        f"`{run['run']}` ({run['rate']}, host load {run['host_load']}): largest |error| "
        f"recorded {100 * worst['old_error']:.0f}%, one fit "
        f"{100 * worst.get('one_fit_error', math.nan):.0f}%, now "
        f"{100 * worst['new_error']:.0f}%." + twin_text + "\n\n" + _markdown((REFIT_HEADER, body))
    )


def _refit_ties(ties: list[dict[str, Any]]) -> str:
    """The selection rule now against every recorded plan, and the benchmark's verdict."""
    header = ["run", "rate", "load", "tied (timed ms)", "recorded pick", "pick now",
              "benchmark steps of the tied", "pick now in the benchmark"]  # fmt: skip

    def name(p: dict[str, Any]) -> str:
        return f"{p['candidate']} {p['strategy']}"

    body = []
    for t in ties:
        bench = {name(p): p["bench_step_ms"] for p in t["tied"] if _num(p["bench_step_ms"])}
        body.append([
            f"`{t['run']}`", t["rate"], _fmt(t.get("host_load") or "–"),
            "; ".join(f"{name(p)} {_fmt(p['timed_ms'], 4)}" for p in t["tied"]) or "–",
            name(t["recorded"]), name(t["now"]),
            "; ".join(f"{k} {_fmt(v, 4)}" for k, v in bench.items()) or "–",
            t["now_in_benchmark"],
        ])  # fmt: skip
    return _markdown((header, body))


def _autotune_refit(data: dict[str, Any], path: pathlib.Path) -> str:
    """Each recorded run's timed steps and benchmark steps: measured, the prediction the run
    recorded, the library's with one fit over every step, and the library's now
    (leave-one-out), with their errors; then the tie rule against every recorded plan."""
    widths = ", ".join(f"{k} {v:g}x" for k, v in data.get("widths", {}).items())
    head = (
        "Every timed step of each recorded plan (predicted from the other timed steps) and each "
        "benchmark step of the run (`(bench)`: the plan row of its exchange): the prediction "
        "the run recorded, the library's with every timed step in one fit (`one fit`), and "
        f"the library's now; wire widened by the backend: {widths}."
    )
    parts = [head, *map(_refit_run, data["runs"])]
    if data.get("ties"):
        parts.append(
            "The selection rule now (`select_step`, exchanges timed alone: `select`) on every "
            "recorded plan: the rows tied with the fastest, the recorded and the current pick, "
            "and the benchmark's own steps of the tied exchanges in the same run.\n\n"
            + _refit_ties(data["ties"])
        )
    return "\n\n".join(parts) + "\n\n" + _source(path, data, _command(path.stem))


def _exchange_cpu(data: dict[str, Any], path: pathlib.Path) -> str:
    """Wall and CPU time per step of each exchange, and the per-codec verdicts."""
    header = ["exchange", "strategy", "feedback", "step ms", "IQR", "CPU ms", "IQR", "steps"]
    body = [
        [f"`{r['codec']}`", r["strategy"], str(r["error_feedback"] or "–"),
         _fmt(r["step_ms"], 4), _fmt(r["step_spread_ms"], 3), _fmt(r["cpu_ms"], 4),
         _fmt(r["cpu_spread_ms"], 3), str(r["step_reps"])]
        for r in data["rows"]
    ]  # fmt: skip
    verdicts = "; ".join(
        f"{k}: two-phase / all-gather CPU {v['cpu_two_phase_over_allgather']:.2f}x "
        f"({'beyond' if v.get('beyond_noise', v.get('beyond_spread')) else 'within'} the "
        f"{'noise' if 'beyond_noise' in v else 'spreads'}), wall "
        f"{v['wall_two_phase_over_allgather']:.2f}x"
        for k, v in data["verdicts"].items()
    )
    load = data.get("loadavg", ["–", "–"])
    return (
        f"{data['devices']} CPU devices, host load {load[0]} to {load[1]}. {verdicts}.\n\n"
        + _markdown((header, body))
        + "\n\n"
        + _source(path, data, "python -m benchmarks.exchange_cpu")
    )


# ------------------------------------------------------------------- hot_path options


def _hot_path_options(data: dict[str, Any], path: pathlib.Path) -> str:
    """``hot_path`` runs that compare XLA compile options (``--settings NAME:XLA_FLAGS=...``,
    one process each, or ``--compile-options``, one process, calls interleaved): per row and
    setting the update in copies of the copy timed in its process, wall and CPU time, and
    with ``--compile-options`` the paired ratio to the first set."""
    paired = any("paired_ratio" in r for r in data["rows"])
    header = ["setting", "row", "copies", "CPU copies", "update ms", "update CPU ms"]
    header += ["paired ratio", "paired CPU ratio"] if paired else ["copy ms"]
    header += ["temp copies", "HLO copies", "faults"]
    body = []
    for r in data["rows"]:
        setting = r.get("compile_options", r.get("setting", "–"))
        cells = [f"`{setting}`", r["name"], _fmt(r["copies"]), _fmt(r["cpu_copies"])]
        cells += [_fmt(r["update_ms"]), _fmt(r["update_cpu_ms"])]
        if paired:
            cells += [_fmt(r["paired_ratio"]), _fmt(r["paired_cpu_ratio"])]
        else:
            cells += [_fmt(r.get("setting_copy_ms", data["copy_ms"]))]
        body.append(cells + [_fmt(r["temp_copies"]), _fmt(r["hlo_copies"]), _fmt(r["faults"])])
    flags = {
        r.get("compile_options", r.get("setting")): r.get("xla_flags", "") for r in data["rows"]
    }
    named = "; ".join(f"`{k}`: `{v}`" for k, v in flags.items() if v)
    command = data["environment"].get("command", "")
    if paired and "--compile-options" in command:
        sets = command.split("--compile-options", 1)[1].split(" --")[0].split()
        pairs = [s.split(":", 1) for s in sets if ":" in s]
        named = "; ".join(f"`{name}`: `{options}`" for name, options in pairs)
    reuse = {r.get("reuse_large_buffers") for r in data["rows"]} == {True}
    load = [s["loadavg"][0] for s in data.get("settings", [])] or [data["loadavg"][0]]
    intro = (
        f"Host load {min(load)} to {max(load)}; freed memory "
        f"{'reused (`--reuse-buffers`)' if reuse else 'not reused (default allocator)'}; "
        f"{data['reps']} calls per row (median); copy {_fmt(data['copy_ms'])} ms"
        f"{' (the first process)' if data.get('settings') else ''}."
        + (f" {'Compile options' if paired else 'XLA_FLAGS'}: {named}." if named else "")
    )
    return f"{intro}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "python -m benchmarks.hot_path"
    )


def _xla_options(data: dict[str, Any], path: pathlib.Path) -> str:
    """``xla_options``: per row and set of compile options, the HLO and machine code against
    XLA's defaults, and the steps whose outputs differ from the defaults' (NaN = NaN)."""
    header = ["options", "row", "HLO same", "fusions", "HLO copies", "temp copies"]
    header += ["instructions", "zmm", "objects differing", "steps differing", "state finite"]
    body = [
        [f"`{r['compile_options']}`", r["name"], _fmt(r["hlo_same"]), _fmt(r["fusions"]),
         _fmt(r["hlo_copies"]), _fmt(r["temp_copies"]), _fmt(r["instructions"]),
         _fmt(r["zmm_instructions"]),
         "–" if r["objects_differing"] is None else f"{r['objects_differing']} / {r['objects']}",
         _fmt(r["steps_differing"]), _fmt(r["state_finite_every_step"])]
        for r in data["rows"]
    ]  # fmt: skip
    options = {r["compile_options"]: r["options"] for r in data["rows"] if r["options"]}
    bad = ", ".join(f"step {k} a {v}" for k, v in data["bad_steps"].items())
    intro = (
        f"MLP {data['mlp']}, one CPU device; {bad} in one gradient value. Options: "
        + "; ".join(f"`{k}`: `{v}`" for k, v in options.items())
        + "."
    )
    return f"{intro}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "python -m benchmarks.xla_options"
    )


def _compile_size_recipes(data: dict[str, Any], path: pathlib.Path) -> str:
    """``compile_size --recipes --against DIR``: per recipe, the step's HLO instructions,
    lowering and compile seconds before (the jaxcomp in DIR) and after, run alternately in one
    run (the ratio is before / after), and whether the compiled collectives are the same."""
    cpu = all("compile_cpu_s" in r for r in data["rows"])
    header = ["recipe", "leaves", "HLO instr. before", "after", "ratio"]
    header += ["lower s before", "after", "compile s before", "after", "ratio", "collectives"]
    if cpu:
        header += ["lower CPU s before", "after", "compile CPU s before", "after", "ratio"]
    pairs: dict[str, dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        pairs.setdefault(r["recipe"], {})[r.get("code", "after")] = r
    body = []
    for name, pair in pairs.items():
        b, a = pair.get("before"), pair.get("after")
        if a is None:
            continue
        if b is None:
            body.append([f"`{name}`", _fmt(a["leaves"]), "–", _fmt(a["hlo_instructions"]), "–",
                         "–", _fmt(a["lower_s"]), "–", _fmt(a["compile_s"]), "–",
                         _fmt(sum(a["collectives"].values()))])  # fmt: skip
            if cpu:
                body[-1] += ["–", _fmt(a["lower_cpu_s"]), "–", _fmt(a["compile_cpu_s"]), "–"]
            continue
        same = "same" if b["collectives"] == a["collectives"] else "DIFFER"
        body.append([f"`{name}`", _fmt(a["leaves"]), _fmt(b["hlo_instructions"]),
                     _fmt(a["hlo_instructions"]),
                     f"{b['hlo_instructions'] / a['hlo_instructions']:.2f}x",
                     _fmt(b["lower_s"]), _fmt(a["lower_s"]), _fmt(b["compile_s"]),
                     _fmt(a["compile_s"]), f"{b['compile_s'] / a['compile_s']:.2f}x",
                     f"{sum(a['collectives'].values())} ({same})"])  # fmt: skip
        if cpu:
            body[-1] += [_fmt(b["lower_cpu_s"]), _fmt(a["lower_cpu_s"]),
                         _fmt(b["compile_cpu_s"]), _fmt(a["compile_cpu_s"]),
                         f"{b['compile_cpu_s'] / a['compile_cpu_s']:.2f}x"]  # fmt: skip
    loads = [r["loadavg_1min"] for r in data["rows"] if "loadavg_1min" in r]
    note = f"Load average (1 min) {min(loads):.1f}-{max(loads):.1f} on the host." if loads else ""
    command = data.get("environment", {}).get("command") or "python -m benchmarks.compile_size"
    return f"{_markdown((header, body))}\n\n{note} " + _source(path, data, command)


# --------------------------------------------------------------------------- overlap


def _overlap(data: dict[str, Any], path: pathlib.Path) -> str:
    header = ["rate", "exchange", "step", "compute ms", "exchange ms", "step ms"]
    header += ["compute + exchange", "max", "step / max", "overlap"]
    body = [
        [
            rate,
            f"`{r['exchange']}`",
            r["kind"],
            _fmt(r["compute_ms"], 4),
            _fmt(r["exchange_ms"], 4),
            _fmt(r["step_ms"], 4),
            _fmt(r["sum_ms"], 4),
            _fmt(r["max_ms"], 4),
            f"{r['step_over_max']:.2f}",
            f"{r['overlap']:.2f}",
        ]
        for rate, one in data["rates"].items()
        for r in one["rows"]
    ]
    first = next(iter(data["rates"].values()))
    head = (
        f"{first.get('devices', '?')} JAX processes over gloo on the shaped loopback, MLP "
        f"25.2M params, batch {first.get('batch', '?')} per process; median ms"
        + (
            f" over {first['rounds']} rounds, each timing every part in turn"
            if "rounds" in first
            else ""
        )
        + ". overlap = "
        "(compute + exchange - step) / min(compute, exchange): 0 = the parts run one after "
        "the other, 1 = the shorter one is hidden."
        + (f" Host load {data['loadavg']}." if "loadavg" in data else "")
    )
    return f"{head}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "sudo python -m benchmarks.overlap"
    )


# --------------------------------------------------------------------------- lm_link


def _opt(v: Any, spec: str, unit: str = "") -> str:
    return "never" if v is None else format(v, spec) + unit


def _lm_link_split(runs: list[dict[str, Any]], unshaped: dict[str, Any]) -> str:
    """The step split into compute and exchange, and the projection onto own cores."""
    header = ["recipe", "unshaped step ms", "its CPU ms", "shaped - unshaped ms"]
    header += ["link model ms", "steps to target", "projected speedup", "link only"]
    body = [
        [
            f"`{r['recipe']}`",
            _fmt(r["compute_ms_per_step"], 4),
            _fmt(r["cpu_ms_per_step_unshaped"], 3),
            _fmt(r["exchange_ms_per_step"], 4),
            _fmt(r.get("link_ms_per_step"), 3),
            _opt(r["steps_to_target"], ".0f"),
            _opt(r["projected_speedup_to_target"], ".1f", "x")
            if "projected_speedup_to_target" in r
            else "–",
            _opt(r["link_speedup_to_target"], ".1f", "x") if "link_speedup_to_target" in r else "–",
        ]
        for r in runs
        if "compute_ms_per_step" in r
    ]
    note = (
        "Unshaped: the same rows on the host's loopback, no shaping, "
        f"{unshaped['runs'][0]['steps']} steps each, host load {unshaped.get('loadavg')}"
        + (f" (`{unshaped['command']}`)" if unshaped.get("command") else "")
        + "; "
        "link model = processes x bytes per step x 8 / rate (bytes: ring model of the "
        "lowered step, over the steps to target); projected = steps to target x (CPU ms + "
        "link model ms) against `adamw`'s: a host where each process has a core of its "
        "own; link only: the same with no compute."
    )
    return f"{_markdown((header, body))}\n\n{note}"


def _short_lr(lr: float) -> str:
    """``0.0045`` -> ``"4.5e-3"``."""
    mantissa, exponent = f"{lr:.3e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _lm_link(data: dict[str, Any], path: pathlib.Path) -> str:
    header = ["recipe", "steps", "ms/step", "held-out loss", "time to target s"]
    header += ["speedup to target", "speedup at own loss"]
    runs = [r for r in data["runs"] if "error" not in r]
    config = data["config"]
    body = [
        [
            f"`{r['recipe']}`",
            _fmt(r["steps"]),
            _fmt(r["ms_per_step"], 4),
            f"{r['final_eval_loss']:.4f}",
            _opt(r["time_to_target_s"], ".1f"),
            _opt(r["speedup_to_target"], ".2f", "x"),
            _opt(r["speedup_at_own_loss"], ".2f", "x"),
        ]
        for r in runs
    ]
    body += [
        [f"`{r['recipe']}`", "failed: " + _fmt(r["error"])] + [""] * 5
        for r in data["runs"]
        if "error" in r
    ]
    link = (
        "on the unshaped loopback"
        if data["rate"] == "none"
        else f"at {data['rate']} (tbf {data['tbf']})"
    )
    head = (
        f"{data['num_processes']} JAX processes over gloo {link}; target = `adamw`'s (peak lr "
        f"{_short_lr(config.get('baseline_lr', config['lr']))}) final held-out loss "
        f"{runs[0]['target_loss']:.4f}; wall clock of process 0, compile and "
        f"evaluation excluded; host load (1-minute, before and after) {data.get('loadavg')}."
    )
    parts = [head, _markdown((header, body))]
    if "unshaped" in data:
        parts.append(_lm_link_split(runs, data["unshaped"]))
    command = data.get("environment", {}).get("command") or "sudo python -m benchmarks.lm_link"
    return "\n\n".join(parts) + "\n\n" + _source(path, data, command)


# ------------------------------------------------------------------ time_to_accuracy


def _time_to_accuracy(data: dict[str, Any], path: pathlib.Path) -> str:
    def seconds(t: Any) -> str:
        return "not reached" if t is None else f"{t:.1f}"

    def speedup(x: Any) -> str:
        return "–" if x is None else f"{x:.2f}x"

    body = []
    for r in data["runs"]:
        loss = r["metric"] != "test_accuracy"
        body.append(
            [
                r["rate"],
                r["task"],
                f"`{r['method']}`",
                f"`{r.get('baseline_own', '–')}` {_fmt(r.get('target_own'), 4)}",
                seconds(r.get("time_to_target_own")),
                speedup(r.get("speedup_own")),
                speedup(r.get("speedup_best")),
                _fmt(r["final"], 4) + (" (loss)" if loss and r["method"] == "none" else ""),
                _fmt(r["step_ms"], 3),
                _bytes(r.get("steady_bytes_per_step", r["bytes_per_step"])),
            ]
        )
    header = [
        "rate",
        "task",
        "method",
        "target (baseline, final)",
        "s to target",
        "speedup",
        "vs best baseline",
        "final",
        "step ms",
        "bytes/step",
    ]
    tol = data.get("tol", 0.01)
    head = (
        f"{data.get('num_processes', 2)} JAX processes (one CPU device each, gloo) on a "
        f"loopback shaped with `tc ... tbf rate RATE {data.get('tbf', '')}`. Target: the "
        "final test accuracy (reached at >= target) or held-out loss (reached at <= target "
        f"x {1 + tol:g}) of the method's own uncompressed baseline; s to target: summed "
        "training-step wall-clock (every step blocked, evaluation excluded) until the "
        "first evaluation that meets it; speedup = the baseline's time to its own final "
        "quality / the method's; vs best baseline: the same against the better uncompressed "
        "run of the task. Bytes per step: ring model, per device, from the lowered step "
        "(steady state for `powersgd4` and `onebit_adam`; torch: the hook's P and Q)."
    )
    models = data.get("models", {})
    notes = "".join(f"\n- **{k}**: {v}" for k, v in models.items())
    if data.get("torch_note"):
        notes += f"\n- {data['torch_note']}"
    return f"{head}\n{notes}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "sudo python -m benchmarks.time_to_accuracy"
    )


# ---------------------------------------------------------------------- any other


def _record_lists(data: Any, path: str = "") -> list[tuple[str, list[dict[str, Any]]]]:
    """Every list of dicts in ``data`` (nested dicts searched), with where it was found."""
    if isinstance(data, list):
        if data and all(isinstance(r, dict) for r in data):
            return [(path, data)]
        return []
    if isinstance(data, dict):
        found = []
        for key, value in data.items():
            if key not in ("environment", "env", "curve"):
                found += _record_lists(value, f"{path}.{key}" if path else key)
        return found
    return []


def _records_table(records: list[dict[str, Any]]) -> str:
    """One row per record (the first :data:`MAX_GENERIC_ROWS`), one column per plain key. A
    key that none of the rows shown carries (a field a later run added to the rows it
    re-ran, e.g. ``convergence.json``'s ``seed`` on its last rows) would be a column of
    dashes: it goes to a second table of just the records that carry it, named by the text
    columns of the first."""
    keys = [
        k
        for k in dict.fromkeys(k for r in records for k in r)
        if all(not isinstance(r.get(k), dict | list) for r in records)
    ]
    shown = records[:MAX_GENERIC_ROWS]
    late = [k for k in keys if not any(k in r for r in shown)]
    first = [k for k in keys if k not in late]
    text = _rows_table(records, first)
    if late:
        names = [k for k in first if all(isinstance(r.get(k), str) for r in records)]
        some = [r for r in records if any(k in r for k in late)]
        text += (
            f"\n\nColumns that only {len(some)} of the {len(records)} rows carry:\n\n"
            + _rows_table(some, names + late)
        )
    return text


def _rows_table(records: list[dict[str, Any]], keys: list[str]) -> str:
    """The first :data:`MAX_GENERIC_ROWS` records as a table of ``keys``, and how many more."""
    body = [[_fmt(r.get(k)) for k in keys] for r in records[:MAX_GENERIC_ROWS]]
    more = ""
    if len(records) > MAX_GENERIC_ROWS:
        more = f"\n\n(first {MAX_GENERIC_ROWS} of {len(records)} rows)"
    return _markdown((keys, body)) + more


def _generic(data: Any, path: pathlib.Path) -> str:
    lists = _record_lists(data)
    if lists:
        parts = [
            (f"`{where}`:\n\n" if len(lists) > 1 else "") + _records_table(records)
            for where, records in lists
        ]
        text = "\n\n".join(parts)
    elif isinstance(data, dict):
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict | list)}
        text = _markdown((["key", "value"], [[k, _fmt(v)] for k, v in scalars.items()]))
    else:
        text = f"`{json.dumps(data)[:200]}`"
    return f"{text}\n\n" + _source(path, data, _command(path.stem))


def _module(stem: str) -> str:
    """The benchmark module that writes ``stem`` (``hot_path_before_h100host`` is written by
    ``hot_path`` with ``--out``): the longest module name that ``stem`` starts with."""
    modules = [p.stem for p in (ROOT / "benchmarks").glob("*.py")]
    found = [m for m in modules if stem == m or stem.startswith(m + "_")]
    return max(found, key=len) if found else stem.removesuffix("_quick")


def _command(stem: str) -> str | None:
    """``python -m benchmarks.M`` for the module M that writes ``stem``; None when no
    benchmark module does (a file assembled from several runs' outputs)."""
    module = _module(stem)
    exists = (ROOT / "benchmarks" / f"{module}.py").exists()
    return f"python -m benchmarks.{module}" if exists else None


def _diloco(data: dict[str, Any], path: pathlib.Path) -> str:
    header = [
        "task",
        "method",
        "metric",
        "vs data parallel",
        "bytes/step (avg)",
        "x fewer",
        "peak step",
        "to target",
        "seconds",
    ]
    rows = []
    for r in data["runs"]:
        metric = "acc" if r["metric"] == "test_accuracy" else "loss"
        delta = r.get("delta")
        rows.append(
            [
                r["task"],
                f"`{r['method']}`",
                f"{metric} {r['value']:.4f}",
                "–" if delta is None else f"{delta:+.4f}",
                _bytes(r["bytes_per_step"]),
                _fmt(r.get("bytes_ratio")),
                _bytes(r["peak_bytes_per_step"]),
                _fmt(r.get("steps_to_target")),
                _fmt(r["train_seconds"]),
            ]
        )
    return _markdown((header, rows)) + "\n\n" + _source(path, data, "python -m benchmarks.diloco")


def _diloco_link(data: dict[str, Any], path: pathlib.Path) -> str:
    header = ["processes", "method", "ms/step", "s per 1000 steps", "speedup", "bytes/step"]
    rows = [
        [
            _fmt(r["processes"]),
            f"`{r['method']}`",
            _fmt(r["ms_per_step"]),
            _fmt(r["seconds_per_1000_steps"]),
            f"{r['speedup_vs_dp']:.1f}x",
            _bytes(r["bytes_per_step"]),
        ]
        for r in data["rows"]
    ]
    note = f"{data['rate']} (tbf {data['tbf']}), MLP {'-'.join(map(str, data['mlp']))}"
    command = "sudo python -m benchmarks.diloco --link"
    return _markdown((header, rows)) + f"\n\n{note}. " + _source(path, data, command)


# ------------------------------------------------------------------------- recipes

# method -> (family, how it is used, the uncompressed baseline it is compared with: the
# classifiers' / the char task's).
RECIPE_ROWS = {
    "sign": ("1-bit", "plain chain: compressed_allreduce + optimizer", ("none", "none")),
    "sgd-sign": ("1-bit", "recipe: jc.sgd", ("none", "sgd-none")),
    "sgd-sign-nesterov": ("1-bit", "recipe: jc.sgd, nesterov", ("none", "sgd-none")),
    "sgd-sign-ef21": ("1-bit", "recipe: jc.sgd, EF21-SGDM", ("none", "sgd-none")),
    "sgd-sign-accordion": ("1-bit", "recipe: jc.sgd + Accordion (int8)", ("none", "sgd-none")),
    "topk1%": ("top-k 1%", "plain chain: compressed_allreduce + optimizer", ("none", "none")),
    "sgd-topk1%": ("top-k 1%", "recipe: jc.sgd", ("none", "sgd-none")),
    "sgd-topk1%-accordion": (
        "top-k 1%",
        "recipe: jc.sgd + Accordion (top-k 10%)",
        ("none", "sgd-none"),
    ),
    "dgc0.1%": ("top-k 0.1%", "jc.dgc + plain SGD", ("none", "none")),
    "int8": ("int8", "plain chain: compressed_allreduce + optimizer", ("none", "none")),
    "sgd-int8": ("int8", "recipe: jc.sgd", ("none", "sgd-none")),
    "powersgd4": ("PowerSGD 4", "plain chain: powersgd + optimizer", ("none", "none")),
    "onebit_adam": ("1-bit Adam", "recipe: jc.onebit_adam", ("adam", "none")),
    "onebit_adam-unbounded": (
        "1-bit Adam",
        "recipe: jc.onebit_adam, adam_bound=False",
        ("adam", "none"),
    ),
    "zero_one_adam": ("0/1 Adam", "recipe: jc.zero_one_adam", ("adam", "none")),
    "zero_one_adam-scaler100": (
        "0/1 Adam",
        "recipe: jc.zero_one_adam, local_step_scaler=100",
        ("adam", "none"),
    ),
}


def _convergence_recipes(data: dict[str, Any], path: pathlib.Path) -> str:
    runs = {(r["task"], r["method"]): r for r in data["runs"]}
    out = []
    for task in ("digits", "mnist1d", "char"):
        rows = []
        for method, (family, how, bases) in RECIPE_ROWS.items():
            r = runs.get((task, method))
            base = runs.get((task, bases[1] if task == "char" else bases[0]))
            if r is None or base is None:
                continue
            char = r["metric"].startswith("eval_loss")
            delta = (
                f"{100 * (r['value'] / base['value'] - 1):+.1f}%"
                if char
                else f"{100 * (r['value'] - base['value']):+.1f} pt"
            )
            rows.append(
                [
                    family,
                    how,
                    f"`{method}`",
                    f"{r['value']:.4f}",
                    f"{base['value']:.4f} (`{base['method']}`)",
                    delta,
                    _bytes(r["bytes_per_step"]),
                    f"{base['bytes_per_step'] / r['bytes_per_step']:.1f}x",
                ]
            )
        if not rows:
            continue
        any_run = next(r for (t, _), r in runs.items() if t == task)
        metric = "held-out loss (nats/byte)" if task == "char" else "test accuracy"
        out.append(f"**{task}**, {any_run['steps']} steps, {metric}:\n")
        header = [
            "family",
            "how",
            "method",
            "value",
            "uncompressed",
            "delta",
            "bytes/step",
            "fewer bytes",
        ]
        out.append(_markdown((header, rows)))
    # The canonical table was written by several --resume runs: its command is the label's;
    # a variant (convergence_recipes_NAME) names the run that wrote it.
    command = "python -m benchmarks.convergence --label recipes"
    if path.stem != "convergence_recipes":
        command = data.get("environment", {}).get("command") or command
    return "\n\n".join(out) + "\n\n" + _source(path, data, command)


# ------------------------------------------------------------------------- narrow_sum


def _narrow_sum(data: dict[str, Any], path: pathlib.Path) -> str:
    """Relative error of the mean against n: ring sum in the type vs float32 sums."""
    types = ("float16", "bfloat16")
    header = ["devices"] + [f"{t} {s}" for t in types for s in ("ring", "two-phase", "all-gather")]
    rows = [
        [n] + [_fmt(data[t]["errors"][n][s], 2) for t in types for s in _NARROW]
        for n in data[types[0]]["errors"]
    ]
    bounds = ", ".join(f"{t} up to n = {data[t]['ring_accurate_up_to']}" for t in types)
    note = (
        f"Relative error of the mean, {_fmt(data['size'])} floats per device, "
        f"{data['seeds']} seeds. The ring stays within {_fmt(data['factor'])}x of two-phase's "
        f"error: {bounds}."
    )
    command = "python -m benchmarks.narrow_sum"
    return note + "\n\n" + _markdown((header, rows)) + "\n\n" + _source(path, data, command)


_NARROW = ("allreduce", "two_phase", "allgather")


# method -> what it is (the defaults table: 300 and 1000 steps against momentum SGD).
DEFAULT_ROWS = {
    "sgd-sign": "`jc.sgd(lr, jc.sign(), axis)` (default: look-ahead)",
    "sgd-sign-heavyball": "`jc.sgd(..., jc.sign(), nesterov=False)` (heavy ball)",
    "sgd-sign-heavyball-allgather": 'heavy ball, `strategy="allgather"` (one compression)',
    "sgd-sign-b64": "`jc.sgd(lr, jc.sign(block_size=64), axis)` (default)",
    "sgd-sign-b64-heavyball": "`jc.sgd(..., jc.sign(block_size=64), nesterov=False)`",
    "sgd-topk1%": "`jc.sgd(lr, jc.top_k(0.01), axis)` (default: look-ahead)",
    "sgd-topk1%-heavyball": "`jc.sgd(..., jc.top_k(0.01), nesterov=False)` (heavy ball)",
    "sgd-topk1%-warmup100": "`jc.sgd(..., jc.top_k(0.01), warmup_steps=100)` (density warm-up)",
    "sgd-topk1%-allgather-warmup100": '`jc.sgd(..., jc.top_k(0.01), strategy="allgather", '
    "warmup_steps=100)`",
    "dgc0.1%": "`jc.dgc(0.001, axis)` + `optax.sgd(lr)` (default: 200-step warm-up)",
    "dgc0.1%-warmup200": "`jc.dgc(0.001, axis)` + `optax.sgd(lr)` (default: `warmup_steps=200`)",
    "dgc0.1%-warmup150": "`jc.dgc(0.001, axis, warmup_steps=150)` + `optax.sgd(lr)`",
    "dgc0.1%-warmup100": "`jc.dgc(0.001, axis, warmup_steps=100)` + `optax.sgd(lr)`",
    "dgc0.1%-nowarmup": "`jc.dgc(0.001, axis, warmup_steps=0)` + `optax.sgd(lr)` (no warm-up)",
    "dgc0.1%-nesterov": "`jc.dgc(0.001, axis, nesterov=True)` + `optax.sgd(lr)`",
    "dgc0.1%-nomask": "`jc.dgc(0.001, axis, momentum_masking=False)` + `optax.sgd(lr)`",
}


def _accuracy_at(runs: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """{seed: {step count: test accuracy}} of a method's runs: each run's final accuracy at
    its own length and its ``--eval-at`` checkpoints."""
    out: dict[int, dict[str, float]] = {}
    for r in runs:
        marks = out.setdefault(r.get("seed", 0), {})
        marks.update({str(k): v for k, v in r.get("checkpoints", {}).items()})
        marks[str(r["steps"])] = r["value"]
    return out


def _seed_cell(acc: dict[int, dict[str, float]], base: dict[int, dict[str, float]], mark: str):
    """Mean accuracy and mean delta (points) over the seeds both have at ``mark``; with
    several seeds, their number and the range of the deltas."""
    seeds = [s for s in acc if mark in acc[s] and mark in base.get(s, {})]
    if not seeds:
        return "–"
    deltas = [100 * (acc[s][mark] - base[s][mark]) for s in seeds]
    mean = sum(acc[s][mark] for s in seeds) / len(seeds)
    if len(seeds) == 1:
        return f"{mean:.4f} ({deltas[0]:+.1f} pt)"
    if acc is base:  # the baseline: the spread of its own accuracy
        values = [acc[s][mark] for s in seeds]
        return f"{mean:.4f} ({len(seeds)} seeds: {min(values):.4f} to {max(values):.4f})"
    spread = f"{len(seeds)} seeds: {min(deltas):+.1f} to {max(deltas):+.1f}"
    return f"{mean:.4f} ({sum(deltas) / len(deltas):+.1f} pt; {spread})"


def _bytes_cells(runs: list[dict[str, Any]], base: dict[str, Any]) -> list[str]:
    """Steady-state bytes per step (fewer than ``none``'s) and the mean over the longest run
    (a density warm-up sends more in its first steps)."""
    r = max((r for r in runs if "bytes_per_step" in r), key=lambda r: r["steps"])
    steady, mean = r["bytes_per_step"], r.get("mean_bytes_per_step", r["bytes_per_step"])
    return [
        f"{_bytes(steady)} ({base['bytes_per_step'] / steady:.1f}x)",
        f"{_bytes(mean)} ({base['bytes_per_step'] / mean:.1f}x)",
    ]


def _convergence_defaults(data: dict[str, Any], path: pathlib.Path) -> str:
    """Test accuracy after 300 and 1000 steps (``--eval-at 300``, ``--seeds``) against the
    uncompressed momentum SGD run (``none``) of the same task and seed: means over seeds."""
    out = []
    for task in dict.fromkeys(r["task"] for r in data["runs"]):
        by = {}
        for r in data["runs"]:
            if r["task"] == task:
                by.setdefault(r["method"], []).append(r)
        if "none" not in by:
            continue
        base = _accuracy_at(by["none"])
        marks = sorted({m for s in base.values() for m in s}, key=int)
        base_run = max(by["none"], key=lambda r: r["steps"])
        header = ["method", *[f"{k} steps" for k in marks], "bytes/step (fewer)", "mean, all steps"]
        rows = []
        for method, how in {"none": "momentum SGD, `pmean` (`none`)", **DEFAULT_ROWS}.items():
            if method in by:
                acc = base if method == "none" else _accuracy_at(by[method])
                cells = [_seed_cell(acc, base, k) for k in marks]
                rows.append([how, *cells, *_bytes_cells(by[method], base_run)])
        out.append(f"**{task}**, test accuracy (delta against `none`, same seed):\n")
        out.append(_markdown((header, rows)))
    command = data.get("environment", {}).get("command") or RENDERERS[path.stem][1]
    return "\n\n".join(out) + "\n\n" + _source(path, data, command)


def _convergence_diagnosis(data: dict[str, Any], path: pathlib.Path) -> str:
    """``--diagnose`` runs: accuracy and training loss against ``none``, and the exchange's
    measurements (``exchange_diagnostics``) averaged over the steps they were taken at."""
    runs = data["runs"]
    base = next((r for r in runs if r["method"] == "none"), None)
    keys = [
        ("update_over_uncompressed", "‖update‖ / ‖uncompressed‖"),
        ("cosine", "cosine"),
        ("memory_over_momentum", "‖e‖ / ‖mean m‖"),
        ("server_over_momentum", "‖server residual‖ / ‖mean m‖"),
    ]
    rows = []
    for r in runs:
        d = r.get("diagnostics") or []
        means = [sum(x[k] for x in d) / len(d) if d else math.nan for k, _ in keys]
        delta = "" if base is None else f" ({100 * (r['value'] - base['value']):+.1f} pt)"
        rows.append(
            [
                DEFAULT_ROWS.get(r["method"], f"`{r['method']}`"),
                f"{r['value']:.4f}{delta}",
                f"{r['final_train_loss']:.4f}",
                *[_fmt(x) for x in means],
            ]
        )
    header = ["method", "test accuracy", "training loss", *[h for _, h in keys]]
    steps = sorted({x["step"] for r in runs for x in r.get("diagnostics") or []})
    note = f"{runs[0]['task']}, {runs[0]['steps']} steps; means over steps {steps}."
    command = data.get("environment", {}).get("command") or RENDERERS[path.stem][1]
    return _markdown((header, rows)) + f"\n\n{note} " + _source(path, data, command)


def _convergence_diagnosis_dgc(data: dict[str, Any], path: pathlib.Path) -> str:
    """``--diagnose`` runs of ``jc.dgc``: accuracy against ``none`` (same seed) and what the
    accumulations hold back over the distance moved (``dgc_diagnostics``), seed means."""
    runs = data["runs"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    base = _accuracy_at(by.pop("none"))
    marks = sorted({m for s in base.values() for m in s}, key=int)
    steps = sorted({x["step"] for r in runs for x in r.get("diagnostics") or []})
    header = ["method", *[f"{k} steps" for k in marks]]
    header += [f"held back / moved, step {s}" for s in steps[1::2]]
    rows = []
    for method, rs in by.items():
        held = [
            sum(x["held_back_over_moved"] for r in rs for x in r["diagnostics"] if x["step"] == s)
            / len(rs)
            for s in steps[1::2]
        ]
        acc = _accuracy_at(rs)
        cells = [_seed_cell(acc, base, k) for k in marks]
        rows.append([DEFAULT_ROWS.get(method, f"`{method}`"), *cells, *[_fmt(h) for h in held]])
    note = (
        f"{runs[0]['task']}, {runs[0]['steps']} steps; held back / moved is "
        "`lr * ||mean_i v_i|| / ||w - w_0||` on the sparsified leaves, mean over the seeds."
    )
    command = data.get("environment", {}).get("command") or RENDERERS[path.stem][1]
    return _markdown((header, rows)) + f"\n\n{note} " + _source(path, data, command)


def _lm(data: dict[str, Any], path: pathlib.Path) -> str:
    if "runs" not in data and "syncs" in data:  # --diagnose written under another tag
        return _lm_sync(data, path)
    header = ["recipe", "replicas", "held-out loss", "vs AdamW DP", "bytes/step", "x fewer"]
    rows = []
    for r in data["runs"]:
        gap = r.get("gap")
        rows.append(
            [
                f"`{r['recipe']}`",
                str(r.get("replicas", 1)),
                f"{r['eval_loss']:.4f}",
                "–" if gap is None else f"{100 * gap:+.1f}%",
                _bytes(r["slow_bytes_per_step"]),
                _fmt(r.get("bytes_ratio")),
            ]
        )
    table = _markdown((header, rows)) + "\n\n" + _source(path, data, "python -m benchmarks.lm")
    return table + _lm_time(data["runs"])


FEEDBACK_COLUMNS = (
    ("sent_over_delta", "‖sent‖ / ‖D_i‖"),
    ("memory_over_delta", "memory after / ‖D_i‖"),
    ("sent_cosine", "cosine of sent, D_i"),
)


def _lm_sync_row(s: dict[str, Any], dp: dict[str, Any] | None, nu: bool, ef: bool) -> list:
    """One sync's cells (``dp``: AdamW data parallel at that step, or None: not recorded)."""
    move = None if dp is None else dp.get("displacement")
    ratio = s.get("adam_denominator_ratio_median")
    return [
        str(s["step"]),
        "–" if dp is None else f"{dp['eval_after']:.4f}",
        f"{s['eval_after']:.4f}",
        "–" if dp is None else f"{s['eval_after'] - dp['eval_after']:+.3f}",
        f"{s['eval_replicas']:.4f}",
        f"{s['eval_mean_params']:.4f}",
        f"{s['delta_cosine']:.2f}",
        f"{s['mean_delta_norm'] / s['delta_norm']:.2f}",
        f"{s['outer_step_norm'] / s['mean_delta_norm']:.2f}",
        "–" if not move else f"{s['outer_step_norm'] / move:.2f}",
        *([] if not nu else ["–" if ratio is None else f"{ratio:.2f}"]),
        *([] if not ef else [f"{s[k]:.2f}" for k, _ in FEEDBACK_COLUMNS]),
    ]


def _lm_sync(data: dict[str, Any], path: pathlib.Path) -> str:
    """Per-sync records of ``benchmarks.lm_diloco --diagnose``: one table per recipe, each
    sync against AdamW data parallel at the same step (where the file has it: ``--no-baseline``
    runs leave those cells empty); SparseLoCo's rows add what its error feedback sent."""
    adamw = [r for r in data["syncs"] if r["recipe"] == "adamw"]
    base = {s["step"]: s for s in adamw[0]["syncs"]} if adamw else {}
    header = [
        "step",
        "AdamW DP",
        "anchor after sync",
        "gap (nats)",
        "replicas before",
        "their mean before",
        "cosine of D_i",
        "‖mean D‖ / ‖D_i‖",
        "outer step / ‖mean D‖",
        "outer step / DP's move",
    ]
    parts = []
    for r in data["syncs"]:
        if r["recipe"] == "adamw":
            continue
        nu = any("adam_denominator_ratio_median" in s for s in r["syncs"])
        ef = all("sent_over_delta" in s for s in r["syncs"])
        rows = [_lm_sync_row(s, base.get(s["step"]), nu, ef) for s in r["syncs"]]
        extra = ["AdamW denominator / DP's (median)"] if nu else []
        extra += [name for _, name in FEEDBACK_COLUMNS] if ef else []
        parts.append(f"`{r['recipe']}`:\n\n" + _markdown((header + extra, rows)))
        if all("line" in s for s in r["syncs"]):
            parts.append(_lm_line(r["syncs"]))
    command = data.get("environment", {}).get("command") or "python -m benchmarks.lm_diloco"
    return "\n\n".join(parts) + "\n\n" + _source(path, data, command)


def _lm_line(syncs: list[dict[str, Any]]) -> str:
    """``--line-search``'s table: at each sync the held-out loss of the old anchor moved by
    ``c`` times the applied outer step (``c = 1``: the anchor the recipe made), the best ``c``,
    and the loss after the exact mean pseudo-gradient's step (an uncompressed exchange)."""
    scales = list(syncs[0]["line"])
    means = list(syncs[0]["mean_line"])
    header = [
        "step",
        *[f"step x {c}" for c in scales],
        "best x",
        *[f"exact mean D x {a}" for a in means],
        "cosine of step, mean D",
        "coordinates moved",
    ]
    rows = []
    for s in syncs:
        best = min(scales, key=lambda c: s["line"][c])
        rows.append(
            [
                str(s["step"]),
                *[f"{s['line'][c]:.4f}" for c in scales],
                best,
                *[f"{s['mean_line'][a]:.4f}" for a in means],
                f"{s['step_cosine']:.3f}",
                f"{100 * s['step_nonzero']:.2f}%",
            ]
        )
    return "Held-out loss along the outer step:\n\n" + _markdown((header, rows))


def _lm_time(runs: list[dict[str, Any]]) -> str:
    """The MODELLED time to AdamW's final training loss (and to 8% above it) on a slow
    link, from each run's loss curve and bytes (``benchmarks.lm.modelled_seconds``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import lm

    base = next((r for r in runs if r["recipe"] == "adamw"), None)
    if base is None or "curve" not in base:
        return ""
    compute = lm.step_compute(base)
    targets = (base["final_train_loss"], 1.08 * base["final_train_loss"])
    ref = [[lm.modelled_seconds(base, t, bw, compute) for bw in lm.LINKS.values()] for t in targets]
    rows = []
    for r in runs:
        row = [f"`{r['recipe']}`"]
        for target, refs in zip(targets, ref, strict=True):
            row.append(str(lm.steps_to_loss(r["curve"], target) or "not reached"))
            for bw, b in zip(lm.LINKS.values(), refs, strict=True):
                t = lm.modelled_seconds(r, target, bw, compute)
                row.append("–" if t is None else f"{t:,.0f} s ({b / t:.2f}x)")
        rows.append(row)
    links = list(lm.LINKS)
    header = ["recipe", "steps to L", *links, "steps to 1.08 L", *links]
    note = (
        f"**Modelled, not measured**: seconds = steps x ({compute:.3f} s + 8 x bytes per step"
        " / link bits per second), `L` = AdamW's final training loss "
        f"({base['final_train_loss']:.4f}, the mean of its last 20 steps), steps = the first "
        "step whose 20-step mean training loss reaches it; compute = AdamW's median measured "
        "step on this host for every recipe; (x) = AdamW's modelled time over the recipe's."
    )
    return "\n\n" + _markdown((header, rows)) + "\n\n" + note


FIDELITY_COMMAND = "python -m benchmarks.lm_diloco --fidelity 0 120 270"


def _lm_fidelity(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.lm_diloco --fidelity``: what each codec keeps of one replica's
    pseudo-gradient (cosine with it, norm ratio, share of its squared norm left out)."""
    header = ["steps", "replicas", "codec", "cosine", "‖coded‖ / ‖D‖", "left out", "x fewer"]
    rows = [
        [
            str(r["steps"]),
            str(r["replicas"]),
            r["codec"],
            _fmt(r["cosine"]),
            _fmt(r["norm_ratio"]),
            f"{100 * r['left_out']:.1f}%",
            f"{r['x_fewer']:.1f}x",
        ]
        for r in data["records"]
    ]
    command = data.get("environment", {}).get("command") or FIDELITY_COMMAND
    return _markdown((header, rows)) + "\n\n" + _source(path, data, command)


def _lm_zeros(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.lm_diloco --fidelity ... --zeros``: per pseudo-gradient, the chunks of the
    chunked top-k codecs holding fewer than ``k`` nonzero values (where a kept zero went on
    the wire as a value until the fix), summed over the codecs."""
    header = ["steps", "replicas", "values", "zero values", "codecs", "chunks"]
    header += ["chunks with < k nonzeros", "zeros kept"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in data["records"]:
        groups.setdefault(str(r["steps"]), []).append(r)
    rows = [
        [
            steps,
            str(rs[0]["replicas"]),
            _fmt(rs[0]["values"]),
            _fmt(rs[0]["zeros"]),
            str(len(rs)),
            _fmt(sum(r["chunks"] for r in rs)),
            _fmt(sum(r["short"] + r["empty"] for r in rs)),
            _fmt(sum(r["kept_zeros"] for r in rs)),
        ]
        for steps, rs in groups.items()
    ]
    command = data.get("environment", {}).get("command") or FIDELITY_COMMAND + " --zeros"
    return _markdown((header, rows)) + "\n\n" + _source(path, data, command)


XFID_COMMAND = "python -m benchmarks.lm_diloco --fidelity-exchange 120 --replicas 8"
LOWRANK_COMMAND = "python -m benchmarks.lm_diloco --fidelity-lowrank 120 --replicas 8"
INDEX_COMMAND = "python -m benchmarks.lm_diloco --fidelity-index 120"


def _lm_xfid(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.lm_diloco --fidelity-exchange``: what each exchange's merged output keeps
    of the mean of the replicas' pseudo-gradients at one sync (its memory carried from the
    sync before), at the bytes per device of the compiled exchange."""
    header = ["steps", "replicas", "exchange", "cosine with mean D", "‖out‖ / ‖mean D‖"]
    header += ["left out", "left out at the best scale", "bytes per sync"]
    rows = [
        [
            str(r["steps"]),
            str(r["replicas"]),
            r["exchange"],
            f"{r['cosine']:.3f}",
            f"{r['norm_ratio']:.3f}",
            f"{100 * r['left_out']:.1f}%",
            f"{100 * (1 - r['cosine'] ** 2):.1f}%",
            _fmt(r["bytes_per_sync"]),
        ]
        for r in data["records"]
    ]
    command = data.get("environment", {}).get("command") or XFID_COMMAND
    return _markdown((header, rows)) + "\n\n" + _source(path, data, command)


def _lm_lowrank(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.lm_diloco --fidelity-lowrank``: the share of the pseudo-gradient's
    ``|D|^2`` (the model's matrices) kept by the top-k at 3000x and by rank-``r`` factors (the
    best, by SVD; ``jc.powersgd``'s one power step with ``Q`` warm and memory carried), of one
    replica's ``D`` and of the mean over the replicas, with the bytes per device and sync."""
    budget = data["budget"]
    header = ["of", "what", "kept of ‖D‖² (at the best scale)", "cosine", "‖out‖ / ‖mean D‖"]
    header += ["left out as applied", "bytes per sync"]

    def nbytes(r: dict[str, Any]) -> str:
        if "bytes_per_sync" in r:
            return _fmt(r["bytes_per_sync"]) + " (compiled)"
        if "(SVD)" in r["method"]:
            rank = int(r["method"].split()[1])
            return _fmt(rank * budget["rank_r_bytes_per_sync_16bit"]) + " (16-bit factors)"
        return "–"

    def num(r: dict[str, Any], k: str, pct: bool = False) -> str:
        if k not in r:
            return "–"
        return f"{100 * r[k]:.1f}%" if pct else f"{r[k]:.3f}"

    rows = [
        [
            r["of"],
            r["method"],
            num(r, "kept", True),
            num(r, "cosine"),
            num(r, "norm_ratio"),
            num(r, "left_out_as_applied", True),
            nbytes(r),
        ]
        for r in data["records"]
    ]
    command = data.get("environment", {}).get("command") or LOWRANK_COMMAND
    if data.get("deltas_from"):
        command = f"LM_LOAD_DELTAS={data['deltas_from']} {command}"
    return _markdown((header, rows)) + "\n\n" + _source(path, data, command)


def _lm_index(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.lm_diloco --fidelity-index``: the share of one replica's ``|D|^2`` each
    chunked top-k variant leaves out, and its payload's bytes (and over the 2-replica row's)."""
    header = ["steps", "replicas", "codec", "left out", "bytes per sync", "bytes over the row's"]
    rows = [
        [
            str(r["steps"]),
            str(r["replicas"]),
            r["codec"],
            f"{100 * r['left_out']:.1f}%",
            _fmt(r["bytes"]),
            f"{r['bytes_over_row']:.2f}",
        ]
        for r in data["records"]
    ]
    command = data.get("environment", {}).get("command") or INDEX_COMMAND
    return _markdown((header, rows)) + "\n\n" + _source(path, data, command)


def _lm_blocks(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.lm_diloco --block-energy``: the share of the mean pseudo-gradient's
    energy in the coordinates or blocks each rule keeps."""
    header = ["kept", "unit", "the mean's own largest (oracle)", "by sum_i ‖D_i‖² per block"]
    header += ["by the previous sync's mean", "at random"]

    def pct(r: dict[str, Any], k: str) -> str:
        return f"{100 * r[k]:.1f}%" if k in r else "–"

    rows = [
        [
            f"{100 * r['share']:.2f}%",
            "coordinates" if r["block"] == 1 else f"blocks of {r['block']}",
            pct(r, "oracle"),
            pct(r, "sum_of_replica_energies"),
            pct(r, "previous_mean"),
            pct(r, "random"),
        ]
        for r in data["records"]
    ]
    command = data.get("environment", {}).get("command") or "python -m benchmarks.lm_diloco"
    return _markdown((header, rows)) + "\n\n" + _source(path, data, command)


#: ``benchmarks.budget_bytes``'s recipes: (column, fixed row, sized row or None).
BUDGET_COLUMNS = (
    (
        "SparseLoCo, 8 replicas (3000x)",
        "SparseLoCo 3000x, 8 replicas: 21 of 4096",
        "SparseLoCo 3000x, 8 replicas: sized",
    ),
    (
        "SparseLoCo, 2 of 4 (3000x)",
        "SparseLoCo 3000x, 2 replicas: 47 of 1024",
        "SparseLoCo 3000x, 2 replicas: sized",
    ),
    ("DeMo (80x)", "DeMo 80x: topk 20, 3 bits", "DeMo 80x: sized"),
    ("DiLoCo / MuLoCo int4, 8 replicas (200x)", "DiLoCo / MuLoCo int4, H = 30, 8 replicas", None),
    ("DiLoCo / MuLoCo int4, 2 of 4 (200x)", "DiLoCo / MuLoCo int4, H = 30, 2 replicas", None),
)


def _budget_table(records: list[dict[str, Any]], targets: dict[str, float], values: bool) -> str:
    """One row per model, a column per recipe of :data:`BUDGET_COLUMNS` present: the ratio at
    the documented setting (bold under ``targets[recipe]``) and at the setting sized for it."""

    def ratio(r: dict[str, Any]) -> str:
        x = f"{r['ratio']:,.0f}x" if r["ratio"] >= 1000 else f"{r['ratio']:.1f}x"
        return f"**{x}**" if r["ratio"] < targets[r["recipe"]] else x

    names = {r["recipe"] for r in records}
    columns = [c for c in BUDGET_COLUMNS if c[1] in names]
    header = ["model"] + (["values"] if values else [])
    for column, _, sized in columns:
        header += [column] + ([f"{column.split(' (')[0]}: sized"] if sized else [])
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        of = {r["recipe"]: r for r in records if r["model"] == model}
        cells = [model] + ([_fmt(next(iter(of.values()))["values"])] if values else [])
        for _, fixed, sized in columns:
            cells.append(ratio(of[fixed]))
            if sized:
                cells.append(f"{of[sized]['setting']}: {ratio(of[sized])}")
        rows.append(cells)
    return _markdown((header, rows))


def _budget_bytes(data: dict[str, Any], path: pathlib.Path) -> str:
    """``benchmarks.budget_bytes``: per model, each recipe's ratio at its documented setting
    (bold under its target) and at the setting sized for the target on that model; then the
    same ratios from the arithmetic alone on every width at 1-4 layers."""
    targets = {r["recipe"]: r["target"] for r in data["rows"]}
    exact = all(
        r["predicted_ratio"] is None or abs(r["predicted_ratio"] / r["ratio"] - 1) < 1e-9
        for r in data["rows"]
    )
    note = (
        "Bytes per step of the exchange against a float32 `pmean` of the same params every "
        f"step on {data['devices']} devices (`H` = {data['sync_every']}), read from each lowered "
        "step as `jc.comm_report`'s logical collectives; **bold**: under the target. "
        + (
            "Every SparseLoCo and DeMo ratio above equals `jc.sparseloco_ratio` / "
            "`jc.demo_ratio`'s arithmetic to within 1e-9."
            if exact
            else "Some ratios differ from `jc.sparseloco_ratio` / `jc.demo_ratio`: see the file."
        )
    )
    parts = [_budget_table(data["rows"], targets, True), note]
    if data.get("arithmetic"):
        parts += [
            "The arithmetic alone (`jc.sparseloco_ratio`, `jc.demo_ratio`; nothing lowered) "
            "on every width at 1 to 4 layers:",
            _budget_table(data["arithmetic"], targets, False),
        ]
    command = data.get("environment", {}).get("command") or "python -m benchmarks.budget_bytes"
    return "\n\n".join(parts) + "\n\n" + _source(path, data, command)


RENDERERS: dict[str, tuple[Callable[[Any, pathlib.Path], str], str]] = {
    "budget_bytes": (_budget_bytes, "python -m benchmarks.budget_bytes"),
    "hot_path_xla": (_hot_path_options, "python -m benchmarks.hot_path"),
    "xla_options": (_xla_options, "python -m benchmarks.xla_options"),
    "compile_size_recipes": (
        _compile_size_recipes,
        "python -m benchmarks.compile_size --recipes --against DIR",
    ),
    "convergence_diagnosis": (
        _convergence_diagnosis,
        "python -m benchmarks.convergence --label diagnosis --diagnose 50",
    ),
    "convergence_diagnosis_dgc": (
        _convergence_diagnosis_dgc,
        "python -m benchmarks.convergence --label diagnosis_dgc --diagnose 50",
    ),
    "convergence_defaults": (
        _convergence_defaults,
        "python -m benchmarks.convergence --label defaults --steps 1000 --eval-at 300",
    ),
    "narrow_sum": (_narrow_sum, "python -m benchmarks.narrow_sum"),
    "lm": (_lm, "python -m benchmarks.lm"),
    "lm_sync": (_lm_sync, "python -m benchmarks.lm_diloco --diagnose"),
    "lm_gap_windows": (_generic, "python -m benchmarks.lm_gap_windows"),
    "lm_fidelity": (_lm_fidelity, FIDELITY_COMMAND),
    "lm_zeros": (_lm_zeros, FIDELITY_COMMAND + " --zeros"),
    "lm_S4_xfid": (_lm_xfid, XFID_COMMAND),
    "lm_S4_blocks": (_lm_blocks, "python -m benchmarks.lm_diloco --block-energy NPY"),
    "lm_S2_lowrank": (_lm_lowrank, LOWRANK_COMMAND),
    "lm_S2_index": (_lm_index, INDEX_COMMAND),
    "convergence_recipes": (
        _convergence_recipes,
        "python -m benchmarks.convergence --label recipes",
    ),
    "wire_bytes": (_wire_bytes, "python -m benchmarks.wire_bytes"),
    "sparse_wire_bytes": (_sparse_wire_bytes, "python -m benchmarks.topk_speed"),
    "topk_speed": (_topk_speed, "python -m benchmarks.topk_speed"),
    "codec_speed": (_codec_speed, "python -m benchmarks.codec_speed"),
    "network": (_network, "sudo python -m benchmarks.network"),
    "network_autotune": (_network_autotune, "sudo python -m benchmarks.network --label autotune"),
    "autotune_refit": (_autotune_refit, "python -m benchmarks.autotune_refit"),
    "exchange_cpu": (_exchange_cpu, "python -m benchmarks.exchange_cpu"),
    "overlap": (_overlap, "sudo python -m benchmarks.overlap"),
    "lm_link": (_lm_link, "sudo python -m benchmarks.lm_link"),
    "lm_link_host_tuned": (_lm_link, "bash benchmarks/lm_link_host.sh"),
    "time_to_accuracy": (_time_to_accuracy, "sudo python -m benchmarks.time_to_accuracy"),
    "gpu_step": (_gpu_step, "python -m benchmarks.gpu_step"),
    "powersgd_convergence": (_powersgd, "python -m benchmarks.powersgd_convergence"),
    "powersgd_convergence_sgd": (_powersgd, "python -m benchmarks.powersgd_convergence"),
    "diloco": (_diloco, "python -m benchmarks.diloco"),
    "diloco_link": (_diloco_link, "sudo python -m benchmarks.diloco --link"),
}


def _renderer(name: str) -> tuple[Callable[[Any, pathlib.Path], str], str | None]:
    """The renderer of ``name``, or of the benchmark it is a variant of (``codec_speed_gpu_h100``
    is ``codec_speed`` written with ``--out``); generic for anything else."""
    if name in RENDERERS:
        return RENDERERS[name]
    variants = [k for k in RENDERERS if name.startswith(k + "_")]
    if variants:
        return RENDERERS[max(variants, key=len)]
    return _generic, _command(name)


def render(name: str) -> str:
    """Markdown for the marker ``name`` (a note when the result does not exist yet)."""
    renderer, command = _renderer(name)
    loaded = _load(name)
    if loaded is None:
        return f"!!! note\n    No `benchmarks/results/{name}.json` yet: `{command}` writes it."
    data, path = loaded
    try:
        return renderer(data, path)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        return _generic(data, path) + f"\n\n(rendered generically: {type(e).__name__} {e})"


def render_others(named: set[str]) -> str:
    stems = sorted({p.stem.removesuffix("_quick") for p in RESULTS.glob("*.json")} - named)
    if not stems:
        return "No other result files yet."
    return "\n\n".join(f"### `{s}`\n\n{render(s)}" for s in stems)


def _named_on_pages(docs: pathlib.Path = DOCS) -> set[str]:
    """The result names that a marker on some page of ``docs`` names."""
    pages = (p for p in docs.rglob("*.md") if "hooks" not in p.parts)
    return {name for p in pages for name in MARKER.findall(p.read_text())} - {"others"}


def render_page(markdown: str) -> str:
    """``markdown`` with every marker pair holding its table rendered from the results now
    (``others``: the result files that no page of the docs names)."""
    named = _named_on_pages() if "bench:others" in markdown else set()

    def replace(match: re.Match) -> str:
        name = match.group("name")
        table = render_others(named) if name == "others" else render(name)
        return f"<!-- bench:{name} -->\n\n{table}\n\n<!-- /bench:{name} -->"

    return BLOCK.sub(replace, markdown)


def stale_pages(docs: pathlib.Path = DOCS) -> list[pathlib.Path]:
    """The Markdown files under ``docs`` whose committed tables differ from the results."""
    pages = sorted(p for p in docs.rglob("*.md") if "hooks" not in p.parts)
    return [p for p in pages if render_page(p.read_text()) != p.read_text()]


def on_page_markdown(markdown: str, page: Any = None, **kwargs: Any) -> str:
    """mkdocs hook: the page as committed; a warning (an error under ``--strict``) if stale."""
    if render_page(markdown) != markdown:
        where = getattr(getattr(page, "file", None), "src_uri", "a page")
        log.warning("%s: benchmark tables are stale; run `%s`", where, WRITE_COMMAND)
    return markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m docs.hooks.bench_tables",
        description="Render the benchmark tables of docs/*.md from benchmarks/results/*.json "
        "(between <!-- bench:NAME --> and <!-- /bench:NAME --> markers). Takes about a second.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite the stale pages in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for path in stale:
        if args.write:
            path.write_text(render_page(path.read_text()))
        print(f"{'rewrote' if args.write else 'stale'}: {path.relative_to(ROOT)}")
    if args.check and stale:
        print(f"run `{WRITE_COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
