"""The smoke subset: a few transforms' training steps and the bytes of compiled collectives.

The suite compiles at XLA:CPU backend optimization level 0 (see conftest.py), which is not
the machine code users run. ``make test`` runs the tests marked ``smoke`` (these) at XLA's
default level instead (``JAXCOMP_XLA_OPT_DEFAULT=1 pytest -m smoke``; a plain ``pytest``
runs them at level 0 with the rest), so a miscompile or a numerical difference that only the
optimized code has still fails CI.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import OPT_DEFAULT
from helpers import N, mesh, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

pytestmark = pytest.mark.smoke

STEPS = 30
LR = 0.005  # with momentum 0.9; the plain run's loss falls ~40x in 30 steps


def test_optimization_level_in_effect():
    flags = os.environ.get("XLA_FLAGS", "")
    assert ("--xla_backend_optimization_level=0" in flags) != OPT_DEFAULT, flags


def _problem():
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (512, 64))
    y = x @ jax.random.normal(kw, (64, 32))
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}  # w: 2048 values, compressed
    return params, x, y


def _loss(params, x, y):
    return jnp.mean(jnp.sum((x @ params["w"] + params["b"] - y) ** 2, axis=-1))


def _train(tx, steps=STEPS):
    """``steps`` data-parallel steps on 8 devices; the loss before and after, the report."""
    params, x, y = _problem()
    m = mesh()
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(p, s, x, y):
        g = jax.grad(_loss)(jax.lax.pcast(p, "data", to="varying"), x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    fn = per_device(step, (P(), specs, P("data"), P("data")), (P(), specs), m)
    xs, ys = shard(x, m), shard(y, m)
    report = jc.comm_report(fn.fn, params, state, xs, ys)
    first = float(_loss(params, x, y))
    for _ in range(steps):
        params, state = fn(params, state, xs, ys)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(params))
    return first, float(_loss(params, x, y)), report


PLAIN_BYTES = 2 * (N - 1) / N * 4 * (64 * 32 + 32)  # f32 pmean of the gradient, ring model

TRANSFORMS = {
    "sign, residual": (
        lambda: optax.chain(jc.compressed_allreduce(jc.sign(), "data"), optax.sgd(LR, 0.9)),
        0.1,
        15.0,
    ),
    "int8, two_phase": (
        lambda: optax.chain(
            jc.compressed_allreduce(jc.int_quant(8), "data", strategy="two_phase"),
            optax.sgd(LR, 0.9),
        ),
        0.05,
        3.5,
    ),
    "top_k 10%": (
        lambda: optax.chain(jc.compressed_allreduce(jc.top_k(0.1), "data"), optax.sgd(LR, 0.9)),
        0.25,
        2.0,
    ),
    "dgc 5%": (
        lambda: optax.chain(jc.dgc(0.05, "data", momentum=0.9, warmup_steps=0), optax.sgd(LR)),
        0.15,
        2.0,
    ),
    "powersgd rank 2": (
        lambda: optax.chain(jc.powersgd(2, "data", start_step=0), optax.sgd(LR, 0.9)),
        0.35,
        5.0,
    ),
    "accumulate 2 x sign": (
        lambda: jc.accumulate(
            optax.chain(jc.compressed_allreduce(jc.sign(), "data"), optax.sgd(LR, 0.9)), 2
        ),
        0.5,
        15.0,
    ),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transform_trains_and_saves_bytes(name):
    make, loss_ratio, min_saving = TRANSFORMS[name]
    first, last, report = _train(make())
    saving = PLAIN_BYTES / report.bytes_per_device
    print(f"{name}: loss {first:.2f} -> {last:.4f}, {saving:.1f}x fewer bytes than pmean")
    assert last < loss_ratio * first
    assert saving > min_saving


@pytest.mark.parametrize(
    "codec, strategy",
    [
        (jc.sign(), "two_phase"),
        (jc.int_quant(8), "allgather"),
        (jc.int_quant(4), "two_phase"),
        (jc.top_k(0.01), "two_phase"),
        (jc.cast("fp16", scaled=False), "allreduce"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_pmean_bytes_equal_the_model_and_error_is_bounded(codec, strategy):
    d = 1 << 14
    x = jax.random.normal(jax.random.PRNGKey(1), (N, d))
    fn = per_device(lambda v: jc.pmean(v[0], "data", codec, strategy=strategy), (P("data"),), P())
    xs = shard(x)
    report = jc.comm_report(fn.fn, xs)
    model = jc.strategy_bytes(codec, d, N)[strategy]
    # The payload as the model says, plus at most a few bytes of scalars (non-finite flag).
    assert model <= report.bytes_per_device <= model + 64, (report.bytes_per_device, model)
    mean = np.asarray(x).mean(0)
    err = np.linalg.norm(np.asarray(fn(xs)) - mean) / np.linalg.norm(mean)
    assert err < {"Cast": 1e-3, "IntQuant": 0.2}.get(type(codec).__name__, 1.0), err
