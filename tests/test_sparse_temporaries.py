"""Top-k all-gathered in pieces (DGC's warm-up stages): the same sums, the same bytes; the
compiled DGC step's temporaries (deterministic, compile only) and the rules that let its
velocity and accumulation be written in place (saturation, the flag read up front)."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import N, per_device, shard, stacked_normal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import collectives
from jaxcomp._src.codecs.base import F32_MAX

SIZES = (4096, 1500)  # at 25% on 8 devices, 8 bytes a value: 4 f32 copies gathered -> 17 pieces


def _reduce(pieces: bool):
    codec = jc.top_k(0.25)

    def f(t):
        x = t[0]
        segments = [x[:d] * (i + 1) for i, d in enumerate(SIZES)]
        r = collectives.reduce_segments(segments, "data", codec, "allgather", gather_pieces=pieces)
        return [m for m in r.mean], [s[None] for s in r.sent]

    return per_device(f, P("data"), ([P(), P()], [P("data"), P("data")]))


def test_allgather_in_pieces_is_the_one_gather_sum_and_bytes():
    x = np.array(stacked_normal(7, (max(SIZES),), offset=0.25))
    x[:, :300] = 10 * x[0, :300]  # every device sends these: sums of 8 values
    x = shard(x)
    one, pieces = _reduce(False), _reduce(True)
    (m1, s1), (m2, s2) = one(x), pieces(x)
    for a, b in zip(s1, s2, strict=True):
        np.testing.assert_array_equal(a, b)  # what each device sent: unchanged
    for a, b in zip(m1, m2, strict=True):
        # A coordinate's n values are added in another order: equal up to float rounding.
        np.testing.assert_allclose(a, b, rtol=2e-7, atol=1e-7)
        assert np.count_nonzero(a) == np.count_nonzero(b) > 0
    r1, r2 = jc.comm_report(one, x), jc.comm_report(pieces, x)
    gathers = [c for c in r2.collectives if c.kind == "all-gather"]
    assert r1.bytes_per_device == r2.bytes_per_device  # the ring model's bytes: the same
    assert len(gathers) == 2 * 17  # values and indices: 4096 -> 12 pieces, 1500 -> 5


def test_dgc_step_temporaries():
    # The donated data-parallel step of the small MLP of benchmarks.memory on 8 devices,
    # temporaries in copies of the f32 params (optax.sgd with momentum: 2.00), with one
    # warm-up stage at 25% (the peak of the default ramp): 2.08 here (the mean and the
    # gathered pieces in the warm-up branch; the gradient until the new velocity and
    # accumulation are written in place). It held 3.94: the new velocity and accumulation
    # beside the old ones until the branch's non-finite flag was known, the gradient held
    # through the branch, and the velocity copied to the output. Before that, 9.97: 4 copies
    # of gathered payloads sliced per leaf out of one bucket (2 more), the sampled
    # selection's gathered and |.| copies of the accumulation and its mask counted as int32,
    # the decoded `sent` vector, and the scatters' zeros copied from a constant at the start.
    from benchmarks import memory

    mesh = jax.make_mesh((N,), ("data",))
    rep = NamedSharding(mesh, P())
    params = jax.jit(lambda: memory.common.mlp_params(memory.QUICK_MLP), out_shardings=rep)()
    dgc = jc.dgc(0.001, "data", warmup_steps=50, warmup_schedule=(0.75,))
    row = memory.measure("dgc", optax.chain(dgc, optax.sgd(0.1)), False, params, mesh, 8)
    assert row["temporaries"] < 2.15, row
    assert row["arguments"] < 3.05, row  # params, velocity and accumulation


def test_dgc_overflow_saturates_and_nan_step_keeps_state():
    # The step's flag is read from the gradients before the velocity and accumulation are
    # written (in place): a finite gradient must leave them finite, so their sums saturate
    # at +-F32_MAX, and a NaN gradient leaves both as they were, bit for bit.
    tx = jc.dgc(0.01, "data", warmup_steps=0, sample_ratio=None, min_size=0)
    p = {"w": jnp.zeros((16, 64))}
    state = jc.sharded_init(tx, p, helpers.mesh(), "data")
    specs = jc.state_specs(state, "data")
    step = per_device(lambda g, s: tx.update({"w": g[0]}, s, p), (P("data"), specs), (P(), specs))
    big = np.full((N, 16, 64), 3e38, np.float32)
    big[:, 0, :3] = [1.0, 2.0, 3.0]
    for _ in range(3):
        out, state = step(shard(big), state)
    u, v = np.asarray(state.velocity["w"]), np.asarray(state.accumulation["w"])
    assert np.isfinite(out["w"]).all() and np.isfinite(u).all() and np.isfinite(v).all()
    # 11 of 1024 sent a step: the others, unsent since the first step, have saturated.
    assert (np.abs(v) == F32_MAX).sum() == N * (16 * 64 - 25)
    nan = big.copy()
    nan[5, 3, 7] = np.nan
    out, after = step(shard(nan), state)
    assert np.isnan(out["w"]).all()
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
