"""What each exchange converges to: the distance to the exact optimum of a mean of quadratics.

Device ``i`` of 8 holds its own quadratic ``f_i(w) = 1/2 sum_j h_ij (w_j - c_ij)^2`` (``h`` in
[0.5, 1]: condition number 2; ``c_i`` a device offset plus noise) over leaves of 32 x 64,
2,048 and 16 values, so the minimiser of the MEAN loss is ``w* = sum_i h_i c_i / sum_i h_i``
and every device's own gradient at ``w*`` is of the order of 1 (the devices disagree). From
``w = 0``, each exchange steps ``optax.chain(exchange, optax.sgd(lr))`` (or the recipe a row
names) on the devices' gradients ``h_i (w - c_i)`` and the benchmark records
``||w - w*|| / ||w*||`` after the row's steps at each ``lr`` (one compiled scan per row, ``lr``
an argument).

With a constant ``lr``, residual error feedback keeps ``w`` ``O(lr)`` from ``w*``; unbiased
codecs without feedback stay in a noise ball ``O(sqrt(lr))``; exact exchanges reach float32's
resolution; an exchange that weights the devices wrongly converges elsewhere at every ``lr``
(Karimireddy et al. 2019, "Error feedback fixes SignSGD"; Stich et al. 2018, "Sparsified SGD
with memory"). docs/choosing-a-codec.md ("What each exchange converges to") renders the table.

Writes ``benchmarks/results/exact_optimum.json`` (about 2 minutes on 2 shared CPU cores)::

    python -m benchmarks.exact_optimum [--rows NAME ...] [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks import common

N = 8
SHAPES = {"W": (32, 64), "v": (2048,), "b": (16,)}
LRS = (0.1, 0.025)
STEPS = 800
ADAM_STEPS = 3000  # Adam's steps are about lr each: the recipes' rows run lr / 10, longer


def problem(seed: int = 0):
    """Stacked per-device curvatures ``h`` and centres ``c`` (float32) and ``w*`` (float64)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    h, c = {}, {}
    for k, s in SHAPES.items():
        h[k] = rng.uniform(0.5, 1.0, (N, *s)).astype(np.float32)
        offset = rng.standard_normal((N,) + (1,) * len(s))
        c[k] = (offset + rng.standard_normal((N, *s))).astype(np.float32)
    best = {k: (h[k].astype(np.float64) * c[k]).sum(0) / h[k].astype(np.float64).sum(0) for k in h}
    return h, c, best


def distance(w: dict, best: dict) -> float:
    """``||w - w*|| / ||w*||`` over every leaf: 1 at ``w = 0``."""
    import numpy as np

    num = sum(np.sum((np.asarray(w[k], np.float64) - best[k]) ** 2) for k in best)
    den = sum(np.sum(best[k] ** 2) for k in best)
    return float(np.sqrt(num / den))


def _ca(codec, **options) -> Callable:
    import jaxcomp as jc

    return lambda lr: _sgd(jc.compressed_allreduce(codec, "data", **options), lr)


def _sgd(exchange, lr, scale: float = 1.0):
    import optax

    return optax.chain(exchange, optax.sgd(lr * scale))


def _adam(recipe: Callable, codec=None) -> Callable:
    """``recipe`` (``jc.onebit_adam`` frozen at step 50, or ``jc.zero_one_adam`` at 100, its
    warm-up 50) at a tenth of the row's lr, its defaults but ``codec`` (None: its own)."""
    import jaxcomp as jc

    freeze = {"freeze_step": 50} if recipe is jc.onebit_adam else {"var_freeze_step": 100}
    codec = {} if codec is None else {"codec": codec}
    return lambda lr: recipe(lr / 10, "data", **freeze, **codec)


