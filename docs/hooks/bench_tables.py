"""mkdocs hook: turn ``<!-- bench:NAME -->`` markers into tables read from benchmark results.

The numbers on the docs pages come from ``benchmarks/results/*.json`` at build time, never
typed by hand. A marker names a result file without its extension (``wire_bytes`` reads
``wire_bytes.json``, or ``wire_bytes_quick.json`` when only a quick run exists). A missing
file becomes a note saying which command produces it; ``<!-- bench:others -->`` lists every
result file that no marker on the page names, each as a generic table.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!--\s*bench:([A-Za-z0-9_]+)\s*-->")
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


def _source(path: pathlib.Path, data: Any, command: str) -> str:
    env = data.get("environment", {}) if isinstance(data, dict) else {}
    where = ", ".join(
        f"{k} {env[k]}"
        for k in ("backend", "device", "device_count", "cpu_cores", "jax", "date_utc")
        if k in env
    )
    quick = " (a `--quick` run)" if path.stem.endswith("_quick") else ""
    rel = path.relative_to(ROOT)
    return f"*Source: `{rel}`{quick}, written by `{command}`.{' ' + where + '.' if where else ''}*"


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
    return f"{head}\n\n{_markdown((header, body))}\n\n" + _source(
        path, data, "python -m benchmarks.codec_speed"
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
    keys = [
        k
        for k in dict.fromkeys(k for r in records for k in r)
        if all(not isinstance(r.get(k), dict | list) for r in records)
    ]
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
    command = f"python -m benchmarks.{path.stem.removesuffix('_quick')}"
    return f"{text}\n\n" + _source(path, data, command)


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


RENDERERS: dict[str, tuple[Callable[[Any, pathlib.Path], str], str]] = {
    "wire_bytes": (_wire_bytes, "python -m benchmarks.wire_bytes"),
    "sparse_wire_bytes": (_sparse_wire_bytes, "python -m benchmarks.topk_speed"),
    "topk_speed": (_topk_speed, "python -m benchmarks.topk_speed"),
    "codec_speed": (_codec_speed, "python -m benchmarks.codec_speed"),
    "network": (_network, "sudo python -m benchmarks.network"),
    "gpu_step": (_gpu_step, "python -m benchmarks.gpu_step"),
    "powersgd_convergence": (_powersgd, "python -m benchmarks.powersgd_convergence"),
    "powersgd_convergence_sgd": (_powersgd, "python -m benchmarks.powersgd_convergence"),
    "diloco": (_diloco, "python -m benchmarks.diloco"),
    "diloco_link": (_diloco_link, "sudo python -m benchmarks.diloco --link"),
}


def _renderer(name: str) -> tuple[Callable[[Any, pathlib.Path], str], str]:
    """The renderer of ``name``, or of the benchmark it is a variant of (``codec_speed_gpu_h100``
    is ``codec_speed`` written with ``--out``); generic for anything else."""
    if name in RENDERERS:
        return RENDERERS[name]
    variants = [k for k in RENDERERS if name.startswith(k + "_")]
    if variants:
        return RENDERERS[max(variants, key=len)]
    return _generic, f"python -m benchmarks.{name}"


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


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    named = set(MARKER.findall(markdown)) - {"others"}

    def replace(match: re.Match) -> str:
        name = match.group(1)
        return render_others(named) if name == "others" else render(name)

    return MARKER.sub(replace, markdown)
