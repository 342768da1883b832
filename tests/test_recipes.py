"""The optimizer recipes (jc.sgd, jc.onebit_adam, Accordion) against the optimizers they extend.

The contract suite (tests/test_contract.py) checks every recipe's state, NaN handling, orbax,
pmap and bytes. Here: that without compression each recipe *is* its optax optimizer on the
mean gradient (numbers, several steps), that what compression holds back is conserved where
the contract table cannot express it (Nesterov's look-ahead, 1-bit Adam's momentum, an
Accordion switch), and that the recipes compose with ``optax.inject_hyperparams``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Blocking, N, held_back, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.onebit_adam import adam_step_bound
from jaxcomp._src.sgd import look_ahead
from jaxcomp._src.zero_one_adam import VARIANCE, default_warmup, round_kinds

SHAPES = {"w": (32, 48), "b": (48,)}
STEPS = 5
LR = 0.05


def params() -> dict:
    rng = np.random.default_rng(0)
    return {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def grads(t: int) -> dict:
    rng = np.random.default_rng(200 + t)
    return {k: (rng.standard_normal((N, *s)) + 0.2).astype(np.float32) for k, s in SHAPES.items()}


class Run:
    """``tx`` in a jitted shard_map step over 8 devices: outputs and states of STEPS steps."""

    def __init__(self, tx: optax.GradientTransformation):
        m = mesh()
        p = jax.device_put(params(), NamedSharding(m, P()))
        state = jc.sharded_init(tx, p, m, "data")
        specs = jc.state_specs(state, "data")

        def step(g, s, p):
            u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
            return jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying")[None], u), s

        run = Blocking(
            jax.jit(
                jax.shard_map(
                    step,
                    mesh=m,
                    in_specs=(P("data"), specs, P()),
                    out_specs=(P("data"), specs),
                )
            )
        )
        self.step = lambda g, state: run(jax.device_put(g, NamedSharding(m, P("data"))), state, p)
        self.outs, self.states = [], [state]
        for t in range(STEPS):
            g = jax.device_put(grads(t), NamedSharding(m, P("data")))
            out, state = run(g, state, p)
            self.outs.append({k: np.asarray(a)[0] for k, a in out.items()})
            self.states.append(state)


def _exact_zero_one(**options):
    """jc.zero_one_adam with the momentum exchanged exactly, a round of each kind in 5 steps
    (the rounds' algebra: without ``adam_bound``, whose clip tests/test_lm_recipes.py pins)."""
    return jc.zero_one_adam(
        1e-2,
        "data",
        codec=jc.identity(),
        error_feedback=None,
        adam_bound=False,
        var_freeze_step=3,
        var_update_scaler=1,
        local_step_scaler=1,
        **options,
    )


# Recipes shared by several tests (each compiles once).
SHARED = {
    "onebit": lambda: jc.onebit_adam(1e-2, "data", freeze_step=2, min_size=1),
    "sgd-sign": lambda: jc.sgd(1e-2, jc.sign(), "data", momentum=0.9),
    # Rounds of steps 0..4: FULL, COMPRESSED, FULL, COMPRESSED, SKIPPED.
    "zero_one": lambda: _exact_zero_one(),
    # The same with variance_rounds="coded": step 2 is a VARIANCE round.
    "zero_one_coded": lambda: _exact_zero_one(variance_rounds="coded"),
    # 1-bit signs, no step bound, variance_rounds="coded"; rounds of steps 0..4: FULL,
    # COMPRESSED, VARIANCE, COMPRESSED, VARIANCE.
    "zero_one_coded_sign": lambda: jc.zero_one_adam(
        1e-2,
        "data",
        var_freeze_step=6,
        warmup_steps=1,
        var_update_scaler=1,
        local_step_scaler=1,
        variance_rounds="coded",
        adam_bound=False,
        min_size=1,
    ),
    # 1-bit signs, the default warm-up (var_freeze_step // 2 = 3); rounds of steps 0..4:
    # FULL x3 (the warm-up), COMPRESSED, FULL (a variance round: a multiple of the gap, 4).
    "zero_one_warmup": lambda: jc.zero_one_adam(
        1e-2, "data", var_freeze_step=6, var_update_scaler=1, min_size=1
    ),
}


@functools.cache
def shared(name: str) -> Run:
    return Run(SHARED[name]())


def reference(opt: optax.GradientTransformation) -> list[dict]:
    """``opt`` on the mean gradient, in float64-free float32 numpy-fed steps."""
    p = params()
    state = opt.init(p)
    outs = []
    for t in range(STEPS):
        g = {k: jnp.asarray(a.mean(0)) for k, a in grads(t).items()}
        u, state = opt.update(g, state, p)
        outs.append({k: np.asarray(a) for k, a in u.items()})
    return outs


def assert_close(outs: list[dict], want: list[dict], rtol=2e-5, atol=1e-7) -> None:
    for t, (a, b) in enumerate(zip(outs, want, strict=True)):
        for k in SHAPES:
            np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=f"{k} step {t}")


