"""Dtypes and edge meshes through the stateless exchanges: float64 leaves, the identity codec,
an axis of one device, and ``jc.all_gather(..., to="invarying")``.

Float64 (``jax_enable_x64``): the documented choice (docs/index.md) is float32 inside, each
leaf back in its dtype, even through ``jc.identity()`` in ``jc.pmean`` / ``jc.psum`` and
the transforms, whose state is float32; ``jc.all_gather`` / ``jc.psum_scatter`` /
``jc.fsdp_gather`` with the identity are ``jax.lax``'s collectives, exact in any dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import N, mesh, per_device, shard
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

# digits below float32's resolution: 1 + 1e-9 is 1 in float32
TINY = 1e-9


def _x64(shape, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(1.0 + TINY * rng.standard_normal(shape), jnp.float64)


def test_identity_all_gather_of_float64_is_jax_lax_bit_for_bit():
    """``jc.all_gather(x, axis, jc.identity())`` sent every floating leaf through float32
    (its docstring: ``jax.lax.all_gather`` exactly): a float64 leaf of ``1 + 1e-9 z`` came
    back 2.95e-9 off (every digit below float32's lost); a bf16 leaf went as float32 on the
    wire. Now it is ``jax.lax.all_gather`` itself, as ``jc.psum_scatter`` was."""
    with jax.enable_x64(True):
        x = _x64((N, 16, 3))

        def step(a):
            ours = jc.all_gather(a[0], "data", jc.identity())
            stacked = jc.all_gather(a[0], "data", jc.identity(), axis=1, tiled=False)
            theirs = jax.lax.all_gather(a[0], "data", tiled=True)
            theirs_stacked = jax.lax.all_gather(a[0], "data", axis=1, tiled=False)
            return ours[None], stacked[None], theirs[None], theirs_stacked[None]

        o = per_device(step, P("data"), P("data"))(shard(x))
        assert o[0].dtype == jnp.float64 and o[1].dtype == jnp.float64
        np.testing.assert_array_equal(o[0], o[2])
        np.testing.assert_array_equal(o[1], o[3])
        np.testing.assert_array_equal(np.asarray(o[0])[0], np.asarray(x).reshape(N * 16, 3))


def test_identity_all_gather_of_bf16_sends_bf16():
    """The identity gathers a bf16 leaf in bf16 (jax.lax's bytes); before, as float32."""
    x = jnp.ones((N, 4096), jnp.bfloat16)
    ours = per_device(
        lambda a: jc.all_gather(a[0], "data", jc.identity())[None], P("data"), P("data")
    )
    theirs = per_device(
        lambda a: jax.lax.all_gather(a[0], "data", tiled=True)[None], P("data"), P("data")
    )
    # logical bytes: XLA:CPU compiles every bf16 collective as float32 (DESIGN.md)
    ours_bytes = jc.comm_report(ours.fn, shard(x)).logical_bytes_per_device
    theirs_bytes = jc.comm_report(theirs.fn, shard(x)).logical_bytes_per_device
    assert ours_bytes == theirs_bytes == (N - 1) * 4096 * 2


@pytest.mark.parametrize("codec", [jc.identity(), jc.int_quant(8), jc.sign()], ids=str)
def test_float64_through_pmean_keeps_float32_precision_in_its_dtype(codec):
    """The documented choice (docs/index.md, "float32 inside"): a float64 leaf comes back
    float64, averaged in float32, so digits below float32's resolution are lost even through
    the identity (``1 + 1e-9 z``: 1.2e-9 off the float64 mean, which ``jax.lax.pmean`` gives
    to 1e-16); psum likewise. Pinned so that a change to it is a decision, not an accident."""
    with jax.enable_x64(True):
        x = _x64((N, 4096))

        def step(a):
            return jc.pmean(a[0], "data", codec)[None], jc.psum(a[0], "data", codec)[None]

        mean, total = per_device(step, P("data"), P("data"))(shard(x))
        want = np.asarray(x).mean(0)
        assert mean.dtype == jnp.float64 and total.dtype == jnp.float64
        err = np.abs(np.asarray(mean)[0] - want).max()
        assert TINY / 10 < err < 1e-7  # float32's: the 1e-9 digits gone, nothing worse
        assert np.abs(np.asarray(total)[0] / N - want).max() < 1e-7


def test_float64_through_compressed_allreduce_keeps_float32_state():
    """Float64 gradients through a transform: float64 updates, float32 memories (the
    documented state dtype), finite; the mean held to float32's precision."""
    with jax.enable_x64(True):
        params = {"w": jnp.zeros((64, 32), jnp.float64)}
        tx = jc.compressed_allreduce(jc.int_quant(8), "data")
        m = mesh()
        state = jc.sharded_init(tx, params, m, "data")
        specs = jc.state_specs(state, "data")

        def step(g, s):
            u, s = tx.update({"w": g[0]}, s, params)
            return u["w"][None], s

        g = jnp.asarray(np.random.default_rng(1).standard_normal((N, 64, 32)), jnp.float64)
        u, state = per_device(step, (P("data"), specs), (P("data"), specs))(shard(g), state)
        assert u.dtype == jnp.float64
        floats = [a for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating)]
        assert floats and {str(a.dtype) for a in floats} == {"float32"}
        want = np.asarray(g).mean(0)
        rel = np.linalg.norm(np.asarray(u)[0] - want) / np.linalg.norm(want)
        assert rel < 2e-2  # int8's error, no worse for the float64 leaf


@pytest.mark.parametrize("codec", [jc.int_quant(8), jc.sign(), jc.top_k(0.25)], ids=str)
def test_complex_bool_and_uint8_leaves_are_gathered_and_scattered_exactly(codec):
    """Through a lossy codec, ``jc.all_gather`` / ``jc.psum_scatter`` leave complex, bool and
    integer leaves to ``jax.lax``'s collective: bit for bit, in their dtype (the codecs take
    real floats; a mask or a counter is never rounded)."""
    rng = np.random.default_rng(0)
    t = {
        "c": (rng.standard_normal((N, 16)) + 1j * rng.standard_normal((N, 16))).astype(
            np.complex64
        ),
        "u8": rng.integers(0, 255, (N, 16)).astype(np.uint8),
        "b": rng.random((N, 16)) > 0.5,
    }

    def step(a):
        a = jax.tree.map(lambda v: v[0], a)
        full = {"c": jnp.tile(a["c"], N), "i": jnp.tile(a["u8"], N).astype(jnp.int32)}
        out = (
            jc.all_gather(a, "data", codec),
            jax.lax.all_gather(a, "data", tiled=True),
            jc.psum_scatter(full, "data", codec),
            jax.lax.psum_scatter(full, "data", tiled=True),
        )
        return jax.tree.map(lambda v: v[None], out)

    ours, theirs, ours_s, theirs_s = per_device(step, P("data"), P("data"))(shard(t))
    for k in t:
        assert ours[k].dtype == t[k].dtype, k
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    for k in ours_s:
        assert ours_s[k].dtype == theirs_s[k].dtype, k
        np.testing.assert_array_equal(ours_s[k], theirs_s[k], err_msg=k)


# --------------------------------------------------------------------------- one device


def _mesh_8x1():
    return jax.make_mesh((N, 1), ("model", "data"), axis_types=(AxisType.Explicit,) * 2)


CODECS_1 = [jc.identity(), jc.int_quant(8), jc.sign(), jc.top_k(0.01), jc.random_k(0.01)]


@pytest.mark.parametrize("check_vma", [True, False])
def test_an_axis_of_one_device_passes_every_leaf_through_exactly(check_vma):
    """The mean (or sum) over an axis of one device is the value itself, as
    ``jax.lax.pmean`` gives it. The codecs ran there and added their error for nothing (a
    8 x 1 mesh, the exchange over the axis of 1, 65,536 values: int8 7.0e-3, sign 0.60,
    top-k 1% 0.96 relative off); now no codec runs. ``jc.all_gather`` / ``jc.psum_scatter``
    over it are the value too; the result typed as ``jax.lax`` types it (``P()`` over the
    axis under ``check_vma=True``)."""
    m = _mesh_8x1()
    rng = np.random.default_rng(0)
    x = {"w": rng.standard_normal((N, 1, 4096)).astype(np.float32)}
    x["h"] = x["w"][..., :64].astype(jnp.bfloat16)
    x["i"] = np.arange(N * 3, dtype=np.int32).reshape(N, 1, 3)
    key = jax.random.PRNGKey(0)

    def step(t):
        t = jax.tree.map(lambda a: a[0, 0], t)
        out, own = {}, {}
        for c in CODECS_1:
            k = key if c.stochastic or c.shared_randomness else None
            for kind, reduce in (("mean", jc.pmean), ("sum", jc.psum)):
                r = reduce(t, "data", c, key=k)
                out[f"{kind}_{c}"] = {"w": r["w"], "h": r["h"]}
                own[f"{kind}_{c}"] = r["i"]  # an int leaf: each device's own, untouched
        own["gather"] = jc.all_gather(t["w"], "data", jc.sign())  # varying, as jax.lax's
        own["scatter"] = jc.psum_scatter(t["w"], "data", jc.sign())
        return jax.tree.map(lambda a: a[None], out), jax.tree.map(lambda a: a[None, None], own)

    # the means and sums replicated over "data" (P("model")): the reduction's result type
    specs = (P("model"), P("model", "data"))
    f = jax.jit(
        jax.shard_map(
            step, mesh=m, in_specs=P("model", "data"), out_specs=specs, check_vma=check_vma
        )
    )
    o, own = jax.block_until_ready(f(jax.device_put(x, NamedSharding(m, P("model", "data")))))
    want = jax.tree.map(lambda a: np.asarray(a)[:, 0], x)
    for c in CODECS_1:
        for kind in ("mean", "sum"):
            got = {**o[f"{kind}_{c}"], "i": np.asarray(own[f"{kind}_{c}"])[:, 0]}
            for k in want:
                assert got[k].dtype == want[k].dtype, (kind, c, k)
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"{kind} {c} {k}")
    np.testing.assert_array_equal(np.asarray(own["gather"])[:, 0], want["w"])
    np.testing.assert_array_equal(np.asarray(own["scatter"])[:, 0], want["w"])


