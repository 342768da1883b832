"""The bytes ratios of the LM recipes on other models: fixed settings against budget-sized ones.

Issue 24's byte targets (bytes per step against per-step float32 ``pmean``: DeMo >= 80x,
DiLoCo int4 at ``H = 30`` >= 200x, SparseLoCo at ``H = 30`` >= 3000x) were met by settings
sized on the LM benchmark's model (``benchmarks/lm.py``: 2 layers of ``d_model`` 128). A
chunked top-k pays per chunk of each leaf, so the same density gives another ratio on another
model. For each model (``benchmarks.char_transformer``'s decoder at several widths, depths,
vocabularies, and widths whose leaves are no multiple of the chunks) this lowers the step of
each recipe of docs/lm.md "The code" (the exchange alone: ``tx.update`` on gradients shaped
like the params, the sync step and a step between syncs) and reads its collectives as
:func:`jaxcomp.comm_report`'s logical program does (ring model, bytes per device, no
compiling), against a float32 ``pmean`` of the same tree every step on 8 devices. Rows
"sized" take ``jc.sparseloco_density`` / ``jc.demo_topk`` for the target on that model; the
"predicted" column is ``jc.sparseloco_ratio`` / ``jc.demo_ratio`` (pure arithmetic).

The inner optimizer does not change the bytes (it runs inside each replica): the lowered
steps use ``optax.sgd`` inside, where the recipes run Muon or AdamW. The LM benchmark's
tables also count its float32 loss ``pmean`` (7 bytes a step on 8 devices) on both sides;
this table counts only the exchange.

The lowered models are :data:`MODELS`; the arithmetic alone covers :data:`GRID` (every
width at 1 to 4 layers) in the same file. Writes ``benchmarks/results/budget_bytes.json``
after every model (``--resume`` keeps the models already there)::

    python -m benchmarks.budget_bytes [--quick] [--resume]
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks import common

N = 8  # devices: the per-step pmean's and the replicas' (8 of 1, or 2 of 4)
H = 30


@dataclasses.dataclass(frozen=True)
class Model:
    d_model: int
    layers: int
    heads: int = 4
    vocab: int = 256
    context: int = 64

    @property
    def name(self) -> str:
        extra = "" if self.vocab == 256 else f", vocab {self.vocab}"
        return f"{self.layers} x d{self.d_model}{extra}"


#: Lowered (measured): every width at 2 layers; widths whose leaves fill no whole chunk of
#: 4096, 1024 or 64 x 64 (100: 100 x 300; 97, a prime: DeMo's blocks padded) and larger
#: vocabularies; the held-out pairs' models (3 layers of 64 and of 96); 1, 3 and 4 layers at
#: the width that misses most (48). The depth moves a ratio by a few percent at most: the
#: arithmetic (:data:`GRID`, every width at 1-4 layers) shows it for the rest.
MODELS = [Model(d, 2) for d in (48, 64, 96, 128, 192, 256)]
MODELS += [Model(100, 2), Model(97, 2, heads=1), Model(96, 3, vocab=512), Model(64, 3, vocab=1000)]
MODELS += [Model(96, 3), Model(64, 3), Model(48, 3), Model(48, 1), Model(48, 4)]
GRID = [Model(d, layers) for d in (48, 64, 96, 128, 192, 256) for layers in (1, 2, 3, 4)]
QUICK = [Model(48, 2), Model(96, 3)]


def params_of(m: Model) -> Any:
    """The model's params as NumPy zeros of their shapes and dtypes (only shapes count)."""
    import jax
    import numpy as np
    from flax import nnx

    from benchmarks import char_transformer as ct

    def make():
        rngs = nnx.Rngs(0)
        return ct.CharTransformer(
            context=m.context, d=m.d_model, layers=m.layers, heads=m.heads, vocab=m.vocab, rngs=rngs
        )

    shapes = nnx.state(nnx.eval_shape(make))
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


def collectives_bytes(fn, *args) -> float:
    """Ring-model bytes per device of ``fn``'s logical program (as ``jc.comm_report``'s
    ``logical``), read from the lowering without compiling it."""
    import jax

    from jaxcomp._src.accounting import parse_stablehlo_collectives

    text = fn.lower(*args).as_text()
    return sum(c.bytes_per_device for c in parse_stablehlo_collectives(text, jax.device_count()))