# --------------------------------------------------------------------------- jc.sgd


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_without_compression_is_optax_sgd(nesterov):
    tx = jc.sgd(LR, jc.identity(), "data", momentum=0.9, nesterov=nesterov, error_feedback=None)
    want = reference(optax.sgd(LR, momentum=0.9, nesterov=nesterov))
    outs = Run(tx).outs
    assert_close(outs, want)
    # The same update up to float32 rounding (docs: the mean of the devices' momenta against
    # the momentum of the mean gradient, summed in another order): within 1e-6 of the
    # largest value at every step (measured 2.7e-7 over 20 steps of another tree).
    for a, b in zip(outs, want, strict=True):
        for k in SHAPES:
            assert np.max(np.abs(a[k] - b[k])) <= 1e-6 * np.max(np.abs(b[k])), k


def test_ef21_sgdm_without_compression_is_optax_sgd():
    """EF21-SGDM (error_feedback="ef21") with the identity: each h_i tracks m_i exactly."""
    tx = jc.sgd(LR, jc.identity(), "data", momentum=0.9, error_feedback="ef21")
    assert_close(Run(tx).outs, reference(optax.sgd(LR, momentum=0.9)))


def test_sgd_schedule_and_zero_momentum():
    schedule = optax.linear_schedule(LR, 0.0, STEPS)
    tx = jc.sgd(schedule, jc.identity(), "data", momentum=0, error_feedback=None)
    assert_close(Run(tx).outs, reference(optax.sgd(schedule)))


def test_sgd_look_ahead_is_the_default_for_biased_codecs():
    """``nesterov=None`` (default): the look-ahead for biased codecs (sign, top-k), heavy-ball
    momentum for unbiased ones (identity, stochastic), so uncompressed stays optax.sgd."""
    assert [look_ahead(None, c) for c in (jc.sign(), jc.sign(block_size=64), jc.top_k(0.01))] == [
        True
    ] * 3
    assert [look_ahead(None, c) for c in (jc.identity(), jc.qsgd(16))] == [False, False]
    assert look_ahead(False, jc.sign()) is False and look_ahead(True, jc.identity()) is True


def test_sgd_default_conserves_the_look_ahead():
    """With a biased codec and the default ``nesterov``, what the devices sent plus what they
    hold back is the sum of the look-aheads beta m_t + (1 - beta) mean g_t (m_t the momentum
    of the mean gradient)."""
    beta = 0.9
    run = Run(jc.sgd(0.1, jc.top_k(0.05), "data", momentum=beta, min_size=1))
    m = {k: np.zeros(s) for k, s in SHAPES.items()}
    sent = {k: np.zeros(s) for k, s in SHAPES.items()}
    look = {k: np.zeros(s) for k, s in SHAPES.items()}
    for t in range(STEPS):
        for k, g in grads(t).items():
            g = g.astype(np.float64).mean(0)
            m[k] = beta * m[k] + (1 - beta) * g
            look[k] += beta * m[k] + (1 - beta) * g
            sent[k] += run.outs[t][k] / -1.0  # -lr / (1 - beta) = -1
    held = held_back(run.states[-1], params())
    for k in SHAPES:
        np.testing.assert_allclose(sent[k] + held[k], look[k], atol=2e-5, err_msg=k)
    assert max(float(np.abs(held[k]).max()) for k in SHAPES) > 1e-3


# --------------------------------------------------------------------------- jc.onebit_adam


def level_sample(g: np.ndarray) -> float:
    """``mean_i mean_j g_{i,j}^2`` of one leaf's per-device gradients ``g[i]``."""
    return float(np.mean(g.astype(np.float64) ** 2))