def test_float64_over_one_device_is_exact():
    """Over an axis of one device a float64 leaf comes back bit for bit through any codec,
    ``jc.psum`` too (its ``n * mean`` is formed in float32 where ``n > 1``, which would round
    ``1 + 1e-9`` to 1: not for one device)."""
    m = _mesh_8x1()
    with jax.enable_x64(True):
        x = _x64((N, 1, 512))

        def step(a):
            a = a[0, 0]
            return jc.pmean(a, "data", jc.int_quant(8))[None], jc.psum(a, "data", jc.sign())[None]

        f = jax.jit(
            jax.shard_map(
                step, mesh=m, in_specs=P("model", "data"), out_specs=(P("model"), P("model"))
            )
        )
        mean, total = f(jax.device_put(x, NamedSharding(m, P("model", "data"))))
        assert mean.dtype == total.dtype == jnp.float64
        np.testing.assert_array_equal(mean, np.asarray(x)[:, 0])
        np.testing.assert_array_equal(total, np.asarray(x)[:, 0])


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_slow_axis_of_one_host_is_the_fast_axiss_float32_mean(check_vma):
    """Two hops on one host (a 1 x 8 mesh, ``axis_name`` "host" of 1, ``inner_axis_name``
    "local" of 8): the codec ran over the axis of one host and added its error (65,536
    values: int8 6.9e-3, sign 0.60, top-k 1% 0.96 relative off; 917,518 bytes per device
    against ``jax.lax.pmean``'s 458,752). Now every leaf is the float32 mean over "local":
    ``jax.lax.pmean``'s bits and bytes; ``jc.all_gather`` / ``jc.psum_scatter`` are
    ``jax.lax``'s over both axes."""
    m = jax.make_mesh((1, N), ("host", "local"), axis_types=(AxisType.Explicit,) * 2)
    x = np.random.default_rng(0).standard_normal((1, N, 1 << 16)).astype(np.float32)
    both = ("host", "local")
    spec = P("host", "local")

    def program(fn):
        return jax.jit(
            jax.shard_map(
                lambda a: fn(a[0, 0])[None, None],
                mesh=m,
                in_specs=spec,
                out_specs=spec,
                check_vma=check_vma,
            )
        )

    xs = jax.device_put(x, NamedSharding(m, spec))
    lax_mean = program(lambda a: jax.lax.pmean(a, both))
    want = np.asarray(lax_mean(xs))
    want_bytes = jc.comm_report(lax_mean, xs).bytes_per_device
    for c in (jc.int_quant(8), jc.sign(), jc.top_k(0.01)):
        ours = program(lambda a, c=c: jc.pmean(a, "host", c, inner_axis_name="local"))
        np.testing.assert_array_equal(np.asarray(ours(xs)), want, err_msg=str(c))
        assert jc.comm_report(ours, xs).bytes_per_device == want_bytes, c
    gather = program(lambda a: jc.all_gather(a, "host", jc.sign(), inner_axis_name="local"))
    lax_gather = program(lambda a: jax.lax.all_gather(a, both, tiled=True))
    np.testing.assert_array_equal(np.asarray(gather(xs)), np.asarray(lax_gather(xs)))
    scatter = program(lambda a: jc.psum_scatter(a, "host", jc.sign(), inner_axis_name="local"))
    lax_scatter = program(lambda a: jax.lax.psum_scatter(a, both, tiled=True))
    np.testing.assert_array_equal(np.asarray(scatter(xs)), np.asarray(lax_scatter(xs)))


