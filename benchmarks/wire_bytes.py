"""Bytes on the wire of a compressed training step, for every codec and strategy, vs pmean.

For each codec (every entry of ``jc.CODECS`` plus the sparse defaults of
``benchmarks/common.py``) and each strategy it supports (``allreduce`` only for summable
codecs, ``allgather``, ``two_phase``, ``auto``), the gradient exchange of one step — the
update of ``jc.compressed_allreduce(codec, "data", strategy=...)`` (``min_size=1024``: biases
and norms go through plain pmean) inside ``jax.shard_map`` — is compiled and its
collectives read by the parsers of ``jc.comm_report`` (ring model, bytes each device sends).
The baseline is plain ``jax.lax.pmean`` of the same tree. Trees are shapes only
(``jax.ShapeDtypeStruct``: nothing is allocated or run):

* ``resnet18`` — the 62 parameter arrays of torchvision's ResNet-18 (11.7M floats);
* ``gpt2`` — GPT-2 small (124.4M floats: wte 50257x768, wpe 1024x768, 12 blocks).

Meshes of n = 2, 4, 8, 16 use the first n of 16 CPU devices in this one process. Next to the
measured bytes the model of ``jc.strategy_bytes`` (per leaf, plus the plain leaves and the
4-byte non-finite flag where the codec does not carry it in its payload) is written, and the
two are compared.

Compiling is what ``jc.comm_report`` does, and it is slow on CPU (73 s for one ResNet-18 step
on the 2 loaded cores here; GPT-2 small has 148 leaves, each its own encode). So every row
reads the collectives of the *lowered* program (``jax.jit(...).lower``: the StableHLO that
``comm_report`` also parses as ``report.logical``), and the rows named by ``--compiled``
(default in full mode: sign, int8 and bf16 on ResNet-18 at n = 8) are also compiled and
parsed as ``comm_report`` does; those show whether XLA changed anything (on CPU it turns bf16
collectives into f32, so bf16 sends twice its logical bytes there). Writes
``benchmarks/results/wire_bytes.json`` and ``wire_bytes.png``::

    python -m benchmarks.wire_bytes                # all codecs, both trees, n = 2..16
    python -m benchmarks.wire_bytes --quick        # 3 codecs, resnet18, n = 2, 8, auto (< 1 min)
    python -m benchmarks.wire_bytes --trees gpt2 --codecs sign int8 --devices 8 16
    python -m benchmarks.wire_bytes --trees gpt2 --devices 2 4 --merge   # add to the file

``--merge`` keeps the rows already in the JSON file and replaces those measured again (same
tree, n, codec and strategy), so a sweep can be run in parts; the commands of the parts are
listed under ``merged_runs``.
"""

from __future__ import annotations

import json
import math
import sys
import time

from benchmarks import common
from jaxcomp.cpu import use_cpu_devices

MAX_DEVICES = 16
QUICK_CODECS = ["int8", "sign", "topk1%"]
AXIS = "data"
MIN_SIZE = 1024


