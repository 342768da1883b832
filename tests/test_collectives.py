"""jc.psum / jc.pmean: every strategy against the exact mean, on 8 devices."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import N, mesh, per_device, rel_err, shard, stacked_normal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.codecs.quantize import Cast

# Relative error of the mean allowed per codec (gradients with mean 1, noise 1).
TOLERANCE = {"identity": 1e-6, "fp16": 2e-3, "bf16": 1e-2, "int8": 2e-2, "int4": 0.25}
CODEC_NAMES = ["identity", "fp16", "bf16", "int8", "int4", "sign", "qsgd", "natural"]


def pmean_fn(codec, strategy, **kw):
    def f(t, key):
        return jc.pmean(
            jax.tree.map(lambda a: a[0], t), "data", codec, key=key, strategy=strategy, **kw
        )

    return per_device(f, (P("data"), P()), P())


def pmean_many_fn(names, strategy):
    """One program: jc.pmean of the same per-device input with each codec in ``names``."""

    def f(t, key):
        t = t[0]
        return {n: jc.pmean(t, "data", jc.get_codec(n), key=key, strategy=strategy) for n in names}

    return per_device(f, (P("data"), P()), P())


@functools.cache
def _means(strategy):
    """(input, {codec name: jc.pmean of it}): one compiled program per strategy for every
    codec of CODEC_NAMES it takes (allreduce: the summable ones)."""
    names = [n for n in CODEC_NAMES if strategy != "allreduce" or jc.get_codec(n).summable]
    x = stacked_normal(0, (3000,), offset=1.0)
    return x, pmean_many_fn(names, strategy)(shard(x), jax.random.PRNGKey(1))


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("strategy", ["auto", "allgather", "two_phase", "allreduce"])
def test_pmean_matches_mean(name, strategy):
    codec = jc.get_codec(name)
    if strategy == "allreduce" and not codec.summable:
        pytest.skip("not summable")
    x, outs = _means(strategy)
    out = outs[name]
    err = rel_err(out, x.mean(0))
    assert err <= TOLERANCE.get(name, 1.0), (name, strategy, err)
    assert out.dtype == jnp.float32 and out.shape == (3000,)


def test_psum_is_n_times_pmean_and_dtypes_kept():
    x = stacked_normal(2, (500,), offset=1.0)
    tree = {
        "w": x,
        "h": x[:, :100].astype(jnp.bfloat16),
        "i": 7 * jnp.arange(N * 3, dtype=jnp.int32).reshape(N, 3),  # a step counter
        "c": (x[:, :4] + 1j * x[:, 4:8]).astype(jnp.complex64),
        "ok": jnp.arange(N * 2).reshape(N, 2) % 3 == 0,
    }

    def f(t):
        t = jax.tree.map(lambda a: a[0], t)
        return jc.psum(t, "data", jc.identity()), jc.pmean(t, "data", jc.int_quant(8))

    def lax(t):
        t = jax.tree.map(lambda a: a[0], t)
        return jax.lax.psum(t, "data"), jax.lax.pmean(t, "data")

    specs = {"w": P(), "h": P(), "i": P("data"), "c": P(), "ok": P("data")}  # ints: per device
    total, mean = per_device(f, P("data"), (specs, specs))(shard(tree))
    want_total, want_mean = per_device(lax, P("data"), P())(shard(tree))
    np.testing.assert_allclose(total["w"], x.sum(0), rtol=1e-5)
    assert total["h"].dtype == jnp.bfloat16 and mean["h"].dtype == jnp.bfloat16
    # Integer and bool leaves pass through (DESIGN.md): each device's own value, its dtype.
    for k in ("i", "ok"):
        for ours in (total, mean):
            assert ours[k].dtype == tree[k].dtype, k
            np.testing.assert_array_equal(ours[k], np.ravel(tree[k]), err_msg=k)
    # Complex leaves are reduced exactly as jax.lax does (they were returned untouched
    # before: each device its own value).
    for ours, theirs in ((total, want_total), (mean, want_mean)):
        assert ours["c"].dtype == jnp.complex64
        np.testing.assert_array_equal(ours["c"], theirs["c"])


def test_bf16_and_fp16_leaves_any_shape():
    x = stacked_normal(3, (4, 5, 6), offset=1.0).astype(jnp.float16)
    out = pmean_fn(jc.int_quant(8), "auto")(shard(x), jax.random.PRNGKey(0))
    assert out.dtype == jnp.float16 and out.shape == (4, 5, 6)
    assert rel_err(out.astype(jnp.float32), x.astype(jnp.float32).mean(0)) < 2e-2


def test_zero_in_zero_out_all_strategies():
    names = ("sign", "signsgd", "int4", "qsgd", "terngrad", "natural")
    for strategy in ("allgather", "two_phase"):  # one program per strategy, every codec in it
        outs = pmean_many_fn(names, strategy)(shard(jnp.zeros((N, 100))), jax.random.PRNGKey(0))
        assert sorted(outs) == sorted(names)
        for name, out in outs.items():
            assert out.shape == (100,), name
            np.testing.assert_array_equal(out, 0.0, err_msg=f"{name} {strategy}")


@pytest.mark.parametrize("strategy", ["allgather", "two_phase"])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_nonfinite_on_one_device_poisons_every_device(strategy, bad):
    x = stacked_normal(4, (200,)).at[3, 17].set(bad)
    f = per_device(
        lambda t: jc.pmean(t[0], "data", jc.threshold_2bit(10.0), strategy=strategy),
        P("data"),
        P("data"),
    )
    out = f(shard(x)).reshape(N, 200)
    # 2-bit thresholding would silently drop the NaN; jaxcomp must not.
    assert bool(jnp.all(~jnp.isfinite(out).all(axis=1)))


@pytest.mark.parametrize("strategy", ["allgather", "two_phase"])
def test_scaled_fp16_flag_from_its_scales(strategy):
    """The scaled cast's step flag reads its scales alone (``Codec.flag_arrays``), not the
    payloads every device received: a NaN, inf or -inf on one device still poisons every
    device, and gradients near float32's largest value on every device (whose sum
    overflows float32 in their own units) average to a finite mean within fp16's rounding,
    not to an inf that a flag from the scales would let through."""
    c = jc.cast("fp16")
    f = per_device(lambda t: jc.pmean(t[0], "data", c, strategy=strategy), P("data"), P("data"))
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        out = f(shard(stacked_normal(4, (200,)).at[3, 17].set(bad))).reshape(N, 200)
        assert not bool(jnp.isfinite(out).all(axis=1).any()), (strategy, bad)
    u = np.asarray(jax.random.uniform(jax.random.PRNGKey(7), (N, 200)))
    big = jnp.asarray((3.0e38 * (0.5 + 0.5 * u)).astype(np.float32))  # up to 3.0e38
    out = np.asarray(f(shard(big)).reshape(N, 200), np.float64)
    mean = np.asarray(big, np.float64).mean(0)
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - mean) / mean) <= 2.0**-10  # two fp16 roundings


@pytest.mark.parametrize("strategy", ["two_phase", "allgather"])
def test_scaled_fp16_flag_does_not_read_the_gathered_values(strategy):
    """Compiled, the scaled cast's pmean moves at least the gathered float16 values' bytes
    (and at most 1.2x that) less than the same codec with the default flag (every float
    received is checked): the read that ``flag_arrays`` saves (``hot_path.hlo_traffic``)."""
    from benchmarks import hot_path

    @dataclasses.dataclass(frozen=True)
    class EveryFloat(Cast):
        def flag_arrays(self, payloads):
            return None

    d = 1 << 16
    x = shard(stacked_normal(3, (d,)))
    traffic = []
    for codec in (jc.cast("fp16"), EveryFloat("float16", True)):
        f = per_device(
            lambda v, c=codec: jc.pmean(v[0], "data", c, strategy=strategy), P("data"), P()
        )
        traffic.append(hot_path.hlo_traffic(f.lower(x).compile().as_text()))
    gathered = 2 * d * (N if strategy == "allgather" else 1)  # float16 bytes a device holds
    assert gathered <= traffic[1] - traffic[0] <= 1.2 * gathered, (traffic, gathered)


def test_unbound_axis_and_bad_arguments():
    with pytest.raises(ValueError, match="'batch'"):
        per_device(lambda t: jc.pmean(t, "batch", jc.sign()), P("data"), P())(
            shard(jnp.ones((N, 4)))
        )
    with pytest.raises(ValueError, match="strategy"):
        jc.pmean(jnp.ones(3), "data", jc.sign(), strategy="ring")
    with pytest.raises(ValueError, match="summable"):
        per_device(lambda t: jc.pmean(t, "data", jc.sign(), strategy="allreduce"), P("data"), P())(
            shard(jnp.ones((N,)))
        )
    with pytest.raises(TypeError, match="codec"):
        jc.pmean(jnp.ones(3), "data", "int8")
    with pytest.raises(ValueError, match="key"):
        per_device(lambda t: jc.pmean(t, "data", jc.qsgd()), P("data"), P())(shard(jnp.ones((N,))))


def test_pmap_works():
    x = stacked_normal(5, (1000,), offset=1.0)
    f = jax.pmap(
        lambda t, k: jc.pmean(t, "i", jc.int_quant(8), key=k), axis_name="i", in_axes=(0, None)
    )
    out = f(x, jax.random.PRNGKey(0))
    assert rel_err(out[0], x.mean(0)) < 2e-2
    np.testing.assert_array_equal(out[0], out[5])


def test_auto_strategy_choices():
    d = 1 << 20
    assert jc.choose_strategy(jc.cast("fp16", scaled=False), d, 8) == "allreduce"
    assert jc.choose_strategy(jc.sign(), d, 8) == "two_phase"
    assert jc.choose_strategy(jc.int_quant(8), d, 8) == "two_phase"
    assert jc.choose_strategy(jc.int_quant(8), d, 2) == "allgather"  # a tie: fewer encodes
    costs = jc.strategy_bytes(jc.sign(), d, 8)
    assert costs["allgather"] / costs["two_phase"] == pytest.approx(4.0, rel=0.01)


@pytest.mark.parametrize("bucket_bytes", [2**25, 1])
def test_payloads_travel_in_buckets(bucket_bytes):
    """20 leaves, sign over all-gather: one all-gather per bucket, whatever the leaf count
    (bucket_bytes=1: each payload array travels alone, two per leaf: words and scale)."""
    tree = {f"w{i}": jnp.zeros((N, 64, 32)) for i in range(20)}
    fn = per_device(
        lambda t: jc.pmean(
            jax.tree.map(lambda a: a[0], t),
            "data",
            jc.sign(),
            strategy="allgather",
            bucket_bytes=bucket_bytes,
        ),
        P("data"),
        P(),
    )
    report = jc.comm_report(fn, shard(tree))
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    # sign's payload: uint32 words and one float32 scale per leaf, two dtypes: two buckets.
    assert len(gathers) == (2 if bucket_bytes > 1 else 40)
    out = fn(shard(tree))
    assert all(float(jnp.abs(v).max()) == 0.0 for v in out.values())


def test_two_phase_top_k_splits_its_slots_so_the_owner_drops_nothing():
    """top_k's two phases: k1 = max(1, 2k // (n + 1), 2k - c) per device, k2 = 2k - k1 for
    the owner (>= n k1 or = c), so the mean of what the devices sent arrives whole, at the
    bytes of k and k."""
    first, second = jc.top_k(0.01).phase_codecs(8192, N)
    assert (first.size(8192), second.size(8192)) == (18, 146)  # k = 82
    assert first.payload_bytes(8192) + second.payload_bytes(8192) == 2 * 8 * 82
    assert jc.top_k(0.01).phase_codecs(8192, 1) == (jc.top_k(0.01),) * 2  # one device: k, k
    dense = jc.top_k(0.75).phase_codecs(192, N)  # k = 144: k1 = 2k - c = 96, k2 = c
    assert (dense[0].size(192), dense[1].size(192)) == (96, 192)
    assert jc.sign().phase_codecs(8192, N) == (jc.sign(),) * 2
    # 8 devices x 400 floats: chunks of 50, k = 5 -> each device sends 1 per chunk, the
    # owner up to 9 >= 8: the exact mean of every device's largest entry of each chunk.
    x = stacked_normal(6, (400,))
    fn = pmean_fn(jc.top_k(0.1), "two_phase")
    out = np.asarray(fn(shard(x), jax.random.PRNGKey(0)))
    rows = np.asarray(x).reshape(N, N, 50)
    kept = np.where(np.abs(rows) == np.abs(rows).max(-1, keepdims=True), rows, 0.0)
    np.testing.assert_allclose(out, kept.reshape(N, 400).mean(0), rtol=1e-6, atol=1e-7)
    report = jc.comm_report(fn, shard(x), jax.random.PRNGKey(0))
    payloads = [c for c in report.collectives if c.kind in ("all-to-all", "all-gather")]
    # 2 (n - 1) * 8 bytes * 5 slots: the bytes of the even split (k = 5 and 5).
    assert sum(c.bytes_per_device for c in payloads) == 560
    assert jc.strategy_bytes(jc.top_k(0.1), 400, N)["two_phase"] == 560


def test_two_phase_random_k_owner_resends_the_indices_the_devices_drew():
    """random_k through two_phase: every device draws chunk j's indices from the same key, so
    the owner's sum has k nonzeros; its re-encoding (top-k of those k, same bytes) sends them
    all. The mean is the random-k of the mean chunk by chunk, 8 * 26 = 208 values (a second
    random-k from another key kept 13 of 4,096, scaled twice: a single mean 22x its norm away,
    SGD on a convex problem diverged)."""
    codec = jc.random_k(0.05)
    first, second = codec.phase_codecs(512, N)
    assert first == codec and (second.size(512), second.approx) == (26, "exact")
    assert second.payload_bytes(512) == codec.payload_bytes(512)
    x = stacked_normal(7, (4096,), offset=1.0)
    out = np.asarray(pmean_fn(codec, "two_phase")(shard(x), jax.random.PRNGKey(3)))
    # Chunk by chunk (512 floats), one coordinate of each of the 26 strata, the mean there
    # times the stratum's size: random-k of the mean, as one shared draw per chunk sends it.
    mean = np.asarray(x, np.float64).mean(0).reshape(N, 512)
    starts, sizes = codec.strata(512)
    for chunk, m in zip(out.reshape(N, 512), mean, strict=True):
        for start, size in zip(starts, sizes, strict=True):
            (hit,) = np.flatnonzero(chunk[start : start + size]) + start
            np.testing.assert_allclose(chunk[hit], size * m[hit], rtol=2e-6)
    assert int((out != 0).sum()) == 208
    assert jc.strategy_bytes(codec, 4096, N)["two_phase"] == 2 * (N - 1) * 8 * 26


def test_scaled_fp16_pmean_small_gradients_exact_wire_bytes():
    """The default fp16 cast (scaled) averages gradients of 1e-7 over 8 devices to fp16's
    relative rounding, two_phase (float32 sums) at the bytes of the cost model, which
    ``comm_report`` reads from the compiled program (one f32 scale per chunk); unscaled
    fp16 psums x / 8, under fp16's smallest normal, and loses 5% and more."""
    tree = {"w": stacked_normal(11, (64, 256), offset=0.0) * 1e-7}
    want = tree["w"].mean(0)
    d = 64 * 256
    for codec, bound in ((jc.cast("fp16"), 2e-3), (jc.cast("fp16", scaled=False), None)):
        fn = per_device(
            lambda t, c=codec: jc.pmean(jax.tree.map(lambda a: a[0], t), "data", c), P("data"), P()
        )
        out = fn(shard(tree))["w"]
        err = rel_err(out, want)
        if bound is None:
            assert err > 0.05, err
            continue
        assert err < bound, err
        report = jc.comm_report(fn, shard(tree))
        payload = [c for c in report.collectives if c.kind in ("all-to-all", "all-gather")]
        assert (
            sum(c.bytes_per_device for c in payload)
            == jc.strategy_bytes(codec, d, N)["two_phase"]
            == 2 * (N - 1) * (2 * d // N + 4)
        )


def test_vmap_axis_name_gives_the_numbers_of_shard_map():
    """``jax.vmap(..., axis_name="data")`` binds the axis without shard_map's varying types,
    and jax refuses ``jax.lax.pcast`` and ``all_gather(to="invarying")`` there ("pvary should
    be called under jax.shard_map"): every exchange that gathers (int8 two-phase, top-k) and
    1-bit Adam's idle branch raised. They are type annotations only, left out for such axes:
    devices emulated on one give the bits of 8 devices."""
    x = {"w": stacked_normal(3, (3000,)), "b": stacked_normal(4, (33,))}
    key = jax.random.PRNGKey(5)
    for codec in (jc.int_quant(8), jc.top_k(0.01), jc.sign()):
        body = functools.partial(jc.pmean, axis_name="data", codec=codec, key=key)
        ref = per_device(
            lambda t, b=body: jax.tree.map(lambda a: a[None], b(jax.tree.map(lambda a: a[0], t))),
            P("data"),
            P("data"),
        )(shard(x))
        out = jax.jit(jax.vmap(body, axis_name="data"))(x)  # one program, not op by op
        tol = 0 if codec.name.startswith(("Int", "TopK")) else 1e-6  # sign: a float psum
        jax.tree.map(lambda a, b, t=tol: np.testing.assert_allclose(a, b, atol=t), out, ref)
    tx = jc.onebit_adam(1e-3, "data", freeze_step=1)
    params = {"w": jnp.zeros((40, 50))}
    state = jax.jit(jax.vmap(tx.init, in_axes=None, axis_name="data", axis_size=N))(params)
    step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="data"))
    for t in range(2):  # the warm-up, then a 1-bit step
        out, state = step({"w": stacked_normal(t, (40, 50))}, state)
    assert np.isfinite(np.asarray(out["w"])).all() and float(jnp.abs(out["w"]).max()) > 0
    np.testing.assert_array_equal(out["w"][0], out["w"][N - 1])  # the same step everywhere


