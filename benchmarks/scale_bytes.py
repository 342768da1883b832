"""Collectives at scale: wire bytes against the number of devices, and digits convergence.

Part 1 — bytes (``jc.comm_report`` of the compiled program, ring model, bytes each device
sends per call) of ``jc.pmean`` of a float32 vector of ``--size`` floats on n = 2, 4, 8, 16
devices, for int8, int4, sign, signSGD (majority vote) and top-k 1%, with every strategy
that carries them, against plain ``jax.lax.pmean``; and the hierarchical reduction on
('host', 'local') meshes of 2x4, 2x8 and 8x2 (outer-axis and inner-axis bytes apart). It runs in a
subprocess with ``jax_num_cpu_devices=16`` (meshes of n use the first n devices).

Part 2 — digits (:mod:`benchmarks.digits_mlp`, the model of ``examples/flax_nnx_train.py``:
MLP 64-256-10, 8 devices, momentum SGD, ``--steps`` steps, ``--seeds`` seeds, held-out
accuracy): uncompressed; int8 and sign two-phase with both residuals against worker-only
feedback (``server_feedback=False``); majority vote with momentum after the vote, unscaled and
scaled; and Signum with majority vote (``worker_momentum=0.9``: each device votes with the
sign of its own momentum, plain SGD after).

Writes ``benchmarks/results/scale_bytes.json`` and ``scale_bytes.png``::

    python -m benchmarks.scale_bytes [--size 1048576] [--steps 1000] [--seeds 3] [--quick]
    python -m benchmarks.scale_bytes --steps 1000 --seeds 2 --only RUN   # one digits row
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import jaxcomp as jc
from benchmarks import common

NS = (2, 4, 8, 16)
CODECS = {  # name -> (codec factory, strategies measured)
    "int8": (lambda: jc.int_quant(8), ("allgather", "two_phase")),
    "int4": (lambda: jc.int_quant(4), ("allgather", "two_phase")),
    "sign": (lambda: jc.sign(), ("allgather", "two_phase", "majority_vote")),
    "signsgd": (lambda: jc.sign(None), ("majority_vote",)),
    "topk1%": (lambda: jc.top_k(0.01), ("allgather", "two_phase")),
}
HIER = ((2, 4), (2, 8), (8, 2))  # outer and inner group sizes differ: bytes split by group


def bytes_part(size: int) -> dict:
    """Run in the 16-device subprocess: the compiled bytes table."""
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(16)
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    def report(fn, m, spec):
        x = jax.ShapeDtypeStruct((m.size, size), jnp.float32, sharding=NamedSharding(m, spec))
        return jc.comm_report(jax.jit(jax.shard_map(fn, mesh=m, in_specs=spec, out_specs=P())), x)

    rows = []
    for n in NS:
        m = jax.make_mesh(
            (n,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n]
        )
        base = report(lambda t: jax.lax.pmean(t[0], "data"), m, P("data")).bytes_per_device
        rows.append({"codec": "f32", "strategy": "pmean", "n": n, "bytes": base, "saving": 1.0})
        for name, (make_codec, strategies) in CODECS.items():
            codec = make_codec()
            for strategy in strategies:
                r = report(
                    lambda t, c=codec, s=strategy: jc.pmean(t[0], "data", c, strategy=s),
                    m,
                    P("data"),
                )
                model = jc.strategy_bytes(codec, size, n)[strategy]
                rows.append(
                    {
                        "codec": name,
                        "strategy": strategy,
                        "n": n,
                        "bytes": r.bytes_per_device,
                        "model": model,
                        "payload": codec.payload_bytes(size),
                        "per_payload": r.bytes_per_device / codec.payload_bytes(size),
                        "saving": base / r.bytes_per_device,
                    }
                )
            print(n, name, flush=True)
    hier = []
    for outer, inner in HIER:
        devices = jax.devices()[: outer * inner]
        m = jax.make_mesh(
            (outer, inner), ("host", "local"), axis_types=(AxisType.Explicit,) * 2, devices=devices
        )
        spec = P(("host", "local"))
        for name, (make_codec, _) in CODECS.items():
            codec = make_codec()
            strategy = "majority_vote" if name == "signsgd" else "auto"
            r = report(
                lambda t, c=codec, s=strategy: jc.pmean(
                    t[0], "host", c, strategy=s, inner_axis_name="local"
                ),
                m,
                spec,
            )
            by_group: dict[int, float] = {}
            dtypes: dict[int, set] = {}
            # Outside the lax.cond: its branch redoes a flagged step pre-scaled (overflow only).
            for c in (c for c in r.collectives if not c.branch):
                by_group[c.group_size] = by_group.get(c.group_size, 0.0) + c.bytes_per_device
                dtypes.setdefault(c.group_size, set()).update(c.dtypes)
            model = jc.hierarchical_bytes(codec, size, outer, inner, strategy)
            hier.append(
                {
                    "codec": name,
                    "mesh": [outer, inner],
                    "outer_strategy": model["strategy"],
                    "outer_bytes": by_group.get(outer, 0.0),
                    "outer_model": model["outer"],
                    "outer_dtypes": sorted(dtypes.get(outer, ())),
                    "inner_bytes": by_group.get(inner, 0.0),
                    "inner_model": model["inner"],
                    "inner_dtypes": sorted(dtypes.get(inner, ())),
                    "flag_bytes": by_group.get(outer * inner, 0.0),
                }
            )
    return {"size": size, "rows": rows, "hierarchical": hier, "env": common.environment()}


RUNS = [  # label -> (codec, train kwargs)
    ("none", "none", {}),
    ("int8 two_phase (both residuals)", "int8", {"strategy": "two_phase"}),
    (
        "int8 two_phase (worker only)",
        "int8",
        {"strategy": "two_phase", "compress_kwargs": {"server_feedback": False}},
    ),
    ("sign two_phase (both residuals)", "sign", {"strategy": "two_phase"}),
    (
        "sign two_phase (worker only)",
        "sign",
        {"strategy": "two_phase", "compress_kwargs": {"server_feedback": False}},
    ),
    ("signsgd vote + momentum lr 0.001", "signsgd", {"strategy": "majority_vote", "lr": 0.001}),
    ("scaled sign vote + momentum", "sign", {"strategy": "majority_vote"}),
    (  # Bernstein et al. 2019: momentum on each worker, vote on sign(m_i), plain SGD after
        "signum vote (worker momentum 0.9), sgd cosine lr 0.01",
        "signsgd",
        {
            "strategy": "majority_vote",
            "cosine_lr": 0.01,
            "momentum": None,
            "compress_kwargs": {"worker_momentum": 0.9},
        },
    ),
]


def train_kwargs(kwargs: dict, steps: int) -> dict:
    """``cosine_lr``: a cosine decay of that peak over the run's steps, as ``lr``."""
    kwargs = dict(kwargs)
    if "cosine_lr" in kwargs:
        import optax

        kwargs["lr"] = optax.cosine_decay_schedule(kwargs.pop("cosine_lr"), steps)
    return kwargs