def resnet18_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of ResNet-18 (ImageNet, 1000 classes); conv kernels HWIO."""
    shapes = {"conv1": (7, 7, 3, 64), "bn1.scale": (64,), "bn1.bias": (64,)}
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            p = f"layer{stage}.{block}"
            first_in = cin if block == 0 else cout
            shapes[f"{p}.conv1"] = (3, 3, first_in, cout)
            shapes[f"{p}.bn1.scale"] = shapes[f"{p}.bn1.bias"] = (cout,)
            shapes[f"{p}.conv2"] = (3, 3, cout, cout)
            shapes[f"{p}.bn2.scale"] = shapes[f"{p}.bn2.bias"] = (cout,)
            if block == 0 and first_in != cout:
                shapes[f"{p}.downsample.conv"] = (1, 1, first_in, cout)
                shapes[f"{p}.downsample.bn.scale"] = (cout,)
                shapes[f"{p}.downsample.bn.bias"] = (cout,)
        cin = cout
    shapes["fc.kernel"] = (512, 1000)
    shapes["fc.bias"] = (1000,)
    return shapes


def gpt2_shapes(layers: int = 12, d: int = 768, vocab: int = 50257, context: int = 1024):
    """Parameter shapes of GPT-2 small (tied output embedding)."""
    shapes = {"wte": (vocab, d), "wpe": (context, d)}
    for i in range(layers):
        p = f"h{i:02d}"
        shapes |= {
            f"{p}.ln_1.scale": (d,),
            f"{p}.ln_1.bias": (d,),
            f"{p}.attn.c_attn.kernel": (d, 3 * d),
            f"{p}.attn.c_attn.bias": (3 * d,),
            f"{p}.attn.c_proj.kernel": (d, d),
            f"{p}.attn.c_proj.bias": (d,),
            f"{p}.ln_2.scale": (d,),
            f"{p}.ln_2.bias": (d,),
            f"{p}.mlp.c_fc.kernel": (d, 4 * d),
            f"{p}.mlp.c_fc.bias": (4 * d,),
            f"{p}.mlp.c_proj.kernel": (4 * d, d),
            f"{p}.mlp.c_proj.bias": (d,),
        }
    shapes |= {"ln_f.scale": (d,), "ln_f.bias": (d,)}
    return shapes


TREES = {"resnet18": resnet18_shapes, "gpt2": gpt2_shapes}


def strategies_for(codec) -> list[str]:
    return (["allreduce"] if codec.summable else []) + ["allgather", "two_phase", "auto"]


def model_bytes(codec, shapes: dict, n: int, strategy: str) -> float:
    """``jc.strategy_bytes`` per compressed leaf + plain pmean of small leaves + the flag
    + residual feedback's ordering psum."""
    import jaxcomp as jc
    from jaxcomp._src import feedback

    scalar = 2 * (n - 1) / n * 4  # one float32 or int32 psum
    # The int32 non-finite flag: one scalar psum, unless the codec's payload carries it
    # (``flags_nonfinite``: every device reads it from what it received).
    total = 0.0 if codec.flags_nonfinite else scalar
    # Residual feedback (what error_feedback="auto" gives a biased codec): the means wait on
    # one float32 psum of the new memories' first values (compressed_allreduce's
    # _after_memory), where some leaf is compressed.
    if feedback.resolve("auto", codec) == "residual" and any(
        math.prod(s) >= MIN_SIZE for s in shapes.values()
    ):
        total += scalar
    for shape in shapes.values():
        d = math.prod(shape)
        if d >= MIN_SIZE:
            chosen = jc.choose_strategy(codec, d, n, strategy)
            total += jc.strategy_bytes(codec, d, n)[chosen]
        else:
            total += 2 * (n - 1) / n * 4 * d
    return total


def collectives_bytes(fn, args, n: int, compiled: bool) -> tuple[float, float | None, int]:
    """(logical bytes per device, compiled bytes per device or None, number of collectives)."""
    import jax

    from jaxcomp._src import accounting

    lowered = fn.lower(*args)
    logical = accounting.parse_stablehlo_collectives(lowered.as_text(), jax.device_count())
    hlo = None
    if compiled:
        hlo = accounting.parse_hlo_collectives(lowered.compile().as_text(), jax.device_count())
    total = lambda cs: float(sum(c.bytes_per_device for c in cs))  # noqa: E731
    return total(logical), None if hlo is None else total(hlo), len(logical)


def measure(
    trees, codecs, devices, compiled=(), progress=True, all_strategies=("resnet18",)
) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    rows = []
    jobs = [
        (t, n, name, s)
        for t in trees
        for n in devices
        for name in codecs
        for s in ["pmean"]
        + (strategies_for(common.make_codec(name)) if t in all_strategies else ["auto"])
    ]
    # pmean rows only once per (tree, n)
    seen, unique = set(), []
    for j in jobs:
        key = (j[0], j[1], "pmean") if j[3] == "pmean" else j
        if key not in seen:
            seen.add(key)
            unique.append(j)
    baselines: dict[tuple, float] = {}
    bar = common.progress(unique, "comm_report") if progress else unique
    for tree, n, name, strategy in bar:
        shapes = TREES[tree]()
        mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,), axis_types=(AxisType.Explicit,))
        # Per-device gradients stacked on a leading device axis, sharded on it.
        grads = {
            k: jax.ShapeDtypeStruct((n, *s), np.float32, sharding=NamedSharding(mesh, P(AXIS)))
            for k, s in shapes.items()
        }
        start = time.perf_counter()
        if strategy == "pmean":
            fn = jax.jit(
                jax.shard_map(
                    lambda g: jax.tree.map(lambda a: jax.lax.pmean(a[0], AXIS), g),
                    mesh=mesh,
                    in_specs=P(AXIS),
                    out_specs=P(),
                )
            )
            args = (grads,)
            name_out, model = "pmean", 2 * (n - 1) / n * 4 * sum(map(math.prod, shapes.values()))
        else:
            codec = common.make_codec(name)
            tx = jc.compressed_allreduce(codec, AXIS, strategy=strategy, min_size=MIN_SIZE)
            params = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()}
            state = jax.eval_shape(tx.init, params)
            specs = jc.state_specs(state, AXIS)
            abstract_state = jax.tree.map(
                lambda leaf, spec, n=n, mesh=mesh: jax.ShapeDtypeStruct(
                    (n * leaf.shape[0], *leaf.shape[1:]) if spec == P(AXIS) else leaf.shape,
                    leaf.dtype,
                    sharding=NamedSharding(mesh, spec),
                ),
                state,
                specs,
            )
            fn = jax.jit(
                jax.shard_map(
                    lambda g, s, tx=tx: tx.update(jax.tree.map(lambda a: a[0], g), s),
                    mesh=mesh,
                    in_specs=(P(AXIS), specs),
                    out_specs=(P(), specs),
                )
            )
            args = (grads, abstract_state)
            name_out, model = name, model_bytes(codec, shapes, n, strategy)
        check = (tree, n, name_out) in compiled or (tree, n, "*") in compiled
        measured, compiled_bytes, count = collectives_bytes(fn, args, n, check)
        if name_out == "pmean":
            baselines[(tree, n)] = measured
        rows.append(
            {
                "tree": tree,
                "params": sum(map(math.prod, shapes.values())),
                "devices": n,
                "codec": name_out,
                "strategy": strategy if strategy != "pmean" else "-",
                "resolved": _resolved(name, shapes, n, strategy) if name_out != "pmean" else "-",
                "bytes_per_device": measured,
                "model_bytes_per_device": model,
                "model_over_measured": model / measured if measured else math.nan,
                "compiled_bytes_per_device": compiled_bytes,
                "collectives": count,
                "compile_seconds": round(time.perf_counter() - start, 2),
            }
        )
    for r in rows:
        r["pmean_bytes_per_device"] = baselines[(r["tree"], r["devices"])]
        r["saving"] = r["pmean_bytes_per_device"] / r["bytes_per_device"]
    return rows


