"""XLA:CPU compile options on the hot path: what each changes, and whether the bits stay.

For each row of ``benchmarks/hot_path.py`` (one CPU device, ``tx.update`` with the gradient
and the state donated) and each set of ``jax.jit`` ``compiler_options`` (XLA's debug options,
per program), deterministic facts against XLA's defaults, no timing:

* the optimized HLO (its metadata left out) the same or not, its fusions, ``hlo_copies``
  (:func:`benchmarks.hot_path.hlo_traffic`) and temporaries in copies of the gradient;
* the machine code: XLA:CPU's object files of the update (``--xla_dump_to``), disassembled
  (``objdump``): instructions, those on 512-bit (zmm) and 256-bit (ymm) registers, and how
  many objects' instruction sequences differ from the defaults' (two compiles with the same
  options differ in at most one object: register choices in the entry's call thunk);
* the bits: ``--steps`` updates in a row (step 2 a NaN in one gradient value, step 4 an inf),
  each option set against the defaults: bytes of the outputs (the mean and the new state)
  that differ, per step, the values that differ (a NaN equal to any NaN), and whether every
  float of the state stayed finite (a non-finite gradient must leave the error-feedback
  memory as it was).

Which options help, timed, is ``python -m benchmarks.hot_path --compile-options ...`` (one
process, calls interleaved) or ``--settings NAME:XLA_FLAGS=...`` (one process per setting);
``docs/hot-path-xla.md`` has both. Writes ``benchmarks/results/xla_options[_LABEL].json``::

    python -m benchmarks.xla_options --options vw512:xla_cpu_prefer_vector_width=512 \\
        fastmath:xla_cpu_enable_fast_math=true
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from benchmarks import common, hot_path

DEFAULT_OPTIONS = [
    # XLA's default level, set: the same program, which shows how much two compiles differ
    "same_as_default:xla_backend_optimization_level=3",
    "vw512:xla_cpu_prefer_vector_width=512",
    "level2:xla_backend_optimization_level=2",
    "region_copies:xla_cpu_copy_insertion_use_region_analysis=true",
    "legacy_emitters:xla_cpu_use_fusion_emitters=false",
    "one_module:xla_cpu_parallel_codegen_split_count=1",
    "eigen_one_thread:xla_cpu_multi_thread_eigen=false",
    "tiling:xla_cpu_experimental_enable_tiling_propagation=true",
    "fast_runtime:xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_RUNTIME",
    "xnn_graph:xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "xnn_eltwise:xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE",
    "ynn_eltwise:xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE",
    "fastmath:xla_cpu_enable_fast_math=true",
]
#: step -> the value written into one gradient entry at that step (the others finite)
BAD_STEPS = {2: float("nan"), 4: float("inf")}


def _instructions(obj: pathlib.Path) -> list[str]:
    """The instructions of an object file (``objdump -d``), without addresses or bytes."""
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True
    ).stdout
    return [line.split("\t", 1)[1].strip() for line in text.splitlines() if ":\t" in line]


def machine_code(folder: pathlib.Path, module: str) -> dict[str, list[str]]:
    """Object file name -> mnemonics, of every object XLA:CPU dumped for ``module``."""
    found = {}
    for obj in sorted(folder.glob(f"module_*.{module}.obj-file.*.o")):
        ins = _instructions(obj)
        found[obj.name.split(".obj-file.", 1)[1]] = ins
    return found


def _code_summary(code: dict[str, list[str]], base: dict[str, list[str]] | None) -> dict:
    ins = [i for part in code.values() for i in part]

    def mnemonics(part):
        return [i.split()[0] for i in part if i]

    differing = None
    if base is not None:
        differing = sum(mnemonics(base.get(k, [])) != mnemonics(v) for k, v in code.items())
    return {
        "objects": len(code),
        "objects_differing": differing,
        "instructions": len(ins),
        "zmm_instructions": sum("zmm" in i for i in ins),
        "ymm_instructions": sum("ymm" in i for i in ins),
    }


def _hlo_key(text: str) -> str:
    """A hash of optimized HLO text without metadata and module names."""
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^HloModule \S+", "", text)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def run(sizes, names, specs, steps: int, folder: pathlib.Path) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    mesh = Mesh(np.array(jax.devices()[:1]), (hot_path.AXIS,), axis_types=(AxisType.Explicit,))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(common.mlp_params(sizes), replicated)
    n_params = sum(int(a.size) for a in jax.tree.leaves(params))
    leaves, treedef = jax.tree.flatten(params)

    def grads(t):
        keys = jax.random.split(jax.random.PRNGKey(t), len(leaves))
        g = [
            np.asarray(jax.random.normal(k, a.shape)) * 10.0 ** (i % 5 - 2)
            for i, (k, a) in enumerate(zip(keys, leaves, strict=True))
        ]
        if t in BAD_STEPS:
            g[-1].flat[7] = BAD_STEPS[t]
        return jax.device_put(jax.tree.unflatten(treedef, g), replicated)

    rows = []
    for r, name in enumerate(names):
        what, feedback, *_ = hot_path.ROWS[name]
        tx = jc.compressed_allreduce(
            common.make_codec(what), hot_path.AXIS, error_feedback=feedback
        )
        specs_ = jc.state_specs(jc.sharded_init(tx, params, mesh, hot_path.AXIS), hot_path.AXIS)

        def body(g, s, p, tx=tx):
            return tx.update(jax.lax.pcast(g, hot_path.AXIS, to="varying"), s, p)

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(), specs_, P()), out_specs=(P(), specs_)
        )
        base = None
        for v, (option_name, opts) in enumerate([("default", {}), *specs]):
            module = f"upd{r}_{v}"  # the dumped module's name: jit_<function name>
            fn = _named(mapped, module)
            update = jax.jit(fn, donate_argnums=(0, 1), compiler_options=opts or None)
            state = jc.sharded_init(tx, params, mesh, hot_path.AXIS)
            compiled = update.lower(grads(0), state, params).compile()
            text = compiled.as_text()
            outputs = []
            for t in range(steps):
                mean, state = update(grads(t), state, params)
                outputs.append(jax.device_get((mean, state)))
            code = machine_code(folder, f"jit_{module}")
            row = {
                "name": name,
                "compile_options": option_name,
                "options": " ".join(f"{k}={v}" for k, v in opts.items()),
                "hlo_same": None if base is None else _hlo_key(text) == base["hlo"],
                "fusions": len(re.findall(r" fusion\(", text)),
                "hlo_copies": hot_path.hlo_traffic(text) / (8 * n_params),
                "temp_copies": compiled.memory_analysis().temp_size_in_bytes / (4 * n_params),
                **_code_summary(code, None if base is None else base["code"]),
                "bytes_differing": None if base is None else _differing(outputs, base["out"]),
                # the same, values (a NaN equal to any NaN)
                "values_differing": None
                if base is None
                else _differing(outputs, base["out"], nan_equal=True),
                "state_finite": [_finite(s) for _, s in outputs],
            }
            row["steps_differing"] = _steps(row["values_differing"])  # the lists, for tables
            row["state_finite_every_step"] = all(row["state_finite"])
            rows.append(row)
            if base is None:
                base = {"hlo": _hlo_key(text), "code": code, "out": outputs}
            print(
                f"{name:26s} {option_name:18s} HLO same {row['hlo_same']!s:5s} "
                f"objects differing {row['objects_differing']!s:4s} "
                f"instructions {row['instructions']:6d} zmm {row['zmm_instructions']:5d} "
                f"bytes differing {row['bytes_differing']} values {row['values_differing']}",
                flush=True,
            )
    return rows


def _named(fn, name: str):
    def wrapped(*args):
        return fn(*args)

    wrapped.__name__ = wrapped.__qualname__ = name
    return wrapped


def _differing(outputs, base, nan_equal: bool = False) -> list[int]:
    """Per step, bytes of the outputs that differ from ``base``'s (``nan_equal``: values
    that differ, a NaN equal to any NaN, whatever its sign and payload bits)."""
    import jax
    import numpy as np

    def count(a, b):
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
        if nan_equal:
            same = (a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind == "f" else a == b
            return int(np.sum(~same))
        return int(np.sum(a.view(np.uint8) != b.view(np.uint8)))

    return [
        sum(count(a, b) for a, b in zip(*map(jax.tree.leaves, pair), strict=True))
        for pair in zip(outputs, base, strict=True)
    ]


def _steps(counts: list[int] | None) -> str | None:
    """The steps (from 0) whose count is not 0, as text ('none' where every count is 0)."""
    if counts is None:
        return None
    return " ".join(str(t) for t, c in enumerate(counts) if c) or "none"


def _finite(tree) -> bool:
    import jax
    import numpy as np

    return all(
        bool(np.all(np.isfinite(x)))
        for x in map(np.asarray, jax.tree.leaves(tree))
        if x.dtype.kind == "f"
    )


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="xla_options.json (`--label L`: xla_options_L.json)",
        takes="about 2 minutes on the 2-core CPU host (compiles, the quick MLP)",
    )
    ap.add_argument(
        "--options",
        nargs="+",
        default=DEFAULT_OPTIONS,
        metavar="OPTIONS",
        help="sets of jax.jit compiler_options, NAME:option=value[,option=value], each "
        "against XLA's defaults",
    )
    ap.add_argument(
        "--rows",
        nargs="+",
        default=["sign", "int8", "fp16", "fp16 scaled, no feedback"],
        choices=list(hot_path.ROWS),
        metavar="ROW",
        help="hot_path rows to compile",
    )
    ap.add_argument("--steps", type=int, default=6, help="updates compared bit for bit")
    ap.add_argument("--full", action="store_true", help="the 25.2M-param MLP, not the 1.6M one")
    ap.add_argument("--label", default=None, help="write xla_options_LABEL.json")
    args = ap.parse_args(argv)
    try:
        specs = [hot_path.parse_compile_options(s) for s in args.options]
    except ValueError as e:
        ap.error(str(e).replace("--compile-options", "--options"))
    if args.steps <= max(BAD_STEPS):
        ap.error(f"--steps must be above {max(BAD_STEPS)} (steps {sorted(BAD_STEPS)} are bad)")
    with tempfile.TemporaryDirectory() as folder:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={folder}".strip()
        import jaxcomp.cpu

        jaxcomp.cpu.use_cpu_devices(1)
        sizes = common.MLP if args.full else hot_path.QUICK_MLP
        rows = run(sizes, args.rows, specs, args.steps, pathlib.Path(folder))
    data = {
        "environment": common.environment(),
        "label": args.label,
        "mlp": list(sizes),
        "bad_steps": {str(k): str(v) for k, v in BAD_STEPS.items()},
        "rows": rows,
    }
    name = "xla_options" + (f"_{args.label}" if args.label else "")
    common.write_json(common.result_path(name, False), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
