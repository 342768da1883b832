"""Means of finite gradients whose float32 SUM overflows: each device near 2^126, 8 devices.

The mean fits float32 (it is at most the largest of the values), so it must come out finite
and right. A reduction that sums first and divides after (``jax.lax.pmean``, and until
2026-11-27 the decode-and-add of ``allgather`` / ``two_phase``, the plain mean of small
leaves, the hierarchical reduce-scatter) made it inf, then NaN in every leaf of the step.
Dividing by ``n`` before the sum is exact for ``n`` a power of two, so the mean of
``x * 2^100`` is the mean of ``x`` times ``2^100`` bit for bit (deterministic codecs scale
with their input), which is what these tests assert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, mesh, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

BIG = 2.0**100  # x ~ 2^26 times this: 8.5e37 a value, 6.8e38 (inf) as a float32 sum of 8


def gradients(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w": (2.0**26 * (1 + 0.1 * rng.random((N, 512)))).astype(np.float32),
        "b": (2.0**26 * (1 - 2 * rng.random((N, 16)))).astype(np.float32),
    }


def pmean_step(codec, strategy, **kw):
    def step(g):
        key = jax.random.PRNGKey(0) if codec.stochastic else None
        tree = jax.tree.map(lambda x: x[0], g)
        out = jc.pmean(tree, "data", codec, key=key, strategy=strategy, **kw)
        return jax.tree.map(lambda x: x[None], out)

    return per_device(step, (P("data"),), P("data"))


@pytest.mark.parametrize(
    ("codec", "strategy", "tol"),
    [
        (jc.identity(), "allgather", 1e-6),
        (jc.identity(), "two_phase", 1e-6),
        (jc.int_quant(8), "allgather", 0.01),
        (jc.int_quant(8), "two_phase", 0.01),
        (jc.sign(), "allgather", 0.06),
        (jc.sign(), "two_phase", 0.06),
        (jc.sign(), "majority_vote", 0.06),  # the psum of the scales
        (jc.natural(), "allgather", 0.3),  # each value a power of two, stochastically
    ],
)
def test_a_mean_that_fits_float32_does_not_overflow_in_the_sum(codec, strategy, tol):
    """Until 2026-11-27 every row here gave NaN in the big leaf (``two_phase``: in both)."""
    g = gradients()
    step = pmean_step(codec, strategy, min_size=0)
    big = step(shard(jax.tree.map(lambda x: x * np.float32(BIG), g)))
    small = step(shard(g))
    for k in g:
        out = np.asarray(big[k])
        assert np.isfinite(out).all(), (k, np.isfinite(out).mean())
        np.testing.assert_array_equal(out, np.asarray(small[k]) * np.float32(BIG))
    truth = g["w"].astype(np.float64).mean(0) * BIG
    assert np.abs(np.asarray(big["w"])[0] - truth).max() <= tol * truth.max()


def test_plain_and_hierarchical_means_do_not_overflow_in_the_sum():
    """Small leaves' plain mean (``min_size``) and the hierarchical reduce-scatter over the
    fast axis (``inner_axis_name``) summed first too: inf / NaN until 2026-11-27."""
    g = gradients(1)
    plain = pmean_step(jc.int_quant(8), "auto", min_size=10**6)
    out = plain(shard(jax.tree.map(lambda x: x * np.float32(BIG), g)))
    ref = plain(shard(g))
    for k in g:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]) * np.float32(BIG))
    m = jax.make_mesh((2, 4), ("host", "local"), devices=jax.devices()[:N])

    def step(x):
        y = jc.pmean(x[0, 0], "host", jc.int_quant(8), inner_axis_name="local", min_size=0)
        return y[None, None]

    both = P("host", "local")
    fn = jax.jit(jax.shard_map(step, mesh=m, in_specs=both, out_specs=both))
    x = g["w"].reshape(2, 4, 512)
    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(m, both))  # noqa: E731
    hier = np.asarray(jax.block_until_ready(fn(put(x * np.float32(BIG)))))
    assert np.isfinite(hier).all()
    np.testing.assert_array_equal(hier, np.asarray(jax.block_until_ready(fn(put(x)))) * BIG)


def hierarchical_pmean(codec):
    """Stateless ``jc.pmean`` of a vector per device over ``host`` x ``local`` (2 x 4), and
    the sharding of its input ``[2, 4, d]``."""
    m = jax.make_mesh((2, 4), ("host", "local"), devices=jax.devices()[:N])
    both = P("host", "local")

    def step(x):
        return jc.pmean(x[0, 0], "host", codec, inner_axis_name="local", min_size=0)[None, None]

    fn = jax.jit(jax.shard_map(step, mesh=m, in_specs=both, out_specs=both))
    return fn, jax.sharding.NamedSharding(m, both)


@pytest.mark.parametrize("codec", [jc.int_quant(8), jc.sign()])
def test_stateless_hierarchical_pmean_scatters_the_gradient_as_given(codec):
    """The common path reduce-scatters the input itself (a bitcast of the parameter), not a
    copy scaled by ``1/L`` (one more read and write of the whole gradient, for part of
    2026-11-27); the pre-scaled redo sits in the ``lax.cond`` branch taken on a flagged step."""
    fn, sharding = hierarchical_pmean(codec)
    x = jax.ShapeDtypeStruct((2, 4, 4096), jnp.float32, sharding=sharding)
    text = fn.lower(x).compile().as_text()
    entry = text[text.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    lines = {ln.split(" = ")[0].strip().lstrip("%"): ln for ln in entry.splitlines()[1:]}
    (scatter,) = [ln for ln in lines.values() if " reduce-scatter(" in ln]
    operand = scatter.split(" reduce-scatter(")[1].split(")")[0].lstrip("%")
    assert " bitcast(%param" in lines[operand] or " parameter(" in lines[operand], lines[operand]
    assert entry.count(" conditional(") == 1


def test_stateless_hierarchical_pmean_keeps_a_non_finite_input_flagged():
    """A NaN on one device takes the redo too, and the step stays NaN in every value."""
    fn, sharding = hierarchical_pmean(jc.int_quant(8))
    x = gradients(5)["w"].reshape(2, 4, 512) * np.float32(BIG)
    x[1, 2, 7] = np.nan
    out = np.asarray(jax.block_until_ready(fn(jax.device_put(x, sharding))))
    assert np.isnan(out).all()


def test_stateless_hierarchical_pmean_under_vmap_is_the_loop_bit_for_bit():
    """A vmapped step over a batch of 3 models (one finite, one whose host sums overflow
    float32, one with a NaN on one device): jax batches the redo's ``lax.cond`` on the
    models' flags into a select of both branches (no ``conditional`` left: the pre-scaled
    pass runs on every vmapped step), and each model's mean is the one the model alone
    gives, bit for bit: finite where the mean fits, NaN where an input is."""
    m = jax.make_mesh((2, 4), ("host", "local"), devices=jax.devices()[:N])
    both = P("host", "local")
    x = np.stack([gradients(s)["w"].reshape(2, 4, 512) for s in (6, 7, 8)], axis=2)
    x[:, :, 1] *= np.float32(BIG)
    x[1, 2, 2, 7] = np.nan
    sharding = jax.sharding.NamedSharding(m, both)
    for codec in (jc.int_quant(8), jc.sign()):

        def mean(v, codec=codec):
            return jc.pmean(v, "host", codec, inner_axis_name="local", min_size=0)

        def vmapped(v):
            return jax.vmap(mean)(v[0, 0])[None, None]

        def looped(v):
            return jnp.stack([mean(v[0, 0, b]) for b in range(3)])[None, None]

        runs = [
            jax.jit(jax.shard_map(f, mesh=m, in_specs=both, out_specs=both))
            for f in (vmapped, looped)
        ]
        text = runs[0].lower(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
        assert " conditional(" not in text.compile().as_text()
        got, want = (
            np.asarray(jax.block_until_ready(f(jax.device_put(x, sharding)))) for f in runs
        )
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got[:, :, :2]).all() and np.isnan(got[:, :, 2]).all()
        small = x[:, :, 1] / np.float32(BIG)
        alone = np.asarray(
            jax.block_until_ready(runs[1](jax.device_put(np.stack([small] * 3, 2), sharding)))
        )
        np.testing.assert_array_equal(got[:, :, 1], alone[:, :, 1] * np.float32(BIG))


def exchange_step(tx, params=None):
    """``tx``'s sharded state on the 8 devices and its step ``(state, grads) -> (update,
    state)`` for ``params`` (default: ``w`` of 512 values and ``b`` of 16)."""
    params = {"w": jnp.zeros(512), "b": jnp.zeros(16)} if params is None else params
    state = jc.sharded_init(tx, params, mesh(), "data")
    specs = jc.state_specs(state, "data")

    def step(s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, params)
        return jax.tree.map(lambda x: x[None], u), s

    return state, per_device(step, (specs, P("data")), (P("data"), specs))


def test_error_feedback_step_of_overflowing_sum_is_finite_and_keeps_exact_memory():
    """``compressed_allreduce(sign, residual)`` through ``allgather``: the update was NaN on
    every device while each device's memory still moved as if the step were applied, so
    ``apply_if_finite`` skipped a step whose compression error was already booked. Now the
    update is finite and update and memory are the small run's times ``2^100``."""
    tx = jc.compressed_allreduce(jc.sign(), "data", strategy="allgather", min_size=0)
    state, fn = exchange_step(tx)
    g = gradients(2)
    u_big, s_big = fn(state, shard(jax.tree.map(lambda x: x * np.float32(BIG), g)))
    u_small, s_small = fn(state, shard(g))
    for k in g:
        assert np.isfinite(np.asarray(u_big[k])).all()
        np.testing.assert_array_equal(np.asarray(u_big[k]), np.asarray(u_small[k]) * BIG)
        np.testing.assert_array_equal(
            np.asarray(s_big.memory[k]), np.asarray(s_small.memory[k]) * np.float32(BIG)
        )


