"""How much of a leaf a shared SparseLoCo mask ever sends, by ``mask`` and ``explore``.

``jc.sparseloco(mask="previous")`` keeps the largest magnitudes of the previous sync's merged
update, which is zero outside the last mask: without ``explore`` the mask hardly moves. This
runs the shared-mask exchange (:func:`jaxcomp._src.shared_mask.shared_mask_feedback`) on 8
CPU devices: one leaf of ``--size`` values, density 0.05, int4 values, two-phase, ``ef_decay``
0.5, ``--syncs`` syncs of ``D_i = s + 3 noise_i`` (``s`` a fixed direction of unit variance,
the persistent part of a pseudo-gradient; noise per device and sync), and records per
(``mask``, ``explore``), over ``--seeds`` seeds:

* ``ever_sent``: coordinates the merged output was ever nonzero at (of ``size``);
* ``cosine_with_s``: the cosine of the summed outputs with ``s``.

Writes ``benchmarks/results/mask_coverage.json`` (about two minutes on a loaded 2-core
host)::

    python -m benchmarks.mask_coverage [--syncs 10] [--seeds 3] [--quick]
"""

from __future__ import annotations

import statistics

from benchmarks import common

CONFIGS = (
    ("previous", 0.0),
    ("previous", 0.1),
    ("previous", 0.25),
    ("previous", 0.5),
    ("previous", 0.75),
    ("random", 0.0),
)
DENSITY, DECAY, NOISE = 0.05, 0.5, 3.0


def exchange(mask: str, explore: float, n: int):
    """The jitted exchange of one leaf over ``n`` devices: (d, memory, previous, count) ->
    (output, memory, previous, count)."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp._src.shared_mask import SharedMaskState, shared_mask_feedback

    tx = shared_mask_feedback(
        jc.int_quant(4),
        "data",
        mask=mask,
        density=DENSITY,
        ef_decay=DECAY,
        min_size=0,
        strategy="two_phase",
        explore=explore,
    )

    def step(d, e, prev, count):
        out, new = tx.update([d[0]], SharedMaskState([e[0]], [prev], count, jax.random.PRNGKey(0)))
        return out[0][None], new.memory[0][None], new.previous[0], new.count

    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    data = P("data")
    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(data, data, P(), P()), out_specs=(data, data, P(), P())
        )
    )
    return fn, jax.sharding.NamedSharding(mesh, data)


def coverage(fn, sharding, mask: str, size: int, n: int, syncs: int, seed: int) -> dict:
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    s = rng.standard_normal(size).astype(np.float32)
    memory = jax.device_put(np.zeros((n, 1, size), np.float32), sharding)
    previous = np.zeros(size, np.float32) if mask == "previous" else None
    count, ever, total = np.int32(0), np.zeros(size, bool), np.zeros(size)
    for _ in range(syncs):
        d = (s + NOISE * rng.standard_normal((n, size))).astype(np.float32)
        out, memory, previous, count = jax.block_until_ready(
            fn(jax.device_put(d, sharding), memory, previous, count)
        )
        o = np.asarray(out)[0]
        ever |= o != 0
        total += o
    cosine = float(total @ s / (np.linalg.norm(total) * np.linalg.norm(s)))
    return {"ever_sent": int(ever.sum()), "cosine_with_s": cosine}


def main(argv: list[str] | None = None) -> dict:
    parser = common.arg_parser(
        __doc__, writes="mask_coverage.json", takes="about 2 minutes on a loaded 2-core host"
    )
    parser.add_argument("--size", type=int, default=4096, help="values of the leaf")
    parser.add_argument("--syncs", type=int, default=10, help="syncs per run")
    parser.add_argument("--seeds", type=int, default=3, help="runs per configuration")
    parser.add_argument("--quick", action="store_true", help="3 syncs, 1 seed")
    args = parser.parse_args(argv)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(8)
    from jaxcomp._src.shared_mask import kept

    n = 8
    syncs, seeds = (3, 1) if args.quick else (args.syncs, args.seeds)
    records = []
    for mask, explore in CONFIGS:
        fn, sharding = exchange(mask, explore, n)
        runs = [coverage(fn, sharding, mask, args.size, n, syncs, seed) for seed in range(seeds)]
        ever = [r["ever_sent"] for r in runs]
        cos = [r["cosine_with_s"] for r in runs]
        record = {
            "mask": mask,
            "explore": explore,
            "kept_per_sync": kept(args.size, DENSITY),
            "ever_sent_mean": round(statistics.mean(ever), 1),
            "ever_sent_min": min(ever),
            "ever_sent_max": max(ever),
            "of": args.size,
            "cosine_with_s_mean": round(statistics.mean(cos), 4),
            "cosine_with_s_min": round(min(cos), 4),
            "cosine_with_s_max": round(max(cos), 4),
        }
        records.append(record)
        print(record, flush=True)
    result = {
        "environment": common.environment(),
        "devices": n,
        "syncs": syncs,
        "seeds": seeds,
        "density": DENSITY,
        "ef_decay": DECAY,
        "value_codec": "int_quant(4)",
        "strategy": "two_phase",
        "records": records,
    }
    common.write_json(common.result_path("mask_coverage", args.quick), result)
    return result


if __name__ == "__main__":
    main()