ROW_KEY = ("tree", "devices", "codec", "strategy")


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` rows with those measured again in ``new`` replaced (same :data:`ROW_KEY`),
    sorted by tree, n, codec and strategy (``pmean`` first). An old row of a codec measured
    again in ``new`` whose strategy that codec no longer carries is dropped (``"fp16"``
    became the scaled cast, not summable: its ``allreduce`` rows are gone)."""
    remeasured = {r["codec"] for r in new}
    by_key = {
        tuple(r[k] for k in ROW_KEY): r
        for r in old
        if r["codec"] not in remeasured
        or r["strategy"] == "-"
        or r["strategy"] in strategies_for(common.make_codec(r["codec"]))
    }
    by_key.update({tuple(r[k] for k in ROW_KEY): r for r in new})
    return sorted(
        by_key.values(),
        key=lambda r: (r["tree"], r["devices"], r["codec"] != "pmean", r["codec"], r["strategy"]),
    )


def merged_runs(old: dict, command: str) -> list[str]:
    """The commands of a sweep run in parts, ``command`` last: those ``old`` lists under
    ``merged_runs``, or, where one run wrote ``old`` (the first part), that run's command
    (its ``environment``), which was lost until 2026-11-27."""
    first = old.get("environment", {}).get("command")
    return [*old.get("merged_runs", [first] if first else []), command]


def _resolved(name: str, shapes: dict, n: int, strategy: str) -> str:
    """What ``auto`` chose for the largest leaf (leaves can differ; the table says the main one)."""
    import jaxcomp as jc

    d = max(math.prod(s) for s in shapes.values())
    return jc.choose_strategy(common.make_codec(name), d, n, strategy)


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'tree':9s}{'n':>3s}  {'codec':10s}{'strategy':11s}{'MiB/device':>11s}"
        f"{'vs pmean':>10s}{'model/meas':>11s}{'compiled MiB':>13s}"
    )
    for r in rows:
        print(
            f"{r['tree']:9s}{r['devices']:>3d}  {r['codec']:10s}{r['strategy']:11s}"
            f"{r['bytes_per_device'] / 2**20:>11.3f}{r['saving']:>9.1f}x"
            f"{r['model_over_measured']:>11.3f}"
            + (
                f"{r['compiled_bytes_per_device'] / 2**20:>13.3f}"
                if r["compiled_bytes_per_device"] is not None
                else ""
            )
        )


def draw(rows: list[dict], path) -> None:
    trees = sorted({r["tree"] for r in rows})

    def one(ax):
        styles = ["-", "--", ":", "-."]
        for ti, tree in enumerate(trees):
            sel = [r for r in rows if r["tree"] == tree and r["strategy"] in ("-", "auto")]
            for name in dict.fromkeys(r["codec"] for r in sel):
                pts = sorted(
                    (r["devices"], r["bytes_per_device"]) for r in sel if r["codec"] == name
                )
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] / 2**20 for p in pts],
                    styles[ti % 4],
                    marker="o",
                    label=f"{tree} {name}",
                    color="black" if name == "pmean" else None,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices n")
        ax.set_ylabel("MiB each device sends per step (ring model)")
        ax.legend(fontsize=6, ncol=3)

    common.plot(path, one, "Wire bytes per device per step, strategy auto, vs plain pmean")


def resolve(ap, args) -> tuple[list, list, list, set, list]:
    """``(trees, codecs, devices, compiled rows, all-strategy trees)`` of a run from its flags
    (``--quick``'s defaults where a flag is not given). A usage error naming the flag where
    one names what the run does not measure: a device count outside ``2..MAX_DEVICES``, an
    unknown codec (it failed minutes in), a ``--compiled`` row or an ``--all-strategies``
    tree outside the run (ignored without a word until 2026-11-27)."""
    trees = args.trees or (["resnet18"] if args.quick else ["resnet18", "gpt2"])
    codecs = args.codecs or (QUICK_CODECS if args.quick else common.codec_names())
    devices = args.devices or ([2, 8] if args.quick else [2, 4, 8, 16])
    if max(devices) > MAX_DEVICES or min(devices) < 2:
        ap.error(f"argument --devices: must be in 2..{MAX_DEVICES}, got {devices}")
    unknown = [c for c in codecs if c not in common.codec_names()]
    if unknown:
        ap.error(f"argument --codecs: unknown {unknown}; known: {common.codec_names()}")
    spec = args.compiled or []
    if args.compiled is None and not args.quick:  # the default rows this run measures
        kept = [c for c in ("pmean", "sign", "int8", "bf16") if c in (*codecs, "pmean")]
        spec = [f"resnet18:8:{c}" for c in kept] if "resnet18" in trees and 8 in devices else []
    compiled = set()
    for row in spec:
        tree, n, codec = (row.split(":") + ["", "", ""])[:3]
        if (
            row.count(":") != 2
            or tree not in trees
            or not n.isdigit()
            or int(n) not in devices
            or codec not in (*codecs, "pmean", "*")
        ):
            ap.error(f"argument --compiled: {row!r} is not a TREE:N:CODEC row this run measures")
        compiled.add((tree, int(n), codec))
    every = args.all_strategies
    if every is None:
        every = [] if args.quick or "resnet18" not in trees else ["resnet18"]
    if not set(every) <= set(trees):
        ap.error(f"argument --all-strategies: {sorted(set(every) - set(trees))} not in --trees")
    return trees, codecs, devices, compiled, every


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes=(
            "wire_bytes.json and .png (`--quick`: wire_bytes_quick.*; `--merge` keeps the rows "
            "already there)"
        ),
        takes=(
            "about 63 minutes on the 2-core CPU host for both trees (3,800 s); `--quick` 2.5 "
            "minutes (139 s)"
        ),
    )
    ap.add_argument(
        "--quick", action="store_true", help="3 codecs, resnet18, n = 2, 8, strategy auto"
    )
    ap.add_argument(
        "--trees",
        nargs="+",
        choices=sorted(TREES),
        default=None,
        help="None: both (--quick: resnet18)",
    )
    ap.add_argument("--codecs", nargs="+", default=None, help="default: all (registry + sparse)")
    ap.add_argument(
        "--devices", nargs="+", type=int, default=None, help="None: 2 4 8 16 (--quick: 2 8)"
    )
    ap.add_argument(
        "--all-strategies",
        nargs="*",
        default=None,
        help="trees measured with every strategy (the others: auto only; default resnet18, "
        "none with --quick)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows already in the JSON file, replace those measured again",
    )
    ap.add_argument(
        "--compiled",
        nargs="*",
        default=None,
        metavar="TREE:N:CODEC",
        help="rows also compiled (comm_report's compiled HLO); '*' as CODEC for all",
    )
    args = ap.parse_args(argv)
    trees, codecs, devices, compiled, every = resolve(ap, args)
    use_cpu_devices(MAX_DEVICES)
    start = time.perf_counter()
    rows = measure(trees, codecs, devices, compiled, all_strategies=tuple(every))
    print_table(rows)
    path = common.result_path("wire_bytes", args.quick)
    command = " ".join(["python -m benchmarks.wire_bytes", *(argv or sys.argv[1:])])
    out = {
        "environment": common.environment(),
        "min_size": MIN_SIZE,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    if args.merge and path.exists():
        old = json.loads(path.read_text())
        out["rows"] = merge_rows(old["rows"], rows)
        out["seconds"] += old.get("seconds", 0.0)
        out["merged_runs"] = merged_runs(old, command)
    common.write_json(path, out)
    draw(out["rows"], common.result_path("wire_bytes", args.quick, "png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
