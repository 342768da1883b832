"""A non-finite step is skipped on every device at once (``jc.apply_if_finite``), never hangs.

A NaN (or inf) in ONE device's gradient at one step, under ``jax.shard_map`` and ``jax.pmap``:
with ``jc.apply_if_finite`` the run goes on and ends bit-identical (max |difference| 0) to a
run that never saw that step, state included. ``optax.apply_if_finite`` around a jaxcomp
transform (whose per-device ``lax.cond`` would leave the other devices waiting in the
exchange) is refused at trace time with the fix named. Each step is compiled once and reused
by both runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, mesh, per_device, shard
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

PARAMS = {"w": jnp.full((16, 64), 0.1), "b": jnp.zeros((64,))}
BAD_DEVICE, BAD_STEP, STEPS = 5, 2, 4


def sgd():
    return jc.sgd(0.1, jc.int_quant(8), "data", min_size=64)


def grads(t, bad=None):
    key = jax.random.PRNGKey(100 + t)
    g = {
        "w": jax.random.normal(key, (N, 16, 64)) + 0.2,
        "b": jax.random.normal(jax.random.fold_in(key, 1), (N, 64)),
    }
    if bad is not None:
        g["w"] = g["w"].at[BAD_DEVICE, 3, 7].set(bad)
    return g


def run(step, params, state, skip_bad_step, bad=jnp.nan):
    """``STEPS`` steps; step ``BAD_STEP`` poisoned on one device, or left out entirely."""
    for t in range(STEPS):
        if t == BAD_STEP and skip_bad_step:
            continue
        params, state = step(params, state, grads(t, bad if t == BAD_STEP else None))
    return params, state


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@functools.cache
def shard_map_step(tx_fn=sgd):
    tx = jc.apply_if_finite(tx_fn(), "data", 3)
    m = mesh()
    state = jc.sharded_init(tx, PARAMS, m, "data")
    specs = jc.state_specs(state, "data")

    def step(params, state, g):
        updates, state = tx.update(jax.tree.map(lambda a: a[0], g), state, params)
        return optax.apply_updates(params, updates), state

    fn = per_device(step, (P(), specs, P("data")), (P(), specs), m)
    params = jax.tree.map(lambda a: shard(a, m, P()), PARAMS)
    return (lambda p, s, g: fn(p, s, shard(g, m))), params, state


def test_nan_on_one_device_is_skipped_everywhere_under_shard_map():
    step, params, state = shard_map_step()
    with_bad = run(step, params, state, skip_bad_step=False, bad=jnp.inf)
    assert int(with_bad[1].total_notfinite) == 1 and int(with_bad[1].notfinite_count) == 0
    without = run(step, params, state, skip_bad_step=True)
    assert_trees_equal(with_bad[0], without[0])  # max |difference| 0
    assert_trees_equal(with_bad[1].inner_state, without[1].inner_state)
    moved = float(jnp.abs(with_bad[0]["w"] - PARAMS["w"]).max())
    assert moved > 0.05, moved  # the other steps did train


def test_nan_on_one_device_is_skipped_everywhere_under_pmap():
    tx = jc.apply_if_finite(sgd(), "data", 3)
    params = jc.replicate(PARAMS, N)
    state = jax.pmap(tx.init, axis_name="data")(params)

    def step(params, state, g):
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state

    fn = jax.pmap(step, axis_name="data")
    blocking = lambda *a: jax.block_until_ready(fn(*a))  # noqa: E731
    with_bad = run(blocking, params, state, skip_bad_step=False)
    without = run(blocking, params, state, skip_bad_step=True)
    assert_trees_equal(with_bad[0], without[0])
    assert_trees_equal(with_bad[1].inner_state, without[1].inner_state)
    assert np.asarray(with_bad[1].total_notfinite).tolist() == [1] * N
    assert float(jnp.abs(with_bad[0]["w"] - PARAMS["w"]).max()) > 0.05  # it trained


def test_a_run_of_bad_steps_longer_than_the_limit_lets_one_through():
    # optax's rule: after max_consecutive_errors skipped steps the next bad one goes through
    # (jaxcomp's exchange then gives NaN everywhere and keeps its memories).
    step, params, state = shard_map_step()
    for t in range(4):
        new_params, state = step(params, state, grads(t, jnp.nan))
        skipped = t < 3
        assert int(state.notfinite_count) == t + 1
        assert bool(np.isfinite(np.asarray(new_params["w"])).all()) == skipped
        if skipped:
            assert_trees_equal(new_params, params)


def gossip_step():
    tx = jc.apply_if_finite(jc.gossip(optax.sgd(0.1), "data"), "data", 3)
    m = mesh()
    replicas = jc.replica_params(PARAMS, m, "data")
    state = jc.sharded_init(tx, PARAMS, m, "data")
    specs = jc.state_specs(state, "data")

    def step(replicas, state, g):
        params = jc.own(replicas)
        updates, state = tx.update(jax.tree.map(lambda a: a[0], g), state, params)
        return jc.slot(optax.apply_updates(params, updates)), state

    fn = per_device(step, (P("data"), specs, P("data")), (P("data"), specs), m)
    return (lambda p, s, g: fn(p, s, shard(g, m))), replicas, state


def test_gossip_skips_the_step_on_every_device():
    step, replicas, state = gossip_step()
    with_bad = run(step, replicas, state, skip_bad_step=False)
    without = run(step, replicas, state, skip_bad_step=True)
    assert_trees_equal(with_bad[0], without[0])
    assert_trees_equal(with_bad[1].inner_state, without[1].inner_state)


def _eval_step(tx, under, check_vma=True):
    """Trace (never run) one step of ``tx`` under shard_map or pmap."""
    m = mesh()

    def step(params, state, g):
        return tx.update(g, state, params)

    if under == "pmap":
        params = jc.replicate(PARAMS, N)
        state = jax.eval_shape(jax.pmap(tx.init, axis_name="data"), params)
        return jax.eval_shape(jax.pmap(step, axis_name="data"), params, state, params)
    placed = lambda tree, spec: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, spec)), tree
    )
    if isinstance(jax.eval_shape(tx.init, PARAMS), optax.MultiStepsState):
        specs = _multi_steps_specs(tx)  # jc.state_specs refuses it: by hand
        init = jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs, check_vma=check_vma)
        state = jax.eval_shape(init, placed(PARAMS, P()))
    else:
        state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, m, "data"), PARAMS)
        specs = jc.state_specs(state, "data")
    fn = jax.shard_map(
        lambda p, s, g: step(p, s, jax.tree.map(lambda a: a[0], g)),
        mesh=m,
        in_specs=(P(), specs, P("data")),
        out_specs=(P(), specs),
        check_vma=check_vma,
    )
    return jax.eval_shape(fn, placed(PARAMS, P()), state, placed(grads(0), P("data")))


def _multi_steps_specs(tx):
    """Specs of an ``optax.MultiSteps`` state around a jaxcomp transform: ``acc_grads`` (each
    device's own sum, concatenated on the leading axis) and the inner per-device fields
    ``P("data")``, the rest ``P()``."""
    abstract = jax.eval_shape(tx.init, PARAMS)
    return jax.tree.map(lambda _: P(), abstract)._replace(
        inner_opt_state=jc.state_specs(abstract.inner_opt_state, "data"),
        acc_grads=jax.tree.map(lambda _: P("data"), PARAMS),
    )


@pytest.mark.parametrize("under", ["shard_map", "pmap"])
def test_optax_apply_if_finite_around_a_jaxcomp_transform_is_refused_with_the_fix(under):
    for inner in (sgd(), jc.gossip(optax.sgd(0.1), "data")):
        with pytest.raises(ValueError, match=r"jc\.apply_if_finite\(tx, axis_name"):
            _eval_step(optax.apply_if_finite(inner, 3), under)
    multi = optax.MultiSteps(sgd(), 2, should_skip_update_fn=optax.skip_not_finite)
    with pytest.raises(ValueError, match=r"MultiSteps\(should_skip_update_fn=skip_not_finite"):
        _eval_step(multi.gradient_transformation(), under)
    # Around the optimizer after the exchange it is fine (the exchange is outside the cond).
    tx = optax.chain(
        jc.compressed_allreduce(jc.int_quant(8), "data", min_size=64),
        optax.apply_if_finite(optax.sgd(0.1), 3),
    )
    _eval_step(tx, under)


def _multi_steps(rule):
    return optax.MultiSteps(sgd(), 2, should_skip_update_fn=rule).gradient_transformation()


@pytest.mark.filterwarnings(
    r"ignore:jc\.\w+ is the inner transform of optax\.MultiSteps:UserWarning"
)
def test_a_multisteps_skip_rule_of_ones_own_is_refused_unless_typed_the_same_everywhere():
    """``optax.MultiSteps(jc.sgd(...), 2, should_skip_update_fn=rule)`` with a rule of the
    user's own: only optax's ``skip_not_finite`` / ``skip_large_updates`` were refused until
    2026-11-27, so ``lambda u, step, p: optax.skip_not_finite(u, step, p)`` traced, and a NaN
    on one of the 8 devices hung the step (killed after 120 s, 3 s of CPU; shard_map with
    ``check_vma`` True or False). Refused now unless jax's types show the verdict the same on
    every device (``check_vma=True``, a rule of the step count): untyped (``pmap``,
    ``check_vma=False``) every rule of the user's own is refused."""
    own = lambda u, step, p: optax.skip_not_finite(u, step, p)  # noqa: E731
    by_count = lambda u, step, p: (step > 100, ())  # noqa: E731
    refused = r"MultiSteps\(should_skip_update_fn=<lambda>\).*jc\.apply_if_finite"
    for rule, under, vma in [
        (own, "shard_map", True),
        (own, "shard_map", False),
        (own, "pmap", True),
        (by_count, "shard_map", False),
        (by_count, "pmap", True),
    ]:
        with pytest.raises(ValueError, match=refused):
            _eval_step(_multi_steps(rule), under, check_vma=vma)
    _eval_step(_multi_steps(by_count), "shard_map")  # typed: the same verdict everywhere
    _eval_step(_multi_steps(None), "shard_map")  # optax's default rule: never skips


@pytest.mark.filterwarnings(
    r"ignore:jc\.\w+ is the inner transform of optax\.MultiSteps:UserWarning"
)
def test_a_multisteps_skip_rule_reduced_over_the_data_axis_only_is_refused_beside_shards():
    """On a 4 x 2 mesh of ``"data"`` and FSDP shards over ``"model"`` (``shard_axis``: the
    exchange sums its non-finite flag over ``"model"`` too), a rule whose verdict is the mean
    over ``"data"`` only still differs between the shards, whose devices would split
    between the branches at that sum: refused. Reduced over both axes it passes."""
    m = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:N])
    axes = ("data", "model")
    inner = jc.sgd(0.1, jc.int_quant(8), "data", min_size=64, shard_axis="model")

    def rule(over):
        return lambda u, step, p: (jax.lax.pmean(optax.tree.norm(u), over) > 1e6, ())

    def trace(over):
        tx = optax.MultiSteps(inner, 2, should_skip_update_fn=rule(over))
        specs = optax.MultiStepsState(  # the rule's psum: no init outside the mesh
            mini_step=P(),
            gradient_step=P(),
            inner_opt_state=jc.state_specs(jax.eval_shape(inner.init, PARAMS), axes),
            acc_grads=jax.tree.map(lambda _: P(axes), PARAMS),
            skip_state=(),
        )
        placed = lambda tree, spec: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, spec)),
            tree,
        )
        params = placed(PARAMS, P())
        state = jax.eval_shape(
            jax.shard_map(tx.init, mesh=m, in_specs=P(), out_specs=specs), params
        )
        fn = jax.shard_map(
            lambda p, s, g: tx.update(jax.tree.map(lambda a: a[0], g), s, p),
            mesh=m,
            in_specs=(P(), specs, P(axes)),
            out_specs=(P("model"), specs),  # each shard's own update, averaged over "data"
        )
        return jax.eval_shape(fn, params, state, placed(grads(0), P(axes)))

    with pytest.raises(ValueError, match=r"MultiSteps\(should_skip_update_fn=<lambda>"):
        trace("data")
    trace(axes)
