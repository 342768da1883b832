"""The hot path's cheaper formulations give the same bits as the ones they replaced.

int8 codes rounded by the float32 adder (``quantize.rounded_codes``), 1-bit codes packed in
two stages (``packing.pack``), the narrow-float finiteness check folded before its reduce
(``base.all_finite``), and large payload arrays travelling in buckets of their own
(``buckets._plan``): each against the formula it replaced, on edge values (+-0, subnormals,
ties, the largest codes, inf, NaN, all-zero and non-finite blocks). One compiled program per
formula, shared by the asserts.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp._src import buckets
from jaxcomp._src.codecs import packing, quantize
from jaxcomp._src.codecs.base import all_finite, max_abs

TINY = np.float32(1e-42)  # a float32 subnormal
#: Normal, but ``L / max|x_B|`` overflows to inf for int8 and int4 (below ``L / F32_MAX``).
SMALL = np.float32(1.5e-38)


def _old_codes(y, levels):
    """The formula ``rounded_codes`` replaced."""
    q = jnp.clip(jnp.nan_to_num(jnp.round(y)), -levels, levels)
    return (q + levels).astype(jnp.uint32)


def _old_encode(x, bits, block):
    """IntQuant(bits, block).encode before ``rounded_codes`` (deterministic, bits >= 2)."""
    levels = 2 ** (bits - 1) - 1
    d = x.shape[0]
    xb = jnp.pad(x, (0, -d % block)).reshape(-1, block)
    absmax = max_abs(xb)
    # The block's place on the levels as the codec forms it (``in_levels``: int2's blocks
    # above 2^126 scaled by 2^-64 first, tests/test_overflow_guards.py): only the rounding
    # that ``rounded_codes`` replaced is the old formula here.
    code = _old_codes(quantize.in_levels(xb, absmax, levels), levels)
    return _old_pack(code.reshape(-1)[:d], bits), absmax / levels


def _old_pack(codes, bits):
    """``packing.pack`` as one reduce of shifted codes (its formula before the two stages)."""
    per = 32 // bits
    n = -(-codes.shape[0] // per)
    c = jnp.pad(codes.astype(jnp.uint32), (0, n * per - codes.shape[0])).reshape(n, per)
    return jnp.sum(c << (jnp.arange(per, dtype=jnp.uint32) * bits), axis=1, dtype=jnp.uint32)


def _edge_vector():
    """Blocks of 64: edge values, an all-zero block, a subnormal-only block, a block of normal
    values so small that ``L / max|x_B|`` overflows, one with inf, one with NaN, one with
    -inf, random values; and a tail of 37."""
    rng = np.random.default_rng(0)
    edges = np.array(
        [0.0, -0.0, TINY, -TINY, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, 127, -127]
        + [65504, -65504, 1e30, -1e30, 3.4e38, -3.4e38],
        np.float32,
    )
    blocks = [
        np.resize(edges, 64),
        np.zeros(64, np.float32),
        np.full(64, TINY, np.float32) * np.sign(rng.standard_normal(64)).astype(np.float32),
        np.linspace(-SMALL, SMALL, 64, dtype=np.float32),
        np.where(np.arange(64) == 3, np.inf, rng.standard_normal(64)).astype(np.float32),
        np.where(np.arange(64) == 9, np.nan, rng.standard_normal(64)).astype(np.float32),
        np.where(np.arange(64) == 0, -np.inf, rng.standard_normal(64)).astype(np.float32),
        (rng.standard_normal(64 * 20) * 10.0 ** rng.integers(-6, 6, 64 * 20)).astype(np.float32),
        rng.standard_normal(37).astype(np.float32),
    ]
    return jnp.asarray(np.concatenate(blocks))


@functools.cache
def _int_quant_pairs():
    """Per bits: (new words, old words, new scales, old scales) of the edge vector, and
    (new, old) codes of ties and of values beside the largest code, all in one program."""
    x = _edge_vector()
    ties = jnp.asarray(np.arange(-130, 130, 0.25, dtype=np.float32))

    @jax.jit
    def run(x, ties):
        out = {}
        for bits in (2, 4, 8):
            new = jc.int_quant(bits, 64).encode(x)
            old = _old_encode(x, bits, 64)
            levels = 2 ** (bits - 1) - 1
            y = jnp.clip(ties, -levels - 0.49, levels + 0.49)
            tail = [jnp.inf, -jnp.inf, jnp.nan, -0.0, 0.0, TINY, -TINY]
            y = jnp.concatenate([y, jnp.array(tail, jnp.float32)])
            out[bits] = (*new, *old, quantize.rounded_codes(y, levels), _old_codes(y, levels))
        return out

    return jax.device_get(run(x, ties))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_int_quant_codes_bit_exact(bits):
    words, scale, old_words, old_scale, codes, old_codes = _int_quant_pairs()[bits]
    np.testing.assert_array_equal(words, old_words)
    np.testing.assert_array_equal(scale.view(np.uint32), old_scale.view(np.uint32))
    np.testing.assert_array_equal(codes, old_codes)
    levels = 2 ** (bits - 1) - 1
    # Ties to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2 (codes are offset by L).
    assert codes.max() == 2 * levels and codes.min() == 0
    # +-inf saturate; NaN, +-0, +-subnormal -> 0.
    np.testing.assert_array_equal(codes[-7:], [2 * levels, 0] + [levels] * 5)


@functools.cache
def _sign_pairs():
    rng = np.random.default_rng(1)
    sizes = (1, 31, 32, 33, 255, 4096 + 7)
    codes = [jnp.asarray(rng.integers(0, 2, d).astype(np.uint32)) for d in sizes]
    x = _edge_vector()

    @jax.jit
    def run(codes, x):
        pairs = [(packing.pack(c, 1), _old_pack(c, 1)) for c in codes]
        words = jc.sign().encode(x)[0]
        return pairs, (words, _old_pack((x < 0).astype(jnp.uint32), 1))

    return jax.device_get(run(codes, x))


def test_one_bit_pack_bit_exact():
    pairs, (words, old) = _sign_pairs()
    for new, ref in pairs:
        np.testing.assert_array_equal(new, ref)
    np.testing.assert_array_equal(words, old)
    assert words.dtype == np.uint32 and words.shape == (-(-_edge_vector().shape[0] // 32),)


@functools.cache
def _finite_flags():
    """(all_finite, all(isfinite)) for fp16, bf16 and both fp8 arrays (float8_e4m3fn has no
    inf: its largest value must count as finite), no whole 256-value row (255),
    a row and a tail (257), 8 rows and a tail (2051); clean, and with a NaN, +inf or -inf in
    a row (first value) or in the tail (last value)."""
    cases = []  # built in numpy: no eager jax op (each would compile a program)
    for dtype in (np.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2):
        top = float(jnp.finfo(dtype).max)
        for d in (255, 257, 8 * 256 + 3):
            batch = np.repeat(np.linspace(-top, top, d)[None], 7, axis=0)
            for i, (bad, at) in enumerate(
                (bad, at) for bad in (np.nan, np.inf, -np.inf) for at in (0, -1)
            ):
                batch[i + 1, at] = bad
            cases.append(jnp.asarray(batch.astype(dtype)))
    run = jax.jit(
        lambda xs: jnp.concatenate(
            [jnp.stack([jax.vmap(all_finite)(x), jnp.all(jnp.isfinite(x), axis=1)], 1) for x in xs]
        )
    )
    return np.asarray(run(cases))


def test_all_finite_matches_isfinite():
    flags = _finite_flags()
    assert flags.shape == (4 * 3 * 7, 2)
    np.testing.assert_array_equal(flags[:, 0], flags[:, 1])
    assert flags[:, 0].sum() == 12  # the clean arrays only: 4 dtypes x 3 sizes
    assert bool(all_finite(jnp.zeros((0, 3), jnp.float16)))  # empty: True, as all() is


def test_large_payload_arrays_travel_alone():
    """Arrays of at least bucket_bytes / 16 are buckets of their own (no concatenation
    copies them); smaller ones of one dtype share buckets; bucket_bytes=1: all alone."""
    arrays = [
        jax.ShapeDtypeStruct((4_194_304,), jnp.uint32),  # 16 MiB: alone
        jax.ShapeDtypeStruct((1024,), jnp.uint32),
        jax.ShapeDtypeStruct((16,), jnp.float32),
        jax.ShapeDtypeStruct((524_288,), jnp.uint32),  # exactly 2 MiB: alone
        jax.ShapeDtypeStruct((524_287,), jnp.uint32),  # 4 bytes less: shares
        jax.ShapeDtypeStruct((4,), jnp.float32),
    ]
    plan = buckets._plan(arrays, 0, buckets.BUCKET_BYTES)
    assert sorted(map(sorted, plan)) == [[0], [1, 4], [2, 5], [3]]
    assert sorted(map(sorted, buckets._plan(arrays, 0, 1))) == [[i] for i in range(6)]


def test_hot_path_op_names_parsed():
    """``hot_path --ops`` names each profiled thunk after an entry instruction of the
    compiled program: its shape (a tuple too) and the jax operation it came from."""
    from benchmarks import hot_path
    from benchmarks.hot_path import entry_instructions

    text = (
        jax.jit(lambda a, b: (a * b + 1.0, jnp.sum(a)))
        .lower(jnp.ones(64), jnp.ones(64))
        .compile()
        .as_text()
    )
    found = entry_instructions(text)
    shapes = {v["shape"] for v in found.values()}
    assert "f32[64]" in shapes and any(s.startswith("(f32[64]") for s in shapes)
    assert any(v["op_name"].endswith("/add") for v in found.values())
    assert any(not v["op_name"] for v in found.values())  # the ROOT tuple: no metadata, kept
    # hlo_traffic: each instruction's output and operands, views moving nothing
    double = jax.jit(lambda a: a * 2.0 + 1.0, donate_argnums=0).lower(jnp.ones(1000)).compile()
    assert hot_path.hlo_traffic(double.as_text()) == 8000  # read 4000 bytes, write 4000
    # an operand read only through a slice counts as the slice: a * 2 and a[0] + b[0]
    # (read 4000 + 4 + 4 bytes, write 4000 + 4), not as a second read of all of a and b
    sliced = jax.jit(lambda a, b: (a * 2.0, a[0] + b[0])).lower(jnp.ones(1000), jnp.ones(1000))
    assert hot_path.hlo_traffic(sliced.compile().as_text()) == 8012


def _loops_wrapped_in_calls(hlo_text: str) -> str:
    """The module with each ``while`` moved into a computation of its own that a ``call``
    runs, as jaxlib 0.12's XLA:CPU does (``xla_cpu_small_call``); the loops are unchanged."""
    lines, wrappers = [], []
    loop = re.compile(r"(\s*(?:ROOT )?)%(\S+) = (.*?) while\((%[\w.\-]+)\)(.*)$")
    for line in hlo_text.splitlines():
        m = loop.match(line)
        if not m:
            lines.append(line)
            continue
        indent, name, shape, operand, rest = m.groups()
        lines.append(
            f"{indent}%{name} = {shape} call({operand}), to_apply=%{name}.wrap, "
            'frontend_attributes={xla_cpu_small_call="true"}'
        )
        wrappers.append(
            f"%{name}.wrap (p: {shape}) -> {shape} {{\n  %p.{name} = {shape} parameter(0)\n"
            f"  ROOT %{name}.inner = {shape} while(%p.{name}){rest}\n}}\n"
        )
    text = "\n".join(lines)
    return text.replace("\nENTRY", "\n" + "\n".join(wrappers) + "\nENTRY", 1)