def test_onebit_adam_level_reference_saturates_instead_of_inf():
    """1-bit Adam's per-leaf ``level_ref`` (the bias-corrected second moment when the
    variance last moved, 1000x the level at step 1) was inf after one step of gradients
    near 1e38, and the frozen variance kept it inf for good; now it saturates at F32_MAX."""
    tx = jc.onebit_adam(0.1, "data", freeze_step=1)
    state, fn = exchange_step(tx)
    big = jax.tree.map(lambda x: x * np.float32(BIG), gradients(3))
    u, state = fn(state, shard(big))
    u, state = fn(state, shard(gradients(4)))
    for leaf in jax.tree.leaves(state):
        assert np.isfinite(np.asarray(leaf)).all()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))


def test_local_sgd_plain_sync_of_replicas_near_float32s_largest_is_finite():
    """``jc.local_sgd`` (and ``jc.diloco`` without a codec) syncs by a plain ``pmean`` of the
    params' change, which summed first: replicas near ``2^126`` all became NaN at the sync,
    for good, until 2026-11-27. Now the synced replicas are the small run's times ``2^100``."""
    tx = jc.local_sgd(optax.sgd(1.0), "data", 1)
    params = {"w": jnp.zeros(512), "b": jnp.zeros(16)}
    state = jc.sharded_init(tx, params, mesh(), "data")
    specs, rspecs = jc.state_specs(state, "data"), jc.replica_specs(params, "data")

    def step(r, s, g):
        p = jc.own(r)
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return jc.slot(optax.apply_updates(p, u)), s

    fn = per_device(step, (rspecs, specs, P("data")), (rspecs, specs))
    replicas = jc.replica_params(params, mesh(), "data")
    g = gradients(5)
    big, _ = fn(replicas, state, shard(jax.tree.map(lambda x: x * np.float32(BIG), g)))
    small, _ = fn(replicas, state, shard(g))
    for k in g:
        assert np.isfinite(np.asarray(big[k])).all()
        np.testing.assert_array_equal(np.asarray(big[k]), np.asarray(small[k]) * np.float32(BIG))


