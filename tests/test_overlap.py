"""jc.overlapped_step: jc.delayed's step as two programs on two host threads.

Params and state after every step are those of jc.delayed in one program, bit for bit (a
compressed transform with a memory, and a plain optimizer with pmean=True). Bad arguments:
tests/test_config_errors.py.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import Blocking, N, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

STEPS = 3


def data(t):
    rng = np.random.default_rng(t)
    x = rng.standard_normal((2 * N, 16)).astype(np.float32)
    return x, np.sin(x[:, :8]).astype(np.float32)


TXS = {  # name: (tx, pmean)
    "fp16_residual": (
        optax.chain(jc.compressed_allreduce(jc.cast("fp16", scaled=False), "data"), optax.sgd(0.5)),
        False,
    ),
    "sgd_pmean": (optax.sgd(0.5, momentum=0.9), True),
}


@functools.cache
def runs(name):
    """(one-program jc.delayed, overlapped_step): params after each step, final state."""
    from benchmarks import common

    tx, pmean = TXS[name]
    m = mesh()
    p0 = jax.device_put(common.mlp_params((16, 8)), NamedSharding(m, P()))
    put = lambda a: jax.device_put(a, NamedSharding(m, P("data")))  # noqa: E731
    one = jc.delayed(tx, axis_name="data" if pmean else None)
    ref, state = common.mlp_tx_step(one, p0, m, "data", pmean_first=False)
    ref = Blocking(ref)
    step = jc.overlapped_step(common.mlp_loss, tx, m, "data", pmean=pmean)
    out = {"one": [], "split": [], "p0": jax.tree.map(np.asarray, p0)}
    for kind, fn, s in (("one", ref, state), ("split", step, step.init(p0))):
        p = p0
        for t in range(STEPS):
            p, s = fn(p, s, *map(put, data(t)))
            out[kind].append(jax.tree.map(np.asarray, p))
        out[kind + "_state"] = jax.tree.map(np.asarray, s)
        out[kind + "_live"] = (fn, p, s)  # to go on from (tests below)
    return out


@pytest.mark.parametrize("name", sorted(TXS))
def test_params_and_state_match_delayed_in_one_program_bit_for_bit(name):
    out = runs(name)
    for t in range(STEPS):
        for k in ("w0", "b0"):
            np.testing.assert_array_equal(out["split"][t][k], out["one"][t][k], err_msg=(t, k))
    # step 0 applies nothing; later steps move the params
    np.testing.assert_array_equal(out["split"][0]["w0"], out["p0"]["w0"])
    assert np.abs(out["split"][2]["w0"] - out["split"][0]["w0"]).max() > 1e-3
    a, b = jax.tree.leaves(out["split_state"]), jax.tree.leaves(out["one_state"])
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert int(out["split_state"].count) == STEPS


def test_layerwise_benchmark_step_is_the_one_program_step_bit_for_bit():
    """benchmarks/overlap.py's `layerwise` row (backward split per layer, each layer's pmean on
    a worker thread) computes the synchronous step exactly."""
    from benchmarks import common, overlap

    m = mesh()
    put = lambda a, s: jax.device_put(a, NamedSharding(m, s))  # noqa: E731
    p0 = put(common.mlp_params((16, 32, 32, 8)), P())
    rng = np.random.default_rng(1)
    x, y = (put(rng.standard_normal((2 * N, d)).astype(np.float32), P("data")) for d in (16, 8))
    step, state = common.mlp_tx_step(optax.sgd(1e-3), p0, m, "data", pmean_first=True)
    want, _ = Blocking(step)(p0, state, x, y)
    got, _ = overlap._layerwise(None, m)(p0, 0, x, y)
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
    assert np.abs(np.asarray(got["w0"]) - np.asarray(p0["w0"])).max() > 0


def test_an_exception_in_the_exchange_reaches_the_caller_and_close_stops_the_worker():
    class Boom(Exception):
        pass

    def update(updates, state, params=None):
        raise Boom("in tx.update, traced on the caller's thread")

    from benchmarks import common

    m = mesh()
    tx = optax.GradientTransformation(optax.init_empty_state, update)
    step = jc.overlapped_step(common.mlp_loss, tx, m, "data")
    p0 = jax.device_put(common.mlp_params((16, 8)), NamedSharding(m, P()))
    batch = [jax.device_put(a, NamedSharding(m, P("data"))) for a in data(0)]
    p, state = step(p0, step.init(p0), *batch)  # step 0: no exchange, so no error yet
    assert int(state.count) == 1
    with pytest.raises(Boom, match="caller's thread"):
        step(p, state, *batch)
    assert not any(a.is_deleted() for a in jax.tree.leaves(state))  # raised before donating
    step.close()
    with pytest.raises(RuntimeError, match="closed"):
        step(p, state, *batch)


def test_nan_gradient_poisons_the_next_step_and_keeps_the_memory():
    """As jc.delayed (tests/test_delayed.py): a NaN in one device's gradient reaches the
    params one step later, non-finite everywhere, and the fp16 residual memory stays as it was;
    the two-thread step gives the one-program step's values, bit for bit."""
    out, m = runs("fp16_residual"), mesh()
    put = lambda a: jax.device_put(a, NamedSharding(m, P("data")))  # noqa: E731
    x, y = data(STEPS)
    x[5] = np.nan  # one row of device 2's batch
    got = {}
    for kind in ("one", "split"):
        fn, p, s = out[kind + "_live"]
        p, s = fn(p, s, put(x), put(y))  # the NaN gradient is pending; params still finite
        assert all(np.isfinite(a).all() for a in jax.tree.leaves(jax.device_get(p)))
        memory = jax.tree.map(np.asarray, s.inner)
        p, s = fn(p, s, *map(put, data(STEPS + 1)))  # exchanged now
        got[kind] = jax.tree.map(np.asarray, (p, s.inner))
        assert not any(np.isfinite(a).any() for a in jax.tree.leaves(got[kind][0])), kind
        kept = zip(jax.tree.leaves(got[kind][1]), jax.tree.leaves(memory), strict=True)
        assert all(np.array_equal(a, b) for a, b in kept), kind
    pairs = zip(jax.tree.leaves(got["split"]), jax.tree.leaves(got["one"]), strict=True)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in pairs)