def test_hlo_traffic_counts_a_loop_inside_a_call():
    """A loop of 4 trips, each reading a quarter of ``x`` (2 MiB, above the loop's cache
    size: its slices are counted) and writing it in place into a zeroed buffer: 2 MiB
    written, then 4 x (512 KiB read + 512 KiB written), whether the loop sits in the entry
    (jaxlib 0.10) or in a ``call`` that XLA:CPU wraps around it (``xla_cpu_small_call``,
    jaxlib 0.12), and the same with each loop moved into one more call."""
    from benchmarks.hot_path import LOOP_CACHE_BYTES, hlo_traffic

    d, trips = 1 << 19, 4
    chunk = d // trips

    def scaled_in_chunks(x):
        def body(i, out):
            part = jax.lax.dynamic_slice(x, (i * chunk,), (chunk,))
            return jax.lax.dynamic_update_slice(out, part * 2.0 + 1.0, (i * chunk,))

        return jax.lax.fori_loop(0, trips, body, jnp.zeros_like(x))

    text = jax.jit(scaled_in_chunks).lower(jnp.ones(d)).compile().as_text()
    assert 4 * d > LOOP_CACHE_BYTES  # x and the output are not taken to be in cache
    wrapped = _loops_wrapped_in_calls(text)
    assert wrapped.count(" call(") == text.count(" call(") + text.count(" while(") >= 1
    # the zeros (2 MiB written, 4 bytes of the f32 zero read), the loop counter's copy (an
    # s32 read and written), then each trip's slice read and written
    expected = 4 * d + 4 + 8 + trips * 2 * 4 * chunk
    assert hlo_traffic(text) == hlo_traffic(wrapped) == expected


