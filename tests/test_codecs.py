"""Every codec in the registry: exact bytes, static shapes, error bounds, bias, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc

NAMES = sorted(jc.CODECS)
SIZES = [0, 1, 7, 31, 32, 33, 255, 257, 1000, 4099]
KEY = jax.random.PRNGKey(0)
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def normal(d, seed=0):
    """Test data from numpy: no PRNG program compiled per shape."""
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


@jax.jit(static_argnums=0)
def roundtrip(codec, x, key):
    return codec.roundtrip(x, key)


def payload_nbytes(payload):
    return sum(leaf.nbytes for leaf in jax.tree.leaves(payload))


def payload_nbytes_abstract(payload):
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(payload))


def _extremes(dtype) -> jax.Array:
    big = 1e30 if dtype == jnp.float32 else 6e4
    x = np.concatenate([normal(300), [big, -big, 1e-40, -1e-42, 0.0, 3.0]])
    return jnp.asarray(x, jnp.float32).astype(dtype)


CONCRETE_SIZES = (33, 4099)  # payloads computed concretely
ZERO_SIZES = (1, 33, 1000)


@functools.cache
def _checked(name: str) -> dict:
    """One compiled program per codec for the per-codec tests below (a compile costs more
    than the checks): concrete payloads of ``normal`` inputs and of ``100 x + 1`` under
    another key, roundtrips of zeros, and whether the roundtrip of finite extremes is
    finite per input dtype (the inputs are arguments, not constants)."""
    codec = jc.get_codec(name)

    def run(xs, extremes):
        other = jax.random.PRNGKey(7)
        return {
            "payload": [codec.encode(x, KEY) for x in xs],
            "other": [codec.encode(100 * x + 1, other) for x in xs],
            "zero": [codec.roundtrip(jnp.zeros(d), KEY) for d in ZERO_SIZES],
            "finite": {
                k: jnp.all(jnp.isfinite(codec.roundtrip(x, KEY))) for k, x in extremes.items()
            },
        }

    xs = [normal(d, seed=d) for d in CONCRETE_SIZES]
    return jax.jit(run)(xs, {k: _extremes(t) for k, t in DTYPES.items()})


@pytest.mark.parametrize("name", NAMES)
def test_payload_bytes_exact_and_shapes_static(name):
    codec = jc.get_codec(name)
    for d in SIZES:
        x = jax.ShapeDtypeStruct((d,), jnp.float32)
        payload = jax.eval_shape(codec.encode, x, KEY)
        assert payload_nbytes_abstract(payload) == codec.payload_bytes(d), (name, d)
        y = jax.eval_shape(lambda p, d=d: codec.decode(p, d), payload)
        assert y.shape == (d,) and y.dtype == jnp.float32
    out = _checked(name)  # concretely too, and shapes never depend on values or the key
    for d, payload, other in zip(CONCRETE_SIZES, out["payload"], out["other"], strict=True):
        assert payload_nbytes(payload) == codec.payload_bytes(d)
        assert jax.tree.map(jnp.shape, payload) == jax.tree.map(jnp.shape, other)


@pytest.mark.parametrize("name", NAMES)
def test_zero_in_zero_out(name):
    for d, y in zip(ZERO_SIZES, _checked(name)["zero"], strict=True):
        assert y.shape == (d,)
        np.testing.assert_array_equal(np.asarray(y), 0.0)


@pytest.mark.parametrize("name", NAMES)
def test_finite_in_finite_out(name):
    for dtype, finite in _checked(name)["finite"].items():  # f32, bf16 and f16 inputs
        assert bool(finite), (name, dtype)


def test_identity_and_cast_error_bounds():
    x = jax.random.normal(KEY, (5000,)) * 10
    np.testing.assert_array_equal(jc.identity().roundtrip(x), x)
    for dtype, mantissa in (("bf16", 7), ("fp16", 10), ("fp8_e4m3", 3), ("fp8_e5m2", 2)):
        y = jc.cast(dtype, scaled=False).roundtrip(x)
        normal = jnp.abs(x) > 0.1
        rel = jnp.abs(y - x) / jnp.abs(x)
        assert float(jnp.max(jnp.where(normal, rel, 0))) <= 2.0 ** -(mantissa + 1) + 1e-7, dtype
    # Saturating, not overflowing: 1e5 in unscaled fp16 is 65504, not inf.
    unscaled = jc.cast("fp16", scaled=False)
    assert float(unscaled.roundtrip(jnp.array([1e5]))[0]) == 65504.0
    assert bool(jnp.isinf(unscaled.roundtrip(jnp.array([jnp.inf]))[0]))


@pytest.mark.parametrize("bits,block", [(8, 256), (4, 256), (2, 64), (3, 100), (8, 17)])
def test_int_quant_error_bound(bits, block):
    x = normal(4099) * np.linspace(0.01, 10, 4099, dtype=np.float32)
    codec = jc.int_quant(bits, block)
    err = np.abs(np.asarray(roundtrip(codec, x, KEY)) - x)
    nb = -(-4099 // block)
    absmax = np.max(np.abs(np.pad(x, (0, nb * block - 4099)).reshape(nb, block)), axis=1)
    bound = np.repeat(absmax, block)[:4099] / (2 * codec.levels)
    assert np.all(err <= bound * (1 + 1e-5))
    if bits == 8:  # the bound: 1/127 of the block absmax
        assert np.all(err <= np.repeat(absmax, block)[:4099] / 127)


def test_sign_threshold_natural_values():
    x = jnp.array([-3.0, -0.2, 0.0, 0.1, 0.6, 5.0])
    np.testing.assert_allclose(roundtrip(jc.sign("mean"), x, KEY), jnp.sign(x + 1e-9) * 1.4833333)
    np.testing.assert_array_equal(roundtrip(jc.sign(None), x, KEY), jnp.where(x < 0, -1.0, 1.0))
    np.testing.assert_array_equal(
        roundtrip(jc.threshold_2bit(0.5), x, KEY), [-0.5, 0.0, 0.0, 0.0, 0.5, 0.5]
    )
    y = roundtrip(jc.natural(), normal(1000), KEY)
    m, _ = jnp.frexp(jnp.abs(y[y != 0]))
    np.testing.assert_array_equal(m, 0.5)  # every value is a power of two


@pytest.mark.parametrize("name", [n for n in NAMES if jc.get_codec(n).unbiased])
def test_unbiased_codecs_are_unbiased(name):
    codec = jc.get_codec(name)
    x = jax.random.normal(jax.random.PRNGKey(1), (256,)) * jnp.linspace(0.1, 3, 256)
    trials = 4000
    keys = jax.random.split(jax.random.PRNGKey(2), trials)
    ys = jax.jit(jax.vmap(lambda k: codec.roundtrip(x, k)))(keys)
    mean, sd = ys.mean(0), ys.std(0)
    # Per coordinate: |mean - x| within 5 standard errors (plus float slack).
    z = jnp.abs(mean - x) / (sd / np.sqrt(trials) + 1e-6 * jnp.abs(x) + 1e-7)
    assert float(jnp.max(z)) < 5.5, (name, float(jnp.max(z)))


@pytest.mark.parametrize("name", [n for n in NAMES if jc.get_codec(n).delta(1000) is not None])
def test_contractive_codecs_respect_delta(name):
    codec = jc.get_codec(name)
    for seed in range(5):
        x = jax.random.normal(jax.random.PRNGKey(seed), (1000,)) * (seed + 1)
        err = float(jnp.sum((roundtrip(codec, x, KEY) - x) ** 2))
        assert err <= (1 - codec.delta(1000)) * float(jnp.sum(x**2)) * (1 + 1e-5), name


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: jc.int_quant(bits=0), "bits"),
        (lambda: jc.int_quant(bits=9), "bits"),
        (lambda: jc.int_quant(bits=8.0), "bits"),
        (lambda: jc.int_quant(8, block_size=0), "block_size"),
        (lambda: jc.int_quant(8, stochastic="yes"), "stochastic"),
        (lambda: jc.qsgd(levels=0), "levels"),
        (lambda: jc.qsgd(levels=128), "levels"),
        (lambda: jc.qsgd(bucket_size=0), "bucket_size"),
        (lambda: jc.terngrad(block_size=-1), "block_size"),
        (lambda: jc.cast("int8"), "dtype"),
        (lambda: jc.sign(scale="max"), "scale"),
        (lambda: jc.sign(block_size=0), "block_size"),
        (lambda: jc.threshold_2bit(0.0), "threshold"),
        (lambda: jc.threshold_2bit(float("nan")), "threshold"),
        (lambda: jc.get_codec("int9"), "int9"),
    ],
)
def test_bad_arguments_name_the_argument(make, arg):
    with pytest.raises((ValueError, TypeError), match=arg):
        make()


def test_stochastic_codec_requires_key_and_vector_input():
    with pytest.raises(ValueError, match="key"):
        jc.qsgd().encode(jnp.ones(10))
    with pytest.raises(ValueError, match="1-D"):
        jc.int_quant(8).encode(jnp.ones((2, 5)))
    with pytest.raises(TypeError, match="floating"):
        jc.int_quant(8).encode(jnp.ones(5, jnp.int32))


def test_codecs_are_hashable_and_jit_static():
    codec = jc.int_quant(4)
    assert hash(codec) == hash(jc.int_quant(4)) and codec == jc.int_quant(4)
    f = jax.jit(lambda c, x: c.roundtrip(x), static_argnums=0)
    np.testing.assert_allclose(f(codec, jnp.ones(10)), jnp.ones(10))


def test_bits_really_packed():
    d = 1 << 20
    assert jc.sign().payload_bytes(d) == d // 8 + 4
    assert jc.int_quant(4).payload_bytes(d) == d // 2 + 4 * (d // 256)
    assert jc.int_quant(2).payload_bytes(d) == d // 4 + 4 * (d // 256)
    assert jc.threshold_2bit(1.0).payload_bytes(d) == d // 4
    assert jc.natural().payload_bytes(d) == d // 8 + d  # 9 bits per value
    words, _ = jc.sign().encode(jnp.ones(d))
    assert words.dtype == jnp.uint32 and words.shape == (d // 32,)


def test_cast_decode_sum_adds_rows_exactly():
    """Cast.decode_sum adds the decoded rows one by one (not XLA:CPU's slow reduce over the
    device axis): the same float32 as adding them in order, and the scale and fill applied."""
    rows = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1000)), jnp.float16)
    want = (rows[0].astype(jnp.float32) + rows[1] + rows[2]) * 0.5 + 1.0
    got = jc.cast("fp16", scaled=False).decode_sum(rows, 1000, scale=0.5, fill=1.0)
    assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("magnitude", [1e-36, 1e-12, 1e-6, 1.0, 1e5, 1e30, 4e37])
def test_scaled_fp16_error_bound_tiny_and_huge(magnitude):
    """``jc.cast("fp16")`` (scaled by default): ``|C(x)_i - x_i| <= 2^-11 |x_i| + 2^-28 max|x|``
    at any magnitude in float32's normal range, values spread over 2^40 below the largest;
    unscaled fp16 saturates at 65504 and flushes values under 6e-8 to zero."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal(4096) * magnitude * np.exp2(rng.uniform(-40, 0, 4096))
    x = np.where(np.abs(x) < 2e-38, 2e-38, x).astype(np.float32)  # float32's normal range
    x[0] = magnitude
    c = jc.cast("fp16")
    payload = jax.jit(c.encode)(jnp.asarray(x))
    y = np.asarray(jax.jit(lambda p: c.decode(p, x.size))(payload), np.float64)
    bound = 2.0**-11 * np.abs(x) + 2.0**-28 * np.abs(x).max()
    assert np.all(np.abs(y - x) <= bound), np.max(np.abs(y - x) / bound)
    values, scale = payload
    assert values.dtype == jnp.float16 and scale.dtype == jnp.float32 and scale.shape == (1,)
    top = np.abs(x).max() / float(scale[0])  # in [2^14, 2^15), the scale held >= 2^-126
    assert 2.0**14 <= top < 2.0**15 or (float(scale[0]) == 2.0**-126 and top < 2.0**15)
    assert float(np.log2(scale[0])) == int(np.log2(scale[0]))  # a power of two: exact
    assert sum(a.nbytes for a in jax.tree.leaves(payload)) == c.payload_bytes(x.size) == 8196