@pytest.mark.parametrize("rescale", [True, False], ids=["rescaled", "frozen"])
def test_onebit_adam_warmup_is_adam_and_identity_stays_adam_with_rescaled_variance(rescale):
    """Warm-up steps are Adam on the mean gradient; with the identity codec the compression
    stage is Adam whose variance stopped at ``freeze_step``, rescaled per leaf by
    ``L_hat_t / L_hat_freeze`` (``L``: Adam's EMA of the devices' mean squared gradient;
    ``rescale_variance=False``: the paper's variance, frozen as it was; ``adam_bound=False``:
    the steps not clipped, whose clip the next test pins)."""
    freeze = 3
    tx = jc.onebit_adam(
        1e-2,
        "data",
        freeze_step=freeze,
        codec=jc.identity(),
        rescale_variance=rescale,
        adam_bound=False,
    )
    run = Run(tx)
    want = reference(optax.adam(1e-2))
    assert_close(run.outs[:freeze], want[:freeze], rtol=1e-4)
    mu = {k: np.zeros(s) for k, s in SHAPES.items()}
    nu = {k: np.zeros(s) for k, s in SHAPES.items()}
    level = {k: 0.0 for k in SHAPES}
    ref = {}
    for t in range(STEPS):
        for k, g in grads(t).items():
            level[k] = 0.999 * level[k] + 0.001 * level_sample(g)
            level_hat = level[k] / (1 - 0.999 ** (t + 1))
            ref[k] = level_hat if t < freeze else ref[k]
            g = g.astype(np.float64).mean(0)
            mu[k] = 0.9 * mu[k] + 0.1 * g
            if t < freeze:
                nu[k] = 0.999 * nu[k] + 0.001 * g * g
            ratio = level_hat / ref[k] if rescale else 1.0
            v_hat = nu[k] / (1 - 0.999 ** min(t + 1, freeze)) * ratio
            direction = (mu[k] / (1 - 0.9 ** (t + 1))) / (np.sqrt(v_hat) + 1e-8)
            np.testing.assert_allclose(run.outs[t][k], -1e-2 * direction, rtol=1e-4, atol=1e-7)
    ours = run.states[-1][0]
    for k in SHAPES:  # the level and its reference: one float per leaf (0: not tracked)
        assert float(ours.level[k]) == pytest.approx(level[k] if rescale else 0.0, rel=1e-5)
        assert float(ours.level_ref[k]) == pytest.approx(ref[k] if rescale else 0.0, rel=1e-5)


def test_onebit_adam_restored_past_a_lower_freeze_step_fills_its_variance():
    """A 1-bit Adam state saved in its warm-up (count 5 of ``freeze_step=8``) with half of
    ``w`` unseen (variance 0) and run with ``freeze_step=3``: the variance is filled at once
    (the unseen coordinates take the leaf's mean, the others kept bit for bit) and the unseen
    coordinates move from the next step. The fill ran only at count ``freeze_step - 1``, so
    they kept a zero preconditioner and never moved again (output 0 there; until 2026-11-27)."""
    tx = jc.onebit_adam(LR, "data", freeze_step=3, min_size=64)
    m = mesh()
    p = jax.device_put(params(), NamedSharding(m, P()))
    fresh = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(fresh, "data")
    rng = np.random.default_rng(1)
    nu = {k: rng.uniform(0.5, 1.5, s).astype(np.float32) for k, s in SHAPES.items()}
    nu["w"][:, :24] = 0.0
    adam = fresh[0]  # (OneBitAdamState, the scale's EmptyState)
    saved = (
        adam._replace(
            count=jax.device_put(np.int32(5), adam.count.sharding),
            nu=jax.tree.map(lambda a, x: jax.device_put(x, a.sharding), adam.nu, nu),
        ),
        *fresh[1:],
    )

    def step(g, s, p):
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
        return u, s

    run = Blocking(
        jax.jit(
            jax.shard_map(step, mesh=m, in_specs=(P("data"), specs, P()), out_specs=(P(), specs))
        )
    )
    state, outs = saved, []
    for t in range(2):
        out, state = run(jax.device_put(grads(t), NamedSharding(m, P("data"))), state, p)
        outs.append(np.asarray(out["w"]))
        if t == 0:
            after = np.asarray(state[0].nu["w"])
            np.testing.assert_array_equal(after[:, 24:], nu["w"][:, 24:])
            np.testing.assert_allclose(after[:, :24], nu["w"][:, 24:].mean(), rtol=1e-5)
    assert np.isfinite(outs[1]).all() and np.abs(outs[1][:, :24]).min() > 0