def placed(tree: Any, mesh: Any, spec: Any) -> Any:
    """``tree``'s leaves as ``jax.ShapeDtypeStruct`` sharded by ``spec`` (lowering only)."""
    import jax
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def pmean_bytes(params: Any) -> float:
    """Bytes per device of a float32 ``pmean`` of ``params``-shaped gradients over 8 devices."""
    import jax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))

    def step(p):
        return jax.lax.pmean(jax.lax.pcast(p, "data", to="varying"), "data")

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P()))
    return collectives_bytes(fn, placed(params, mesh, P()))


def replica_step_bytes(tx: Any, params: Any, replicas: int, count: int) -> float:
    """Bytes per device across replicas of one step of a periodic transform (``jc.sparseloco``,
    ``jc.diloco``) at step count ``count`` (``H - 1``: a sync step; 0: a step between syncs)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    shape = (replicas, N // replicas)
    mesh = jax.make_mesh(shape, ("replica", "data"), axis_types=(AxisType.Explicit,) * 2)
    state = jc.sharded_init(tx, params, mesh, "replica")
    specs = jc.state_specs(state, "replica")
    stacked = jax.tree.map(lambda x: np.zeros((replicas, *x.shape), x.dtype), params)

    def step(r, s):
        p = jc.own(r)
        g = jax.tree.map(lambda x: 1e-3 * x, p)  # a replica's mean gradient
        u, s = tx.update(g, jc.at_count(s, count), p)
        return jc.slot(optax.apply_updates(p, u)), s

    inout = (P("replica"), specs)
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=inout, out_specs=inout))
    return collectives_bytes(fn, placed(stacked, mesh, P("replica")), state)


def dp_step_bytes(tx: Any, params: Any) -> float:
    """Bytes per step of a data-parallel transform (``jc.demo``) over 8 devices."""
    import jax
    import optax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(state, "data")

    def step(p, s):
        g = jax.tree.map(lambda x: 1e-3 * x, jax.lax.pcast(p, "data", to="varying"))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
    return collectives_bytes(fn, placed(params, mesh, P()), state)


def rows_of(m: Model) -> list[dict[str, Any]]:
    """Every recipe's row on model ``m``: documented setting and budget-sized one."""
    import jax
    import optax

    import jaxcomp as jc

    params = params_of(m)
    base = pmean_bytes(params)
    inner = optax.sgd(1e-3)
    sl8 = dict(bits=1, min_size=0)
    sl2 = dict(chunk=1024, bits=1, min_size=0)
    d8 = jc.sparseloco_density(params, 3000, H, N, **sl8)
    d2 = jc.sparseloco_density(params, 3000, H, 2, devices=N, **sl2)
    k = jc.demo_topk(params, 80, N, bits=3)
    sparse = {  # name: (target, replicas, setting)
        "SparseLoCo 3000x, 8 replicas: 21 of 4096": (3000, N, dict(density=21 / 4096, **sl8)),
        "SparseLoCo 3000x, 8 replicas: sized": (3000, N, dict(density=d8, **sl8)),
        "SparseLoCo 3000x, 2 replicas: 47 of 1024": (3000, 2, dict(density=188 / 4096, **sl2)),
        "SparseLoCo 3000x, 2 replicas: sized": (3000, 2, dict(density=d2, **sl2)),
    }
    out = []

    values = int(sum(x.size for x in jax.tree.leaves(params)))

    def row(recipe, target, setting, replicas, measured, predicted):
        out.append(
            dict(
                model=m.name,
                d_model=m.d_model,
                layers=m.layers,
                vocab=m.vocab,
                values=values,
                recipe=recipe,
                setting=setting,
                replicas=replicas,
                target=target,
                pmean_bytes=base,
                bytes_per_step=measured,
                ratio=base / measured,
                predicted_ratio=predicted,
            )
        )

    between: dict[tuple, float] = {}  # a step between syncs: the same for every density

    def per_step(kind: str, tx: Any, replicas: int) -> float:
        if (kind, replicas) not in between:
            between[kind, replicas] = replica_step_bytes(tx, params, replicas, 0)
        sync = replica_step_bytes(tx, params, replicas, H - 1)
        return (sync + (H - 1) * between[kind, replicas]) / H

    for name, (target, m_, kw) in sparse.items():
        tx = jc.sparseloco(inner, "replica", H, value_scale="mean", **kw)
        chunk = kw.get("chunk", 4096)
        setting = f"{round(kw['density'] * chunk)} of {chunk}"
        predicted = jc.sparseloco_ratio(params, H, m_, devices=N, **kw)
        row(name, target, setting, m_, per_step("sparseloco", tx, m_), predicted)
    for topk, label in ((20, "DeMo 80x: topk 20, 3 bits"), (k, "DeMo 80x: sized")):
        tx = jc.demo(1e-3, "data", decay=0.95, topk=topk, bits=3)
        row(
            label,
            80,
            f"topk {topk}",
            N,
            dp_step_bytes(tx, params),
            jc.demo_ratio(params, N, topk=topk, bits=3),
        )
    for replicas in (N, 2):
        tx = jc.diloco(inner, "replica", H, codec=jc.int_quant(4))
        label = f"DiLoCo / MuLoCo int4, H = 30, {replicas} replicas"
        row(label, 200, "int4", replicas, per_step("diloco", tx, replicas), None)
    return out


