"""FSDP through compressed collectives: bytes, quality and codec cost of ``jc.fsdp_gather``.

Three measurements, all in one run, on the GPT-style character LM of ``examples/fsdp_lm.py``
(every weight sharded over the data axis, AdamW on the shards):

* ``bytes``: ``jc.comm_report`` of the compiled FSDP step, per device, with int8 weights and
  int4 gradients (and int4 / 2-bit) against the float32 FSDP step (``jax.lax`` collectives),
  at 8 devices (the quality runs' steps) and 4: the ratio should be flat in ``n``.
* ``quality``: held-out loss (nats per byte, on text the model never saw) after the same
  steps, same seed, same batches: float32, int8/int4, int4/int2, each gradient codec with and
  without error feedback; a second, smaller model (``d_model`` 64) gates the int8/int4 result.
* ``codec_cost``: encoding (quantize + pack) a shard of the gathered weights on one CPU
  device, in copies of the same array (``jnp.copy`` under ``jit``), median of ``--reps``.

Writes ``benchmarks/results/sharded.json``::

    python -m benchmarks.sharded                 # 200 steps
    python -m benchmarks.sharded --quick         # 20 steps, fewer runs
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

from benchmarks import common

QUALITY = [  # (name, weights, grads, error feedback, d_model)
    ("float32", "none", "none", False, 128),
    ("int8/int4", "int8", "int4", False, 128),
    ("int8/int4+ef", "int8", "int4", True, 128),
    ("int4/int2", "int4", "int2", False, 128),
    ("int4/int2+ef", "int4", "int2", True, 128),
    ("float32 d64", "none", "none", False, 64),
    ("int8/int4 d64", "int8", "int4", False, 64),
]
QUICK_QUALITY = [QUALITY[0], QUALITY[1], QUALITY[4]]


def _load(name: str, path) -> Any:
    """The file ``path`` executed as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example():
    """``examples/fsdp_lm.py`` as a module (examples are scripts, not a package). Its
    ``from _flags import bounded`` finds ``examples/_flags.py`` only where ``examples/`` is
    on ``sys.path`` (a script run from there): loaded here first, as ``_flags``, so
    ``python -m benchmarks.sharded`` from the root runs (it failed with
    ModuleNotFoundError)."""
    examples = common.ROOT / "examples"
    if "_flags" not in sys.modules:
        sys.modules["_flags"] = _load("_flags", examples / "_flags.py")
    return _load("fsdp_lm", examples / "fsdp_lm.py")


def measure_bytes(lm, quality: list[dict], devices=(4,)) -> list[dict]:
    """Bytes per device of one compiled step: compressed over float32, at 8 devices from the
    quality runs, at ``devices`` from compiled steps that do not train."""
    rows = []
    base8 = next((q for q in quality if q["run"] == "float32"), None)
    for q in quality if base8 else []:
        if q["d_model"] == 128 and not q["error_feedback"] and q["run"] != "float32":
            rows.append(
                {
                    "devices": 8,
                    "weights": q["weights"],
                    "grads": q["grads"],
                    "bytes_per_device": q["bytes_per_device"],
                    "float32_bytes_per_device": base8["bytes_per_device"],
                    "ratio": round(q["bytes_per_device"] / base8["bytes_per_device"], 4),
                }
            )
    for n in devices:
        base = lm.train(0, weights="none", grads="none", devices=n, eval_sequences=8)
        for w, g in (("int8", "int4"),):
            r = lm.train(0, weights=w, grads=g, devices=n, eval_sequences=8)
            rows.append(
                {
                    "devices": n,
                    "weights": w,
                    "grads": g,
                    "bytes_per_device": r["bytes_per_device"],
                    "float32_bytes_per_device": base["bytes_per_device"],
                    "ratio": round(r["bytes_per_device"] / base["bytes_per_device"], 4),
                }
            )
            print(f"  n={n} {w}/{g}: {rows[-1]['ratio']:.4f}x the float32 step", flush=True)
    return rows


def measure_quality(lm, runs, steps: int, save) -> list[dict]:
    """Held-out loss of each run, its ratio to float32's (same ``d_model``); ``save(rows)``
    after each run (a partial result survives an interrupted run)."""
    rows = []
    for name, w, g, ef, d in runs:
        r = lm.train(steps, weights=w, grads=g, error_feedback=ef, d_model=d)
        rows.append(
            {
                "run": name,
                "weights": w,
                "grads": g,
                "error_feedback": ef,
                "d_model": d,
                "params": r["params"],
                "steps": steps,
                "eval_loss": round(r["eval_loss"], 5),
                "final_train_loss": round(r["train_loss"][-1], 5),
                "seconds": round(r["seconds"], 2),
                "bytes_per_device": r["bytes_per_device"],
            }
        )
        print(f"  {name}: held-out loss {r['eval_loss']:.4f} ({r['seconds']:.0f} s)", flush=True)
        save(rows)
    for row in rows:
        base = next(
            b for b in rows if b["run"].startswith("float32") and b["d_model"] == row["d_model"]
        )
        row["eval_loss_ratio"] = round(row["eval_loss"] / base["eval_loss"], 5)
    return rows