def rows() -> dict[str, tuple[Callable, int]]:
    """Row name -> (``make(lr)``: the transform at ``lr``, steps): the main table's rows."""
    import jax.numpy as jnp
    import optax

    import jaxcomp as jc

    ef21 = {"error_feedback": "ef21"}

    def dgc(momentum, masking=True, sample_ratio=0.01):
        kw = {"warmup_steps": 0, "momentum": momentum, "momentum_masking": masking}
        kw["sample_ratio"] = sample_ratio
        return lambda lr: _sgd(jc.dgc(0.05, "data", **kw), lr, 0.1 if momentum else 1.0)

    return {
        "identity": (_ca(jc.identity()), STEPS),
        "powersgd(2)": (
            lambda lr: _sgd(jc.powersgd(2, "data", start_step=0, min_size=0), lr),
            STEPS,
        ),
        "delayed(optax.sgd, axis_name)": (
            lambda lr: jc.delayed(optax.sgd(lr), axis_name="data"),
            STEPS,
        ),
        "random_k(0.05) allgather": (_ca(jc.random_k(0.05), strategy="allgather"), STEPS),
        "random_k(0.05) allreduce": (_ca(jc.random_k(0.05), strategy="allreduce"), STEPS),
        "random_k(0.05) two_phase": (_ca(jc.random_k(0.05), strategy="two_phase"), STEPS),
        "int8": (_ca(jc.int_quant(8), strategy="allgather"), STEPS),
        "bf16 cast": (_ca(jc.cast(jnp.bfloat16), strategy="allgather"), STEPS),
        "int4": (_ca(jc.int_quant(4), strategy="allgather"), STEPS),
        "sign allgather": (_ca(jc.sign(), strategy="allgather"), STEPS),
        "sign two_phase": (_ca(jc.sign(), strategy="two_phase"), STEPS),
        "sign buckets of 1 KB": (_ca(jc.sign(), bucket_bytes=1024), STEPS),
        "threshold(0.5, 256)": (_ca(jc.threshold(0.5, 256), strategy="allgather"), STEPS),
        "top_k(0.05) allgather": (_ca(jc.top_k(0.05), strategy="allgather"), STEPS),
        "top_k(0.05) two_phase": (_ca(jc.top_k(0.05), strategy="two_phase"), STEPS),
        "dgc(0.05) momentum 0": (dgc(0.0), STEPS),
        "dgc(0.05) momentum 0.9, masking off, exact top-k, sgd(lr / 10)": (
            dgc(0.9, False, None),
            4 * STEPS,
        ),
        "dgc(0.05) momentum 0.9, masking on, exact top-k, sgd(lr / 10)": (
            dgc(0.9, True, None),
            4 * STEPS,
        ),
        "qsgd()": (_ca(jc.qsgd(), strategy="allgather"), STEPS),
        "natural()": (_ca(jc.natural(), strategy="allgather"), STEPS),
        "terngrad()": (_ca(jc.terngrad(), strategy="allgather"), STEPS),
        "fp16 cast (scaled)": (_ca(jc.cast(jnp.float16), strategy="allgather"), STEPS),
        "ef21 top_k(0.05)": (_ca(jc.top_k(0.05), **ef21), STEPS),
        "ef21 sign allgather": (_ca(jc.sign(), strategy="allgather", **ef21), 2 * STEPS),
        "ef21 sign two_phase": (_ca(jc.sign(), strategy="two_phase", **ef21), STEPS),
        "threshold_2bit(5)": (_ca(jc.threshold_2bit(5.0), strategy="allgather"), STEPS),
        "threshold_2bit(0.5)": (_ca(jc.threshold_2bit(0.5), strategy="allgather"), STEPS),
        "majority_vote": (_ca(jc.sign(), strategy="majority_vote"), STEPS),
        "onebit_adam(identity), lr / 10": (_adam(jc.onebit_adam, jc.identity()), ADAM_STEPS),
        "onebit_adam, lr / 10": (_adam(jc.onebit_adam), ADAM_STEPS),
        "zero_one_adam(identity), lr / 10": (_adam(jc.zero_one_adam, jc.identity()), ADAM_STEPS),
        "zero_one_adam, lr / 10": (_adam(jc.zero_one_adam), ADAM_STEPS),
    }


def descend(make: Callable, steps: int, lrs: tuple[float, ...], data) -> list[dict]:
    """The params after ``steps`` of ``make(lr)`` from ``w = 0`` for each ``lr`` (one compiled
    program); every device must hold the same params."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    h, c, _ = data
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    w0 = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    w0 = jax.device_put(w0, NamedSharding(mesh, P()))
    state = jc.sharded_init(make(lrs[0]), w0, mesh, "data")
    specs = jc.state_specs(state, "data")

    def run(w, s, h, c, lr):
        tx = make(lr)
        h, c = jax.tree.map(lambda a: a[0], h), jax.tree.map(lambda a: a[0], c)
        w = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), w)

        def step(carry, _):
            w, s = carry
            u, s = tx.update(jax.tree.map(lambda hh, ww, cc: hh * (ww - cc), h, w, c), s, w)
            return (optax.apply_updates(w, u), s), None

        (w, _), _ = jax.lax.scan(step, (w, s), None, length=steps)
        return jax.tree.map(lambda a: a[None], w)

    spec = P("data")
    in_specs = (P(), specs, spec, spec, P())
    f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=spec))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))  # noqa: E731
    outs = []
    for lr in lrs:
        out = jax.block_until_ready(f(w0, state, put(h), put(c), jnp.float32(lr)))
        out = {k: np.asarray(v) for k, v in out.items()}
        for k, v in out.items():
            if not np.array_equal(v, np.broadcast_to(v[0], v.shape)):
                raise AssertionError(f"{k}: the devices' params differ")
        outs.append({k: v[0] for k, v in out.items()})
    return outs


def measure(name: str, make: Callable, steps: int, lrs: tuple[float, ...], data) -> dict:
    """One row: the distance to ``w*`` after ``steps`` at each ``lr``."""
    start = time.perf_counter()
    far = [distance(w, data[2]) for w in descend(make, steps, lrs, data)]
    row = {"exchange": name, "steps": steps}
    row |= {f"lr {lr:g}": float(f"{d:.3g}") for lr, d in zip(lrs, far, strict=True)}
    print(row, f"{time.perf_counter() - start:.1f} s", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(
        __doc__,
        writes="exact_optimum.json (--quick: exact_optimum_quick.json)",
        takes="about 2 minutes on 2 shared CPU cores (--quick: seconds)",
    )
    parser.add_argument("--rows", nargs="+", help="only these rows (names as in the table)")
    parser.add_argument("--quick", action="store_true", help="identity and int8, 50 steps")
    args = parser.parse_args(argv)
    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(N)
    table = rows()
    names = args.rows or (["identity", "int8"] if args.quick else list(table))
    unknown = sorted(set(names) - set(table))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; known: {sorted(table)}")
    data = problem()
    records = []
    for name in names:
        make, steps = table[name]
        records.append(measure(name, make, 50 if args.quick else steps, LRS, data))
    result = {"environment": common.environment(), "devices": N, "shapes": SHAPES}
    result["lrs"], result["rows"] = list(LRS), records
    common.write_json(common.result_path("exact_optimum", args.quick), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
