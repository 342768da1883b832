"""The float32 overflow guards of carried state, as pure functions (no devices, no compile).

The contract suites' item 8 runs every transform through finite outliers; these pin the
guards themselves: a norm or mean of finite values is finite (and right), a square
saturates, PowerSGD's warm-start rescale keeps a column with a 2e19 entry, Accordion's
running squared norm stays finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp as jc
from jaxcomp._src.codecs.base import (
    F32_MAX,
    clip_scales,
    max_abs_over,
    mean_abs,
    safe_divide,
    saturating_square,
    scaled_global_norm,
    scaled_global_norm_parts,
    scaled_norm,
)
from jaxcomp._src.dgc import _clip_local
from jaxcomp._src.onebit_adam import adam_denominator, saturate, unprecondition
from jaxcomp._src.powersgd import _unit_columns, orthogonalize
from jaxcomp._src.sparseloco import clip_factor


def test_norm_and_mean_of_finite_values_stay_finite():
    x = jnp.asarray([[3e38, -3e38, 1.0], [2e19, 0.0, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
    assert not np.isfinite(float(jnp.sqrt(jnp.sum(x[1] * x[1]))))  # the plain norm: inf
    norms = np.asarray(scaled_norm(x[1:], axis=1))
    np.testing.assert_allclose(norms, [2e19, 0.0], rtol=1e-6)
    means = np.asarray(mean_abs(x, jnp.asarray([3, 3, 3])))
    np.testing.assert_allclose(means, [2e38, 2e19 / 3, 0.0], rtol=1e-6)
    assert np.isnan(float(mean_abs(jnp.asarray([[jnp.nan, 1.0]]), jnp.asarray([2]))[0]))
    sq = np.asarray(saturating_square(jnp.asarray([2e19, -1e30, 3.0, jnp.inf])))
    np.testing.assert_array_equal(sq, [F32_MAX, F32_MAX, 9.0, F32_MAX])


def test_powersgd_warm_start_keeps_a_column_with_a_huge_entry():
    q = jnp.zeros((1, 48, 1), jnp.float32).at[0, 0, 0].set(2e19).at[0, 1, 0].set(1.0)
    old = jnp.ones((1, 48, 1), jnp.float32) / np.sqrt(48.0)
    unit = np.asarray(_unit_columns(q, old))[0, :, 0]
    np.testing.assert_allclose(unit[:2], [1.0, 5e-20], rtol=1e-6)  # not the zero column
    zero = np.asarray(_unit_columns(jnp.zeros_like(q), old))
    np.testing.assert_array_equal(zero, np.asarray(old))  # a zero column keeps its direction


def test_accordion_norm_saturates_and_recovers():
    a = jc.accordion(jc.int_quant(8), interval=2)
    state = a.init()
    for t, v in enumerate([3e38, 1.0, 1.0, 1.0]):
        state = a.update(state, jnp.int32(t), [jnp.full((8,), v, jnp.float32)])
        assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in state[1:]), t
    assert float(state.previous) == 8.0  # the last interval's mean squared norm


def test_adam_momentum_turned_back_from_preconditioned_units_saturates():
    """1-bit / 0/1 Adam turn a momentum sent in preconditioned units back with
    ``u (sqrt(k v) + eps)``: finite ``u``, ``k`` and ``v`` give a finite momentum (a 1e28 step
    at a coordinate of variance 6.8e35 overflowed to inf; ``k v`` of a saturated variance
    was inf, and a zero step times it NaN); a non-finite ``u`` stays non-finite."""
    v = jnp.asarray([6.8e35, F32_MAX, F32_MAX, 4.0, 0.0], jnp.float32)
    u = jnp.asarray([1e28, 0.0, -3.0, 0.5, 7.0], jnp.float32)
    big = np.sqrt(1000.0) * np.sqrt(np.float64(F32_MAX))  # 5.83e20: k v itself overflows
    np.testing.assert_allclose(np.asarray(adam_denominator(v[1:2], 1000.0, 1e-8)), big, rtol=1e-6)
    m = np.asarray(unprecondition(u, v, 250.0, 1e-8))
    want = [F32_MAX, 0.0, -3.0 * np.sqrt(250.0) * np.sqrt(np.float64(F32_MAX)), 0.5 * np.sqrt(1e3)]
    np.testing.assert_allclose(m, [*want, 0.0], rtol=1e-6)
    bad = np.asarray(unprecondition(jnp.asarray([jnp.inf, jnp.nan]), v[:2], 250.0, 1e-8))
    assert np.isposinf(bad[0]) and np.isnan(bad[1])
    x = jnp.asarray([2e38, 2e38, 1.0], jnp.float32)
    total = x + x  # inf, inf, 2: a sum of finite values that overflows saturates
    np.testing.assert_array_equal(np.asarray(saturate(total, x)), [F32_MAX, F32_MAX, 2.0])
    assert np.isinf(float(saturate(jnp.float32(jnp.inf), jnp.float32(jnp.inf))))


def test_guarded_norms_keep_a_nonfinite_value_of_a_long_vector():
    """Each guarded norm (and PowerSGD's orthogonalization, which scales each column by its
    largest entry) of 8,192 values holding a NaN or inf, at every 128th position or one of
    the last ones, is non-finite: none divides by a max that dropped the NaN and came out 0.
    ``scaled_global_norm`` took ``jnp.max(..., initial=0)``, which XLA:CPU computed as 0 for
    a NaN at the last value (docs/errors.md): every value then scaled to 0, the norm 0."""
    norms = {
        "scaled_norm": lambda x: scaled_norm(x),
        "scaled_norm_rows": lambda x: scaled_norm(x.reshape(64, -1), axis=1),
        "scaled_global_norm": lambda x: scaled_global_norm([x]),
        "scaled_global_norm_parts": lambda x: jnp.stack(scaled_global_norm_parts([x])),
        "powersgd_orthogonalize": lambda x: orthogonalize(x.reshape(-1, 4)),
    }
    d = 8192
    clean = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    positions = [*range(0, d, 128), d // 2 + 37, d - 9, d - 8, d - 2, d - 1]
    for name, fn in norms.items():
        fn = jax.jit(fn)
        hidden = []
        for value in (np.nan, np.inf, -np.inf):
            for pos in positions:
                x = clean.copy()
                x[pos] = value
                if np.isfinite(np.asarray(fn(jnp.asarray(x)))).all():
                    hidden.append((value, pos))
        assert not hidden, (name, hidden)
    # The same bits as jnp.max where nothing is NaN (inf included), over any axis.
    x = jnp.asarray(clean.reshape(8, 32, 32)).at[3, 4, 5].set(-jnp.inf)
    for axis in (None, 0, 1, -1):
        want = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
        np.testing.assert_array_equal(max_abs_over(x, axis), want)


def test_max_abs_over_keeps_a_nan_in_narrow_floats():
    """bfloat16 / float16 / float8 rows are reduced as integers of their width too: a float
    max reduce of 1M bfloat16 values dropped a NaN at its first and middle values."""
    d = 1 << 20
    clean = np.random.default_rng(0).standard_normal(d).astype(np.float32)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float8_e5m2):
        top = jax.jit(max_abs_over)
        x = jnp.asarray(clean, dtype).at[7].set(-jnp.inf)
        np.testing.assert_array_equal(top(x), jnp.max(jnp.abs(x), keepdims=True))
        for pos in (0, d // 2 + 37, d - 1):
            assert np.isnan(float(top(jnp.asarray(clean, dtype).at[pos].set(jnp.nan))[0])), pos


def test_division_by_values_above_2_to_126_is_right():
    """XLA:CPU divides by multiplying with the reciprocal, subnormal (flushed to 0) for a
    divisor above 2^126: safe_divide scales such divisors by 2^-64 first, and the codecs that
    divide a block by its largest value read right at float32's top (all were 0 before)."""
    x = jnp.asarray([3e38, -1e38, 2e38, 0.0], jnp.float32)
    unit = jax.jit(safe_divide)(x, jnp.float32(3e38))
    np.testing.assert_allclose(np.asarray(unit), [1.0, -1 / 3, 2 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(float(scaled_norm(x[:2])), np.hypot(3e38, 1e38), rtol=1e-6)
    q = np.asarray(_unit_columns(x[None, :, None], jnp.ones((1, 4, 1))))[0, :, 0]
    np.testing.assert_allclose(q, np.asarray(x) / np.linalg.norm(np.float64(x)), rtol=1e-6)

    def roundtrip(codec, v, key=None):
        return np.asarray(jax.jit(codec.roundtrip)(jnp.asarray(v, jnp.float32), key))

    np.testing.assert_allclose(roundtrip(jc.int_quant(3, 4), x), x, rtol=1e-6)
    np.testing.assert_allclose(roundtrip(jc.int_quant(2, 4), x), [3e38, 0, 3e38, 0], rtol=1e-6)
    for codec in (jc.chunked_top_k(2, 3, bits=8), jc.chunked_top_k(4, 4, 1, "mean")):
        v = np.asarray([3e38, -3e38, 3e38, -3e38][: codec.k], np.float32)
        np.testing.assert_allclose(roundtrip(codec, v), v, rtol=1e-6)  # was +-1.2e36 / inf
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    for codec in (jc.terngrad(), jc.int_quant(2, 4, stochastic=True), jc.qsgd(4, 4)):
        ys = np.asarray(jax.jit(jax.vmap(lambda k, c=codec: c.roundtrip(x, k)))(keys))
        assert np.isfinite(ys).all(), codec
        # Unbiased: the mean of 2000 draws within 5 standard errors (all were 0 before).
        err = np.abs(ys.astype(np.float64).mean(0) - np.float64(x))
        assert (err <= 5 * ys.astype(np.float64).std(0) / np.sqrt(2000) + 1e-6 * 3e38).all()


def test_codecs_whose_scale_overflows_float32_stay_finite_and_unbiased():
    """QSGD's bucket norm of 600 values of 2e37 (4.9e38) and random-k's d/k times a value
    above F32_MAX / 2 (6e38) overflowed: NaN (0 * inf) and inf from finite input. The norm
    is sent as F32_MAX (any norm >= max |x_i| keeps QSGD unbiased), random-k saturates."""
    keys = jax.random.split(jax.random.PRNGKey(1), 400)
    x = jnp.full((600,), 2e37, jnp.float32)
    ys = np.asarray(jax.jit(jax.vmap(lambda k: jc.qsgd(16).roundtrip(x, k)))(keys), np.float64)
    assert np.isfinite(ys).all()
    np.testing.assert_allclose(ys.mean(), 2e37, rtol=0.02)  # 240,000 draws of a 6% s.d.
    y = np.asarray(jc.random_k(0.5).roundtrip(jnp.asarray([3e38, 3e38]), keys[0]))
    assert y.max() == F32_MAX and y.min() == 0.0  # 2 * 3e38 saturated, was inf
    y = jc.random_k(0.5).roundtrip(jnp.asarray([jnp.nan, jnp.nan]), keys[0])
    assert np.isnan(np.asarray(y)).any()  # non-finite stays non-finite


def test_clip_by_global_norm_of_values_above_2_to_126_clips_to_the_norm():
    """A gradient near float32's top: its norm was 0 (x / top flushed), so it passed
    unclipped; a norm above 2^126 * limit made ``limit / norm`` 0, every update dropped."""
    g = {"a": jnp.asarray([1e38, -0.5e38], jnp.float32), "b": jnp.asarray([0.8e38], jnp.float32)}
    true = np.sqrt(1.89) * 1e38  # 1.37e38: 1 / true is subnormal
    np.testing.assert_allclose(float(scaled_global_norm(jax.tree.leaves(g))), true, rtol=1e-6)
    tx = jc.clip_by_global_norm(1.0, "data", bound=True)
    out = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="data")(
        jax.tree.map(lambda x: x[None], g)
    )
    flat = np.concatenate([np.asarray(out["a"][0]), np.asarray(out["b"][0])])
    np.testing.assert_allclose(flat, np.asarray([1e38, -0.5e38, 0.8e38]) / true, rtol=1e-6)


# Finite gradients whose global norm overflows float32 (3e38 x 4: norm 6e38; 1e38 x 100: 1e39;
# 1e20 x 5: a plain sum of squares is inf, the scaled norm 2.2e20 is not) or lies above 2^126
# (1.37e38: ``limit / norm`` is subnormal, flushed to 0 on XLA:CPU).
OVERFLOWING = {
    "3e38x4": {"a": jnp.asarray([3e38, -3e38, 3e38, -3e38], jnp.float32)},
    "1e38x100": {"a": jnp.full((60,), 1e38, jnp.float32), "b": jnp.full((40,), -1e38)},
    "1e20x5": {"a": jnp.full((3,), 1e20, jnp.float32), "b": jnp.full((2,), -1e20)},
    "norm 1.37e38": {"a": jnp.asarray([1e38, -0.5e38]), "b": jnp.asarray([0.8e38])},
}


@jax.jit
def _clip_library(tree, limit):
    """``jc.clip_by_global_norm(limit, bound=True)`` and dgc's local clipping of one device."""
    tx = jc.clip_by_global_norm(limit, "data", bound=True)
    ours = jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="data")(
        jax.tree.map(lambda x: x[None], tree)
    )
    dgc_g, _ = _clip_local(jax.tree.leaves(tree), [], limit)
    return {
        "clip_by_global_norm": jnp.concatenate([jnp.ravel(x[0]) for x in jax.tree.leaves(ours)]),
        "dgc clip_norm": jnp.concatenate([jnp.ravel(x) for x in dgc_g]),
    }


