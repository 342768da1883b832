"""The hot path's parts, each alone: one jitted program per part of an update, against a copy.

Where does one ``tx.update`` of ``benchmarks/hot_path.py`` spend its time? Each part of the
sign, int8 and unscaled fp16 updates with residual feedback (the scale, the encoding, the
decoding, the new memory, the collective over one device) is jitted alone on one flat
float32 array of ``--size`` values (``g`` the gradient, ``e`` the memory, both normal
random), a donated output where the update writes in place, and timed against a donated
copy (``g * 1.0001``) in the same process, the calls interleaved (each round every program
once, the order turned by one each round) so that a shared host's load falls on each alike.
Each row records the median wall and CPU time (``time.process_time``, every thread) per
call, in copies of the copy's, the minor page faults per call (``getrusage``: pages touched
for the first time since they were mapped, that is fresh buffers), ``hlo_copies`` (the
bytes the compiled program's instructions read and write over a copy's, as
``hot_path.hlo_traffic`` counts them: deterministic) and ``same_bits``: whether the part's
output equals, bit for bit, that of the row it is an alternative formulation of.

Alternative formulations (rows with ``alternative_to``) are timed beside the library's: the
f32 -> f16 rounding done by integer arithmetic on the bit patterns, the int8 codes written
as bytes and bitcast to words, and sign's payload as encoded before 2026-11-27 (the signs
and the scale in two passes, not one variadic reduce). Writes
``benchmarks/results/hot_path_parts[_LABEL].json``::

    python -m benchmarks.hot_path_parts                           # the default allocator
    python -m benchmarks.hot_path_parts --reuse-buffers --label reuse   # freed memory reused
    python -m benchmarks.hot_path_parts --parts copy "fp16 encode" --reps 21
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

from benchmarks import common

SIZE = 25_165_824  # 24 * 2^20 values (the hot path's MLP holds 25.2M): whole int8 blocks


def _f16_by_bits(x):
    """``x.astype(float16)`` (round to nearest even) by integer arithmetic on float32 bits:
    the normal range rebiased and rounded by adding ``0xFFF`` plus the kept LSB, values below
    fp16's normal range rounded by the float adder (``|x| + 0.5``: its ulp is fp16's
    subnormal step), overflow to inf, inf and NaN (quieted, payload truncated) kept."""
    import jax
    import jax.numpy as jnp

    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = (b >> 16) & 0x8000
    a = b & 0x7FFFFFFF
    m = a - jnp.uint32(112 << 23)  # exponent 127 -> 15
    normal = (m + 0xFFF + ((m >> 13) & 1)) >> 13
    normal = jnp.minimum(normal, 0x7C00)  # past 65504 + half an ulp: inf
    tiny = jax.lax.bitcast_convert_type(jnp.abs(x) + 0.5, jnp.uint32) - 0x3F000000
    special = 0x7C00 | jnp.where(a > 0x7F800000, 0x200 | ((a >> 13) & 0x3FF), 0)
    h = jnp.where(a >= 0x7F800000, special, jnp.where(a < 0x38800000, tiny, normal))
    return jax.lax.bitcast_convert_type((h | sign).astype(jnp.uint16), jnp.float16)


def _f16_saturating_by_bits(x):
    """The unscaled fp16 codec's encoding (finite values clipped to +-65504, inf and NaN
    kept) with the rounding of :func:`_f16_by_bits`."""
    import jax.numpy as jnp

    big = 65504.0
    return _f16_by_bits(jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x))


def _int8_words_from_bytes(x):
    """int8's payload with its codes written as bytes and bitcast to uint32 words
    (little-endian: code ``i`` in byte ``i % 4`` of word ``i // 4``, the layout of
    ``packing.pack``), not packed by shifts and a sum."""
    import jax
    import jax.numpy as jnp

    from jaxcomp._src.codecs import base, quantize

    xb = base.blocks(x, 256)
    absmax = base.max_abs(xb)
    code = quantize.rounded_codes(quantize.in_levels(xb, absmax, 127), 127)
    words = jax.lax.bitcast_convert_type(code.astype(jnp.uint8).reshape(-1, 4), jnp.uint32)
    return words, absmax / 127


def _sign_encode_apart(x):
    """``jc.sign()``'s payload as it was encoded before 2026-11-27: the packed signs and the
    scale ``mean |x|`` (:func:`~jaxcomp._src.codecs.base.mean_abs`) in two passes."""
    import jax.numpy as jnp

    from jaxcomp._src.codecs import base, packing

    d = x.shape[0]
    signs = packing.pack((x < 0).astype(jnp.uint32), 1)
    return signs, base.mean_abs(base.blocks(x, d), jnp.full((1,), d))


def parts(d: int) -> dict[str, tuple[str, Callable, Callable, tuple, str | None]]:
    """name -> (codec, program, its arguments' maker, donated arguments, the row it is an
    alternative to or None)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp._src.codecs import base

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))

    def one_device(f):  # a collective over a 1-device axis, as the hot path's update runs it
        return jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)

    def g():
        return jax.random.normal(jax.random.PRNGKey(0), (d,), jnp.float32)

    def e():
        return 0.01 * jax.random.normal(jax.random.PRNGKey(1), (d,), jnp.float32)

    fp16, int8, sign = jc.cast("fp16", scaled=False), jc.int_quant(8), jc.sign()

    def payload(codec):
        return lambda: (g(), e(), codec.encode(g() + e()))

    def memory(codec):  # the new memory, written over the donated old one
        return lambda g, e, p: (g + e) - codec.decode(p, d)

    def decode(codec):  # the mean, written over the donated gradient
        return lambda g, e, p: codec.decode(p, d)

    return {
        "copy": ("-", lambda g: g * 1.0001, lambda: (g(),), (0,), None),
        "g + e": ("-", lambda g, e: g + e, lambda: (g(), e()), (0,), None),
        "fp16 convert": ("fp16", lambda g: g.astype(jnp.float16), lambda: (g(),), (), None),
        "fp16 convert, integer bits": (
            "fp16",
            _f16_by_bits,
            lambda: (g(),),
            (),
            "fp16 convert",
        ),
        "fp16 encode": ("fp16", lambda g, e: fp16.encode(g + e), lambda: (g(), e()), (), None),
        "fp16 encode, integer bits": (
            "fp16",
            lambda g, e: _f16_saturating_by_bits(g + e),
            lambda: (g(), e()),
            (),
            "fp16 encode",
        ),
        "fp16 all-reduce": (
            "fp16",
            one_device(lambda h: jax.lax.psum(h, "d")),
            lambda: (g().astype(jnp.float16),),
            (),
            None,
        ),
        "fp16 decode": ("fp16", decode(fp16), payload(fp16), (0,), None),
        "fp16 memory": ("fp16", memory(fp16), payload(fp16), (1,), None),
        "int8 maxima": (
            "int8",
            lambda g, e: base.max_abs(base.blocks(g + e, 256)),
            lambda: (g(), e()),
            (),
            None,
        ),
        "int8 encode": ("int8", lambda g, e: int8.encode(g + e), lambda: (g(), e()), (), None),
        "int8 encode, bytes bitcast": (
            "int8",
            lambda g, e: _int8_words_from_bytes(g + e),
            lambda: (g(), e()),
            (),
            "int8 encode",
        ),
        "int8 all-gather": (
            "int8",
            one_device(lambda w: jax.lax.all_gather(w, "d", tiled=True)),
            lambda: (int8.encode(g())[0],),
            (),
            None,
        ),
        "int8 decode": ("int8", decode(int8), payload(int8), (0,), None),
        "int8 memory": ("int8", memory(int8), payload(int8), (1,), None),
        "sign encode": ("sign", lambda g, e: sign.encode(g + e), lambda: (g(), e()), (), None),
        "sign encode, two passes": (
            "sign",
            lambda g, e: _sign_encode_apart(g + e),
            lambda: (g(), e()),
            (),
            "sign encode",
        ),
        "sign decode": ("sign", decode(sign), payload(sign), (0,), None),
        "sign memory": ("sign", memory(sign), payload(sign), (1,), None),
    }