def digits_part(steps: int, seeds: int, quick: bool, only: list[str] | None = None) -> list[dict]:
    """Every run of ``RUNS`` (or the uncompressed one and those labelled in ``only``)."""
    from benchmarks import digits_mlp

    out = []
    for label, codec, kwargs in RUNS:
        if only and label != RUNS[0][0] and label not in only:
            continue
        accs = []
        ratio = None
        for seed in range(seeds):
            r = digits_mlp.train(codec, steps=steps, seed=seed, **train_kwargs(kwargs, steps))
            accs.append(r.accuracy)
            ratio = r.ratio
        out.append(
            {
                "run": label,
                "accuracy": accs,
                "mean_accuracy": statistics.mean(accs),
                "bytes_saving": ratio,
            }
        )
        print(f"{label:36s} {100 * statistics.mean(accs):6.2f}%  {accs}  {ratio:.1f}x", flush=True)
    base = out[0]["mean_accuracy"]
    for row in out:
        row["points_vs_none"] = 100 * (row["mean_accuracy"] - base)
    return out


def update_digits(only: list[str], steps: int, seeds: int, quick: bool) -> int:
    """``--only``: rerun some digits runs and merge their rows into the existing results."""
    labels = [label for label, _, _ in RUNS]
    unknown = [name for name in only if name not in labels]
    if unknown:
        raise SystemExit(f"--only: unknown run(s) {unknown}; runs are {labels}")
    path = common.result_path("scale_bytes", quick)
    result = json.loads(path.read_text())
    digits = result["digits"]
    if (digits["steps"], digits["seeds"]) != (steps, seeds):
        raise SystemExit(
            f"--only: {path.name} has steps={digits['steps']} seeds={digits['seeds']}; "
            "pass the same --steps and --seeds"
        )
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(8)
    env = common.environment()
    new = {row["run"]: {**row, "env": env} for row in digits_part(steps, seeds, quick, only)}
    old = {row["run"]: row for row in digits["runs"]}
    if abs(new[labels[0]]["mean_accuracy"] - old[labels[0]]["mean_accuracy"]) > 1e-6:
        print("note: the uncompressed run differs from the stored one", flush=True)
    old.update(new)
    digits["runs"] = [old[label] for label in labels if label in old]
    common.write_json(path, result)
    return 0