def test_a_trace_error_keeps_the_state_and_caller_settings_reach_the_exchange():
    """A batch of the wrong shape raises before the exchange donates ``state.inner`` (the same
    state then steps on); a thread-local setting of the caller's (``jax.numpy_rank_promotion``)
    applies to the exchange, traced on the caller's thread."""
    import jax.numpy as jnp

    fn, p, s = runs("sgd_pmean")["split_live"]
    put = lambda a: jax.device_put(a, NamedSharding(mesh(), P("data")))  # noqa: E731
    x, y = data(STEPS)
    with pytest.raises(TypeError, match="dot_general"):
        fn(p, s, put(x[:, :5]), put(y))  # 5 features for a 16-input layer
    assert not any(a.is_deleted() for a in jax.tree.leaves(s))
    p2, s2 = fn(p, s, put(x), put(y))
    assert int(s2.count) == STEPS + 1

    def update(u, state, params=None):  # adds a [8] row to each [16, 8] leaf: rank promotion
        return jax.tree.map(lambda g: g + jnp.zeros(g.shape[-1:], g.dtype), u), state

    tx = optax.GradientTransformation(optax.init_empty_state, update)
    step = jc.overlapped_step(fn.loss_fn, tx, mesh(), "data", pmean=True)
    state = step.init(p2)
    _, state = step(p2, state, put(x), put(y))  # step 0: no exchange
    with (
        jax.numpy_rank_promotion("raise"),
        pytest.raises(ValueError, match="rank_promotion=.raise."),
    ):
        step(p2, state, put(x), put(y))
    assert not any(a.is_deleted() for a in jax.tree.leaves(state))
    _, state = step(p2, state, put(x), put(y))  # allowed outside the caller's context
    assert int(state.count) == 2
    step.close()


def test_a_second_call_reuses_its_compiled_programs_without_tracing():
    """The step keeps its two compiled programs per input signature: later steps of the same
    shapes trace nothing (loss_fn is not called, no program is built); a new shape, dtype or
    jax setting is a new signature."""
    import jax.numpy as jnp

    from jaxcomp._src import overlap

    fn, p, _ = runs("sgd_pmean")["split_live"]  # its programs compiled; its state consumed
    put = lambda a: jax.device_put(a, NamedSharding(mesh(), P("data")))  # noqa: E731
    batch = tuple(map(put, data(STEPS + 2)))
    s = fn.init(p)
    calls = {"loss": 0, "compile": 0}
    loss_fn, compile_ = fn.loss_fn, fn._compile

    def counted_loss(*a):
        calls["loss"] += 1
        return loss_fn(*a)

    def counted_compile(*a):
        calls["compile"] += 1
        return compile_(*a)

    fn.loss_fn, fn._compile = counted_loss, counted_compile
    try:
        for _ in range(3):
            old, (p, s) = s, fn(p, s, *batch)
            programs = fn._compiled(p, s, batch)
        assert fn._compiled(p, s, batch)[1] is programs[1]
        with pytest.raises(ValueError, match="`state` was donated to an earlier step"):
            fn(p, old, *batch)  # its inner state went to the last exchange
    finally:
        fn.loss_fn, fn._compile = loss_fn, compile_
    assert calls == {"loss": 0, "compile": 0} and len(fn._programs) == 2  # step 0's and later
    key = overlap._signature((p, s, batch))
    assert overlap._signature((p, s, batch)) == key
    assert overlap._signature((p, s, (batch[0][:, :4], batch[1]))) != key  # shape
    assert overlap._signature((p, s, (batch[0].astype(jnp.float16), batch[1]))) != key
    whole = jax.device_put(batch[0], NamedSharding(mesh(), P()))  # the same values, replicated
    assert overlap._signature((p, s, (whole, batch[1]))) != key  # sharding
    assert overlap._signature((p, s, (np.asarray(batch[0]), batch[1]))) != key  # host array
    with jax.numpy_rank_promotion("raise"):
        assert overlap._signature((p, s, batch)) != key
