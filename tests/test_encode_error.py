"""Residual error feedback formed in the encoding step: exact, and fewer temporaries.

``Codec.encode_with_error`` gives ``(payload, x - decode(payload))``; the strategies return
that error per segment (``Reduced.error``) and ``compressed_allreduce`` stores it as the new
memory instead of forming ``(g + e) - sent`` after the exchange. These tests hold it to the
unfused formula bit for bit and read the step's temporaries from the compiled program.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import N, per_device, shard, stacked_normal
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import collectives
from jaxcomp._src.codecs.base import max_abs, mean_abs
from jaxcomp._src.codecs.sign import nonzero_words, root_mean_square

# (codec, strategy): allgather, two_phase (errors per row), allreduce (x - n decode(x / n)).
CASES = [
    ("int8", "allgather"),
    ("int8", "two_phase"),
    ("sign", "two_phase"),
    ("fp16_unscaled", "allreduce"),
    ("fp16", "allgather"),
]
SIZES = (1000, 4099, 37)  # whole blocks, blocks and a tail, less than a block per device


@functools.cache
def _reduced():
    """One program: every case's (error, segment - sent) on every device; a zero segment too."""

    def f(t):
        x = t[0]
        segments = [x[:d] * (i + 1) for i, d in enumerate(SIZES)] + [jnp.zeros(64)]
        out = {}
        for name, strategy in CASES:
            codec = jc.get_codec(name)
            r = collectives.reduce_segments(segments, "data", codec, strategy, with_payload=True)
            sizes = [s.shape[0] for s in segments]
            own = collectives.own_sent(sizes, r.payload, "data", codec, strategy)
            out[f"{name}/{strategy}"] = (
                jnp.concatenate(r.error)[None],
                jnp.concatenate([s - sent for s, sent in zip(segments, r.sent, strict=True)])[None],
                jnp.concatenate([s - o for s, o in zip(segments, own, strict=True)])[None],
            )
        return out

    x = shard(stacked_normal(3, (max(SIZES),), offset=0.5))
    return per_device(f, P("data"), P("data"))(x)


@pytest.mark.parametrize("case", [f"{n}/{s}" for n, s in CASES])
def test_error_of_the_encoding_step_is_the_unfused_residual(case):
    # Bit for bit: the same values as (g + e) - decode(payload) formed after the exchange,
    # and as x - own_sent(payload) (1-bit Adam's memory, formed after its cond).
    error, unfused, late = (np.asarray(a) for a in _reduced()[case])
    assert error.shape == (N, sum(SIZES) + 64)
    np.testing.assert_array_equal(error, unfused)
    np.testing.assert_array_equal(error, late)
    assert np.all(error[:, -64:] == 0.0)  # a zero gradient leaves a zero memory, never NaN
    assert np.isfinite(error).all() and np.abs(error).max() > 0  # something was dropped


@pytest.mark.parametrize("name", ["int8", "int4", "sign", "signsgd", "fp16", "topk1%"])
def test_encode_with_error_is_encode_and_residual(name):
    codec = jc.get_codec(name)
    x = np.random.default_rng(5).standard_normal(4099).astype(np.float32)
    key = jax.random.PRNGKey(0)

    @jax.jit
    def both(x):
        payload, error = codec.encode_with_error(x, key)
        return payload, error, codec.encode(x, key), x - codec.decode(payload, x.shape[0])

    payload, error, alone, unfused = both(x)
    np.testing.assert_array_equal(error, unfused)
    for a, b in zip(jax.tree.leaves(payload), jax.tree.leaves(alone), strict=True):
        np.testing.assert_array_equal(a, b)