def test_fsdp_gather_over_one_device_is_jax_lax():
    """``jc.fsdp_gather`` (int8 weights, int4 gradients) over an axis of one device: the
    codecs ran and added their error (a 256 x 64 shard: weights 6.9e-3, the gradient 0.13
    relative off ``jax.lax.all_gather``'s); now both hops are ``jax.lax``'s, bit for bit, and
    a residual is added to the gradient, the new one zero."""
    m1 = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    x = rng.standard_normal((32, 256)).astype(np.float32)
    r = rng.standard_normal((1, 256, 64)).astype(np.float32)

    def loss(gather, w, x):
        return jnp.sum((x @ gather(w)) ** 2) / 2

    def step(w, r, x):
        lax = lambda w: jax.lax.all_gather(w, "data", tiled=True)  # noqa: E731
        ours = lambda w, r: jc.fsdp_gather(w, "data", residual=r)  # noqa: E731
        g_ours, r_new = jax.grad(lambda w, r: loss(lambda w: ours(w, r), w, x), (0, 1))(w, r)
        return ours(w, r), lax(w), g_ours, jax.grad(lambda w: loss(lax, w, x))(w), r_new

    f = jax.jit(
        jax.shard_map(
            step,
            mesh=m1,
            in_specs=(P("data"), P("data"), P()),
            out_specs=(P(), P(), P("data"), P("data"), P("data")),
            check_vma=False,
        )
    )
    put = lambda a, s: jax.device_put(a, NamedSharding(m1, s))  # noqa: E731
    got, want, g, g_lax, r_new = f(put(w, P("data")), put(r, P("data")), put(x, P()))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(g, np.asarray(g_lax) + r[0])
    np.testing.assert_array_equal(r_new, 0.0)