def test_onebit_adam_momentum_exchange_conserves():
    """Compression stage, in the preconditioned units u = m / (max(sqrt(v_hat), f) + eps)
    the momentum travels in (``f``: the default ``adam_bound``'s per-leaf floor,
    ``sqrt((1 - b2)(1 - b1^2 / b2) L) / (1 - b2^t)``): the devices' steps average without a
    clip, ``d_t = mean_i u(b1 m_{t-1} + (1 - b1) g_{i,t}) + held_{t-1} - held_t``, and the
    momentum is that mean clipped at Adam's bound ``B_t = C sqrt(1 - b2^(t+1))``
    (held_{t-1} was kept in step t-1's units, which the rescaled variance moves by ~0.1%:
    hence atol 3e-4 on values of ~1)."""
    run = shared("onebit")  # freeze_step=2
    p = params()
    floored = 0
    room = np.sqrt((1 - 0.999) * (1 - 0.81 / 0.999))
    for t in range(2, STEPS):
        before, after = run.states[t][0], run.states[t + 1][0]
        held = (held_back(before, p), held_back(after, p))
        bound = float(adam_step_bound(t, 0.9, 0.999))
        for k, g in grads(t).items():
            level_hat = float(after.level[k]) / (1 - 0.999 ** (t + 1))
            v_hat = np.asarray(after.nu[k], np.float64) / (1 - 0.999**2)
            v_hat = v_hat * level_hat / float(after.level_ref[k])
            floor = room * np.sqrt(float(after.level[k])) / (1 - 0.999 ** (t + 1))
            floored += int((np.sqrt(v_hat) < floor).sum())
            unit = 1.0 / (np.maximum(np.sqrt(v_hat), floor) + 1e-8)
            local = (0.9 * np.asarray(before.mu[k]) + 0.1 * g.astype(np.float64)) * unit
            want = np.clip(local.mean(0) + held[0][k] - held[1][k], -bound, bound)
            got = np.asarray(after.mu[k]) * unit
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-4, err_msg=f"{k} {t}")
    # The floor binds (1,174 coordinate-steps under it); the mean's clip barely (0.5% over
    # at one coordinate), so it is not asserted.
    assert floored > 0
    assert max(float(np.abs(h).max()) for h in held_back(run.states[-1], p).values()) > 1e-4


def test_adam_bound_floor_at_every_allowed_beta():
    """``adam_bound``'s floor at ``b1 = b2 = 0`` (each in its allowed [0, 1)) was
    ``sqrt((1 - b2)(1 - 0 / 0))``: NaN, so every compressed step of 1-bit Adam was NaN and
    skipped, its state frozen for good. Where ``b1^2 >= b2`` there is no bound (Adam's is
    inf) and the floor is 0; elsewhere ``(1 - b1) sqrt(L_hat) / floor`` is Adam's bound."""
    from jaxcomp._src.onebit_adam import variance_floor

    level, count = {"w": jnp.float32(4.0)}, jnp.int32(5)
    for b1, b2 in [(0.0, 0.0), (0.9, 0.0), (0.9, 0.5)]:
        assert float(variance_floor(level, count, b1, b2)["w"]) == 0.0, (b1, b2)
        assert float(adam_step_bound(count, b1, b2)) == np.inf
    for b1, b2 in [(0.0, 0.5), (0.9, 0.999)]:
        level_hat = 4.0 / (1 - b2**6)
        bound = (1 - b1) * np.sqrt(level_hat) / float(variance_floor(level, count, b1, b2)["w"])
        assert bound == pytest.approx(float(adam_step_bound(count, b1, b2)), rel=1e-5)
    for tx in (
        jc.onebit_adam(LR, "data", freeze_step=2, b1=0.0, b2=0.0),  # steps 2-4 were NaN
        jc.zero_one_adam(LR, "data", var_freeze_step=2, b1=0.0, b2=0.0),
    ):
        outs = Run(tx).outs
        assert all(np.isfinite(o[k]).all() and np.abs(o[k]).max() > 0 for o in outs for k in o)


