"""jc.delayed: the exchange of step t runs in step t + 1's program (staleness 1).

Its output at step t is the wrapped transform's output for the gradients of step t - 1 (zero
at step 0), bit for bit, with the wrapped state advancing in step; the compiled step sends
what the wrapped one sends; a NaN reaches the output one step later and the wrapped
transform's memory stays as it was; the state checkpoints with orbax.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import Blocking, N, mesh, per_device
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SHAPES = {"w": (64, 48), "b": (48,)}
STEPS = 3


def params():
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def grads(t):
    rng = np.random.default_rng(10 + t)
    return {k: (rng.standard_normal((N, *s)) + 0.3).astype(np.float32) for k, s in SHAPES.items()}


def wrapped():
    # fp16 with residual feedback: a memory to keep, and the cheapest program to compile.
    codec = jc.cast("fp16", scaled=False)
    return optax.chain(
        jc.compressed_allreduce(codec, "data", error_feedback="residual"), optax.sgd(0.1)
    )


@functools.cache
def built(delay: bool):
    tx = jc.delayed(wrapped()) if delay else wrapped()
    m = mesh()
    p = jax.device_put(params(), NamedSharding(m, P()))
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")

    def step(g, s, p):
        return tx.update(jc.own(g), s, p)

    fn = jax.jit(
        jax.shard_map(step, mesh=m, in_specs=(P("data"), specs, P()), out_specs=(P(), specs))
    )
    put = lambda g: jax.device_put(g, NamedSharding(m, P("data")))  # noqa: E731
    return fn, Blocking(fn), state, p, put


@functools.cache
def run(delay: bool):
    _, step, state, p, put = built(delay)
    outs, states = [], [state]
    for t in range(STEPS):
        out, state = step(put(grads(t)), state, p)
        outs.append(jax.tree.map(np.asarray, out))
        states.append(state)
    return outs, states


def test_output_is_the_wrapped_output_one_step_late():
    late, late_states = run(True)
    now, now_states = run(False)
    assert all(not a.any() for a in late[0].values())
    for t in range(1, STEPS):
        for k in SHAPES:
            np.testing.assert_array_equal(late[t][k], now[t - 1][k], err_msg=k)
        # the wrapped state after step t is the plain one after step t - 1
        for a, b in zip(
            jax.tree.leaves(late_states[t + 1].inner), jax.tree.leaves(now_states[t]), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bytes_are_the_wrapped_transforms():
    sent = {}
    for delay in (True, False):
        fn, _, state, p, put = built(delay)
        sent[delay] = jc.comm_report(fn, put(grads(0)), state, p).bytes_per_device
    assert sent[True] == sent[False] > 0


def test_nan_reaches_the_output_one_step_later_and_memory_is_kept():
    _, step, _, p, put = built(True)
    _, states = run(True)
    g = grads(1)
    g["w"][3, 0, 0] = np.nan
    out, state = step(put(g), states[1], p)  # exchanges step 0's finite gradients
    assert all(np.isfinite(np.asarray(a)).all() for a in out.values())
    out, after = step(put(grads(2)), state, p)  # exchanges the NaN
    assert not np.isfinite(np.asarray(out["w"])).any()
    before_memory = jax.tree.leaves(state.inner[0].memory)
    for a, b in zip(jax.tree.leaves(after.inner[0].memory), before_memory, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _axis_name_step(tx):
    """``(step, state, put)``: ``tx`` (a ``jc.delayed(..., axis_name="data")``) under
    ``jit(shard_map)`` on the 8-device mesh, replicated params, per-device gradients."""
    m = mesh()
    p = jax.device_put(params(), NamedSharding(m, P()))
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")
    step = jax.shard_map(
        lambda g, s: tx.update(jc.own(g), s, p),
        mesh=m,
        in_specs=(P("data"), specs),
        out_specs=(P(), specs),
    )
    return Blocking(jax.jit(step)), state, lambda g: jax.device_put(g, NamedSharding(m, P("data")))


def test_plain_pmean_delayed_with_axis_name():
    fn, state, put = _axis_name_step(jc.delayed(optax.sgd(1.0), axis_name="data"))
    _, state = fn(put(grads(0)), state)
    out, _ = fn(put(grads(1)), state)
    np.testing.assert_allclose(out["w"], -grads(0)["w"].mean(0), rtol=1e-5, atol=1e-6)


def test_a_state_of_other_devices_is_refused_naming_pending():
    """A state saved on 2n devices, restored on n without ``jc.resize_state``: each device
    holds two rows of ``pending``; refused naming it (``jc.delayed(optax.sgd, axis_name=...)``
    has no other per-device field, and read the first row, dropping the other, with no
    error)."""
    tx = jc.delayed(optax.sgd(1.0), axis_name="data")
    m = mesh()
    p = jax.device_put(params(), NamedSharding(m, P()))
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")
    doubled = state._replace(
        pending=jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                (2 * a.shape[0], *a.shape[1:]), a.dtype, sharding=a.sharding
            ),
            state.pending,
        )
    )
    fn = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(jc.own(g), s, p),
            mesh=m,
            in_specs=(P("data"), specs),
            out_specs=(P(), specs),
        )
    )
    g = jax.device_put(grads(0), NamedSharding(m, P("data")))
    with pytest.raises(ValueError, match="delayed state field `pending`"):
        fn.trace(g, doubled)


@pytest.mark.parametrize("axis_name", [None, "data"])
def test_integer_leaves_pass_through_one_step_late(axis_name):
    """An int32 counter beside the floats: its int gradient passes the wrapped exchange
    untouched (each device its own, in its dtype: zero at step 0, step t - 1's at t), also
    with ``axis_name`` (whose pmean turned it into float32); a ``float0`` gradient
    (``jax.grad(..., allow_int=True)``) reaches ``tx`` as a ``float0``. Both raised a
    ``lax.cond`` type error ("the manual axis types do not match") before 2026-11-27."""
    inner = jc.compressed_allreduce(jc.cast("fp16", scaled=False), "data")
    tx = jc.delayed(inner if axis_name is None else optax.identity(), axis_name=axis_name)
    m = mesh()
    p = jax.device_put(
        {"b": np.zeros(48, np.float32), "n": np.zeros(3, np.int32)}, NamedSharding(m, P())
    )
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")
    seen = []

    def step(g, s):
        g = jc.own(g)
        zero = tx.update({"b": g["b"], "n": np.zeros(3, jax.dtypes.float0)}, s, p)[0]["n"]
        seen.append(zero.dtype)
        out, s = tx.update(g, s, p)
        return jax.tree.map(lambda a: a[None], out), s

    fn = per_device(step, (P("data"), specs), (P("data"), specs), m)
    put = lambda g: jax.device_put(g, NamedSharding(m, P("data")))  # noqa: E731
    counts = [np.arange(3 * N, dtype=np.int32).reshape(N, 3) + 100 * t for t in range(2)]
    out0, state = fn(put({"b": grads(0)["b"], "n": counts[0]}), state)
    out1, _ = fn(put({"b": grads(1)["b"], "n": counts[1]}), state)
    assert seen[0] == jax.dtypes.float0
    assert out0["n"].dtype == np.int32 and not out0["n"].any()
    np.testing.assert_array_equal(out1["n"], counts[0])
    np.testing.assert_allclose(
        out1["b"], np.broadcast_to(grads(0)["b"].mean(0), (N, 48)), rtol=1e-3, atol=1e-3
    )


def test_axis_name_with_an_exchanging_tx_is_refused_naming_axis_name():
    """``delayed(chain(compressed_allreduce, sgd), axis_name="data")`` averages twice: the
    inner exchange refused the already-averaged gradients with a message about ``pcast``;
    now the error names delayed's `axis_name` and says to leave it out."""
    fn, state, put = _axis_name_step(jc.delayed(wrapped(), axis_name="data"))
    with pytest.raises(
        ValueError, match=r"delayed: `axis_name`='data' averages.*leave `axis_name` out"
    ):
        fn.lower(put(grads(0)), state)


def test_only_the_marked_refusal_is_rewritten():
    """delayed tells the inner exchange's refusal of averaged gradients by its mark
    (``skeleton.INVARIANT_GRADIENTS``), not by its text: another ValueError of ``tx`` that
    happens to say "identical on every device" reaches the user as ``tx`` raised it (until
    2026-11-27 delayed matched that text and replaced it by its `axis_name` advice), and the
    refusal itself is exactly a ValueError (tests/test_config_errors.py checks the type)."""

    def update(updates, state, params=None):
        raise ValueError("my_tx: these gradients are identical on every device, as meant")

    mine = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    fn, state, put = _axis_name_step(jc.delayed(mine, axis_name="data"))
    with pytest.raises(ValueError, match="^my_tx: these gradients"):
        fn.lower(put(grads(0)), state)
    fn, state, put = _axis_name_step(jc.delayed(wrapped(), axis_name="data"))
    with pytest.raises(ValueError, match="leave `axis_name` out") as info:
        fn.lower(put(grads(0)), state)
    assert type(info.value) is ValueError and info.value.__cause__ is None
    # jc.clip_by_global_norm before the exchange refuses the averaged gradients first (its
    # own refusal, unmarked: without an exchange in tx its advice is the right one); it names
    # the way out of this one too.
    clipped = optax.chain(jc.clip_by_global_norm(1.0, "data"), wrapped())
    fn, state, put = _axis_name_step(jc.delayed(clipped, axis_name="data"))
    with pytest.raises(ValueError, match=r"^clip_by_global_norm: .*leave `axis_name` out"):
        fn.lower(put(grads(0)), state)