def test_hot_path_settings_parsed():
    """``hot_path --settings``: 'default' and 'reuse' set no variable; ``VAR=VALUE`` pairs
    (comma-separated) become the child process's environment; anything else is refused."""
    from benchmarks.hot_path import main, setting_env

    assert setting_env("default") == {} and setting_env("reuse") == {}
    assert setting_env("GLIBC_TUNABLES=glibc.malloc.hugetlb=1") == {
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"
    }
    assert setting_env("MALLOC_MMAP_MAX_=0,MALLOC_TRIM_THRESHOLD_=2147483647") == {
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": "2147483647",
    }
    assert setting_env("LD_PRELOAD=/lib/je.so,MALLOC_CONF=a:0,b:-1") == {
        "LD_PRELOAD": "/lib/je.so",
        "MALLOC_CONF": "a:0,b:-1",
    }
    for bad in ("hugetlb", "=1", "glibc=1"):
        with pytest.raises(ValueError, match=r"neither 'default', 'reuse' nor \[NAME:\]VAR=VALUE"):
            setting_env(bad)
    with pytest.raises(SystemExit):  # argparse's error, before any jax work
        main(["--quick", "--settings", "default", "hugetlb"])


def test_hot_path_compile_options_parsed():
    """``hot_path --compile-options``: 'default' compiles with none; ``NAME:option=value``
    pairs become ``jax.jit``'s ``compiler_options`` (true/false as bools, digits as ints,
    else text); an ``XLA_FLAGS`` setting keeps its flags, spaces and commas included."""
    from benchmarks.hot_path import main, parse_compile_options, setting_env, setting_name

    assert parse_compile_options("default") == ("default", {})
    spec = "vw:xla_cpu_prefer_vector_width=512,xla_cpu_enable_fast_math=false,x=a,b"
    assert parse_compile_options(spec.replace(",b", "")) == (
        "vw",
        {"xla_cpu_prefer_vector_width": 512, "xla_cpu_enable_fast_math": False, "x": "a"},
    )
    for bad in ("vw512", "vw:", ":a=1", "vw:=1", spec):
        with pytest.raises(ValueError, match="--compile-options"):
            parse_compile_options(bad)
    with pytest.raises(SystemExit):  # argparse's error, before any jax work
        main(["--quick", "--compile-options", "default", "vw512"])
    flags = "x:XLA_FLAGS=--xla_a=1 --xla_b=c,d"
    assert setting_env(flags) == {"XLA_FLAGS": "--xla_a=1 --xla_b=c,d"}
    assert setting_name(flags) == "x"