def arithmetic_of(m: Model) -> list[dict[str, Any]]:
    """The same ratios from ``jc.sparseloco_ratio`` / ``jc.demo_ratio`` alone (no lowering)."""
    import jaxcomp as jc

    params = params_of(m)
    sl8, sl2 = dict(bits=1, min_size=0), dict(chunk=1024, bits=1, min_size=0)
    k = jc.demo_topk(params, 80, N, bits=3)
    d8 = jc.sparseloco_density(params, 3000, H, N, **sl8)
    d2 = jc.sparseloco_density(params, 3000, H, 2, devices=N, **sl2)
    ratios = {
        "SparseLoCo 3000x, 8 replicas: 21 of 4096": jc.sparseloco_ratio(
            params, H, N, density=21 / 4096, **sl8
        ),
        "SparseLoCo 3000x, 8 replicas: sized": jc.sparseloco_ratio(params, H, N, density=d8, **sl8),
        "SparseLoCo 3000x, 2 replicas: 47 of 1024": jc.sparseloco_ratio(
            params, H, 2, devices=N, density=188 / 4096, **sl2
        ),
        "SparseLoCo 3000x, 2 replicas: sized": jc.sparseloco_ratio(
            params, H, 2, devices=N, density=d2, **sl2
        ),
        "DeMo 80x: topk 20, 3 bits": jc.demo_ratio(params, N, topk=20, bits=3),
        "DeMo 80x: sized": jc.demo_ratio(params, N, topk=k, bits=3),
    }
    settings = {"8 replicas: sized": f"{round(d8 * 4096)} of 4096"}
    settings |= {"2 replicas: sized": f"{round(d2 * 1024)} of 1024", "DeMo 80x: sized": f"topk {k}"}
    return [
        dict(
            model=m.name,
            recipe=name,
            setting=next((v for key, v in settings.items() if name.endswith(key)), ""),
            ratio=r,
        )
        for name, r in ratios.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(
        __doc__,
        writes="budget_bytes.json (--quick: budget_bytes_quick.json)",
        takes="2 to 7 minutes a model on 2 CPU cores shared at a load of 8-17 (lowering "
        "only; the 15 models: 66 minutes)",
    )
    parser.add_argument("--quick", action="store_true", help="two models")
    parser.add_argument(
        "--resume", action="store_true", help="keep the models already in the file, add the rest"
    )
    args = parser.parse_args(argv)
    import json

    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(N)
    path = common.result_path("budget_bytes", args.quick)
    result = {"environment": common.environment(), "devices": N, "sync_every": H, "rows": []}
    if args.resume and path.exists():
        before = json.loads(path.read_text())
        result["rows"] = before["rows"]
        result["environment"]["resumed"] = before["environment"]
    result["arithmetic"] = [row for m in GRID for row in arithmetic_of(m)]
    done = {r["model"] for r in result["rows"]}
    for m in [m for m in (QUICK if args.quick else MODELS) if m.name not in done]:
        t0 = time.perf_counter()
        result["rows"] += rows_of(m)
        print(f"{m.name}: {time.perf_counter() - t0:.0f} s", flush=True)
        common.write_json(path, result, quiet=True)  # a bounded run keeps what finished
    common.write_json(path, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
