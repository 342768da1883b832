"""Summing in a narrow type: a mean that fits the type never overflows, and ``auto`` keeps the
sum accurate and cheap.

* ``jc.pmean`` through fp16 / bf16 / fp8 with the default strategy, every device holding a
  value whose sum over the 8 devices leaves the type's range though the mean fits (fp16 and
  e5m2: 10000 x 8 > 65504 / 57344; e4m3: 100 x 8 > 448; bf16: 1e38 x 8 > 3.4e38): the mean is
  the value, not NaN (a summable payload is pre-scaled by 1/n before the psum).
* ``jc.psum`` keeps jax.lax.psum's meaning: the sum in the leaf's own type, so an fp16 leaf
  whose sum leaves fp16's range is inf (a float32 leaf holds 80000).
* ``auto``: fp16 / bf16 payloads are psum'ed while the ring sum in their type stays within 2x
  of two-phase's error (n <= 8, ``benchmarks/narrow_sum.py``), two-phase (float32 sums) above;
  plain float32 pmean where it sends fewer bytes (a 7-float leaf at 32 devices: 54 B against
  sign's 248 B), measured on the compiled program.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import N, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from benchmarks import narrow_sum
from jaxcomp._src.cost import RING_SUM_MAX_DEVICES

# codec -> a value whose sum over 8 devices overflows the codec's type, its mean does not
CASES = {"fp16": 1e4, "bf16": 1e38, "fp8_e5m2": 1e4, "fp8_e4m3": 100.0}


@functools.cache
def mean_of(name: str):
    """One compiled ``jc.pmean`` per codec (default strategy)."""
    codec = jc.cast(name)
    return per_device(lambda x: jc.pmean(x[0], "data", codec)[None], P("data"), P("data"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_mean_that_fits_never_overflows(name):
    value = CASES[name]
    x = np.full((N, 64), value, np.float32)
    x[:, 1::2] *= -0.5  # both signs, two magnitudes
    mean = np.asarray(mean_of(name)(shard(x)))
    want = np.asarray(jc.cast(name).roundtrip(jnp.asarray(x[0])))  # the value in the type
    assert np.isfinite(mean).all()
    np.testing.assert_allclose(mean[0], want, rtol=1e-2)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_stateless_fp8_mean_of_a_small_gradient_is_not_zero(name):
    """``jc.pmean`` (no memory) through the default fp8 casts, scaled since 2026-11-27, of
    4,096 values of size 1e-4 per device: within the type's rounding of the float32 mean
    (relative error of the 2-norm 0.037 e4m3 / 0.075 e5m2, two roundings: each device's
    and the two-phase owner's). Unscaled, e4m3 rounded every value to 0 (error 1), e5m2 0.14."""
    x = np.random.default_rng(3).standard_normal((N, 4096)).astype(np.float32) * 1e-4
    got = np.asarray(mean_of(name)(shard(x)))[0].astype(np.float64)
    want = x.astype(np.float64).mean(0)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < {"fp8_e4m3": 0.05, "fp8_e5m2": 0.1}[name], rel


def test_psum_is_the_sum_in_the_leafs_type():
    """As jax.lax.psum: 8 x 10000 is inf in an fp16 leaf (-40000 fits, to the fp16 sum's
    rounding), 80000 in a float32 leaf; the wire (fp16 of x / 8) never overflows."""
    fp16 = jc.cast("fp16")

    def step(x):
        out = jc.psum({"h": x[0].astype(jnp.float16), "f": x[0]}, "data", fp16)
        return out["h"][None], out["f"][None]

    x = np.tile(np.float32([1e4, -5e3]), (N, 1))
    h, f = per_device(step, P("data"), (P("data"), P("data")))(shard(x))
    h, f = np.asarray(h)[0], np.asarray(f)[0]
    assert np.isposinf(h[0]) and np.isfinite(f).all()
    np.testing.assert_allclose([float(h[1]), *f], [-4e4, 8e4, -4e4], rtol=2e-3)


def test_auto_keeps_narrow_sums_accurate():
    d = 1 << 20
    assert RING_SUM_MAX_DEVICES == {"float16": 8, "bfloat16": 8}
    for name in ("fp16", "bf16"):
        codec = jc.cast(name, scaled=False)
        assert [jc.choose_strategy(codec, d, n) for n in (2, 8, 16, 1024)] == [
            "allreduce",
            "allreduce",
            "two_phase",
            "two_phase",
        ]
        costs = jc.strategy_bytes(codec, d, 16)
        assert costs["two_phase"] == pytest.approx(costs["allreduce"])  # same bytes
    assert jc.choose_strategy(jc.identity(), d, 1024) == "allreduce"  # float32 sums
    # The simulation behind the table, at the boundary (a small size: ~0.1 s).
    dtype = np.float16
    rows = {n: narrow_sum.relative_errors(n, dtype, 2048, 1) for n in (8, 16, 64)}
    assert narrow_sum.accurate_up_to(rows, 2.0) == 8
    assert rows[64]["allreduce"] > 3 * rows[64]["two_phase"]
    assert narrow_sum.overflow_devices(1e4, np.float16) == 7
    assert narrow_sum.overflow_devices(1e4, ml_dtypes.bfloat16) > 1e30


def test_auto_picks_plain_pmean_where_cheaper():
    sign = jc.sign()
    costs = jc.strategy_bytes(sign, 7, 32)
    assert costs["plain"] == pytest.approx(2 * 31 / 32 * 28)  # 54.25 B
    assert min(costs["allgather"], costs["two_phase"]) == 248
    assert jc.choose_strategy(sign, 7, 32) == "plain"
    assert jc.choose_strategy(sign, 4096, 32) == "two_phase"
    # On the compiled program, 8 devices: a 7-float leaf through sign sends plain's bytes
    # (49 B and the 8-byte non-finite flag) and its mean is exact.
    f = per_device(lambda x: jc.pmean(x[0], "data", sign)[None], P("data"), P("data"))
    x = np.random.default_rng(0).standard_normal((N, 7)).astype(np.float32)
    report = jc.comm_report(f.fn, shard(x))
    assert report.bytes_per_device <= 2 * 7 / 8 * 28 + 8
    np.testing.assert_allclose(np.asarray(f(shard(x)))[0], x.mean(0), rtol=1e-6)