def test_max_abs_bit_exact():
    """``max_abs`` reduces the int32 bits of ``|x|``: the same floats as ``max(|x|)`` per row
    (+-0, subnormals, the largest float, inf), NaN in a row with a NaN, 0 for a zero row."""
    big = np.finfo(np.float32).max
    rows = np.array(
        [
            [-0.0, 0.0] * 32,
            [TINY, -TINY] * 32,
            [1.0, -2.5, big, -big] * 16,
            [np.inf, 1.0, -np.inf, 3.0] * 16,
            [np.nan, 1.0, np.inf, -np.nan] * 16,
            [0.0] * 63 + [-SMALL],
        ],
        np.float32,
    )
    xb = np.concatenate([rows, np.random.default_rng(0).standard_normal((4, 64))]).astype(
        np.float32
    )
    got, want = jax.jit(lambda a: (max_abs(a), jnp.max(jnp.abs(a), axis=1)))(xb)
    got, want = np.asarray(got), np.asarray(want)
    nan = np.isnan(want)
    np.testing.assert_array_equal(nan, [False] * 4 + [True] + [False] * 5)
    np.testing.assert_array_equal(np.isnan(got), nan)
    assert got[~nan].tobytes() == want[~nan].tobytes()
    assert got[0] == 0.0 and not np.signbit(got[0]) and got[2] == big and got[5] == SMALL