def draw(ax, table: dict) -> None:
    for name, (_, strategies) in [("f32", (None, ("pmean",))), *CODECS.items()]:
        for strategy in strategies:
            pts = [
                (r["n"], r["bytes"])
                for r in table["rows"]
                if (r["codec"], r["strategy"]) == (name, strategy)
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"{name} {strategy}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices n")
    ax.set_ylabel(f"bytes sent per device (vector of {table['size']} f32)")
    ax.legend(fontsize=6, ncol=2)


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="scale_bytes.json and .png (`--quick`: *_quick; `--only` merges into the file)",
        takes="minutes (not recorded); `--quick` is a smoke run",
    )
    ap.add_argument("--size", type=int, default=1 << 20, help="vector floats (bytes part)")
    ap.add_argument("--steps", type=int, default=1000, help="digits training steps")
    ap.add_argument("--seeds", type=int, default=3, help="digits seeds per row")
    ap.add_argument("--quick", action="store_true", help="100 steps, 1 seed, small vector")
    ap.add_argument("--bytes-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-digits", action="store_true", help="bytes part only")
    ap.add_argument(
        "--only",
        action="append",
        metavar="RUN",
        help="digits only: rerun the uncompressed run and this one (repeatable) and update "
        "their rows in the existing JSON (same --steps and --seeds); no bytes part",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.steps, args.seeds = 1 << 14, 100, 1
    if args.bytes_only:  # the subprocess
        print("JSON" + json.dumps(bytes_part(args.size)))
        return 0
    if args.only:
        return update_digits(args.only, args.steps, args.seeds, args.quick)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_bytes", "--bytes-only", "--size", str(args.size)],
        cwd=common.ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        raise SystemExit(f"the 16-device bytes subprocess failed ({proc.returncode})")
    table = json.loads(proc.stdout.split("JSON", 1)[1])
    for r in table["rows"]:
        print(
            f"n={r['n']:2d} {r['codec']:8s} {r['strategy']:14s} {r['bytes']:12.0f} B "
            f"{r['saving']:6.1f}x"
        )
    for h in table["hierarchical"]:
        print(h)
    result = {"benchmark": "scale_bytes", "bytes": table}
    if not args.skip_digits:
        from jaxcomp.cpu import use_cpu_devices

        use_cpu_devices(8)
        result["digits"] = {
            "steps": args.steps,
            "seeds": args.seeds,
            "model": "MLP 64-256-10, batch 256, sgd lr 0.05 momentum 0.9 unless noted",
            "runs": digits_part(args.steps, args.seeds, args.quick),
            "env": common.environment(),
        }
    common.write_json(common.result_path("scale_bytes", args.quick), result)
    common.plot(
        common.result_path("scale_bytes", args.quick, "png"),
        lambda ax: draw(ax, table),
        "jc.pmean bytes per device against n (compiled, ring model)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