def test_scaled_casts_at_the_top_of_float32_decode_finite():
    """Vectors whose largest value is near float32's largest (3.4e38): the scale is held at
    ``2^(127 - t)``, so a value that rounds up to ``2^t`` of the scale is not inf (it was for
    ``max |x| > 3.4024e38`` in fp16), and fp16 stays within ``2^-11 |x_i| + 2^-28 max |x|``."""
    big = np.float32(np.finfo(np.float32).max)
    x = np.array([big, -big, 3.4025e38, 2.0**127, 1e30, 1.0], np.float32)
    for name in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
        c = jc.cast(name, scaled=True)
        y = np.asarray(jax.jit(lambda v, c=c: c.decode(c.encode(v), v.size))(x), np.float64)
        assert np.all(np.isfinite(y)), (name, y)
    y = np.asarray(jc.cast("fp16").roundtrip(jnp.asarray(x)), np.float64)
    bound = 2.0**-11 * np.abs(x.astype(np.float64)) + 2.0**-28 * float(big)
    assert np.all(np.abs(y - x) <= bound), np.abs(y - x) / bound
    assert float(jc.cast("fp16").encode(jnp.asarray(x))[1][0]) == 2.0**112


def test_scaled_fp16_zero_nonfinite_and_capabilities():
    """A zero vector decodes to zero (no NaN); NaN or inf anywhere gives a non-finite scale
    (the flag) and a non-finite decode; the scaled cast is not summable (one scale per
    device), not elementwise, and error feedback "auto" keeps no memory for it."""
    c = jc.cast("fp16")
    zero = c.decode(c.encode(jnp.zeros(100)), 100)
    assert np.array_equal(np.asarray(zero), np.zeros(100))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        payload = c.encode(jnp.array([1.0, bad, 2.0]))
        assert not np.isfinite(float(payload[1][0]))
        assert not np.any(np.isfinite(np.asarray(c.decode(payload, 3))))
    assert (c.scaled, c.summable, c.elementwise, c.rounding_only) == (True, False, False, True)
    assert c.chunk_unit(64) is None and c.payload_bytes(10) == 24
    plain = jc.cast("fp16", scaled=False)
    assert (plain.summable, plain.elementwise, plain.rounding_only) == (True, True, False)
    assert not jc.cast("bf16").scaled and jc.cast("bf16", scaled=True).rounding_only
    # Scaled under each type's own largest value: fp8 e4m3 (448) does not saturate at 1e4.
    x = jnp.array([1e4, -3e3, 7.0, 0.5])
    for name, mantissa in (("fp8_e4m3", 3), ("fp8_e5m2", 2), ("bf16", 7)):
        y = jc.cast(name, scaled=True).roundtrip(x)
        assert float(jnp.max(jnp.abs(y - x) / jnp.abs(x))) <= 2.0 ** -(mantissa + 1), name
    from jaxcomp._src import feedback

    assert feedback.resolve("auto", c) is None
    assert feedback.resolve("auto", plain) == "residual"
    assert [jc.choose_strategy(c, 1 << 20, n) for n in (2, 8)] == ["two_phase"] * 2
    # At 2 devices that is one float32 scale a leaf more than the all-gather (docs, "Scaled
    # fp16"): 2d + 8 against 2d + 4 bytes.
    two = jc.strategy_bytes(c, 1000, 2)
    assert (two["two_phase"], two["allgather"]) == (2008, 2004)
    assert jc.choose_strategy(c, 3, 8) == "plain"  # a payload larger than the floats
    with pytest.raises(TypeError, match="`scaled`"):
        jc.cast("fp16", scaled="yes")