def _fp16_update_temporaries():
    """Compiled temporaries of one fp16 ``tx.update`` with residual feedback on a 1-device
    mesh (a 512 x 1024 leaf, gradient and state donated), in bytes of the leaf."""
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",), axis_types=(AxisType.Explicit,))
    params = jax.device_put({"w": jnp.zeros((512, 1024))}, NamedSharding(mesh, P()))
    tx = jc.compressed_allreduce(jc.cast("fp16", scaled=False), "data", error_feedback="residual")
    state = jc.sharded_init(tx, params, mesh, "data")
    specs = jc.state_specs(state, "data")

    def body(g, s, p):
        return tx.update(jax.lax.pcast(g, "data", to="varying"), s, p)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P()), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    compiled = step.lower(params, state, params).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (4 * 512 * 1024)


def test_cast_residual_written_in_place():
    """An elementwise codec's residual ``(g + e) - C(g + e)`` is formed in the memory's shape,
    so the new memory is written over the donated one: the update keeps the donated
    gradient's copy (1) and the fp16 payload sent and received (2 x 0.5) at most, not a
    fresh memory as well (2.17 copies before)."""
    assert _fp16_update_temporaries() < 1.6
    codec = jc.cast("fp16", scaled=False)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 40)).astype(np.float32)) * 7e4
    flat = codec.decode(codec.encode(x.reshape(-1)), x.size).reshape(x.shape)
    assert np.asarray(codec.roundtrip(x)).tobytes() == np.asarray(flat).tobytes()


