"""FSDP (``jc.fsdp_gather``) as an LM user runs it: many steps against ``jax.lax`` FSDP, and
in combination with the rest of jaxcomp (a replica axis, scan, remat, clipping, narrow types).

Small on purpose: tiny models, a few compiled programs, each test a few seconds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Blocking
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

D = 32
BOTH = ("replica", "data")


def _mesh_2x4():
    return jax.make_mesh(
        (2, 4), BOTH, axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8]
    )


def _params(d=D):
    k = jax.random.split(jax.random.PRNGKey(0), 2)
    return {"a": jax.random.normal(k[0], (d, d)) / 6, "b": jax.random.normal(k[1], (d, 8)) / 6}


def _batches(steps, rows, d=D, seed=1):
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    x = jax.random.normal(k[0], (steps, rows, d))
    y = jax.random.normal(k[1], (steps, rows, 8))
    return x, y


def _net(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"] - y) ** 2)


# --------------------------------------------------------------------------- a replica axis


def _train_replicas(tx, fsdp, steps=4, grads=None):
    """``tx`` over ``"replica"`` of a 2 x 4 mesh: FSDP over ``"data"`` inside each replica
    (``fsdp``: params ``P("replica", "data")``, shard gradients from ``jc.fsdp_gather``) or
    data parallel (params ``P("replica")``, ``pmean`` over ``"data"``)."""
    m = _mesh_2x4()
    pspec = P("replica", "data") if fsdp else P("replica")
    reps = jax.tree.map(
        lambda a: jax.device_put(a, NamedSharding(m, pspec)),
        jc.replica_params(_params(), m, "replica"),
    )
    if fsdp:  # every state array per device: its leading dimension over both axes
        init = lambda r: tx.init(jc.own(r))  # noqa: E731
        shape = jax.eval_shape(
            jax.shard_map(init, mesh=m, in_specs=pspec, out_specs=P(), check_vma=False), reps
        )
        specs = jax.tree.map(lambda a: P(BOTH) if a.ndim else P(), shape)
        state = jax.jit(jax.shard_map(init, mesh=m, in_specs=pspec, out_specs=specs))(reps)
    else:
        state = jc.sharded_init(tx, _params(), m, "replica")
        specs = jc.state_specs(state, "replica")

    def step(r, s, x, y, given):
        p = jc.own(r)
        if grads is not None:  # the given per-device gradient, e.g. a NaN on one device
            g = jax.tree.map(lambda a: a[0], given)
        elif fsdp:
            gather = functools.partial(jc.fsdp_gather, axis_name="data", weights=None, grads=None)
            g = jax.grad(lambda p: _net(gather(p), x, y))(p)
            g = jax.tree.map(lambda a: a / 4, g)  # the sum over the replica's devices -> mean
        else:
            local = jax.lax.pcast(p, "data", to="varying")
            g = jax.lax.pmean(jax.grad(lambda p: _net(p, x, y))(local), "data")
        u, s = tx.update(g, s, p)
        return jc.slot(optax.apply_updates(p, u)), s, jax.tree.map(lambda a: a[None], u)

    gspec = P(BOTH)
    fn = Blocking(
        jax.jit(
            jax.shard_map(
                step,
                mesh=m,
                in_specs=(pspec, specs, gspec, gspec, gspec),
                out_specs=(pspec, specs, gspec),
            )
        )
    )
    xs, ys = _batches(steps, 64)
    put = lambda a: jax.device_put(a, NamedSharding(m, gspec))  # noqa: E731
    given = jax.tree.map(put, grads if grads is not None else jnp.zeros((8,)))
    updates = None
    for t in range(steps):
        reps, state, updates = fn(reps, state, put(xs[t]), put(ys[t]), given)
    return reps, state, updates


@pytest.mark.parametrize(
    "make",
    [
        lambda: jc.diloco(optax.adamw(3e-3), "replica", sync_every=2),
        lambda: jc.local_sgd(optax.sgd(0.1), "replica", sync_every=2),
    ],
    ids=["diloco", "local_sgd"],
)
def test_fsdp_inside_the_replicas_of_diloco_and_local_sgd_is_data_parallel_exactly(make):
    """FSDP over "data" inside each replica of jc.diloco / jc.local_sgd gives data parallel's
    params bit for bit (4 steps, 2 syncs): the outer exchange averages each shard over the
    replicas. Until 2026-11-27 it failed while tracing ("cond branches must have equal output
    types": the sync's non-finite flag differed per shard)."""
    fsdp, _, _ = _train_replicas(make(), fsdp=True)
    dp, _, _ = _train_replicas(make(), fsdp=False)
    for a, b in zip(jax.tree.leaves(fsdp), jax.tree.leaves(dp), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fsdp_inside_diloco_with_a_codec_is_within_int8_error():
    tx = lambda: jc.diloco(
        optax.adamw(3e-3), "replica", sync_every=2, codec=jc.int_quant(8), min_size=0
    )  # noqa: E731
    fsdp, _, _ = _train_replicas(tx(), fsdp=True)
    dp, _, _ = _train_replicas(tx(), fsdp=False)
    for a, b in zip(jax.tree.leaves(fsdp), jax.tree.leaves(dp), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(a - b)) <= 1e-4 * np.max(np.abs(b))  # measured: the largest difference
        # synced: the replicas agree, up to the float32 rounding of p + u (docs/lm.md)
        np.testing.assert_allclose(a[0], a[1], rtol=0, atol=1e-6 * np.max(np.abs(b)))


def test_a_nonfinite_shard_skips_the_sync_of_every_shard():
    """A NaN in one device's shard gradient (replica 0, shard 0) at a sync: every device's
    update is NaN and its whole state stays as it was, not only the devices of that shard
    (each shard's mean is exchanged by its own devices: their flags were their own)."""
    tx = jc.diloco(optax.sgd(0.1), "replica", sync_every=1)
    g = jax.tree.map(lambda a: jnp.ones((8, a.shape[0] // 4, *a.shape[1:])), _params())
    g["a"] = g["a"].at[0, 0, 0].set(jnp.nan)
    _, state, updates = _train_replicas(tx, fsdp=True, steps=1, grads=g)
    for u in jax.tree.leaves(updates):
        assert bool(jnp.all(jnp.isnan(u)))
    assert int(np.asarray(state.count)) == 0  # the sync is retried next step
    for a, p in zip(jax.tree.leaves(state.anchor), jax.tree.leaves(_params()), strict=True):
        np.testing.assert_array_equal(np.asarray(a).reshape(2, *p.shape)[0], p)


# --------------------------------------------------------------------------- clipping shards


def _clip_shards(tx, g, m, spec):
    """``tx.update`` of the shards of ``g`` (each device its block of ``spec``)."""
    update = lambda g: tx.update(g, None)[0]  # noqa: E731
    fn = jax.jit(jax.shard_map(update, mesh=m, in_specs=spec, out_specs=spec))
    put = lambda a: jax.device_put(a, NamedSharding(m, spec))  # noqa: E731
    return jax.tree.map(np.asarray, fn(jax.tree.map(put, g)))


def test_clipping_fsdp_shards_clips_the_whole_gradient():
    """jc.clip_by_global_norm(c, None, shard_axis="data") of FSDP shard gradients equals
    optax.clip_by_global_norm(c) of the whole gradient. Without shard_axis each shard was
    clipped by its own norm (at c sqrt(8)): another direction, no error."""
    m = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:8])
    k = jax.random.split(jax.random.PRNGKey(4), 2)
    g = {"a": jax.random.normal(k[0], (32, 16)), "b": jax.random.normal(k[1], (8,)) * 5}
    g["a"] = g["a"].at[:4].multiply(20.0)  # one device's shard much larger than the others
    want = jax.tree.map(np.asarray, optax.clip_by_global_norm(3.0).update(g, None)[0])
    got = _clip_shards(jc.clip_by_global_norm(3.0, None, shard_axis="data"), g, m, P("data"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
    old = _clip_shards(jc.clip_by_global_norm(3.0, "data"), g, m, P("data"))
    rel = float(np.linalg.norm(old["a"] - want["a"]) / np.linalg.norm(want["a"]))
    assert rel > 0.5, rel
    # Finite values whose norm overflows float32 in one shard: clipped along the direction.
    huge = {"a": jnp.zeros((32, 16)).at[0, 0].set(3e38).at[9, 1].set(-2e38), "b": jnp.ones(8)}
    got = _clip_shards(jc.clip_by_global_norm(1.0, None, shard_axis="data"), huge, m, P("data"))
    norm = np.sqrt(3.0**2 + 2.0**2)
    assert got["a"][0, 0] == pytest.approx(3 / norm, rel=1e-6)
    assert got["a"][9, 1] == pytest.approx(-2 / norm, rel=1e-6)
    assert np.all(got["b"] == 0) or float(np.max(np.abs(got["b"]))) < 1e-37
    # A NaN in one shard stays NaN; an inf in one shard makes the clipped gradient non-finite.
    tx = jc.clip_by_global_norm(1.0, None, shard_axis="data")
    for bad in (jnp.nan, jnp.inf):
        got = _clip_shards(tx, {"a": g["a"].at[5, 0].set(bad)}, m, P("data"))
        assert not np.all(np.isfinite(got["a"])), bad


def test_clipping_hsdp_shards_per_replica_at_c_sqrt_n():
    """A replica axis averaged after the clipping (HSDP): each replica group's shards are
    clipped by its own whole gradient's norm, at c sqrt(2) (bound=False)."""
    m = _mesh_2x4()
    g = jax.random.normal(jax.random.PRNGKey(5), (2, 32, 16)) * 3  # replica r: g[r], rows over data
    tx = jc.clip_by_global_norm(1.0, "replica", shard_axis="data")
    got = _clip_shards(tx, g, m, P("replica", "data"))
    for r in range(2):
        want = np.asarray(optax.clip_by_global_norm(np.sqrt(2.0)).update(g[r], None)[0])
        np.testing.assert_allclose(got[r], want, rtol=2e-6, atol=1e-7)


def test_clipping_shard_axis_refuses_gradients_that_are_not_shards():
    m = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:8])
    tx = jc.clip_by_global_norm(1.0, None, shard_axis="data")
    fn = jax.jit(
        jax.shard_map(
            lambda g: tx.update(jax.lax.pmean(g, "data"), None)[0],
            mesh=m,
            in_specs=P("data"),
            out_specs=P(),
        )
    )
    with pytest.raises(ValueError, match="shard_axis"):
        fn(jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("data"))))
    with pytest.raises(ValueError, match="axis_name"):
        jc.clip_by_global_norm(1.0, None)
    with pytest.raises(TypeError, match="shard_axis"):
        jc.clip_by_global_norm(1.0, "data", shard_axis=3)


# --------------------------------------------------------------------------- error feedback


def _conservation(dtype, two_hops, steps=3):
    """Relative error of ``sum_t out_t + sum_j e_j = sum_t sum_j g_j`` per chunk after
    ``steps`` int4 reduce-scatters with error feedback, ``g_j`` the cotangent device ``j``
    puts on the gathered weights (exactly representable in ``dtype``)."""
    axes = ("host", "local") if two_hops else ("data",)
    m = jax.make_mesh(
        (2, 4) if two_hops else (8,),
        axes,
        axis_types=(AxisType.Explicit,) * len(axes),
        devices=jax.devices()[:8],
    )
    slow, inner = (axes[0], axes[1]) if two_hops else (axes[0], None)
    gather = functools.partial(
        jc.fsdp_gather, axis_name=slow, inner_axis_name=inner, weights=None, grads=jc.int_quant(4)
    )

    def f(w, c):
        r = jc.fsdp_residual(w, slow, inner)
        outs, cts = [], []
        for t in range(steps):
            ct = (c * (1.0 + 0.7 * t) + t).astype(dtype)  # this device's cotangent
            loss = lambda w, r: jnp.sum((ct * gather(w.astype(dtype), residual=r)).astype(F32))  # noqa: B023, E731
            g, r = jax.grad(loss, argnums=(0, 1))(w, r)
            outs.append(g)
            cts.append(ct.astype(F32))
        return sum(outs)[None], sum(cts)[None], r[None]

    spec = P(axes)
    fn = jax.jit(jax.shard_map(f, mesh=m, in_specs=(spec, spec), out_specs=spec))
    w = jnp.zeros((8 * 4, 16))
    c = jax.random.normal(jax.random.PRNGKey(6), (8 * 8 * 4, 16))  # per device: the whole leaf
    out, cts, res = (
        np.asarray(a, np.float64)
        for a in fn(*(jax.device_put(a, NamedSharding(m, spec)) for a in (w, c)))
    )
    exact = cts.sum(0).reshape(8, 4, 16)  # chunk i: rows of device i's shard
    total = out.copy()  # [device i, 4, 16]: what device i received, summed over the steps
    h_n = 2 if two_hops else 8
    for d in range(8):  # device d keeps, in row k of its residual, chunk k (one hop) or (k, l)
        for k in range(h_n):
            total[k * 4 + d % 4 if two_hops else k] += res[d, k]
    return float(np.linalg.norm(total - exact) / np.linalg.norm(exact))


F32 = jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
def test_error_feedback_conserves_the_sum_on_narrow_leaves(dtype):
    """Nothing is lost, only delayed: over 3 steps, what the devices received plus every
    device's residual is the sum of their cotangents, to float32 rounding. bf16 and fp16
    leaves lost the rounding of each returned chunk until 2026-11-27 (9e-4 and 1.1e-4 of the
    sum); each chunk's rounding is now kept, once, by the device that returns it."""
    assert _conservation(dtype, two_hops=False) < 1e-6


def test_error_feedback_over_two_hops_keeps_each_device_its_own_memory():
    """Two hops (2 hosts x 4 local devices): device (h, l) keeps the residual of chunks
    (h', l); the sum over steps is conserved only if each memory stays with its chunk."""
    assert _conservation(F32, two_hops=True) < 1e-6
