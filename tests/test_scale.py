"""Collectives at scale: bytes per device against n, majority vote, hierarchical, sparse two-phase.

Bytes are read from the programs' collectives on meshes of the first n of the 8 CPU devices:
the logical program (lowered, not compiled: compiling dozens of programs would blow the test
budget; for these integer/f32 payloads logical and compiled bytes agree, checked once below)
and ``jc.comm_report`` (compiled). ``python -m benchmarks.scale_bytes`` writes the full compiled
table, n = 2..16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    N,
    device_mean,
    empty,
    mesh,
    per_device,
    rel_err,
    server_per_leaf,
    shard,
    stacked_normal,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.accounting import parse_stablehlo_collectives
from jaxcomp._src.codecs.base import ceil_div

D = 1 << 18  # floats per device in the bytes tests (compiled only, never run)
HOST, LOCAL = "host", "local"


def mesh_2d():
    return jax.make_mesh((2, 4), (HOST, LOCAL), axis_types=(AxisType.Explicit,) * 2)


class Logical(list):
    """The collectives of the lowered program, with the total like a CommReport's."""

    @property
    def collectives(self):
        return self

    @property
    def bytes_per_device(self):
        return sum(c.bytes_per_device for c in self)


def pmean_report(codec, strategy, n, inner=False, compiled=False):
    """Collectives of one jc.pmean of an f32[D] vector (codec None: plain lax.pmean)."""
    if inner:
        m, spec, kw = mesh_2d(), P((HOST, LOCAL)), {"inner_axis_name": LOCAL}
        axis = HOST
    else:
        m, spec, kw, axis = mesh(n), P("data"), {}, "data"

    def f(t):
        if codec is None:
            return jax.lax.pmean(t[0], "data")
        return jc.pmean(t[0], axis, codec, strategy=strategy, **kw)

    fn = jax.jit(jax.shard_map(f, mesh=m, in_specs=spec, out_specs=P()))
    x = jax.ShapeDtypeStruct((m.size, D), jnp.float32, sharding=NamedSharding(m, spec))
    if compiled:
        return jc.comm_report(fn, x)
    return Logical(parse_stablehlo_collectives(fn.lower(x).as_text(), jax.device_count()))


def flag(n):
    """Bytes of the non-finite flag: one int32 all-reduce."""
    return 2 * (n - 1) / n * 4


@pytest.mark.parametrize("name", ["int8", "int4", "sign"])
def test_two_phase_bytes_stay_flat_in_n_and_allgather_grows(name):
    codec = jc.get_codec(name)
    payload = codec.payload_bytes(D)
    rows = {}
    for n in (2, 4, 8):
        two = pmean_report(codec, "two_phase", n).bytes_per_device
        gathered = pmean_report(codec, "allgather", n).bytes_per_device
        rows[n] = (two, gathered)
        model = jc.strategy_bytes(codec, D, n)
        assert two == pytest.approx(model["two_phase"] + flag(n), rel=0.01)
        assert two <= 1.3 * 2 * payload, (n, two, payload)
        assert gathered == pytest.approx((n - 1) * payload, rel=0.01)
    assert rows[8][1] / rows[2][1] == pytest.approx(7, rel=0.01)  # all-gather: linear in n
    assert rows[8][0] / rows[2][0] < 2.0  # two-phase: 2(n-1)/n, from 1 to 1.75 payloads
    print(name, {n: (round(a), round(b)) for n, (a, b) in rows.items()}, "payload", payload)


def test_two_phase_flat_while_chunks_are_large_figures_of_the_docs():
    """docs/index.md and choosing-a-codec.md: two_phase with sign sends 952 B per device at
    8 devices and 1,240 B at 32 for a 4,079-float vector (the fixed part of each chunk),
    218,848 B and 242,544 B for 10^6 floats (the ring's (n-1)/n); auto picks two_phase."""
    want = {(4079, 8): 952, (4079, 32): 1240, (10**6, 8): 218_848, (10**6, 32): 242_544}
    for (d, n), bytes_ in want.items():
        assert jc.strategy_bytes(jc.sign(), d, n)["two_phase"] == bytes_, (d, n)
        assert jc.choose_strategy(jc.sign(), d, n) == "two_phase"


