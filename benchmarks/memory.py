"""The compiled step's memory per device, in copies of the float32 params, for every transform.

Each row compiles one data-parallel training step of an MLP (``--mlp``, default
1024-2304-2304-1024, 10.0M params) on ``--devices`` CPU devices (axis ``"data"``, params
replicated, batch sharded, params and state donated) and reads XLA's
``compiled.memory_analysis()``: ``arguments`` (params, state, batch), ``temporaries`` (what the
program allocates while it runs), ``outputs`` and ``aliased`` (outputs written into donated
arguments). Each is divided by the bytes of the float32 params, so ``optax.sgd`` with momentum
holds 2.0 argument copies (params + momentum). Rows marked "bf16 memory" keep the error-
feedback memories in bfloat16 (``memory_dtype="bfloat16"``). Plain optimizers average the
gradient with
``jax.lax.pmean``; jaxcomp transforms replace that exchange. Nothing runs: compile only.

Writes ``benchmarks/results/memory.json`` (``--quick``: memory_quick.json, a small MLP)::

    python -m benchmarks.memory              # about a minute on 2 cores
    python -m benchmarks.memory --quick
"""

from __future__ import annotations

import sys

from benchmarks import common

AXIS = "data"
MLP = (1024, 2304, 2304, 1024)
QUICK_MLP = (128, 256, 256, 128)


def transforms() -> dict:
    """``name -> (tx, plain)``: ``plain`` steps pmean the gradient before ``tx``."""
    import optax

    import jaxcomp as jc

    adamw = optax.adamw(1e-3)
    bf16 = {"memory_dtype": "bfloat16"}
    return {
        "optax.sgd(momentum)": (optax.sgd(0.1, momentum=0.9), True),
        "jc.sgd(int8)": (jc.sgd(0.1, jc.int_quant(8), AXIS), False),
        "jc.sgd(fp16)": (jc.sgd(0.1, jc.cast("fp16"), AXIS), False),
        "jc.sgd(sign)": (jc.sgd(0.1, jc.sign(), AXIS), False),
        "dgc(0.1%) + sgd": (optax.chain(jc.dgc(0.001, AXIS), optax.sgd(0.1)), False),
        "optax.adamw": (adamw, True),
        "int8 + adamw": (optax.chain(jc.compressed_allreduce(jc.int_quant(8), AXIS), adamw), False),
        "powersgd r4 + adamw": (optax.chain(jc.powersgd(4, AXIS), adamw), False),
        "jc.onebit_adam": (jc.onebit_adam(1e-3, AXIS, freeze_step=100), False),
        "jc.zero_one_adam": (jc.zero_one_adam(1e-3, AXIS, var_freeze_step=100), False),
        # Error-feedback memories in bfloat16 (memory_dtype=): half of that state.
        "jc.sgd(int8), bf16 memory": (jc.sgd(0.1, jc.int_quant(8), AXIS, **bf16), False),
        "jc.sgd(sign), bf16 memory": (jc.sgd(0.1, jc.sign(), AXIS, **bf16), False),
        "jc.onebit_adam, bf16 memory": (
            jc.onebit_adam(1e-3, AXIS, freeze_step=100, **bf16),
            False,
        ),
    }


def measure(name: str, tx, plain: bool, params, mesh, batch: int) -> dict:
    """Compile the donated step and read its memory analysis (bytes per device)."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    fn, state = common.mlp_tx_step(tx, params, mesh, AXIS, pmean_first=plain, donate=True)
    n = mesh.shape[AXIS]
    sizes = (params["w0"].shape[0], params[f"w{len(params) // 2 - 1}"].shape[1])
    rows = jax.sharding.NamedSharding(mesh, P(AXIS))
    x = jax.ShapeDtypeStruct((n * batch, sizes[0]), np.float32, sharding=rows)
    y = jax.ShapeDtypeStruct((n * batch, sizes[1]), np.float32, sharding=rows)
    m = fn.lower(params, state, x, y).compile().memory_analysis()
    unit = sum(int(np.prod(v.shape)) * 4 for v in jax.tree.leaves(params))
    return {
        "transform": name,
        "arguments": m.argument_size_in_bytes / unit,
        "temporaries": m.temp_size_in_bytes / unit,
        "outputs": m.output_size_in_bytes / unit,
        "aliased": m.alias_size_in_bytes / unit,
        "param_bytes": unit,
    }


def main(argv: list[str] | None = None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="memory.json (memory_quick.json with --quick)",
        takes="one compile per transform (duration not recorded; --quick is a small MLP)",
    )
    ap.add_argument("--quick", action="store_true", help=f"a small MLP {QUICK_MLP}")
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    ap.add_argument("--batch", type=int, default=8, help="examples per device")
    ap.add_argument("--rows", nargs="+", default=None, help="only these transforms")
    args = ap.parse_args(argv)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(args.devices)
    import jax

    mesh = jax.make_mesh((args.devices,), (AXIS,))
    sizes = QUICK_MLP if args.quick else MLP
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.jit(lambda: common.mlp_params(sizes), out_shardings=replicated)()
    rows = []
    for name, (tx, plain) in transforms().items():
        if args.rows and name not in args.rows:
            continue
        rows.append(measure(name, tx, plain, params, mesh, args.batch))
        r = rows[-1]
        print(
            f"{name:<24} arguments {r['arguments']:5.2f}  temporaries {r['temporaries']:5.2f}"
            f"  outputs {r['outputs']:5.2f}  aliased {r['aliased']:5.2f}",
            flush=True,
        )
    path = common.result_path("memory", args.quick)
    data = {
        "mlp": sizes,
        "devices": args.devices,
        "batch": args.batch,
        "environment": common.environment(),
        "rows": rows,
    }
    if args.rows and path.exists():
        data = keep_other_rows(path, data)
    common.write_json(path, data)
    return 0


def keep_other_rows(path, data: dict) -> dict:
    """``data`` with the rows of ``path`` that ``data`` does not replace, in their order
    (``--rows`` remeasures some transforms; the others keep their figures, and the file's
    environment records each remeasurement under ``"remeasured"``)."""
    import json

    old = json.loads(path.read_text())
    same = (list(old["mlp"]), old["devices"], old["batch"])
    if same != (list(data["mlp"]), data["devices"], data["batch"]):
        return data
    new = {r["transform"]: r for r in data["rows"]}
    rows = [new.pop(r["transform"], r) for r in old["rows"]] + list(new.values())
    env = data["environment"]
    note = f"{env.get('date_utc')}: {env.get('command')}"
    old["environment"]["remeasured"] = "; ".join(
        filter(None, [old["environment"].get("remeasured"), note])
    )
    return {**old, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