def test_random_k_with_per_device_keys_under_pmap_is_one_mean_everywhere():
    """``pmap`` and ``check_vma=False`` type every key invariant, so a per-device key
    (``jax.random.split`` into ``pmap``) reached random-k unrefused: each device drew its own
    coordinates, the psum added values of different coordinates and each device decoded a
    different wrong mean (``jc.psum_scatter`` the same). The keys are now made one over the
    axis (a ``pmax`` of their words): every device gets ``(d/k) P_S(mean)`` for one draw ``S``."""
    x = stacked_normal(11, (64,))
    keys = jax.random.split(jax.random.key(3), N)  # one key per device
    codec = jc.random_k(0.5)

    def check(out, exact, d):
        out = np.asarray(out)
        for row in out:  # every device the same answer
            np.testing.assert_array_equal(row, out[0])
        kept = out[0] != 0
        assert kept.sum() == d // 2  # one draw of k = d/2 coordinates
        np.testing.assert_allclose(out[0][kept], 2 * exact[kept], rtol=1e-5, atol=1e-6)

    mean = jax.pmap(lambda v, k: jc.pmean(v, "i", codec, key=k), axis_name="i")(x, keys)
    check(mean, np.asarray(x).mean(0), 64)
    off = jax.jit(
        jax.shard_map(
            lambda v, k: jc.psum(v[0], "data", codec, key=k[0])[None],
            mesh=mesh(),
            in_specs=(P("data"), P("data")),
            out_specs=P("data"),
            check_vma=False,
        )
    )(shard(x), shard(keys))
    check(off, np.asarray(x).sum(0), 64)
    scattered = jax.pmap(lambda v, k: jc.psum_scatter(v, "i", codec, key=k), axis_name="i")
    out = np.asarray(scattered(x, keys)).reshape(1, -1)  # device i holds chunk i of the sum
    check(out, np.asarray(x).sum(0), 64)


