"""Encode + decode time of every codec, as a ratio to a plain copy of the same array.

A copy (``jnp.copy`` under ``jit``: read 4d bytes, write 4d bytes) is the memory-bound floor
of anything that touches every float once, so ``(t_encode + t_decode) / t_copy`` says how far
a codec is from free, whatever the machine. Encode and decode are compiled and timed on
their own (as they run in a collective: encode, send, decode), each the median of
``--reps`` calls after a warm-up, every call blocked until ready, all in the same run as the
copy (``--pipeline K``: each sample is K calls back to back, blocked once, over K: on a GPU
a blocked round trip costs ~0.1 ms, more than copying 16M floats). Inputs are standard
normal float32 vectors of 1M, 16M and 64M elements (``--quick``: 1M and 4M, 5 codecs). Runs
on whatever backend JAX has; backend and device are recorded.
Writes ``benchmarks/results/codec_speed.json`` and ``codec_speed.png``::

    python -m benchmarks.codec_speed
    python -m benchmarks.codec_speed --quick
    python -m benchmarks.codec_speed --codecs sign int8 --sizes 16777216 --reps 9
    python -m benchmarks.codec_speed --pipeline 20 --out /tmp/codec_speed_gpu.json
    python -m benchmarks.codec_speed --codecs fp8 fp8_e5m2 --reps 5 --merge   # re-time rows

``--merge`` keeps the rows already in the JSON file and replaces those timed again (same
codec and size), each row against the copy of its own run; the runs merged are listed under
``runs`` (command, date, codecs). It refuses a file of another backend, device, ``--reps``
or ``--pipeline``: one table, one way of timing.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from benchmarks import common

SIZES = [1 << 20, 1 << 24, 1 << 26]
QUICK_SIZES = [1 << 20, 1 << 22]
QUICK_CODECS = ["fp16", "int8", "int4", "sign", "topk1%"]


def time_codec(name: str, x, copy_s: float, reps: int, pipeline: int = 1) -> dict:
    """Median encode and decode seconds of codec ``name`` on ``x``, and their ratio to a copy."""
    import jax

    codec = common.make_codec(name)
    d = x.shape[0]
    key = jax.random.PRNGKey(1)
    encode = jax.jit(lambda v, k: codec.encode(v, k))
    decode = jax.jit(lambda p: codec.decode(p, d))
    payload = jax.block_until_ready(encode(x, key))
    enc_s = common.median_seconds(lambda: encode(x, key), reps, pipeline=pipeline)
    dec_s = common.median_seconds(lambda: decode(payload), reps, pipeline=pipeline)
    return {
        "codec": name,
        "size": d,
        "encode_ms": 1e3 * enc_s,
        "decode_ms": 1e3 * dec_s,
        "copy_ms": 1e3 * copy_s,
        "in_copies": (enc_s + dec_s) / copy_s,
        "encode_in_copies": enc_s / copy_s,
        "decode_in_copies": dec_s / copy_s,
        "payload_bytes": codec.payload_bytes(d),
        "compression": 4 * d / codec.payload_bytes(d),
    }


def run(codecs: list[str], sizes: list[int], reps: int, save=None, pipeline: int = 1) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    jobs = [(size, name) for size in sizes for name in codecs]
    x, copy_s, current = None, None, None
    for size, name in common.progress(jobs, "codec_speed"):
        if size != current:
            x = jax.block_until_ready(jax.random.normal(jax.random.PRNGKey(0), (size,)))
            copy = jax.jit(jnp.copy)
            copy_s = common.median_seconds(lambda c=copy, x=x: c(x), reps, pipeline=pipeline)
            current = size
        rows.append(time_codec(name, x, copy_s, reps, pipeline))
        if save is not None:
            save(rows)  # after every codec: a run cut short keeps what it measured
    return rows


MERGE_SAME = ("backend", "device", "reps", "pipeline")


def run_record(data: dict) -> dict:
    """Command, date and codecs of the run that wrote ``data`` (a file not merged yet)."""
    env = data.get("environment", {})
    codecs = list(dict.fromkeys(r["codec"] for r in data["rows"]))
    return {"command": env.get("command"), "date_utc": env.get("date_utc"), "codecs": codecs}


def merge_mismatch(old: dict, new: dict) -> str | None:
    """What of :data:`MERGE_SAME` differs between the file ``old`` and the run ``new``, if any."""
    get = lambda d, k: d["environment"].get(k) if k in ("backend", "device") else d.get(k)  # noqa: E731
    wrong = [
        f"{k} {get(old, k)!r} != {get(new, k)!r}" for k in MERGE_SAME if get(old, k) != get(new, k)
    ]
    return ", ".join(wrong) or None


def merge(old: dict, new: dict) -> dict:
    """The run ``new`` written over the file ``old``: ``old``'s rows in ``old``'s order, those
    timed again (same codec and size) replaced by ``new``'s, new ones last; ``runs`` lists
    ``old``'s runs (or the one that wrote it) and then ``new``'s; seconds add up."""
    key = lambda r: (r["codec"], r["size"])  # noqa: E731
    fresh = {key(r): r for r in new["rows"]}
    rows = [fresh.pop(key(r), r) for r in old["rows"]] + list(fresh.values())
    runs = old.get("runs") or [run_record(old)]
    return {
        **new,
        "seconds": round(old.get("seconds", 0.0) + new["seconds"], 1),
        "rows": rows,
        "runs": [*runs, run_record(new)],
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'codec':10s}{'size':>10s}{'ratio':>7s}{'encode ms':>11s}{'decode ms':>11s}"
        f"{'copy ms':>9s}{'x copy':>8s}"
    )
    for r in rows:
        print(
            f"{r['codec']:10s}{r['size']:>10,d}{r['compression']:>6.1f}x{r['encode_ms']:>11.2f}"
            f"{r['decode_ms']:>11.2f}{r['copy_ms']:>9.2f}{r['in_copies']:>8.2f}"
        )


def draw(rows: list[dict], path) -> None:
    import numpy as np

    sizes = sorted({r["size"] for r in rows})
    names = list(dict.fromkeys(r["codec"] for r in rows))

    def one(ax):
        width = 0.8 / len(sizes)
        for i, size in enumerate(sizes):
            vals = [
                next((r["in_copies"] for r in rows if r["codec"] == n and r["size"] == size), 0)
                for n in names
            ]
            label = f"{size / 2**20:g}M floats"
            ax.bar(np.arange(len(names)) + i * width, vals, width, label=label)
        ax.axhline(2.0, color="red", linestyle="--", label="2x a copy")
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=60, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("(encode + decode) / copy time")
        ax.legend(fontsize=7)

    common.plot(path, one, "Codec cost in copies of the same array (lower is better)")


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="codec_speed.json and .png (`--out`: another path; `--quick`: codec_speed_quick.*)",
        takes="about 9 minutes on the 2-core CPU host (538 s), 50 s on an H100",
    )
    ap.add_argument(
        "--quick", action="store_true", help=f"codecs {QUICK_CODECS}, 1M and 4M".replace("%", "%%")
    )
    ap.add_argument("--codecs", nargs="+", default=None, help="default: all (registry + sparse)")
    ap.add_argument(
        "--sizes", nargs="+", type=int, default=None, help="vector sizes (None: 2^20, 2^24, 2^26)"
    )
    ap.add_argument("--reps", type=int, default=None, help="timed calls per figure (median)")
    ap.add_argument("--out", type=pathlib.Path, help="JSON path (PNG beside it)")
    ap.add_argument(
        "--pipeline", type=int, default=1, help="calls per sample, blocked once (GPU: 20)"
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows already in the JSON file, replace those timed again",
    )
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    codecs = args.codecs or (QUICK_CODECS if args.quick else common.codec_names())
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    reps = args.reps or (5 if args.quick else 7)
    start = time.perf_counter()
    path = args.out or common.result_path("codec_speed", args.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if args.merge and path.exists() else None
    if old is not None:
        mismatch = merge_mismatch(
            old, {"environment": common.environment(), "reps": reps, "pipeline": args.pipeline}
        )
        if mismatch:
            ap.error(f"argument --merge: {common.show_path(path)} was timed otherwise: {mismatch}")

    def save(rows, complete=False):
        out = {
            "environment": common.environment(),
            "reps": reps,
            "pipeline": args.pipeline,
            "complete": complete,
            "seconds": round(time.perf_counter() - start, 1),
            "rows": rows,
        }
        if old is not None:
            out = merge(old, out)
        path.write_text(json.dumps(out, indent=2) + "\n")
        return out

    rows = run(codecs, sizes, reps, save, args.pipeline)
    print_table(rows)
    written = save(rows, complete=True)
    print(f"wrote {common.show_path(path)}")
    draw(written["rows"], path.with_suffix(".png"))  # with --merge: every row of the file
    return 0


if __name__ == "__main__":
    sys.exit(main())