def test_a_transform_over_one_device_still_compresses_and_holds_back_the_rest():
    """The documented choice for the transforms (docs/index.md): over an axis of one device
    ``jc.compressed_allreduce`` still runs its codec (a one-device run shows the codec's
    effect on training), and what it drops is held back, not lost: output + memory is the
    gradient (sign, 65,536 values: the output 0.60 relative off the gradient)."""
    m1 = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    params = {"w": jnp.zeros((1 << 16,), jnp.float32)}
    tx = jc.compressed_allreduce(jc.sign(), "data")
    state = jc.sharded_init(tx, params, m1, "data")
    specs = jc.state_specs(state, "data")

    def step(g, s):
        u, s = tx.update({"w": g[0]}, s, params)
        return u["w"][None], s

    f = jax.jit(
        jax.shard_map(step, mesh=m1, in_specs=(P("data"), specs), out_specs=(P("data"), specs))
    )
    g = np.random.default_rng(0).standard_normal((1, 1 << 16)).astype(np.float32)
    u, state = jax.block_until_ready(f(jax.device_put(g, NamedSharding(m1, P("data"))), state))
    memory = np.asarray(state.memory["w"]).reshape(g.shape)
    rel = np.linalg.norm(np.asarray(u) - g) / np.linalg.norm(g)
    assert 0.5 < rel < 0.7
    np.testing.assert_allclose(np.asarray(u) + memory, g, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- to="invarying"


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("codec", [jc.identity(), jc.int_quant(8)], ids=str)
def test_all_gather_to_invarying_leaves_replicated(codec, check_vma):
    """``jc.all_gather(..., to="invarying")`` as ``jax.lax.all_gather``'s: under
    ``check_vma=True`` the result may leave with ``out_specs`` ``P()`` (the default
    ``"varying"`` cannot: jax refuses "out_specs ... can't be statically inferred"), with the
    values of ``to="varying"``; one hop and two (``inner_axis_name``), an empty leaf too."""
    w = jnp.round(jax.random.normal(jax.random.PRNGKey(0), (N * 4, 6)) * 4)
    tree = {"w": w, "e": jnp.zeros((N * 2, 0))}

    def gathered(t, to):
        return jc.all_gather(t, "data", codec, to=to)

    f = jax.jit(
        jax.shard_map(
            lambda t: gathered(t, "invarying"),
            mesh=mesh(),
            in_specs=P("data"),
            out_specs=P(),
            check_vma=check_vma,
        )
    )
    got = jax.block_until_ready(f(jax.device_put(tree, NamedSharding(mesh(), P("data")))))
    want = per_device(
        lambda t: jax.tree.map(lambda a: a[None], gathered(t, "varying")), P("data"), P("data")
    )(shard(tree))
    np.testing.assert_array_equal(got["w"], np.asarray(want["w"])[0])
    assert got["e"].shape == (N * 2, 0)
    m2 = jax.make_mesh((2, 4), ("host", "local"), axis_types=(AxisType.Explicit,) * 2)
    two = jax.jit(
        jax.shard_map(
            lambda a: jc.all_gather(a, "host", codec, inner_axis_name="local", to="invarying"),
            mesh=m2,
            in_specs=P(("host", "local")),
            out_specs=P(),
            check_vma=check_vma,
        )
    )
    got2 = jax.block_until_ready(two(jax.device_put(w, NamedSharding(m2, P(("host", "local"))))))
    np.testing.assert_array_equal(got2, np.asarray(want["w"])[0])
    if check_vma:
        with pytest.raises(ValueError, match="out_specs"):
            jax.jit(
                jax.shard_map(
                    lambda t: gathered(t, "varying"), mesh=mesh(), in_specs=P("data"), out_specs=P()
                )
            ).lower(jax.device_put(tree, NamedSharding(mesh(), P("data"))))
