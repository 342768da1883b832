"""Wire bytes of a compressed step in a data x model mesh: model-sharded vs replicated params.

A (data 4 x model 2) mesh on 8 CPU devices; a 2-layer MLP (``--sizes``, default
1024-4096-1024, 8.4M params) whose kernels are sharded over ``"model"`` (``w0``:
``P(None, "model")``, ``b0``: ``P("model")``, ``w1``: ``P("model", None)``, ``b1``: ``P()``);
one SGD step inside ``jax.shard_map(step, mesh=mesh, in_specs=..., out_specs=...,
axis_names={"data"})`` (manual over ``data`` only, ``model`` left to the compiler), the
gradient exchanged by ``jc.compressed_allreduce(jc.sign(), "data")`` (error feedback on)
before ``optax.sgd``, params and state donated. The same step with every param replicated
over ``model`` is the reference: ``jc.comm_report(...).bytes_per_device`` of each compiled
step, and their ratio (issue 14's target: model-sharded <= 0.6 of model-replicated). Plain
``jax.lax.pmean`` steps of both layouts are listed beside them. Every f32 collective of the
compiled sharded step at least half a model shard of the smallest kernel in size whose device
groups span the model axis (read from the compiled HLO's replica groups or permute pairs) is
listed: there should be none. Each row also splits its bytes by the mesh axes they cross.

The state's specs compose the data axis with the params' own: ``jc.state_specs(state,
"data")`` (and ``jc.sharded_init``); where they accept ``param_specs=`` (the per-leaf state
of issue 14) the params' specs are passed too. Writes
``benchmarks/results/mesh_bytes[_LABEL].json``::

    python -m benchmarks.mesh_bytes --label before     # mesh_bytes_before.json
    python -m benchmarks.mesh_bytes                    # mesh_bytes.json
    python -m benchmarks.mesh_bytes --quick            # a 256-1024-256 MLP (smoke test)
    python -m benchmarks.mesh_bytes --explicit         # mesh_bytes_explicit.json

``--explicit``: the model axis is ``AxisType.Explicit`` and each step runs inside
``jax.sharding.auto_axes(step, axes="model", out_sharding=...)``, the pattern jaxcomp names
when it refuses params sharded over an Explicit axis (a ``shard_map`` manual over the data
axis alone gathers every operand sharded over an Explicit axis at its boundary).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import time

from benchmarks import common

DATA, MODEL = "data", "model"
MESH = (4, 2)
SIZES = (1024, 4096, 1024)
QUICK_SIZES = (256, 1024, 256)
BATCH = 8  # per data shard
TARGET = 0.6


def param_specs(sharded: bool) -> dict:
    from jax.sharding import PartitionSpec as P

    if not sharded:
        return {"w0": P(), "b0": P(), "w1": P(), "b1": P()}
    return {"w0": P(None, MODEL), "b0": P(MODEL), "w1": P(MODEL, None), "b1": P()}


def loss(params, x, y):
    import jax
    import jax.numpy as jnp

    h = jax.nn.relu(x @ params["w0"] + params["b0"])
    return jnp.mean((h @ params["w1"] + params["b1"] - y) ** 2)


def groups_of(line: str, num_devices: int) -> list[list[int]]:
    """Device groups of one HLO collective line: ``replica_groups`` (listed or iota form
    ``[G,S]<=[dims]T(perm)``) or a permute's ``source_target_pairs``; ``[]``: all devices."""
    import numpy as np

    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line) or re.search(
        r"replica_groups=\{(.*?)\}\}", line
    )
    if m:
        groups = re.findall(r"\{([\d,]+)", m.group(1))
        return [[int(v) for v in g.split(",") if v] for g in groups]
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        ids = np.arange(num_devices).reshape([int(v) for v in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    return [list(range(num_devices))]


def axes_of(report, collective, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> list:
    """Mesh axes a compiled collective's groups span (logical ids in mesh order)."""
    import numpy as np

    line = next((ln for ln in report.hlo_text.splitlines() if f"{collective.name} = " in ln), "")
    spanned = set()
    for group in groups_of(line, int(np.prod(mesh_shape))):
        coords = np.array(np.unravel_index(group, mesh_shape)).T
        spanned |= {names[a] for a in range(len(names)) if len(set(coords[:, a])) > 1}
    return [a for a in names if a in spanned]


def state_and_specs(tx, params, mesh, pspecs):
    """``jc.sharded_init`` and ``jc.state_specs``; ``param_specs=`` passed where accepted."""
    import jaxcomp as jc

    def kw(fn):
        return {"param_specs": pspecs} if "param_specs" in inspect.signature(fn).parameters else {}

    state = jc.sharded_init(tx, params, mesh, DATA, **kw(jc.sharded_init))
    # shard_map's specs name the manual axis only; each leaf keeps its model sharding.
    return state, jc.state_specs(state, DATA)


def measure(sharded: bool, method: str, sizes, run: bool, explicit: bool = False) -> dict:
    import warnings

    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    model_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh(MESH, (DATA, MODEL), axis_types=(AxisType.Explicit, model_type))
    d_in, hidden, d_out = sizes
    rng = np.random.RandomState(0)
    host = {
        "w0": rng.standard_normal((d_in, hidden)).astype(np.float32) / np.sqrt(d_in),
        "b0": np.zeros((hidden,), np.float32),
        "w1": rng.standard_normal((hidden, d_out)).astype(np.float32) / np.sqrt(hidden),
        "b1": np.zeros((d_out,), np.float32),
    }
    pspecs = param_specs(sharded)
    pshard = {k: NamedSharding(mesh, s) for k, s in pspecs.items()}
    params = {k: jax.device_put(v, pshard[k]) for k, v in host.items()}
    n_data = MESH[0]
    x = jax.device_put(
        rng.standard_normal((n_data * BATCH, d_in)).astype(np.float32),
        NamedSharding(mesh, P(DATA)),
    )
    y = jax.device_put(
        rng.standard_normal((n_data * BATCH, d_out)).astype(np.float32),
        NamedSharding(mesh, P(DATA)),
    )
    opt = optax.sgd(1e-3)
    if method == "pmean":
        tx = opt
    else:
        # Each device compresses its own block of the model-sharded leaves (param_specs).
        blocks = {"param_specs": pspecs}  # P() everywhere when replicated: no warning
        tx = optax.chain(jc.compressed_allreduce(common.make_codec(method), DATA, **blocks), opt)
    state, sspecs = state_and_specs(tx, params, mesh, pspecs)

    def step(p, s, x, y):
        g = jax.grad(loss)(jax.lax.pcast(p, DATA, to="varying"), x, y)
        if method == "pmean":
            g = jax.lax.pmean(g, DATA)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    stepped = jax.shard_map(
        step,
        mesh=None if explicit else mesh,  # explicit: the context mesh (auto_axes makes it)
        in_specs=(P(), sspecs, P(DATA), P(DATA)),
        out_specs=(P(), sspecs),
        axis_names={DATA},
    )
    if explicit:  # the model axis made Auto for the step: jaxcomp refuses it Explicit
        layout = (pspecs, jax.tree.map(lambda a: a.sharding.spec, state))
        stepped = jax.sharding.auto_axes(stepped, axes=MODEL, out_sharding=layout)
    fn = jax.jit(
        stepped,
        donate_argnums=(0, 1),
        out_shardings=(pshard, jax.tree.map(lambda a: a.sharding, state)),
    )
    context = jax.set_mesh(mesh) if explicit else contextlib.nullcontext()
    with context:
        report = jc.comm_report(fn, params, state, x, y)
    kernel = min(d_in * hidden, hidden * d_out)
    threshold = 0.5 * 4 * kernel / MESH[1]

    def describe(c):
        return {
            "kind": c.kind,
            "dtype": c.dtype,
            "shape": c.shape_str(),
            "axes": axes_of(report, c, MESH, (DATA, MODEL)),
            "group_size": c.group_size,
            "array_bytes": c.array_bytes,
            "bytes_per_device": c.bytes_per_device,
        }

    listed = [describe(c) for c in report.collectives]
    suspects = [
        c
        for c in listed
        if "f32" in c["dtype"] and MODEL in c["axes"] and c["array_bytes"] >= threshold
    ]
    row = {
        "params": "model-sharded" if sharded else "model-replicated",
        "method": method,
        "param_specs": {k: str(s) for k, s in pspecs.items()},
        "state_specs": [str(s) for s in jax.tree.leaves(sspecs, is_leaf=lambda s: s is None)],
        "state_shapes": [
            f"{a.dtype}{list(a.shape)} {a.sharding.spec}" for a in jax.tree.leaves(state)
        ],
        "bytes_per_device": report.bytes_per_device,
        "logical_bytes_per_device": report.logical_bytes_per_device,
        "collectives": report.count,
        "by_kind": report.by_kind(),
        "bytes_by_axes": {
            "+".join(axes) or "none": sum(
                c["bytes_per_device"] for c in listed if "+".join(c["axes"]) == "+".join(axes)
            )
            for axes in {tuple(c["axes"]) for c in listed}
        },
        "collectives_listed": listed,
        "f32_gradient_sized_over_model": suspects,
    }
    if run:  # prove it runs: one step, blocked
        with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
            params, state = jax.block_until_ready(fn(params, state, x, y))
        row["ran"] = bool(all(np.isfinite(np.asarray(v)).all() for v in params.values()))
    return row


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes=(
            "mesh_bytes.json (`--label L`: mesh_bytes_L.json; `--explicit`: "
            "mesh_bytes_explicit.json; `--quick`: *_quick)"
        ),
        takes="10-20 s on the 2-core CPU host",
    )
    ap.add_argument("--quick", action="store_true", help="a 256-1024-256 MLP")
    ap.add_argument("--sizes", type=int, nargs=3, default=None, help="d_in hidden d_out")
    ap.add_argument("--codec", default="sign", help="the compressed rows' codec (default sign)")
    ap.add_argument("--no-run", action="store_true", help="compile only, do not run one step")
    ap.add_argument("--label", default=None, help="write mesh_bytes_LABEL.json (e.g. before)")
    ap.add_argument(
        "--explicit",
        action="store_true",
        help="an Explicit model axis, made Auto for the step (jax.sharding.auto_axes)",
    )
    args = ap.parse_args(argv)
    sizes = tuple(args.sizes or (QUICK_SIZES if args.quick else SIZES))

    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(MESH[0] * MESH[1])
    start = time.perf_counter()
    rows = []
    for method in ["pmean", args.codec]:
        for sharded in (True, False):
            row = measure(sharded, method, sizes, run=not args.no_run, explicit=args.explicit)
            rows.append(row)
            print(
                f"{row['params']:17s} {method:6s} {row['bytes_per_device'] / 1e6:9.3f} MB/device"
                f"  {row['collectives']:3d} collectives,"
                f" {len(row['f32_gradient_sized_over_model'])} f32 gradient-sized over model",
                flush=True,
            )
    by = {(r["params"], r["method"]): r["bytes_per_device"] for r in rows}
    ratio = by[("model-sharded", args.codec)] / by[("model-replicated", args.codec)]
    pmean_ratio = by[("model-sharded", "pmean")] / by[("model-replicated", "pmean")]
    suspects = rows[2]["f32_gradient_sized_over_model"]
    print(
        f"\n{args.codec}: model-sharded / model-replicated bytes per device = {ratio:.3f}"
        f" (target <= {TARGET}); pmean: {pmean_ratio:.3f}"
    )
    for c in suspects:
        print(f"  f32 over model: {c}")
    out = {
        "environment": common.environment(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],  # other work on the host
        "label": args.label,
        "mesh": {DATA: MESH[0], MODEL: MESH[1]},
        "model_axis": "Explicit, made Auto for the step" if args.explicit else "Auto",
        "sizes": list(sizes),
        "params": sizes[0] * sizes[1] + sizes[1] + sizes[1] * sizes[2] + sizes[2],
        "codec": args.codec,
        "sharded_over_replicated": ratio,
        "pmean_sharded_over_replicated": pmean_ratio,
        "target": TARGET,
        "f32_gradient_sized_over_model": suspects,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    label = args.label or ("explicit" if args.explicit else None)
    name = "mesh_bytes" + (f"_{label}" if label else "")
    common.write_json(common.result_path(name, args.quick), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