def test_vmap_axes_in_a_tuple_give_the_numbers_of_a_2d_mesh():
    """Reducing over ``("i", "j")`` where ``jax.vmap`` binds ``i`` (``vmap(pmap)``) or both
    (``vmap(vmap)``): jax's all_gather over such a tuple failed while batching ("axis size
    doesn't match"), and jax batched an all_to_all operand that does not vary over a vmap
    axis (random-k's shared indices) into the wrong shape (verifier error at lowering;
    ``vmap`` alone over ``"j"``: "Bounds of the scatter dimensions"). Now the bits of a 2 x 4
    ``shard_map`` mesh."""
    y = stacked_normal(7, (300,)).reshape(2, 4, 300)
    key = jax.random.PRNGKey(2)
    m = jax.make_mesh((2, 4), ("i", "j"), devices=jax.devices()[:8])
    for codec, strategy in ((jc.int_quant(8), "allgather"), (jc.random_k(0.5), "two_phase")):
        body = functools.partial(
            jc.pmean, axis_name=("i", "j"), codec=codec, key=key, strategy=strategy
        )
        ref = jax.jit(
            jax.shard_map(
                lambda v, b=body: b(v[0, 0])[None, None],
                mesh=m,
                in_specs=P("i", "j"),
                out_specs=P("i", "j"),
            )
        )(jax.device_put(y, jax.NamedSharding(m, P("i", "j"))))
        nested = jax.jit(jax.vmap(jax.vmap(body, axis_name="j"), axis_name="i"))(y)
        np.testing.assert_array_equal(nested, ref)
        np.testing.assert_array_equal(
            jax.vmap(jax.pmap(body, axis_name="j"), axis_name="i")(y), ref
        )
    one = functools.partial(
        jc.pmean, axis_name="j", codec=jc.random_k(0.5), key=key, strategy="two_phase"
    )
    out = jax.jit(jax.vmap(one, axis_name="j"))(y[0])
    np.testing.assert_array_equal(out, jax.pmap(one, axis_name="j")(y[0]))