def test_powersgd_factor_sums_near_float32s_largest_are_finite():
    """PowerSGD's all-reduces of ``P_i = M_i Q`` and ``M_i^T P`` summed first: with values
    near ``2^123`` (1.1e37) on 8 devices the step was NaN (flagged, memories kept) where every
    factor and the mean fit float32, until 2026-11-27. Divided by ``n`` first (``P``'s
    scale cancels in the orthogonalization), the step is the small run's times ``2^97``."""
    tx = jc.powersgd(2, "data", start_step=0, min_size=0)
    state, fn = exchange_step(tx, {"w": jnp.zeros((64, 32)), "b": jnp.zeros(16)})
    rng = np.random.default_rng(6)
    g = {
        "w": (2.0**26 * (1 + 0.1 * rng.random((N, 64, 32)))).astype(np.float32),
        "b": (2.0**26 * (1 - 2 * rng.random((N, 16)))).astype(np.float32),
    }
    scale = np.float32(2.0**97)
    u_big, _ = fn(state, shard(jax.tree.map(lambda x: x * scale, g)))
    u_small, _ = fn(state, shard(g))
    for k in g:
        assert np.isfinite(np.asarray(u_big[k])).all(), k
        np.testing.assert_array_equal(np.asarray(u_big[k]), np.asarray(u_small[k]) * scale)


