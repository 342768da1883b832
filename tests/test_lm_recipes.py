"""The recipes for language models: 1-bit / 0/1 Adam learn coordinates unseen before their
variance froze (an embedding row of a token first seen late); local SGD and DiLoCo over the
replica axis of a replica x data mesh, data parallel inside each replica."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Blocking, N, mesh
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.onebit_adam import adam_step_bound

D = 64  # coordinates; coordinate 0 gets a gradient only from step LATE on
LATE, STEPS, TARGET = 12, 40, 1.76


def late_coordinate_run(tx: optax.GradientTransformation, weight0: float = 1.0) -> np.ndarray:
    """Minimize 0.5 |w - TARGET|^2 over the coordinates present (coordinate 0 only from
    step LATE, its gradient times ``weight0``), each device's gradient with its own noise:
    ``w`` after STEPS steps."""
    m = mesh()
    p = jax.device_put(jnp.zeros((D,), jnp.float32), NamedSharding(m, P()))
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")

    def step(p, s, present):
        key = jax.random.fold_in(jax.random.PRNGKey(0), jax.lax.axis_index("data"))
        noise = 0.05 * jax.random.normal(key, (D,))
        g = (jax.lax.pcast(p, "data", to="varying") - TARGET + noise) * present
        g = g.at[0].multiply(weight0)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = Blocking(
        jax.jit(jax.shard_map(step, mesh=m, in_specs=(P(), specs, P()), out_specs=(P(), specs)))
    )
    for t in range(STEPS):
        present = jnp.ones((D,)).at[0].set(float(t >= LATE))
        p, state = run(p, state, present)
    return np.asarray(p)


@functools.cache
def adam_reference() -> np.ndarray:
    """:func:`late_coordinate_run` of float32 pmean then ``optax.adam(0.05)`` (run once)."""
    return late_coordinate_run(
        optax.chain(jc.compressed_allreduce(jc.identity(), "data"), optax.adam(0.05))
    )


@functools.cache
def onebit_reference() -> np.ndarray:
    """:func:`late_coordinate_run` of ``jc.onebit_adam(0.05, freeze_step=4)`` (run once)."""
    return late_coordinate_run(jc.onebit_adam(0.05, "data", freeze_step=4, min_size=1))


@pytest.mark.parametrize(
    "run",
    [
        onebit_reference,
        lambda: late_coordinate_run(
            jc.zero_one_adam(
                0.05,
                "data",
                var_freeze_step=4,
                var_update_scaler=1,
                local_step_scaler=4,
                min_size=1,
            )
        ),
    ],
    ids=["onebit_adam", "zero_one_adam"],
)
def test_a_coordinate_unseen_at_the_freeze_still_learns(run):
    adam, ours = adam_reference(), run()
    # Adam moves it about lr per step once it appears; a zero variance frozen kept it at 0.0.
    assert 0.5 < adam[0] < TARGET
    assert ours[0] > 0.5 * adam[0]
    # The coordinates seen from the start move as Adam's do (1-bit Adam at its defaults, with
    # or without the bound: 1.61 where Adam's reach 1.61 on average, of 1.76, in these 40
    # steps; coordinate 0: 1.02 against Adam's 1.30).
    assert np.all(ours[1:] > 0.8 * adam[1:]) and np.all(ours[1:] < TARGET + 0.1)


def test_zero_one_adam_a_late_rare_coordinate_does_not_blow_up_at_a_variance_round():
    # Coordinate 0 appears at step 12, a compressed round (preconditioned by the leaf's mean
    # variance), with a gradient 1000x smaller than the others': the variance round at step
    # 16 gives it a variance 1e6x below the leaf's. Its 1-bit momentum, divided by that,
    # sent it to 89.0 (a target of 1.76); kept in preconditioned units it reaches 0.65 where
    # Adam reaches 1.30.
    lr = 0.05
    tx = jc.zero_one_adam(
        lr, "data", var_freeze_step=STEPS, var_update_scaler=1, warmup_steps=0, min_size=1
    )
    ours = late_coordinate_run(tx, weight0=1e-3)
    adam = late_coordinate_run(
        optax.chain(jc.compressed_allreduce(jc.identity(), "data"), optax.adam(lr)), 1e-3
    )
    assert np.all(np.isfinite(ours))
    assert 0.4 * adam[0] < ours[0] < TARGET, (ours[0], adam[0])


def replicated_steps(tx, params):
    """``(params replicated, tx's state, run)``: ``run(p, state, g)`` is one step of ``tx`` on
    ``g`` (``[N, ...]``, one gradient per device), applied to the replicated ``p``."""
    m = mesh()
    p = jax.device_put(params, NamedSharding(m, P()))
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")

    def step(p, s, g):
        u, s = tx.update(g[0], s, p)
        return optax.apply_updates(p, u), s

    run = Blocking(
        jax.jit(
            jax.shard_map(step, mesh=m, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
        )
    )
    return p, state, run


def unseen_rows_run(codec, **options) -> tuple[float, float]:
    """``jc.onebit_adam(1e-2, freeze_step=2, **options)`` on a 64 x 32 leaf of ones whose odd
    rows (a token never seen) have a zero gradient on every device, 8 steps: ``(max |move|``
    of the odd rows, mean ``|move|`` of the even rows ``)``."""
    m = mesh()
    tx = jc.onebit_adam(1e-2, "data", freeze_step=2, codec=codec, **options)
    p, state, run = replicated_steps(tx, jnp.ones((64, 32), jnp.float32))
    for t in range(8):
        g = np.random.default_rng(100 + t).standard_normal((N, 64, 32)).astype(np.float32)
        g[:, 1::2], g[:, 0::2] = 0.0, g[:, 0::2] + 0.5
        p, state = run(p, state, jax.device_put(g, NamedSharding(m, P("data"))))
    move = np.abs(np.asarray(p) - 1.0)
    return float(move[1::2].max()), float(move[0::2].mean())


def test_onebit_adam_unseen_rows_stay_put_with_exact_zeros():
    # A sign maps 0 to +scale: rows without a gradient move in every 1-bit round, to and fro
    # (0.0030 after 8 steps, 0.0101 after 3, where the others move 0.068); with the zero
    # words marked they stay put, and the others, the rms taken over them only, move 0.081
    # (Adam: about lr per step, 0.08). The figures without the step bound (adam_bound=False,
    # the default when they were written: docs/lm-onebit-adam.md, "A sign has no zero").
    # The default codec of both recipes is jc.sign("rms", exact_zeros=True).
    moved, seen = unseen_rows_run(jc.sign("rms"), adam_bound=False)
    still, seen_exact = unseen_rows_run(None, adam_bound=False)
    assert moved > 0.002 and still == 0.0, (moved, still)
    assert 0.06 < seen < seen_exact < 0.085, (seen, seen_exact)
    # The defaults (exact zeros, steps clipped at Adam's bound): still to the bit.
    assert unseen_rows_run(None)[0] == 0.0


def test_inject_hyperparams_onebit_adam():
    """``optax.inject_hyperparams(jc.onebit_adam)``: the bool ``rescale_variance`` stays
    static, an eager ``init`` (a concrete zero ``weight_decay``) and the traced ``update``
    build the same chain (they differed by ``add_decayed_weights``: a state of 2 transforms
    for a chain of 3), and the run is the plain recipe's to float32 rounding."""
    inject = optax.inject_hyperparams(jc.onebit_adam)
    tx = inject(0.05, "data", freeze_step=4, min_size=1, rescale_variance=True)
    w = jnp.zeros((D,), jnp.float32)
    eager, traced = tx.init(w), jax.eval_shape(tx.init, w)
    assert jax.tree.structure(eager) == jax.tree.structure(traced)
    assert eager.hyperparams["weight_decay"].shape == () and "rescale_variance" not in (
        eager.hyperparams
    )
    np.testing.assert_allclose(late_coordinate_run(tx), onebit_reference(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- replica x data

M, W = 2, 16  # 2 replicas of 4 devices; one leaf of W floats


@functools.cache
def replica_step(kind: str, inner_mean: bool = True):
    """``kind`` (local_sgd / diloco, H = 2, outer SGD lr 1) over the replica axis of a 2 x 4
    mesh, plain data parallel (``pmean`` over ``data``) inside each replica."""
    m = jax.make_mesh((M, N // M), ("replica", "data"), axis_types=(AxisType.Explicit,) * 2)
    if kind == "diloco":
        tx = jc.diloco(optax.sgd(0.1), "replica", 2, outer=optax.sgd(1.0))
    else:
        tx = jc.local_sgd(optax.sgd(0.1), "replica", 2)
    p0 = {"w": jnp.zeros((W,), jnp.float32)}
    state = jc.sharded_init(tx, p0, m, "replica")
    specs = jc.state_specs(state, "replica")

    def step(r, s, targets):
        p = jc.own(r)
        local = jax.lax.pcast(p, "data", to="varying")
        g = jax.tree.map(lambda w: w - targets[0], local)  # grad of 0.5 |w - target_i|^2
        if inner_mean:
            g = jax.lax.pmean(g, "data")
        u, s = tx.update(g, s, p)
        return jc.slot(optax.apply_updates(p, u)), s

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=m,
            in_specs=(P("replica"), specs, P(("replica", "data"))),
            out_specs=(P("replica"), specs),
        )
    )
    targets = jax.device_put(
        np.arange(N * W, dtype=np.float32).reshape(N, W) / W,
        NamedSharding(m, P(("replica", "data"))),
    )
    return fn, jc.replica_params(p0, m, "replica"), state, targets


@pytest.mark.parametrize("kind", ["local_sgd", "diloco"])
def test_replicas_of_data_parallel_groups_average_each_replica_then_sync(kind):
    fn, r, state, targets = replica_step(kind)
    t = np.arange(N * W, dtype=np.float32).reshape(N, W) / W
    # Each replica: SGD on the mean of its 4 devices' gradients; at step 2 the replicas average.
    replica_target = t.reshape(M, N // M, W).mean(1)
    w = np.zeros((M, W), np.float32)
    for _ in range(2):
        w = w - 0.1 * (w - replica_target)
    want = np.broadcast_to(w.mean(0), (M, W))
    run = Blocking(fn)
    out, s1 = run(r, state, targets)  # a local step: replicas apart
    assert not np.allclose(np.asarray(out["w"])[0], np.asarray(out["w"])[1])
    out, _ = run(out, s1, targets)  # the sync
    np.testing.assert_allclose(np.asarray(out["w"]), want, rtol=1e-5, atol=1e-6)
    # On the wire at the sync: one f32 mean over the 2 replicas (2 (M-1)/M 4 W bytes) and
    # the inner means over each replica's 4 devices, nothing else.
    report = jc.comm_report(fn, out, s1, targets)
    across = sum(c.bytes_per_device for c in report.collectives if c.group_size == M)
    assert across == 2 * (M - 1) / M * 4 * W


def test_gradients_not_averaged_inside_a_replica_are_refused():
    fn, r, state, targets = replica_step("diloco", inner_mean=False)
    with pytest.raises(ValueError, match=r"jax.lax.pmean\(grads, 'data'\)"):
        fn.lower(r, state, targets)


# --------------------------------------------------------------------------- clipping

CLIP = 1.0


@functools.cache
def clip_step(bound: bool):
    """Per-device gradients through ``jc.clip_by_global_norm`` (and, for comparison, optax's
    clipping of the mean and of each device): (ours mean, exact, optax local) per call."""
    m = mesh()
    tx = jc.clip_by_global_norm(CLIP, "data", bound=bound)

    def step(g):
        g = g[0]
        ours, _ = tx.update({"w": g}, tx.init(None))
        local, _ = optax.clip_by_global_norm(CLIP).update({"w": g}, optax.EmptyState())
        exact, _ = optax.clip_by_global_norm(CLIP).update(
            {"w": jax.lax.pmean(g, "data")}, optax.EmptyState()
        )
        mean = lambda t: jax.lax.pmean(t["w"], "data")  # noqa: E731
        return mean(ours), exact["w"], mean(local), ours["w"][None]

    run = Blocking(
        jax.jit(
            jax.shard_map(step, mesh=m, in_specs=P("data"), out_specs=(P(), P(), P(), P("data")))
        )
    )
    return lambda g: run(jax.device_put(g, NamedSharding(m, P("data"))))


def test_clip_by_global_norm_clips_the_mean_where_devices_disagree():
    rng = np.random.default_rng(0)
    noise = jnp.asarray(rng.standard_normal((N, 4096)).astype(np.float32) / 8.0)  # |g_i| ~ 8
    ours, exact, local, per_device = clip_step(False)(noise)
    norm = lambda x: float(jnp.linalg.norm(x))  # noqa: E731
    assert norm(exact) == pytest.approx(CLIP, rel=1e-5)
    assert norm(ours) == pytest.approx(CLIP, rel=0.1)  # DGC's c sqrt(n) per device
    assert norm(local) == pytest.approx(CLIP / np.sqrt(N), rel=0.1)  # optax before: too hard
    assert np.linalg.norm(np.asarray(per_device), axis=1).max() <= CLIP * np.sqrt(N) * (1 + 1e-5)
    # bound=True: the mean never passes c (here the devices agree: no averaging-out).
    agree = jnp.broadcast_to(noise[0], noise.shape)
    ours, exact, _, _ = clip_step(True)(agree)
    assert norm(ours) == pytest.approx(norm(exact), rel=1e-5)
    # Zero stays zero, a NaN stays NaN, a huge finite gradient gives a finite one.
    for g, ok in ((jnp.zeros_like(noise), "zero"), (noise.at[3, 0].set(jnp.nan), "nan")):
        out = np.asarray(clip_step(False)(g)[3])
        assert (out == 0).all() if ok == "zero" else np.isnan(out[3]).any()
    huge = np.asarray(clip_step(False)(noise * 3e37)[3])
    assert np.isfinite(huge).all()
    assert np.linalg.norm(huge, axis=1).max() == pytest.approx(CLIP * np.sqrt(N), rel=1e-4)


def stale_variance_run(tx) -> tuple[float, float]:
    """Two warm-up steps of a 512-value leaf whose coordinate 0 has a gradient 1e-6 of the
    others' (a variance of 1e-12 theirs), then its gradient at their size in the first 1-bit
    round: ``(max |move|`` of coordinates 1.. in that round, ``|move|`` of coordinate 0``)``."""
    m = mesh()
    p, state, run = replicated_steps(tx, jnp.zeros((512,), jnp.float32))
    for t in range(3):
        g = np.random.default_rng(200 + t).standard_normal((N, 512)).astype(np.float32) + 1.0
        g[:, 0] *= 1e-6 if t < 2 else 1.0
        before = np.asarray(p)
        p, state = run(p, state, jax.device_put(g, NamedSharding(m, P("data"))))
    move = np.abs(np.asarray(p) - before)
    return float(move[1:].max()), float(move[0])


@pytest.mark.parametrize(
    "make, bounded",
    [
        (lambda b: jc.onebit_adam(1e-2, "data", freeze_step=2, min_size=1, **b), True),
        (lambda b: jc.onebit_adam(1e-2, "data", freeze_step=2, min_size=1, **b), False),
        (lambda b: jc.zero_one_adam(1e-2, "data", var_freeze_step=2, min_size=1, **b), True),
        (lambda b: jc.zero_one_adam(1e-2, "data", var_freeze_step=2, min_size=1, **b), False),
        # The floor reads the levels, tracked for it where the variance is not rescaled.
        (
            lambda b: jc.onebit_adam(
                1e-2, "data", freeze_step=2, min_size=1, rescale_variance=False, **b
            ),
            True,
        ),
    ],
    ids=[
        "onebit_adam",
        "onebit_adam-unbounded",
        "zero_one_adam",
        "zero_one_adam-unbounded",
        "onebit_adam-frozen",
    ],
)
def test_a_stale_tiny_variance_does_not_scale_up_its_chunk(make, bounded):
    # Adam's variance takes in the gradient that moves its momentum; a frozen (or sampled)
    # one does not: coordinate 0's preconditioned step is then 1e6x the others', and the
    # root mean square of the 1-bit chunk it sits in moves every coordinate by that (the LM
    # benchmark's input embedding, 6-25x its usual step). Both recipes' default bound lifts
    # each leaf's sqrt(v_hat) to the floor at which a gradient at the leaf's level moves the
    # preconditioned momentum by Adam's own bound (7.27 sqrt(1 - b2^3) = 0.40 at step 3) and
    # clips the mean step at it: every coordinate moves about lr (0.0109, coordinate 0
    # 0.0108; each device's step clipped, the bound until 2026-11-27: 0.0104 and 0.0100;
    # adam_bound=False: 616).
    others, first = stale_variance_run(make({} if bounded else {"adam_bound": False}))
    if bounded:
        assert 0.9e-2 < others < 1.2e-2 and first < 1.2e-2, (others, first)
        # No coordinate beyond Adam's own step at step 3: lr C sqrt(1 - b2^3) / (1 - b1^3).
        adam = 1e-2 * float(adam_step_bound(2, 0.9, 0.999)) / (1 - 0.9**3)
        assert max(others, first) <= adam * (1 + 1e-5), (others, first, adam)
    else:
        assert others > 1.0 and first > 1.0, (others, first)
