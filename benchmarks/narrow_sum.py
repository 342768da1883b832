"""Summing in a narrow float type: the error of a ring all-reduce in fp16 / bf16 against n.

A summable codec (``jc.cast("fp16", scaled=False)``, ``jc.cast("bf16")``; the scaled default
fp16 is not summable) under ``strategy="allreduce"`` is added *in its own type* by the network:
a ring all-reduce passes a partial sum from device to device, and every hop rounds it to 11
(fp16) or 8 (bf16) significant bits. This simulates it
in numpy (no devices; ``ml_dtypes`` for the types) for n = 2 .. 1024 devices, each holding
``x_i = g + noise_i`` (a shared signal and per-device noise of the same size, ``--size``
floats), and compares the relative error ``||est - mean|| / ||mean||`` against the exact
float64 mean of:

* ``allreduce``: every device sends ``cast(x_i / n)`` (pre-scaled, so a mean that fits the
  type never overflows), and the ring adds them one hop at a time, rounding to the type;
* ``two_phase``: the owner of a chunk adds the n decoded ``cast(x_i)`` in float32, divides
  by n and re-casts the mean (a second rounding): the same bytes as ``allreduce``;
* ``allgather``: every device adds the n decoded payloads in float32 (no second rounding;
  ``(n - 1)`` payloads on the wire);
* ``one rounding``: ``cast(mean)``, the floor of any scheme that ends in the type.

``accurate(n)``: the ring's error stays within ``--factor`` (2) times two-phase's. The largest
such n per type is what ``jc.choose_strategy``'s ``auto`` uses
(``jaxcomp._src.cost.RING_SUM_MAX_DEVICES``): above it, a summable narrow codec goes
``two_phase``, which accumulates in float32 at the same bytes. Also recorded: where the sum
of ``cast(x_i)`` without the pre-scaling overflows (every value 10000 in fp16: from n = 7).

Writes ``benchmarks/results/narrow_sum.json`` and ``narrow_sum.png`` (a few seconds)::

    python -m benchmarks.narrow_sum [--size 8192] [--seeds 3] [--factor 2] [--quick]
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from benchmarks import common

TYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NS = tuple(2**k for k in range(1, 11))  # 2 .. 1024


def device_values(n: int, size: int, seed: int) -> np.ndarray:
    """``x_i = g + noise_i``, float32 ``[n, size]``: signal and per-device noise alike."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(size)
    return (signal[None] + rng.standard_normal((n, size))).astype(np.float32)


def ring_sum(parts: np.ndarray, dtype) -> np.ndarray:
    """The reduce-scatter of a ring all-reduce in ``dtype``: each hop adds one device's part
    to the partial sum and rounds it to ``dtype`` (float32 addition, as NCCL's)."""
    total = parts[0].astype(dtype)
    for part in parts[1:]:
        total = (total.astype(np.float32) + part.astype(np.float32)).astype(dtype)
    return total.astype(np.float32)


def estimates(x: np.ndarray, dtype) -> dict[str, np.ndarray]:
    """The mean of the rows of ``x`` as each strategy computes it."""
    n = x.shape[0]
    decoded = x.astype(dtype).astype(np.float32)
    f32_mean = decoded.sum(0, dtype=np.float32) / np.float32(n)
    return {
        "allreduce": ring_sum((x * np.float32(1.0 / n)).astype(dtype), dtype),
        "two_phase": f32_mean.astype(dtype).astype(np.float32),
        "allgather": f32_mean,
        "one_rounding": x.astype(np.float64).mean(0).astype(dtype).astype(np.float32),
    }


def relative_errors(n: int, dtype, size: int, seeds: int) -> dict[str, float]:
    """Mean over seeds of ``||est - mean|| / ||mean||`` per strategy."""
    errs: dict[str, list[float]] = {}
    for seed in range(seeds):
        x = device_values(n, size, seed)
        exact = x.astype(np.float64).mean(0)
        for name, est in estimates(x, dtype).items():
            rel = np.linalg.norm(est - exact) / np.linalg.norm(exact)
            errs.setdefault(name, []).append(float(rel))
    return {k: float(np.mean(v)) for k, v in errs.items()}


def accurate_up_to(rows: dict[int, dict[str, float]], factor: float) -> int:
    """The largest n of ``rows`` up to which the ring stays within ``factor`` x two-phase."""
    best = 1
    for n in sorted(rows):
        if rows[n]["allreduce"] > factor * rows[n]["two_phase"]:
            break
        best = n
    return best


def overflow_devices(value: float, dtype) -> int:
    """The smallest n at which summing ``cast(value)`` n times in ``dtype`` (no pre-scaling)
    leaves the type's range, though the mean is ``value``."""
    return int(np.floor(float(ml_dtypes.finfo(dtype).max) / value)) + 1


def main(argv: list[str] | None = None) -> dict:
    parser = common.arg_parser(
        __doc__,
        writes="narrow_sum.json and narrow_sum.png (--quick: narrow_sum_quick.*)",
        takes="seconds (numpy only, no devices)",
    )
    parser.add_argument("--size", type=int, default=8192, help="floats per device")
    parser.add_argument("--seeds", type=int, default=3, help="independent draws per n")
    parser.add_argument("--factor", type=float, default=2.0, help="ring error / two-phase's")
    parser.add_argument("--quick", action="store_true", help="size 1024, one seed, n <= 64")
    args = parser.parse_args(argv)
    size, seeds, ns = args.size, args.seeds, NS
    if args.quick:
        size, seeds, ns = 1024, 1, tuple(n for n in NS if n <= 64)
    result: dict = {"environment": common.environment(), "size": size, "seeds": seeds}
    result["factor"] = args.factor
    for name, dtype in TYPES.items():
        rows = {n: relative_errors(n, dtype, size, seeds) for n in ns}
        result[name] = {
            "errors": {str(n): r for n, r in rows.items()},
            "ring_accurate_up_to": accurate_up_to(rows, args.factor),
            "overflow_devices_at_10000": overflow_devices(1e4, dtype),
        }
        for n, r in rows.items():
            print(name, n, {k: f"{v:.2e}" for k, v in r.items()})
        print(name, "ring accurate up to n =", result[name]["ring_accurate_up_to"])
    common.write_json(common.result_path("narrow_sum", args.quick), result)
    _plot(result, ns, args.quick)
    return result


def _plot(result: dict, ns: tuple, quick: bool) -> None:
    def draw(ax):
        for name, style in (("float16", "-"), ("bfloat16", "--")):
            errors = result[name]["errors"]
            for strategy in ("allreduce", "two_phase", "one_rounding"):
                ys = [errors[str(n)][strategy] for n in ns]
                ax.plot(ns, ys, style, marker="o", label=f"{name} {strategy}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices n")
        ax.set_ylabel("relative error of the mean")
        ax.legend(fontsize=8)

    common.plot(common.result_path("narrow_sum", quick, "png"), draw, "Summing in fp16 / bf16")


if __name__ == "__main__":
    main()