def test_powersgd_orthogonalize_of_entries_above_2_to_126_keeps_its_columns():
    """``orthogonalize`` divided each column by its largest entry with a plain divide: above
    ``2^126`` XLA:CPU multiplies by a flushed (zero) reciprocal, and the step above came out
    15.6% off the small run's at ``2^97`` once its sums no longer overflowed."""
    from jaxcomp._src.powersgd import orthogonalize

    p = jnp.asarray(np.random.default_rng(7).normal(size=(1, 64, 2)).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(orthogonalize(p * np.float32(2.0**125))), np.asarray(orthogonalize(p))
    )


def test_random_k_allreduce_step_past_float32_keeps_the_residual_memory():
    """``jc.random_k`` through ``allreduce`` sends ``n decode(C(x / n)) = s_j x_i``, past
    float32 for a finite ``x_i`` near ``2^126`` (``s_j`` = 10 in ``w``, 8 in ``b``). Until
    2026-11-27 that step was not flagged: residual feedback stored inf where drawn and every
    later update was non-finite. Now it is NaN on every device with every memory kept, and
    the next step is the one it would have been."""
    tx = jc.compressed_allreduce(
        jc.random_k(0.1), "data", strategy="allreduce", error_feedback="residual", min_size=0
    )
    state, fn = exchange_step(tx)
    _, state = fn(state, shard(gradients(8)))  # a nonzero memory to keep
    big = shard(jax.tree.map(lambda x: x * np.float32(BIG), gradients(9)))
    u_big, s_big = fn(state, big)
    u_next, s_next = fn(s_big, shard(gradients(10)))
    u_ref, s_ref = fn(state, shard(gradients(10)))
    for k in ("w", "b"):
        assert np.isnan(np.asarray(u_big[k])).all(), k
        np.testing.assert_array_equal(np.asarray(s_big.memory[k]), np.asarray(state.memory[k]))
        assert np.isfinite(np.asarray(u_next[k])).all(), k
        np.testing.assert_array_equal(np.asarray(u_next[k]), np.asarray(u_ref[k]))
        np.testing.assert_array_equal(np.asarray(s_next.memory[k]), np.asarray(s_ref.memory[k]))