def test_grad_through_pmean_and_psum_is_that_of_jax_lax():
    """``jax.grad`` through ``jc.pmean`` / ``jc.psum`` (a drop-in inside a user's loss, e.g.
    ``jc.pmean(loss(p), "data", codec)``) differentiated the codec as written: through int8's
    rounding and sign the gradient was 0, through top-k it kept a few coordinates. It is now
    ``jax.lax``'s own (straight-through), under ``pmap`` and ``shard_map`` with and without
    ``check_vma``; the forward pass is unchanged."""
    x = stacked_normal(3, (40,))
    w = jnp.linspace(-1.0, 1.0, 40)
    c = jnp.cos(jnp.arange(40.0))

    def grads(reduce, check_vma):
        def step(v, wp):
            return jax.grad(lambda q: jnp.sum(c * reduce(v[0] * q)))(wp)[None]

        f = jax.shard_map(
            step, mesh=mesh(), in_specs=(P("data"), P()), out_specs=P("data"), check_vma=check_vma
        )
        return np.asarray(jax.jit(f)(shard(x), w))

    for codec in (jc.int_quant(8), jc.sign(), jc.top_k(0.25)):
        for name in ("pmean", "psum"):
            ours = functools.partial(getattr(jc, name), axis_name="data", codec=codec)
            ref = functools.partial(getattr(jax.lax, name), axis_name="data")
            for check_vma in (True, False):
                want = grads(ref, check_vma)
                assert np.abs(want).max() > 0.1
                np.testing.assert_array_equal(grads(ours, check_vma), want)
    tree = {"f": x, "i": jnp.arange(N * 2).reshape(N, 2)}  # an int leaf rides along
    loss = lambda t, r: jnp.sum(c * r(t)["f"])  # noqa: E731
    ours = jax.pmap(
        jax.grad(lambda t: loss(t, lambda u: jc.pmean(u, "i", jc.int_quant(8))), allow_int=True),
        axis_name="i",
    )(tree)
    want = jax.pmap(jax.grad(lambda t: loss(t, lambda u: jax.lax.pmean(u, "i"))), axis_name="i")(
        {"f": x}
    )
    np.testing.assert_array_equal(ours["f"], want["f"])
    tangent = stacked_normal(4, (40,))  # forward mode: the tangent through jax.lax.psum
    jvp = lambda r: jax.pmap(lambda v, t: jax.jvp(r, (v,), (t,))[1], axis_name="i")  # noqa: E731
    np.testing.assert_array_equal(
        jvp(lambda v: jc.psum(v, "i", jc.sign()))(x, tangent),
        jvp(lambda v: jax.lax.psum(v, "i"))(x, tangent),
    )