def measure_codec_cost(size: int, reps: int) -> list[dict]:
    """Encode of ``size`` float32 values (one device's shard) in copies of the array."""
    import jax
    import jax.numpy as jnp

    import jaxcomp as jc

    x = jax.random.normal(jax.random.PRNGKey(0), (size,))
    copy = jax.jit(jnp.copy)
    copy_s = common.median_seconds(lambda: copy(x), reps)
    rows = []
    for name in ("int8", "int4"):
        codec = jc.get_codec(name)
        encode = jax.jit(lambda v, c=codec: c.encode(v))
        decode = jax.jit(lambda p, c=codec: c.decode(p, size))
        payload = encode(x)
        enc_s = common.median_seconds(lambda e=encode: e(x), reps)
        dec_s = common.median_seconds(lambda d=decode, p=payload: d(p), reps)
        rows.append(
            {
                "codec": name,
                "size": size,
                "encode_copies": round(enc_s / copy_s, 3),
                "decode_copies": round(dec_s / copy_s, 3),
            }
        )
        print(f"  {name}: encode {enc_s / copy_s:.2f} copies, decode {dec_s / copy_s:.2f}")
    return rows


def link_worker(args) -> None:
    """One of the processes of ``--link``: time the float32 and the int8/int4 FSDP step of a
    ``size x size`` linear layer sharded over every process (one device each)."""
    import json

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp.launch import initialize

    initialize()
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,))
    shard = NamedSharding(mesh, P("data"))
    size, n = args.link_size, jax.device_count()
    w = jax.jit(lambda: 0.01 * jax.random.normal(jax.random.PRNGKey(0), (size, size)),
                out_shardings=shard)()  # fmt: skip
    x = jax.jit(lambda: jax.random.normal(jax.random.PRNGKey(1), (8 * n, size)),
                out_shardings=shard)()  # fmt: skip
    rows = {}
    for name, codecs in (
        ("float32", (None, None)),
        ("int8/int4", (jc.int_quant(8), jc.int_quant(4))),
    ):

        def step(w, x, codecs=codecs):
            def loss(w):
                full = jc.fsdp_gather(w, "data", weights=codecs[0], grads=codecs[1])
                return jnp.sum((x @ full) ** 2) / 2

            return w - 1e-9 * jax.grad(loss)(w)

        fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data")))
        report = jc.comm_report(fn, w, x)
        seconds = common.median_seconds(lambda fn=fn: fn(w, x), args.reps)
        rows[name] = {"seconds": seconds, "bytes_per_device": report.bytes_per_device}
        print(f"[{jax.process_index()}] {name}: {seconds * 1e3:.0f} ms/step", flush=True)
    rows["speedup"] = rows["float32"]["seconds"] / rows["int8/int4"]["seconds"]
    rows["params"] = size * size
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


def measure_link(args) -> dict | None:
    """``--link``: 2 processes in a network namespace whose loopback is shaped to
    ``--link-rate`` (1 Gbit/s)."""
    import json
    import os
    import tempfile

    from benchmarks import network

    reason = network.skip_reason()
    if reason:
        print(f"link: skipped ({reason})")
        return None
    ns = network.Namespace(f"jaxcomp-sharded-{os.getpid()}").open()
    out = tempfile.mktemp(suffix=".json")
    try:
        ns.shape(args.link_rate)
        argv = ["--link-worker", "--out", out, "--link-size", str(args.link_size)]
        code = network.launch(
            ns, args.link_rate, __file__, [*argv, "--reps", str(args.reps)], 2, 900, []
        )
        if code != 0:
            raise RuntimeError(f"link workers failed with status {code}")
        with open(out) as f:
            result = json.load(f)
    finally:
        ns.close()
    result.update(rate=args.link_rate, tbf=" ".join(network.TBF), processes=2)
    print(f"link: int8/int4 FSDP step {result['speedup']:.2f}x faster than float32")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(
        __doc__,
        writes="sharded.json (`--quick`: sharded_quick.json)",
        takes=(
            "about an hour on the shared 2-core CPU host (7 runs of 200 steps); `--quick` "
            "about 9 minutes"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="20 steps, 3 runs")
    parser.add_argument("--steps", type=int, default=None, help="None: 200 (--quick: 20)")
    parser.add_argument("--reps", type=int, default=7, help="timing samples of the codec cost")
    parser.add_argument("--codec-size", type=int, default=1 << 22, help="values encoded")
    parser.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=("bytes", "quality", "codec"),
        help="measurements to leave out",
    )
    parser.add_argument("--link", action="store_true", help="only the shaped-link run (root)")
    parser.add_argument("--link-size", type=int, default=5120, help="--link: layer is size^2")
    parser.add_argument("--link-rate", default="1gbit", help="--link: tc tbf rate")
    parser.add_argument("--link-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.link_worker:
        link_worker(args)
        return 0
    if args.link:
        result = measure_link(args)
        if result is not None:
            suffix = "" if args.link_rate == "1gbit" else f"_{args.link_rate}"
            common.write_json(common.result_path(f"sharded_link{suffix}", False), result)
        return 0
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(8)
    lm = example()
    steps = args.steps or (20 if args.quick else 200)
    out = {"environment": common.environment(), "steps": steps}
    path = common.result_path("sharded", args.quick)

    def save(rows=None):
        if rows is not None:
            out["quality"] = rows
        common.write_json(path, out, quiet=rows is not None)

    if "quality" not in args.skip:
        print(f"held-out loss after {steps} steps, 8 devices:", flush=True)
        runs = QUICK_QUALITY if args.quick else QUALITY
        out["quality"] = measure_quality(lm, runs, steps, save)
    if "bytes" not in args.skip:
        print("bytes per device of one FSDP step:", flush=True)
        out["bytes"] = measure_bytes(lm, out.get("quality", []))
        save()
    if "codec" not in args.skip:
        print("codec cost on one device:", flush=True)
        out["codec_cost"] = measure_codec_cost(args.codec_size, args.reps)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