# The audit's probe (2026-11-27): 4,096 unit normals times these scales.
AUDIT_SCALES = (1e-6, 1e-4, 1e-2, 1.0, 1e3, 1e5)


@pytest.mark.parametrize(
    "name,dtype,mantissa,low", [("fp8", "fp8_e4m3", 3, -13), ("fp8_e5m2", "fp8_e5m2", 2, -28)]
)
def test_fp8_casts_are_scaled_by_default(name, dtype, mantissa, low):
    """``jc.cast("fp8_e4m3")`` / ``"fp8_e5m2"`` (the registry's ``"fp8"``, ``"fp8_e5m2"``)
    are scaled unless ``scaled=False``: a gradient of any size keeps the type's rounding,
    ``|C(x)_i - x_i| <= 2^-(m+1) |x_i| + 2^low max |x|`` (e4m3: ``2^-4``, ``2^-13``; e5m2:
    ``2^-3``, ``2^-28``), relative error of the 2-norm 0.026-0.027 (e4m3) / 0.051-0.053
    (e5m2) at every scale. Unscaled (the default before) e4m3 sent zeros at 1e-6 and 1e-4
    (relative error 1) and saturated at 448 above (0.68 at 1e3, 0.996 at 1e5). One float32
    scale per vector on the wire: ``d + 4`` bytes."""
    x0 = normal(4096)
    c = jc.get_codec(name)
    for scale in AUDIT_SCALES:
        x = (x0 * np.float32(scale)).astype(np.float32)
        y = np.asarray(roundtrip(c, jnp.asarray(x), KEY), np.float64)
        err = np.abs(y - x)
        rel = np.linalg.norm(err) / np.linalg.norm(x.astype(np.float64))
        assert rel < 2.0 ** -(mantissa + 1) / 2, (scale, rel)
        bound = 2.0 ** -(mantissa + 1) * np.abs(x) + 2.0**low * np.abs(x).max()
        assert np.all(err <= bound), (scale, float(np.max(err / bound)))
    assert c == jc.cast(dtype) == jc.cast(dtype, scaled=True) and c.scaled
    assert c.payload_bytes(4096) == 4100 == payload_nbytes(c.encode(jnp.asarray(x0)))
    assert jc.cast(dtype, scaled=False).payload_bytes(4096) == 4096
    tiny = np.asarray(roundtrip(jc.cast(dtype, scaled=False), jnp.asarray(x0 * 1e-6), KEY))
    assert not tiny.any()  # unscaled: below both types' smallest subnormal, all zeros