def _same_bits(a, b) -> bool:
    import jax
    import numpy as np

    return all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def run(d: int, names: list[str], reps: int, warmup: int) -> dict:
    import jax

    from benchmarks.hot_path import hlo_traffic

    table = parts(d)
    names = ["copy", *[n for n in names if n != "copy"]]
    jitted, args, rows, outputs = {}, {}, {}, {}
    for name in names:
        codec, fn, make, donate, alternative = table[name]
        jitted[name] = jax.jit(fn, donate_argnums=donate, keep_unused=True)
        args[name] = jax.block_until_ready(make())
        compiled = jitted[name].lower(*args[name]).compile()
        rows[name] = {
            "part": name,
            "codec": codec,
            "alternative_to": alternative,
            "hlo_copies": hlo_traffic(compiled.as_text()) / (8 * d),
            "temp_copies": compiled.memory_analysis().temp_size_in_bytes / (4 * d),
        }
        if not donate:  # a donated part's output is its next input: compared once, below
            outputs[name] = jax.block_until_ready(jitted[name](*args[name]))
    for name in names:
        alternative = table[name][4]
        if alternative:
            rows[name]["same_bits"] = _same_bits(outputs[name], outputs[alternative])
    outputs.clear()
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    faults = {n: [] for n in names}
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            donate = table[name][3]
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(jitted[name](*args[name]))
            t1, c1 = time.perf_counter(), time.process_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if donate:  # the output takes the donated argument's place
                args[name] = tuple(out if j in donate else a for j, a in enumerate(args[name]))
            del out
            if i >= warmup:
                wall[name].append(1e3 * (t1 - t0))
                cpu[name].append(1e3 * (c1 - c0))
                faults[name].append(f1 - f0)
    copy_ms, copy_cpu_ms = statistics.median(wall["copy"]), statistics.median(cpu["copy"])
    for name in names:
        row = rows[name]
        row["ms"] = statistics.median(wall[name])
        row["cpu_ms"] = statistics.median(cpu[name])
        row["copies"] = row["ms"] / copy_ms
        row["cpu_copies"] = row["cpu_ms"] / copy_cpu_ms
        row["faults"] = statistics.median(faults[name])
        row["fault_copies"] = row["faults"] * resource.getpagesize() / (4 * d)
    return {
        "size": d,
        "reps": reps,
        "warmup": warmup,
        "copy_ms": copy_ms,
        "copy_cpu_ms": copy_cpu_ms,
        "rows": [rows[n] for n in names],
    }


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="hot_path_parts.json (`--label L`: hot_path_parts_L.json; `--quick`: *_quick)",
        takes="3.5 minutes on the 2-core CPU host at a load of 15-20 (compiles included)",
    )
    ap.add_argument("--size", type=int, default=SIZE, help="float32 values per array")
    ap.add_argument("--reps", type=int, default=11, help="timed calls per part")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    ap.add_argument("--parts", nargs="+", default=None, metavar="PART", help="parts (None: all)")
    ap.add_argument("--label", default=None, help="write hot_path_parts_LABEL.json")
    ap.add_argument("--quick", action="store_true", help="2^20 values, 3 reps")
    ap.add_argument(
        "--reuse-buffers",
        action="store_true",
        help="jaxcomp.cpu.reuse_large_buffers(): freed memory reused, no page faults",
    )
    args = ap.parse_args(argv)
    import jaxcomp.cpu

    jaxcomp.cpu.use_cpu_devices(1)
    reuse = args.reuse_buffers and jaxcomp.cpu.reuse_large_buffers()
    size = 1 << 20 if args.quick else args.size
    if size % 1024:
        ap.error("--size must be a multiple of 1024 (whole int8 blocks and sign words)")
    known = list(parts_names())
    unknown = [p for p in args.parts or () if p not in known]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; known: {known}")
    reps = 3 if args.quick else args.reps
    data = {
        "environment": common.environment(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "label": args.label,
        "reuse_large_buffers": bool(reuse),
        **run(size, args.parts or known, reps, args.warmup),
    }
    data["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    report(data)
    name = "hot_path_parts" + (f"_{args.label}" if args.label else "")
    common.write_json(common.result_path(name, args.quick), data)
    return 0


def parts_names() -> list[str]:
    """The parts' names, in order, without building any program."""
    return [
        "copy",
        "g + e",
        "fp16 convert",
        "fp16 convert, integer bits",
        "fp16 encode",
        "fp16 encode, integer bits",
        "fp16 all-reduce",
        "fp16 decode",
        "fp16 memory",
        "int8 maxima",
        "int8 encode",
        "int8 encode, bytes bitcast",
        "int8 all-gather",
        "int8 decode",
        "int8 memory",
        "sign encode",
        "sign encode, two passes",
        "sign decode",
        "sign memory",
    ]


def report(data: dict) -> None:
    print(
        f"\n{data['size']:,} values, copy {data['copy_ms']:.2f} ms ({data['copy_cpu_ms']:.2f} ms "
        f"CPU), reuse {data['reuse_large_buffers']}, load {data['loadavg']} -> "
        f"{data['loadavg_after']}"
    )
    for r in data["rows"]:
        same = f"  same bits: {r['same_bits']}" if "same_bits" in r else ""
        print(
            f"{r['part']:28s} {r['ms']:8.2f} ms {r['copies']:6.2f} copies | CPU "
            f"{r['cpu_copies']:6.2f} copies | faults {r['fault_copies']:5.2f} copies | "
            f"HLO traffic {r['hlo_copies']:5.2f}{same}"
        )


if __name__ == "__main__":
    sys.exit(main())
