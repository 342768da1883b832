"""Top-k all-gathered in pieces (DGC's warm-up stages): the same sums, the same bytes, and the
compiled step's temporaries (deterministic, compile only)."""

import jax
import numpy as np
import optax
from helpers import N, per_device, shard, stacked_normal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import collectives

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
    # warm-up stage at 25% (the peak of the default ramp): 3.94 here. It held 9.97: 4 copies
    # of gathered payloads sliced per leaf out of one bucket (2 more), the sampled
    # selection's gathered and |.| copies of the accumulation and its mask counted as int32,
    # the decoded `sent` vector, and the scatters' zeros copied from a constant at the start.
    from benchmarks import memory

    mesh = jax.make_mesh((N,), ("data",))
    rep = NamedSharding(mesh, P())
    params = jax.jit(lambda: memory.common.mlp_params(memory.QUICK_MLP), out_shardings=rep)()
    dgc = jc.dgc(0.001, "data", warmup_steps=50, warmup_schedule=(0.75,))
    row = memory.measure("dgc", optax.chain(dgc, optax.sgd(0.1)), False, params, mesh, 8)
    assert row["temporaries"] < 4.1, row
    assert row["arguments"] < 3.05, row  # params, velocity and accumulation