def test_hot_path_parts_alternatives_give_the_same_bits():
    """``benchmarks/hot_path_parts.py`` times two alternative formulations beside the
    library's: the f32 -> f16 rounding by integer arithmetic on the bit patterns, and the
    int8 codes written as bytes and bitcast to words. Each gives the bits of XLA's cast and
    of the codec on edge
    values (+-0, subnormals of both types, ties, 65504 and what rounds past it, inf, NaN with
    payloads, all-zero and non-finite blocks) and on 65,536 random float32 bit patterns."""
    from benchmarks import hot_path_parts

    rng = np.random.default_rng(0)
    edges = np.array(
        [0.0, -0.0, TINY, -TINY, 6.1e-5, 6.0e-5, 5.96e-8, 2.98e-8, 2.99e-8, 1.0, -1.0]
        + [1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65504.0, 65519.99, 65520.0, -65520.0, 3e38]
        + [np.inf, -np.inf, np.nan, -np.nan],
        np.float32,
    )
    patterns = rng.integers(0, 2**32, size=65_536, dtype=np.uint64).astype(np.uint32)
    x = np.concatenate([edges, patterns.view(np.float32)])
    x = np.concatenate([x, np.zeros(-x.size % 1024, np.float32)])

    def bits(a):
        return np.asarray(a).view(np.uint16)

    cast = jax.jit(lambda v: v.astype(jnp.float16))  # XLA's cast (numpy's differs on NaN)
    assert np.array_equal(bits(jax.jit(hot_path_parts._f16_by_bits)(x)), bits(cast(x)))
    fp16 = jc.cast("fp16", scaled=False)
    assert np.array_equal(
        bits(jax.jit(hot_path_parts._f16_saturating_by_bits)(x)), bits(jax.jit(fp16.encode)(x))
    )
    blocks = rng.standard_normal((8, 256)).astype(np.float32)
    blocks[1] = 0.0
    blocks[2, 5], blocks[3, 7], blocks[4] = np.nan, np.inf, blocks[4] * SMALL
    v = blocks.reshape(-1)
    words, scales = jax.jit(hot_path_parts._int8_words_from_bytes)(v)
    want_words, want_scales = jax.jit(jc.int_quant(8).encode)(v)
    assert np.array_equal(np.asarray(words), np.asarray(want_words))
    assert np.array_equal(
        np.asarray(scales).view(np.uint32), np.asarray(want_scales).view(np.uint32)
    )


def test_hot_path_parts_named_as_built():
    """``hot_path_parts.parts_names`` (what ``--parts`` accepts, without building programs)
    lists the programs ``parts`` builds, in order; each alternative names a part."""
    from benchmarks import hot_path_parts

    table = hot_path_parts.parts(1024)
    assert list(table) == hot_path_parts.parts_names()
    assert {row[4] for row in table.values()} - {None} <= set(table)


@pytest.mark.parametrize("d, bad", [(1000, False), (4096, False), (4096, True), (0, False)])
def test_sign_encodes_in_one_pass_with_pack_words_and_mean_abs_scales(d, bad):
    """``jc.sign()`` (scale ``"mean"``, one per vector) packs its signs and sums its scale in
    one variadic reduce (``sign.signs_and_mean_abs``): the words of ``packing.pack(x < 0,
    1)`` and the scale of ``base.mean_abs`` to 1e-6 relative (the same positive terms added in
    another order: 32 at a time, then the partial sums), on +-0, subnormals, values near
    float32's largest (the sum must not overflow), a vector of no whole words, an empty one,
    and one holding a NaN and an inf (the scale NaN). One pass: the encoding of ``g + e``
    reads each once (HLO traffic 1.05 copies of a copy's at 65,536 values; 2.14 before)."""
    from benchmarks import hot_path
    from jaxcomp._src.codecs.base import blocks, mean_abs

    rng = np.random.default_rng(d + bad)
    x = rng.standard_normal(d).astype(np.float32) * np.exp(rng.standard_normal(d) * 3)
    if d:
        x[:4] = [0.0, -0.0, TINY, -TINY]
        x[5:9] = 3e38  # a sum of these overflows float32; the pre-scaled one does not
    if bad:
        x[100], x[200] = np.nan, -np.inf
    words, scales = jax.jit(jc.sign().encode)(x)
    # XLA's compare (subnormals flushed: -TINY < 0 is False there, True in numpy)
    want_words = jax.jit(lambda v: packing.pack((v < 0).astype(jnp.uint32), 1))(x)
    count = jnp.full((1 if d else 0,), d)
    want_scales = np.asarray(jax.jit(mean_abs)(blocks(jnp.asarray(x), max(d, 1)), count))
    np.testing.assert_array_equal(np.asarray(words), np.asarray(want_words))
    np.testing.assert_allclose(np.asarray(scales), want_scales, rtol=1e-6)  # NaN == NaN
    assert np.isnan(np.asarray(scales)).any() == bad

    g = jnp.ones(65_536, jnp.float32)
    one = jax.jit(lambda g, e: jc.sign().encode(g + e)).lower(g, g).compile()
    assert hot_path.hlo_traffic(one.as_text()) / (8 * 65_536) < 1.1