def test_random_k_key_replicated_but_different_per_process_is_made_one(monkeypatch):
    """With several processes a key passed in replicated (``P()``) is only typed the same
    everywhere: each process puts its own buffers there (a per-process seed). Under
    ``check_vma=True`` the key was used as typed, so the devices of each process drew their own
    coordinates and each process got a different wrong mean (2 processes x 4 devices over gloo:
    up to 11.2 from the one-process mean). Emulated in one process: devices 0-3 hold one key,
    4-7 another, and :func:`jaxcomp._src.collectives.process_count` says 2; every device must
    now get ``(d/k) P_S(mean)`` for one draw ``S`` (``jc.psum_scatter`` the same)."""
    from jaxcomp._src import collectives

    monkeypatch.setattr(collectives, "process_count", lambda: 2)
    m = mesh()
    x = stacked_normal(12, (64,))
    words = [jax.random.PRNGKey(0), jax.random.PRNGKey(1)]
    devices = list(m.devices.flat)
    key = jax.make_array_from_single_device_arrays(
        (2,),
        NamedSharding(m, P()),
        [jax.device_put(words[i // 4], d) for i, d in enumerate(devices)],
    )
    codec = jc.random_k(0.5)

    def run(fn, out_specs=P("data")):
        step = jax.shard_map(fn, mesh=m, in_specs=(P("data"), P()), out_specs=out_specs)
        return np.asarray(jax.block_until_ready(jax.jit(step)(shard(x, m), key)))

    mean = run(lambda v, k: jc.pmean(v[0], "data", codec, key=k)[None])
    exact = np.asarray(x).mean(0)
    for row in mean:
        np.testing.assert_array_equal(row, mean[0])
    kept = mean[0] != 0
    assert kept.sum() == 32
    np.testing.assert_allclose(mean[0][kept], 2 * exact[kept], rtol=1e-5, atol=1e-6)
    total = run(lambda v, k: jc.psum_scatter(v[0], "data", codec, key=k)).reshape(-1)
    kept = total != 0
    assert kept.sum() == 32
    np.testing.assert_allclose(total[kept], 2 * np.asarray(x).sum(0)[kept], rtol=1e-5, atol=1e-5)


def test_vmap_and_shard_map_axes_in_one_tuple_under_check_vma_are_refused_naming_it():
    """``jax.vmap(..., axis_name="v")`` inside ``jax.shard_map(..., check_vma=True)`` over
    "data", reducing over ``("v", "data")``: jax reduces over no such tuple there, and
    jaxcomp's all-gather strategies failed with jax's bare AssertionError (no message). Now a
    ValueError names ``axis_name`` and the fix; with ``check_vma=False`` the numbers are
    ``jax.lax.pmean``'s within int8's rounding."""
    m = mesh(2)
    x = stacked_normal(13, (37,))  # 2 devices x 4 vmapped rows

    def run(reduce, check_vma):
        body = jax.vmap(reduce, axis_name="v")
        step = jax.shard_map(
            body, mesh=m, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma
        )
        return np.asarray(jax.block_until_ready(jax.jit(step)(shard(x, m))))

    codec = jc.int_quant(8)
    with pytest.raises(ValueError, match=r"`axis_name` \('v', 'data'\) mixes .*check_vma=False"):
        run(lambda r: jc.pmean(r, ("v", "data"), codec, strategy="allgather"), True)
    got = run(lambda r: jc.pmean(r, ("v", "data"), codec, strategy="allgather"), False)
    want = run(lambda r: jax.lax.pmean(r, ("v", "data")), False)
    assert rel_err(got, want) < 0.01