def test_encode_sum_of_the_scaled_cast_bounds_from_the_row_scales():
    """A two-phase owner's re-encoding (``Codec.encode_sum``): the scaled cast takes the
    rows' largest scale (no pass over the mean), within ``2^-11 |mean| + 2^-28 max_j max|x_j|``
    of the float32 mean also where the rows cancel; a NaN row gives a NaN scale; other codecs
    (and the unscaled cast) encode the decoded sum, bit for bit."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 512)).astype(np.float32) * 1e-3
    x[1] = -x[0] + 1e-9 * rng.standard_normal(512)  # rows that cancel to tiny values
    c = jc.cast("fp16")
    others = (jc.cast("fp16", scaled=False), jc.int_quant(8))

    @jax.jit  # one program (op by op, each primitive compiled on its own: 2.9 s of CPU)
    def run(x):
        rows = jax.vmap(c.encode)(x)
        decoded = [c.decode(jax.tree.map(lambda a, i=i: a[i], rows), 512) for i in range(4)]
        payload = c.encode_sum(rows, 512, 0.25)
        bad = (rows[0], rows[1].at[2, 0].set(jnp.nan))
        theirs = []
        for other in others:
            enc = jax.vmap(other.encode)(x)
            want = other.encode(other.decode_sum(enc, 512, 0.25))
            theirs.append((other.encode_sum(enc, 512, 0.25), want))
        return rows, decoded, payload, c.decode(payload, 512), c.encode_sum(bad, 512, 0.25), theirs

    rows, decoded, payload, got, bad, theirs = run(jnp.asarray(x))
    decoded = np.stack([np.asarray(d) for d in decoded])
    mean = decoded.mean(0, dtype=np.float64)
    assert float(payload[1][0]) == float(jnp.max(rows[1]))
    got = np.asarray(got, np.float64)
    float32_sum = 2.0**-22 * np.abs(decoded).sum(0)  # the owner adds in float32
    bound = 2.0**-11 * np.abs(mean) + 2.0**-28 * np.abs(x).max() + float32_sum
    assert np.all(np.abs(got - mean) <= bound)
    assert np.isnan(float(bad[1][0]))
    for got_payload, want in theirs:
        for a, b in zip(jax.tree.leaves(got_payload), jax.tree.leaves(want), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_scaled_cast_owner_sum_stays_finite_and_flags_by_its_scale():
    """``encode_sum`` adds the rows in units of their largest scale, so rows near float32's
    largest value (whose sum in ``x``'s units overflows: the mean of 2 rows of 3e38 was
    inf with a finite scale) re-encode to finite values; the payload's values are finite
    whenever its scale is, which is why ``flag_arrays`` names the scales alone (None for
    the unscaled cast, whose values themselves carry inf)."""
    c = jc.cast("fp16")
    x = np.full((2, 512), 3.0e38, np.float32)
    x[1, ::2] = 2.5e38
    rows = jax.vmap(c.encode)(jnp.asarray(x))
    values, scale = jax.jit(lambda r: c.encode_sum(r, 512, 0.5))(rows)
    assert np.all(np.isfinite(np.asarray(values, np.float32))) and np.isfinite(float(scale[0]))
    mean = x.astype(np.float64).mean(0)
    got = np.asarray(c.decode((values, scale), 512), np.float64)
    assert np.max(np.abs(got - mean) / mean) <= 2.0**-10
    payloads = [rows, (values[None], scale[None])]
    assert [a.shape for a in c.flag_arrays(payloads)] == [(2, 1), (1, 1)]
    assert jc.cast("fp16", scaled=False).flag_arrays(payloads) is None
    assert jc.int_quant(8).flag_arrays(payloads) is None


@pytest.mark.parametrize("magnitude", [1e-36, 1e-34, 1e-30, 1.0, 3e38])
def test_scaled_fp16_mean_of_rows_tiny_and_huge(magnitude):
    """The mean of 8 scaled-fp16 rows, as all-gather decodes it (``decode_sum``) and as a
    two-phase owner re-encodes it (``encode_sum``): the rows summed in units of their largest
    scale stay within each row's bound (``2^-11 |x| + 2^-28 max |x|``, twice for the
    re-encoding) plus float32's smallest normal (XLA:CPU flushes subnormals), from rows whose
    scale is ``2^-126`` to rows near float32's largest. With ``1/n`` folded into each row's
    scale (``2^-126 / 8``: subnormal, flushed) the mean of rows under ``2^-111`` was 0."""
    rng = np.random.default_rng(4)
    x = (rng.uniform(-1.0, 1.0, (8, 512)) * magnitude).astype(np.float32)
    c = jc.cast("fp16")
    rows = jax.vmap(c.encode)(jnp.asarray(x))
    mean = x.astype(np.float64).mean(0)
    got = np.asarray(jax.jit(lambda r: c.decode_sum(r, 512, 0.125))(rows), np.float64)
    owner = jax.jit(lambda r: c.encode_sum(r, 512, 0.125))(rows)
    again = np.asarray(c.decode(owner, 512), np.float64)
    spread = np.abs(x.astype(np.float64)).mean(0)
    bound = 2.0**-11 * spread + 2.0**-28 * float(np.abs(x).max()) + 2.0**-126
    assert np.all(np.abs(got - mean) <= bound), np.max(np.abs(got - mean) / bound)
    assert np.all(np.abs(again - mean) <= 2 * bound), np.max(np.abs(again - mean) / bound)


FLAGGING = [name for name in NAMES if jc.get_codec(name).flags_nonfinite]


@pytest.mark.parametrize("d", [1000, 8192, 1 << 20])
@pytest.mark.parametrize("name", FLAGGING)
def test_nonfinite_flagging_codecs_keep_a_nan_in_long_vectors(name, d):
    """A NaN or +inf at the first, a middle or the last value of a vector reaches the floats
    a ``flags_nonfinite`` codec's step flag reads (:meth:`Codec.flag_arrays`, else every
    floating leaf of the payload). XLA:CPU's float max reduce over 4,096 values or more can
    drop a NaN (docs/errors.md): jc.terngrad()'s whole-vector scale did, and jc.qsgd()'s
    bucket norm did for a NaN at the last value (payload finite, the NaN sent as 0)."""
    codec = jc.get_codec(name)
    encode = jax.jit(lambda v: codec.encode(v, jax.random.PRNGKey(0)))
    clean = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    for value in (np.nan, np.inf):
        for pos in (0, d // 2 + 37, d - 1):
            x = clean.copy()
            x[pos] = value
            payload = encode(jnp.asarray(x))
            named = codec.flag_arrays([payload])
            floats = [a for a in jax.tree.leaves(payload) if jnp.issubdtype(a.dtype, jnp.floating)]
            flags = floats if named is None else named
            assert flags and not all(bool(jnp.isfinite(a).all()) for a in flags), (value, pos)


def test_sign_rms_keeps_the_norm_at_the_bytes_of_sign():
    """``jc.sign(scale="rms")`` (1-bit Adam's default codec): signs scaled by the root mean
    square of their block, so ``||C(x)|| = ||x||`` (``jc.sign()``'s mean |x| gives 3.5 for
    this x, norm 7.0 < 10.0), at exactly ``jc.sign()``'s bytes; zero stays zero, a finite
    outlier a finite scale, a non-finite input non-finite; not contractive (no ``delta``)."""
    c, blocked, d = jc.sign(scale="rms"), jc.sign(scale="rms", block_size=2), 4

    @jax.jit
    def roundtrips(rows):
        out = [c.decode(c.encode(r), d) for r in rows]
        return out + [
            blocked.decode(blocked.encode(rows[0]), d),
            jc.sign().decode(jc.sign().encode(rows[0]), d),
        ]

    x = [6.0, -8.0, 0.0, 0.0]  # ||x||_2 = 10, rms 5; mean |x| 3.5
    rows = jnp.array([x, [0.0] * 4, [3e38, -3e38, 1.0, 0.0], [1, np.nan, 0, 2], [1, np.inf, 0, 2]])
    out = [np.asarray(o) for o in roundtrips(list(rows))]
    np.testing.assert_allclose(out[0], [5.0, -5.0, 5.0, 5.0])
    np.testing.assert_array_equal(out[1], np.zeros(d))
    assert np.all(np.isfinite(out[2])) and out[2][0] == pytest.approx(3e38 / 2**0.5, rel=1e-5)
    assert not np.isfinite(out[3]).any() and not np.isfinite(out[4]).any()
    # per block of 2: rms(6, -8) = sqrt(50), rms(0, 0) = 0; jc.sign(): mean |x|
    np.testing.assert_allclose(out[5], [50**0.5, -(50**0.5), 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[6], [3.5, -3.5, 3.5, 3.5])
    for n in (1, 31, 1000, 4097):
        assert c.payload_bytes(n) == jc.sign().payload_bytes(n)
    assert c.delta(4) is None and jc.sign().delta(4) == 0.25


def test_sign_exact_zeros_decodes_zero_words_to_zero():
    """``jc.sign(exact_zeros=True)``: one bit per packed word marks the words of 32 values that
    are all zero, which decode to exactly 0 (a sign alone maps 0 to +scale); the scales are
    taken over the other values (``"rms"`` keeps the norm, ``"mean"`` is their mean |x|); a
    non-finite value still gives a non-finite decode; the bytes count the extra words."""
    d = 100  # words: [0, 32) values, [32, 64) zeros, [64, 96) one -2 and zeros, [96, 100) ones
    x = np.zeros(d, np.float32)
    x[:32] = np.where(np.arange(32) % 2, 3.0, -1.0)
    x[70], x[96:] = -2.0, 1.0
    rms, mean, plain = (jc.sign(s, exact_zeros=True) for s in ("rms", "mean", None))

    @jax.jit
    def roundtrips(v):
        zero, nan = jnp.zeros(70), jnp.concatenate([jnp.zeros(40), jnp.full(1, jnp.nan)])
        out = [c.decode(c.encode(v), d) for c in (rms, mean, plain, jc.sign("rms"))]
        return out + [rms.decode(rms.encode(zero), 70), rms.decode(rms.encode(nan), 41)]

    out = [np.asarray(o) for o in roundtrips(jnp.asarray(x))]
    sent = np.ones(d, bool)
    sent[32:64] = False
    for o in out[:3]:
        np.testing.assert_array_equal(o[~sent], 0.0)
        np.testing.assert_array_equal(np.sign(o[sent]), np.where(x[sent] < 0, -1.0, 1.0))
    norm = np.linalg.norm(x)  # sqrt(16 + 144 + 4 + 4) = sqrt(168)
    np.testing.assert_allclose(np.abs(out[0][sent]), norm / np.sqrt(68), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out[0]), norm, rtol=1e-6)
    np.testing.assert_allclose(np.abs(out[1][sent]), np.abs(x).sum() / 68, rtol=1e-6)
    np.testing.assert_array_equal(np.abs(out[2][sent]), 1.0)
    assert np.count_nonzero(out[3]) == d  # without: every zero moves by the scale
    np.testing.assert_array_equal(out[4], 0.0)
    bad = out[5]
    assert not np.isfinite(bad[32:]).any() and np.all(bad[:32] == 0.0)
    for n in (1, 31, 1000, 32 * 32 + 1):
        words = -(-n // 32)
        payload = jax.eval_shape(rms.encode, jax.ShapeDtypeStruct((n,), jnp.float32))
        assert rms.payload_bytes(n) == jc.sign("rms").payload_bytes(n) + 4 * -(-words // 32)
        assert sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(payload)) == (
            rms.payload_bytes(n)
        )
    assert not rms.votes and jc.sign(None).votes