def test_savings_against_pmean_at_8_devices():
    base = pmean_report(None, None, N).bytes_per_device
    assert base == pytest.approx(2 * 7 / 8 * 4 * D, rel=0.01)
    ratio = {
        "int8": base / pmean_report(jc.int_quant(8), "two_phase", N).bytes_per_device,
        "sign": base / pmean_report(jc.sign(), "two_phase", N).bytes_per_device,
        "vote": base / pmean_report(jc.sign(None), "majority_vote", N).bytes_per_device,
        "top1%": base / pmean_report(jc.top_k(0.01), "two_phase", N).bytes_per_device,
        "top1%_allgather": base / pmean_report(jc.top_k(0.01), "allgather", N).bytes_per_device,
    }
    print("savings vs pmean at 8 devices:", ratio)
    compiled = pmean_report(jc.int_quant(8), "two_phase", N, compiled=True)
    assert compiled.bytes_per_device == pytest.approx(base / ratio["int8"], rel=1e-6)
    assert ratio["int8"] >= 3.5 and ratio["sign"] >= 20 and ratio["vote"] >= 20
    assert ratio["top1%"] > 1.5 * ratio["top1%_allgather"]  # gTop-k: sparse stops growing with n


# --------------------------------------------------------------------------- majority vote


def expected_vote(x: np.ndarray) -> np.ndarray:
    """sign of sum_i sign(x_i) (0 counts as +), a tie going to the chunk owner's own sign."""
    n, d = x.shape
    negative = x < 0
    m = negative.sum(0)
    words = ceil_div(d, 32)
    owner = (np.arange(d) // 32) // ceil_div(words, n)
    own = negative[owner, np.arange(d)]
    return np.where((2 * m > n) | ((2 * m == n) & own), -1.0, 1.0)


@pytest.mark.parametrize("codec", [jc.sign(None), jc.sign("mean", block_size=100)])
def test_majority_vote_is_the_sign_of_the_integer_vote(codec):
    # Few distinct values so ties (4 against 4) happen often.
    x = np.asarray(jnp.round(stacked_normal(7, (1000,), offset=0.1)))
    f = per_device(
        lambda t: jc.pmean(t[0], "data", codec, strategy="majority_vote"), P("data"), P()
    )
    out = np.asarray(f(shard(jnp.asarray(x))))
    vote = expected_vote(x)
    if codec.scale is None:
        np.testing.assert_array_equal(out, vote)
    else:  # scaled by the mean over devices of each device's block mean |x|
        blocks = np.abs(x).reshape(N, 10, 100).mean(2).mean(0)
        np.testing.assert_allclose(out, vote * np.repeat(blocks, 100), rtol=1e-6)


def test_majority_vote_zero_nonfinite_and_bad_codecs():
    f = per_device(
        lambda t: jc.pmean(t[0], "data", jc.sign(None), strategy="majority_vote"), P("data"), P()
    )
    np.testing.assert_array_equal(f(shard(jnp.zeros((N, 70)))), 0.0)
    out = f(shard(stacked_normal(1, (70,)).at[2, 5].set(jnp.nan)))
    assert not bool(jnp.all(jnp.isfinite(out)))
    for codec in (jc.int_quant(1), jc.top_k(0.1), jc.identity()):
        with pytest.raises(ValueError, match="majority_vote.*sign codec"):
            jc.pmean(jnp.ones(8), "data", codec, strategy="majority_vote")
        with pytest.raises(ValueError, match="majority_vote.*sign codec"):
            jc.compressed_allreduce(codec, "data", strategy="majority_vote")
    with pytest.raises(ValueError, match="ef21"):
        jc.compressed_allreduce(jc.sign(), "data", strategy="majority_vote", error_feedback="ef21")
    assert jc.choose_strategy(jc.sign(None), D, 8) == "two_phase"  # auto never votes


# --------------------------------------------------------------------------- Signum


def signum_step(tx):
    """(state, step(g, s)) for ``tx`` on a single (30, 40) leaf, every leaf compressed."""
    state = jc.sharded_init(tx, {"w": jnp.zeros((30, 40))}, mesh(), "data")
    specs = jc.state_specs(state, "data")
    step = per_device(lambda g, s: tx.update({"w": g[0]}, s), (P("data"), specs), (P(), specs))
    return state, step


def test_signum_worker_momentum_recursion_is_exact():
    beta = 0.9
    tx = jc.compressed_allreduce(
        jc.sign(None), "data", strategy="majority_vote", worker_momentum=beta, min_size=1
    )
    state, step = signum_step(tx)
    # per device, like the params: global (n, *param.shape), the device axis sharded
    assert state.momentum["w"].shape == (N, 30, 40) and state.memory is None
    assert jc.state_specs(state, "data").momentum == {"w": P("data")}
    m = np.zeros((N, 1200), np.float32)
    for t in range(4):
        g = stacked_normal(t, (30, 40), offset=0.2)
        out, state = step(shard(g), state)
        g = np.asarray(g).reshape(N, 1200)
        m = np.float32(beta) * m + np.float32(1 - beta) * g  # per device, f32 like the step
        momentum = np.asarray(state.momentum["w"]).reshape(N, 1200)
        np.testing.assert_allclose(momentum, m, rtol=1e-6, atol=1e-7)
        # the server's answer: sign(sum_i sign(m_i)), computed on the devices' momenta
        np.testing.assert_array_equal(np.asarray(out["w"]).ravel(), expected_vote(m))
    assert int(state.count) == 4
    off = jc.compressed_allreduce(jc.sign(None), "data", strategy="majority_vote")
    assert off.init({"w": jnp.zeros((64, 64))}).momentum is None  # unused: None, not f32[0]


def test_worker_momentum_state_unchanged_on_a_nan_step():
    # Majority vote: sign with residual feedback is the contract suite's sign-worker_momentum
    # row (tests/test_contract.py, item 2: the whole state unchanged on a non-finite step).
    tx = jc.compressed_allreduce(
        jc.sign(None),
        "data",
        strategy="majority_vote",
        error_feedback=None,
        worker_momentum=0.5,
        min_size=1,
    )
    state, step = signum_step(tx)
    _, state = step(shard(stacked_normal(0, (30, 40))), state)
    bad = stacked_normal(1, (30, 40)).at[3, 2, 7].set(jnp.nan)
    out, after = step(shard(bad), state)
    assert not bool(jnp.all(jnp.isfinite(out["w"])))
    for name, old, new in zip(state._fields, state, after, strict=True):
        if old is None:
            assert new is None, name
            continue
        assert jax.tree.structure(new) == jax.tree.structure(old), name
        for o, n in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
            np.testing.assert_array_equal(np.asarray(n), np.asarray(o), err_msg=name)
    assert float(jnp.abs(after.momentum["w"]).max()) > 0


@pytest.mark.slow
def test_signum_majority_vote_trains_digits_within_2_points():
    """Signum (sign(None) majority vote, worker momentum 0.9, plain SGD, cosine lr 0.01) against
    uncompressed momentum SGD (lr 0.05, momentum 0.9), same seed and steps.

    120 steps keep the test fast (test compile flags: signum 99.0%, momentum SGD 97.2%; 200
    steps: 98.0%, 98.0%; 300 steps: 98.7%, 97.7%); ``python -m benchmarks.scale_bytes`` runs
    the 1000-step row."""
    import optax

    from benchmarks import digits_mlp as example

    steps = 120
    base = example.train("none", steps=steps)
    signum = example.train(
        "signsgd",
        steps=steps,
        strategy="majority_vote",
        lr=optax.cosine_decay_schedule(0.01, steps),
        momentum=None,
        compress_kwargs={"worker_momentum": 0.9},
    )
    print(f"signum {signum.accuracy:.4f} vs {base.accuracy:.4f}, {signum.ratio:.1f}x")
    assert base.accuracy >= 0.96
    assert signum.accuracy >= base.accuracy - 0.02
    assert signum.ratio >= 20


# --------------------------------------------------------------------------- sparse two-phase


@pytest.mark.slow
def test_sparse_two_phase_conserves_mass_with_both_residuals():
    params = {"w": jnp.zeros((40, 50))}
    # Chunks of 250: k = 3, split k1 = 1 per device, k2 = 5 < 8 for the owner, who drops some.
    tx = jc.compressed_allreduce(jc.top_k(0.01), "data", strategy="two_phase", min_size=1)
    state = jc.sharded_init(tx, params, mesh(), "data")
    specs = jc.state_specs(state, "data")
    step = per_device(lambda g, s: tx.update({"w": g[0]}, s), (P("data"), specs), (P(), specs))
    fed = applied = 0.0
    for t in range(3):
        g = stacked_normal(t, (40, 50), offset=0.3)
        out, state = step(shard(g), state)
        fed, applied = fed + g.mean(0), applied + out["w"]
        assert int(jnp.sum(out["w"] != 0)) <= N * 5  # k2 per chunk
    memory = device_mean(state.memory, params)["w"]
    server = server_per_leaf(state.server_residual, params)["w"]  # owned chunks, joined
    assert np.abs(server).max() > 0  # re-sparsification dropped something, kept here
    np.testing.assert_allclose(applied + memory + server, fed, atol=2e-5)


# --------------------------------------------------------------------------- hierarchical


def hier_fn(fn, in_specs, out_specs):
    return per_device(fn, in_specs, out_specs, mesh_2d())


@pytest.mark.parametrize(
    "name,strategy,tol",
    [("int8", "auto", 0.02), ("sign", "two_phase", 0.5)],
)
def test_hierarchical_equals_flat_within_codec_error(name, strategy, tol):
    codec = jc.get_codec(name)
    x = stacked_normal(3, (3000,), offset=1.0)

    def both(t):
        mean = jc.pmean(t[0], HOST, codec, strategy=strategy, inner_axis_name=LOCAL)
        return mean, jc.psum(t[0], HOST, jc.identity(), inner_axis_name=LOCAL)

    hier, total = hier_fn(both, P((HOST, LOCAL)), (P(), P()))(shard(x, mesh_2d(), P((HOST, LOCAL))))
    flat = per_device(lambda t: jc.pmean(t[0], "data", codec, strategy=strategy), P("data"), P())(
        shard(x)
    )
    exact = x.mean(0)
    assert rel_err(hier, exact) <= tol and rel_err(flat, exact) <= tol
    np.testing.assert_allclose(total, x.sum(0), rtol=1e-4, atol=1e-4)  # psum: n = 8 x mean


@pytest.mark.parametrize("name", ["int8", "sign", "signsgd_vote"])
def test_hierarchical_outer_axis_carries_only_the_payload(name):
    codec, strategy = (
        (jc.sign(None), "majority_vote") if name == "signsgd_vote" else (jc.get_codec(name), "auto")
    )
    report = pmean_report(codec, strategy, 8, inner=True)
    # Every step runs the collectives outside the lax.cond; its branch (the step redone with
    # the input pre-scaled by 1/L) runs only on a flagged step, and is the same exchange.
    every = [c for c in report.collectives if not c.branch]
    redo = [c for c in report.collectives if c.branch]
    assert sorted((c.kind, c.group_size, c.array_bytes) for c in redo) == sorted(
        (c.kind, c.group_size, c.array_bytes) for c in every
    )
    outer = [c for c in every if c.group_size == 2]
    inner = [c for c in every if c.group_size == 4]
    model = jc.hierarchical_bytes(codec, D, 2, 4, strategy)
    # Outer (slow) axis: the codec's payload of the D/4 chunk, nothing gradient-sized in f32.
    assert sum(c.bytes_per_device for c in outer) == pytest.approx(model["outer"], rel=1e-6)
    for c in outer:
        if "f32" in c.dtypes:
            assert c.array_bytes <= 0.01 * D, str(report)  # block scales only
    # Inner (fast) axis: one f32 reduce-scatter and one f32 all-gather of the vector, and one
    # scalar all-reduce of the non-finite flag (each device saw only its outer chunk).
    vector = [c for c in inner if c.array_bytes > 4]
    flags = [c for c in inner if c.array_bytes <= 4]
    assert sorted(c.kind for c in vector) == ["all-gather", "reduce-scatter"]
    assert all(c.dtypes == ("f32",) for c in vector)
    assert [c.kind for c in flags] == ["all-reduce"]
    assert sum(c.bytes_per_device for c in vector) == pytest.approx(model["inner"], rel=1e-6)
    assert sum(c.bytes_per_device for c in flags) == pytest.approx(flag(4))


def test_hierarchical_transform_memory_per_device_and_bad_inner_axis():
    # Conservation over both axes (what is applied plus what is held back, the server
    # residual joined inner-major) is the contract suite's sign-hierarchical row
    # (tests/test_contract.py, item 1); here the memory's layout and the inner axis's error.
    params = {"w": jnp.zeros((30, 40)), "b": jnp.zeros((40,))}
    axes = (HOST, LOCAL)
    tx = jc.compressed_allreduce(
        jc.sign(), HOST, inner_axis_name=LOCAL, strategy="two_phase", min_size=100
    )
    state = jc.sharded_init(tx, params, mesh_2d(), axes)
    specs = jc.state_specs(state, list(axes))
    assert specs.memory["w"] == P(axes) and state.memory["w"].shape == (N, 30, 40)
    assert empty(state.memory["b"]) and empty(specs.memory["b"])  # below min_size: no memory
    with pytest.raises(ValueError, match="inner_axis_name"):
        hier_fn(
            lambda t: jc.pmean(t[0], HOST, jc.sign(), inner_axis_name="gpu"),
            P((HOST, LOCAL)),
            P(),
        )(shard(jnp.ones((N, 8)), mesh_2d(), P(axes)))


# --------------------------------------------------------------------------- the auto model


def test_auto_table_and_server_feedback_switch():
    d = 1 << 20
    picks = {
        (name, n): jc.choose_strategy(jc.get_codec(name), d, n)
        for name in ("int8", "sign", "fp16", "fp16_unscaled")
        for n in (2, 4, 8, 16, 64)
    }
    assert picks[("int8", 2)] == "allgather" and picks[("int8", 8)] == "two_phase"
    # Unscaled fp16 is psum'ed (summed in fp16) up to 8 devices, then two-phase (float32 sums);
    # the scaled default (one scale per device: not summable) goes two-phase at every n.
    assert [picks[("fp16_unscaled", n)] for n in (2, 4, 8, 16, 64)] == ["allreduce"] * 3 + [
        "two_phase"
    ] * 2
    assert [picks[("fp16", n)] for n in (2, 4, 8, 16, 64)] == ["two_phase"] * 5
    assert jc.choose_strategy(jc.top_k(0.01), d, 2) == "allgather"
    assert jc.choose_strategy(jc.top_k(0.01), d, 64) == "two_phase"
    h = jc.hierarchical_bytes(jc.int_quant(8), d, 2, 4)
    assert h["strategy"] == "allgather" and h["inner"] == 2 * 3 * 4 * (d // 4)
    off = jc.compressed_allreduce(jc.sign(), "data", strategy="two_phase", server_feedback=False)
    assert off.init({"w": jnp.zeros((64, 64))}).server_residual is None
    with pytest.raises(TypeError, match="server_feedback"):
        jc.compressed_allreduce(jc.sign(), "data", server_feedback="yes")


@pytest.mark.slow
def test_dgc_and_powersgd_take_an_inner_axis():
    params = {"w": jnp.zeros((32, 40))}
    axes = (HOST, LOCAL)
    m = mesh_2d()
    g = stacked_normal(11, (32, 40), offset=0.5)
    for tx in (
        jc.dgc(1.0, HOST, momentum=0.0, sample_ratio=None, min_size=1, inner_axis_name=LOCAL),
        jc.powersgd(2, HOST, start_step=1, min_size=1, inner_axis_name=LOCAL),
    ):
        state = jc.sharded_init(tx, params, m, HOST)  # the same on every device of a host
        specs = jc.state_specs(state, HOST)
        update = lambda g, s, tx=tx: tx.update({"w": g[0]}, s)  # noqa: E731
        step = hier_fn(update, (P(axes), specs), (P(), specs))
        out, state = step(shard(g, m, P(axes)), state)  # DGC at ratio 1 / PowerSGD warm-up: exact
        np.testing.assert_allclose(out["w"], g.mean(0), atol=1e-5)
        out, state = step(shard(g, m, P(axes)), state)
        assert bool(jnp.all(jnp.isfinite(out["w"])))