# --------------------------------------------------------------------------- jc.zero_one_adam


@pytest.mark.parametrize("name", ["zero_one", "zero_one_coded"])
def test_zero_one_adam_rounds_against_numpy(name):
    """FULL rounds move Adam's m and v from the float32 mean (v an EMA in time: a round
    ``gap`` steps after the last weighs ``1 - b2^gap``); COMPRESSED rounds (identity codec)
    average the devices' momentum steps plus what they held; a VARIANCE round
    (``variance_rounds="coded"``: a variance round after a compressed one) is a compressed
    round whose float32 mean gradient moves v; a SKIPPED round decays the momentum and each
    device holds (1 - b1) g_i for its next exchange."""
    run = shared(name)
    kinds = ["full", "compressed", "full", "compressed", "skipped"]
    if name == "zero_one_coded":
        kinds[2] = "variance"
        assert round_kinds(5, 3, 1, 1, 16, 0, coded=True) == [0, 1, VARIANCE, 1, 2]
    mu = {k: np.zeros(s) for k, s in SHAPES.items()}
    nu = {k: np.zeros(s) for k, s in SHAPES.items()}
    level = {k: 0.0 for k in SHAPES}
    ref = {}
    last = 0  # step + 1 of the last FULL round
    for t, kind in enumerate(kinds):
        g = {k: a.astype(np.float64) for k, a in grads(t).items()}
        moves = kind in ("full", "variance")
        gap, last = t + 1 - last, (t + 1 if moves else last)
        for k in SHAPES:
            # The variance, rescaled between its rounds by the level L_hat_t / L_hat_full.
            level[k] = 0.999 * level[k] + 0.001 * level_sample(g[k])
            level_hat = level[k] / (1 - 0.999 ** (t + 1))
            ref[k] = level_hat if moves else ref[k]
            mean = g[k].mean(0)
            mu[k] = 0.9 * mu[k] + (0.1 * mean if kind != "skipped" else 0.0)
            if moves:
                nu[k] = 0.999**gap * nu[k] + (1 - 0.999**gap) * mean * mean
            v_hat = nu[k] / (1 - 0.999**last) * level_hat / ref[k]
            direction = (mu[k] / (1 - 0.9 ** (t + 1))) / (np.sqrt(v_hat) + 1e-8)
            np.testing.assert_allclose(
                run.outs[t][k], -1e-2 * direction, rtol=1e-4, atol=1e-7, err_msg=f"{k} {t}"
            )
    ours = run.states[-1][0]
    assert int(ours.variance_updates) == 2 and int(ours.variance_step) == 3
    for k in SHAPES:
        np.testing.assert_allclose(
            np.asarray(ours.pending[k]), 0.1 * grads(4)[k], rtol=1e-6, atol=1e-8
        )


def test_zero_one_adam_warmup_is_adam_then_the_schedule_compresses():
    """The first ``warmup_steps`` rounds are uncompressed Adam on the mean gradient (1-bit
    codec and all); then the momentum goes through the codec. The default warm-up is half
    of ``var_freeze_step`` (a quarter until 2026-11-26): on the LM benchmark's schedule
    (``var_freeze_step=100``, the library's ``var_update_scaler=16``) the first compressed
    round is step 50 (paper: 17; a quarter: 25), and 62 of 300 rounds are float32 (45; 49),
    the 12 variance rounds after the warm-up on a gap of 4 (24 on gaps of 2 and 4)."""
    run = shared("zero_one_warmup")
    want = reference(optax.adam(1e-2))
    assert_close(run.outs[:3], want[:3])
    assert not np.allclose(run.outs[3]["w"], want[3]["w"], rtol=1e-2)  # 1-bit from here
    assert default_warmup(100, None) == 50 and default_warmup(7, None) == 3
    kinds = lambda w, coded=False: round_kinds(300, 100, 16, 1000, 16, w, coded)  # noqa: E731
    paper, quarter, half = kinds(0), kinds(25), kinds(default_warmup(100, None))
    assert (paper.index(1), quarter.index(1), half.index(1)) == (17, 25, 50)
    assert (paper.count(0), quarter.count(0), half.count(0)) == (45, 49, 62)
    assert VARIANCE not in paper + quarter + half
    assert [t for t in range(50, 100) if half[t] == 0] == list(range(52, 100, 4))
    # variance_rounds="coded": the variance rounds after the first compressed one send the
    # momentum through the codec (and the gradient in float32 for the variance).
    coded = kinds(default_warmup(100, None), True)
    assert (coded.count(0), coded.count(VARIANCE)) == (50, 12)
    assert int(run.states[-1][0].variance_updates) == 4