def test_max_abs_and_mean_abs_fold_rows_exactly():
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((5, 256)).astype(np.float32)
    xb[1] = 0.0
    xb[2, 17] = np.nan
    xb[3, 200] = -np.inf
    got = np.asarray(jax.jit(max_abs)(xb))
    np.testing.assert_array_equal(got, np.max(np.abs(xb), axis=1))  # max: order-free, exact
    count = np.array([256, 256, 256, 256, 100])
    mean = np.asarray(jax.jit(mean_abs)(xb, count))
    want = np.sum(np.abs(xb).astype(np.float64), axis=1) / count
    assert mean[1] == 0.0 and np.isnan(mean[2]) and np.isinf(mean[3])
    np.testing.assert_allclose(mean[[0, 4]], want[[0, 4]], rtol=1e-6)  # pairwise-tree order
    # The rms scale (jc.sign("rms")) folds its max and its sum of squares the same way.
    xb[4, :3] = 3e38  # a finite row whose plain sum of squares overflows
    rms = np.asarray(jax.jit(root_mean_square)(xb, count.astype(np.float32)))
    want = np.sqrt(np.sum(xb.astype(np.float64) ** 2, axis=1) / count)
    assert rms[1] == 0.0 and np.isnan(rms[2]) and not np.isfinite(rms[3])
    np.testing.assert_allclose(rms[[0, 4]], want[[0, 4]], rtol=1e-6)


def test_sign_rms_and_exact_zeros_encode_without_a_copy_of_x():
    # The zero-word flags on |x|'s int32 bits: the float formula's flags, bit for bit.
    x = np.random.default_rng(1).standard_normal(32 * 7 + 5).astype(np.float32)
    x[:64] = 0.0
    x[64:96] = -0.0
    x[96:128] = 0.0
    x[100] = 1e-45  # a denormal: zero, as XLA's float compare (flushing denormals) has it
    x[10] = -1.2e-38  # the smallest normals: not zero
    x[12] = 1.2e-38
    x[128:160] = 0.0
    x[150] = np.nan
    x[160:192] = 0.0
    x[170] = -np.inf
    flushed = np.where(np.abs(x) < np.finfo(np.float32).tiny, 0.0, x)
    words = np.abs(np.pad(flushed, (0, 27)).reshape(-1, 32)).max(axis=1)
    want = (words != 0).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(nonzero_words)(x), want)
    float_max = jax.jit(lambda v: jnp.max(jnp.abs(v.reshape(-1, 32)), axis=1) != 0)
    np.testing.assert_array_equal(float_max(np.pad(x, (0, 27))), want)  # XLA's float formula
    # Compiled temporaries of encoding g + e, in copies of x: a two-phase worker's 8 rows
    # (the 1-bit Adam recipes' exchange) wrote x / m out whole for the rms reduce (1.00), and
    # exact_zeros wrote |x| out whole for the zero words' max (a vector: 2.03 -> 1.25).
    d = 1 << 14
    spec = jax.ShapeDtypeStruct((d,), jnp.float32)
    rms, exact = jc.sign("rms"), jc.sign("rms", exact_zeros=True)
    rows = lambda g, e: rms.encode_rows_with_error((g + e).reshape(N, -1), None)  # noqa: E731
    temps = {
        name: jax.jit(f).lower(spec, spec).compile().memory_analysis().temp_size_in_bytes / (4 * d)
        for name, f in (("rows", rows), ("exact", lambda g, e: exact.encode(g + e)))
    }
    assert temps["rows"] < 0.4 and temps["exact"] < 1.4, temps


def test_step_temporaries_within_one_copy_of_sgd():
    # Compiled, deterministic: the donated data-parallel step of a small MLP on 8 devices
    # (benchmarks.memory), temporaries in copies of the f32 params. optax.sgd(momentum) holds
    # 2.00; forming g + e - C(g + e) after the exchange held 3.16 (int8) and 2.69 (sign).
    from benchmarks import memory

    mesh = jax.make_mesh((N,), ("data",))
    rep = jax.sharding.NamedSharding(mesh, P())
    params = jax.jit(lambda: memory.common.mlp_params(memory.QUICK_MLP), out_shardings=rep)()
    temps = {}
    for name, codec in [("int8", jc.int_quant(8)), ("sign", jc.sign())]:
        tx = jc.sgd(0.1, codec, "data")
        temps[name] = memory.measure(name, tx, False, params, mesh, 8)["temporaries"]
    assert temps["int8"] < 2.85 and temps["sign"] < 2.45, temps