@pytest.mark.parametrize("case", sorted(OVERFLOWING))
def test_clipping_a_finite_gradient_whose_norm_overflows_keeps_its_direction(case):
    """The clipped gradient has norm ``limit`` along the gradient's direction. Before,
    ``limit / inf`` made every value 0 (3e38x4, 1e38x100) for both clippings (1e20x5 and
    1.37e38 were right since 89b2222); optax's ``clip_by_global_norm`` returns zeros for
    all four (docs/errors.md)."""
    tree = OVERFLOWING[case]
    g = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])
    want = g * (2.0 / np.linalg.norm(g))
    for name, got in _clip_library(tree, 2.0).items():
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-6, err_msg=name)
    optax_out, _ = optax.clip_by_global_norm(2.0).update(tree, optax.EmptyState())
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(optax_out))  # as documented


def test_clipping_keeps_a_nonfinite_gradient_nonfinite():
    """An inf among values of 1e38 (norm inf either way) or a NaN is never clipped away."""
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        tree = {"a": jnp.full((8,), 1e38, jnp.float32).at[3].set(bad), "b": jnp.ones(3)}
        for name, got in _clip_library(tree, 1.0).items():
            assert not np.isfinite(np.asarray(got)).all(), (name, bad)


def test_clipping_gives_the_same_bits_as_before_on_ordinary_gradients():
    """The formulas before the overflow guard (written out here) and after agree bit for bit
    wherever the old norm was finite and ``limit / norm`` normal: scales 1e-30 .. 1e30
    (norms above 2^64 take the 2^-64 path), clipped and not clipped."""

    def old_clip(tree, limit):  # clipping.py before: norm * pre, pre = 2^-64 above 2^64
        norm = scaled_global_norm(jax.tree.leaves(tree))
        pre = jnp.where((norm > limit) & (norm > 2.0**64), 2.0**-64, 1.0)
        factor = jnp.where(norm > limit, limit / jnp.where(norm > 0, norm * pre, 1.0), 1.0)
        return jnp.concatenate([jnp.ravel((x * pre) * factor) for x in jax.tree.leaves(tree)])

    def old_dgc(tree, limit):  # dgc._clip_local before
        norm = scaled_global_norm(jax.tree.leaves(tree))
        scale = jnp.where(norm > limit, limit / jnp.where(norm > 0, norm, 1.0), 1.0)
        return jnp.concatenate([jnp.ravel(x * scale) for x in jax.tree.leaves(tree)])

    key = jax.random.PRNGKey(3)
    for scale in (1e-30, 1e-3, 1.0, 1e10, 1e25, 1e30):
        tree = {
            "w": scale * jax.random.normal(key, (37, 29)),
            "b": scale * jax.random.normal(jax.random.fold_in(key, 1), (13,)),
        }
        for limit in (scale * 0.5, scale * 1e3, 1.0):
            limit = jnp.float32(limit)
            got = _clip_library(tree, limit)
            want = {
                "clip_by_global_norm": np.asarray(jax.jit(old_clip)(tree, limit)),
                "dgc clip_norm": np.asarray(jax.jit(old_dgc)(tree, limit)),
            }
            for name in got:
                np.testing.assert_array_equal(
                    np.asarray(got[name]).view(np.uint32), want[name].view(np.uint32), err_msg=name
                )