def test_zero_one_adam_skipped_round_nonfinite_poisons_every_device():
    run = shared("zero_one")
    before = run.states[4]  # step 4 is a skipped round
    g = grads(4)
    g["w"][6, 1, 2] = np.inf
    out, after = run.step(g, before)
    for k in SHAPES:
        assert not np.isfinite(np.asarray(out[k])).any(), k
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def steps_from(run: Run, t0: int, feeds: list[dict]) -> tuple[list[dict], object]:
    """``run``'s step from its state after ``t0`` steps, fed ``feeds`` in turn: the outputs
    (device 0's, as numpy) and the last state."""
    state, outs = run.states[t0], []
    for g in feeds:
        out, state = run.step(g, state)
        outs.append({k: np.asarray(a)[0] for k, a in out.items()})
    return outs, state


def all_finite(tree) -> bool:
    return all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves(tree))


def test_zero_one_adam_finite_outlier_at_a_variance_round_keeps_the_state_finite():
    """A gradient of 1e30 (finite) on every device at a coded VARIANCE round: its 1-bit
    momentum spreads ~1e28 (in preconditioned units) over the leaf, and the next round turns
    that back into momentum units by ``sqrt(v_hat)`` of the outlier's coordinate (~1e19).
    That product overflowed: the momentum held inf with the step's flag clear, and every
    later step read it, was flagged non-finite and skipped (count stuck at 4 for good). Now
    it saturates at F32_MAX and each step goes on."""
    run = shared("zero_one_coded_sign")
    g2 = grads(2)
    g2["w"][:, 0, 0] = 1e30
    outs, state = steps_from(run, 2, [g2, grads(3), grads(4)])
    ours = state[0]
    assert all(all_finite(o) for o in outs) and all_finite(ours)
    assert int(ours.count) == 5 and int(ours.variance_updates) == 3
    assert float(np.abs(np.asarray(ours.mu["w"])[0, 0])) == np.finfo(np.float32).max


@pytest.mark.parametrize("name", ["onebit", "zero_one_coded_sign"])
def test_adam_full_round_of_huge_finite_gradients_is_adam_not_skipped(name):
    """3e38 at ``w[0, 0]`` on every device in an uncompressed round (step 0): the mean is
    finite, so the step is Adam's (``m_hat = 3e38``, ``v_hat`` the saturated square
    ``F32_MAX``), not a skipped non-finite step. The float32 sum of the 8 gradients is inf:
    summed before the division, the mean was inf and the step skipped."""
    run = shared(name)
    g = grads(0)
    g["w"][:, 0, 0] = 3e38
    (out,), state = steps_from(run, 0, [g])
    assert int(state[0].count) == 1 and all_finite(out) and all_finite(state[0])
    # v_hat = F32_MAX, within the float32 bias correction 1 / (1 - b2^t) (rel 1e-4 at t = 1)
    big = np.float32(3e38) / np.sqrt(np.float64(np.finfo(np.float32).max))  # 1.6263e19
    assert out["w"][0, 0] == pytest.approx(-1e-2 * big, rel=1e-4)