def test_the_one_global_norm_gives_each_caller_the_bits_of_its_own_norm_before():
    """clipping.py's ``global_norm_parts`` / ``safe_global_norm``, base.py's
    ``scaled_global_norm_parts`` and sparseloco.py's ``_norm_parts`` (as they were, written
    out here) computed ``max |x| * |x / max |x||`` three ways; ``scaled_global_norm_parts``
    is now the only one. What each caller computes from it is the same bits as before, on
    scales 1e-38 .. 3e38, zeros, values whose norm overflows, bf16 and int leaves, and a NaN
    or inf at the first, a middle or the last of 8,192 values (where a float max may drop
    the NaN)."""

    def clipping_parts(tree):  # clipping.global_norm_parts before
        leaves = [
            jnp.asarray(x, jnp.float32)
            for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.floating)
        ]
        top = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in leaves]))
        safe = jnp.where(jnp.isfinite(top) & (top > 0), top, 1.0)
        total = sum(jnp.sum(jnp.square(safe_divide(x, safe))) for x in leaves)
        return jnp.where(jnp.isfinite(top), safe, top), jnp.sqrt(total)

    def base_parts(arrays):  # codecs.base.scaled_global_norm_parts before (dgc's clip_norm)
        biggest = jnp.max(jnp.stack([max_abs_over(a).reshape(()) for a in arrays]))
        return biggest, jnp.sqrt(sum(jnp.sum(jnp.square(safe_divide(a, biggest))) for a in arrays))

    def sparseloco_parts(x):  # sparseloco._norm_parts before
        a = jnp.max(jnp.abs(x))
        p = jnp.where(a > 1.0, 2.0**-40, 1.0)
        return a, jnp.linalg.norm((x * p) / jnp.where(a > 0, a * p, 1.0))

    def old_clip_factor(t, d):  # sparseloco.clip_factor before, of top-k 10%
        sent = jc.top_k(0.1).roundtrip(t)
        (a_d, b_d), (a_s, b_s) = sparseloco_parts(d), sparseloco_parts(sent)
        ratio = (a_d / jnp.where(a_s > 0, a_s, 1.0)) * (b_d / jnp.where(b_s > 0, b_s, 1.0))
        bad = jnp.logical_not(jnp.all(jnp.isfinite(t)) & jnp.all(jnp.isfinite(d)))
        return jnp.where(bad, jnp.nan, jnp.where(a_s > 0, jnp.minimum(ratio, 1.0), 1.0))

    def floats(tree):
        return [
            jnp.asarray(x, jnp.float32)
            for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.floating)
        ]

    def scaled(tree, pre, factor):
        return [(x * pre) * factor for x in jax.tree.leaves(tree)]

    @jax.jit
    def before(tree):
        w = floats(tree)[0].reshape(-1)
        top, root = clipping_parts(tree)
        return {
            "jc.clip_by_global_norm": [  # in each leaf's dtype, as the transform returns it
                x.astype(jnp.result_type(leaf)).astype(jnp.float32)
                for x, leaf in zip(
                    scaled(floats(tree), *clip_scales(top, root, 1.0)),
                    [v for v in jax.tree.leaves(tree) if jnp.issubdtype(v.dtype, jnp.floating)],
                    strict=True,
                )
            ],
            "safe_global_norm": jnp.where(jnp.isfinite(top), top * root, top),
            "dgc clip_norm": scaled(floats(tree), *clip_scales(*base_parts(floats(tree)), 2.0)),
            "sparseloco clip": [old_clip_factor(w, 0.5 * w), old_clip_factor(0.0 * w, w)],
        }

    clip = jc.clip_by_global_norm(1.0, "data", bound=True)

    @jax.jit
    def after(tree):
        w, k = floats(tree)[0].reshape(-1), jc.top_k(0.1)
        one = jax.tree.map(lambda x: jnp.asarray(x)[None], tree)  # one device
        out = jax.vmap(lambda u: clip.update(u, clip.init(u))[0], axis_name="data")(one)
        return {
            "jc.clip_by_global_norm": [x[0].astype(jnp.float32) for x in floats(out)],
            "safe_global_norm": scaled_global_norm(floats(tree)),
            "dgc clip_norm": _clip_local(floats(tree), [], 2.0)[0],
            "sparseloco clip": [clip_factor(k, w, 0.5 * w), clip_factor(k, 0.0 * w, w)],
        }

    rng = np.random.default_rng(0)
    trees = [
        {
            "w": np.clip(s * rng.standard_normal((37, 29)), -F32_MAX, F32_MAX).astype(np.float32),
            "b": np.ones(13, np.float32),
        }
        for s in (1e-38, 1e-30, 1e-3, 1.0, 1e19, 1e30, 3e38)
    ]
    trees.append({"w": np.zeros((37, 29), np.float32), "b": np.zeros(13, np.float32)})
    trees.append({"w": np.full((8, 8), 3e38, np.float32), "b": np.ones(13, np.float32)})
    trees.append({"w": rng.standard_normal((37, 29)).astype(jnp.bfloat16), "i": np.arange(3)})
    for value in (np.nan, np.inf, -np.inf):
        for pos in (0, 4000, 8191):
            x = rng.standard_normal(8192).astype(np.float32)
            x[pos] = value
            trees.append({"w": x.reshape(64, 128), "b": np.ones(13, np.float32)})
    for i, tree in enumerate(trees):
        want, got = before(tree), after(tree)
        for name in want:
            for g, w in zip(jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True):
                np.testing.assert_array_equal(g, w, err_msg=f"{name}, tree {i}")


def test_a_float16_memory_plus_its_outputs_rounding_saturates_instead_of_inf():
    # A float16 memory near 65504 and a float16 leaf whose float32 mean (1.2e5) saturates on
    # output: the rounding added to the memory (mean - 65504) took it past 65504, and a plain
    # cast made it inf, so every later g + e was inf and the frozen memory stayed inf for good
    # (jc.compressed_allreduce(jc.sign(), memory_dtype=float16) on 8 devices: every update
    # non-finite from the second step on). Stored saturating, as every memory is.
    from jaxcomp._src.feedback import with_rounding

    memory = jnp.asarray([6e4, -6e4, 1.0, 0.0], jnp.float16)
    mean = jnp.asarray([1.2e5, -1e5, 3.0, 0.0], jnp.float32)
    (out,) = with_rounding([memory], [mean], [jnp.float16])
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [65504.0, -65504.0, 1.0, 0.0])
    (kept,) = with_rounding([memory], [mean], [jnp.float16], ok=False)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(memory))
    (bf,) = with_rounding(
        [jnp.asarray([3e38], jnp.bfloat16)], [jnp.asarray([3.3e38])], [jnp.bfloat16]
    )
    assert np.isfinite(np.asarray(bf, np.float32)).all()