@pytest.mark.parametrize("name,bad_t", [("onebit", 1), ("onebit", 3), ("zero_one_coded_sign", 2)])
def test_adam_after_a_nonfinite_step_the_next_steps_are_those_without_it(name, bad_t):
    """A NaN on one device at step ``bad_t`` (1-bit Adam: a warm-up and a compressed step;
    0/1 Adam: a coded VARIANCE round): that update is NaN and the whole state is kept, its
    step count included (the schedule counts finite steps), so the steps fed after it are,
    bit for bit, those of the run that never saw it."""
    run = shared(name)
    bad = grads(bad_t)
    bad["w"][3, 1, 2] = np.nan
    later = [grads(t) for t in range(bad_t, STEPS)]
    outs, state = steps_from(run, bad_t, [bad, *later])
    assert all(np.isnan(a).all() for a in outs[0].values())
    for t, out in zip(range(bad_t, STEPS), outs[1:], strict=True):
        for k in SHAPES:
            np.testing.assert_array_equal(out[k], run.outs[t][k], err_msg=f"{k} step {t}")
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(run.states[-1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- Accordion


def test_accordion_gentle_in_critical_intervals_and_memory_shared():
    """Intervals 0 and 1 are critical (gentle codec: top-k at 50%; the first has no norm to
    compare with); the gradients' norm then holds still, so interval 2 is not (top-k at
    5%); the shared memory conserves the gradient across the switch."""
    tx = jc.sgd(
        0.1,
        jc.top_k(0.05),
        "data",
        momentum=0,
        min_size=1,
        strategy="allgather",
        adaptive=jc.accordion(jc.top_k(0.5), interval=2, threshold=0.5),
    )
    run = Run(tx)
    ours = [s[0] for s in run.states]
    critical = [bool(s.adaptive.critical) for s in ours]
    assert critical == [True, True, True, True, False, False], critical
    dense = [int(np.count_nonzero(o["w"])) for o in run.outs]
    size = int(np.prod(SHAPES["w"]))
    assert all(d > 0.4 * size for d in dense[:4]), dense  # at most 8 x 5% otherwise
    assert all(d <= N * 0.05 * size + 1 for d in dense[4:]), dense
    fed = sum(g["w"].astype(np.float64).mean(0) for g in map(grads, range(STEPS)))
    sent = sum(o["w"] for o in run.outs) / -0.1
    held = held_back(run.states[-1], params())["w"]
    np.testing.assert_allclose(sent + held, fed, atol=2e-5)


def test_accordion_state_stays_float32_under_x64():
    """``previous`` was ``jnp.zeros([])``: float64 with ``jax_enable_x64`` on, where the
    state documents float32 (a checkpoint then changed dtype between x64 and not)."""
    acc = jc.accordion(jc.top_k(0.5), interval=2)
    with jax.enable_x64(True):
        state = acc.init()
        after = acc.update(state, jnp.int32(1), [jnp.ones(4, jnp.float32)])
    want = [jnp.dtype(bool), jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)]
    assert [x.dtype for x in state] == want and [x.dtype for x in after] == want


def test_accordion_errors_name_the_argument():
    with pytest.raises(TypeError, match="gentle"):
        jc.accordion("top_k")
    with pytest.raises(ValueError, match="interval"):
        jc.accordion(jc.top_k(0.1), interval=0)
    with pytest.raises(TypeError, match="adaptive"):
        jc.compressed_allreduce(jc.sign(), "data", adaptive=jc.top_k(0.1))


# --------------------------------------------------------------------------- inject_hyperparams


@pytest.mark.parametrize(
    "name,factory,kwargs",
    [
        ("sgd-sign", jc.sgd, {"codec": jc.sign(), "momentum": 0.9}),
        ("onebit", jc.onebit_adam, {"freeze_step": 2, "min_size": 1}),
        (
            "zero_one",
            jc.zero_one_adam,
            {
                "codec": jc.identity(),
                "error_feedback": None,
                "adam_bound": False,
                "var_freeze_step": 3,
                "var_update_scaler": 1,
                "local_step_scaler": 1,
            },
        ),
    ],
    ids=["sgd", "onebit_adam", "zero_one_adam"],
)
def test_recipes_compose_with_inject_hyperparams(name, factory, kwargs):
    """The learning rate (and momentum, betas, freeze step) become hyperparameters in the
    state; exchange options (``min_size``) stay static; the steps are those of the recipe
    built directly."""
    injected = optax.inject_hyperparams(factory)(learning_rate=1e-2, axis_name="data", **kwargs)
    run = Run(injected)
    assert float(run.states[-1].hyperparams["learning_rate"]) == pytest.approx(1e-2)
    assert_close(run.outs, shared(name).outs, rtol=1e-5)


def test_onebit_adam_weight_decay_is_adamw_and_masked():
    """``weight_decay=`` is AdamW's decoupled decay: in the warm-up 1-bit Adam is optax.adamw
    on the mean gradient, the mask as ``optax.adamw``'s (here: the bias not decayed)."""
    mask = {"w": True, "b": False}
    tx = jc.onebit_adam(LR, "data", freeze_step=10, weight_decay=0.1, weight_decay_mask=mask)
    assert_close(Run(tx).outs, reference(optax.adamw(LR, weight_decay=0.1, mask=mask)))
