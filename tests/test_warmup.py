"""The density warm-up of sparse codecs (jaxcomp._src.warmup): its schedule, its defaults in
jc.sgd and jc.dgc, the exact number of values each device sends per step, and its bytes.
Its argument errors are rows of tests/test_config_errors.py."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import N, jaxcomp_state, mesh, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import warmup


def test_ramp_and_stages_are_exact():
    assert warmup.ramp(0.01) == (0.25, 0.0625, 0.015625)
    assert warmup.ramp(0.001) == (0.25, 0.0625, 0.015625, 0.00390625)
    assert warmup.ramp(0.0625) == (0.25,)
    assert warmup.ramp(0.25) == warmup.ramp(0.5) == ()
    # One definition of the stages: DGC's sparsity schedules go through the same function.
    assert warmup.densities(0.001) == warmup.ramp(0.001)
    dgc_paper = (0.75, 0.9375, 0.984375, 0.996, 0.999)  # 99.9% is the codec's own ratio
    assert warmup.densities(0.001, dgc_paper) == pytest.approx((0.25, 0.0625, 0.015625, 0.004))
    assert warmup.densities(0.001, (0.75, 0.99)) == pytest.approx((0.25, 0.01))
    # 100 steps over 3 stages: steps 0-33, 34-66, 67-99, then the codec from step 100 on.
    stages = [warmup.stage(t, 100, 3) for t in (0, 33, 34, 66, 67, 99, 100, 10**6)]
    assert stages == [0, 0, 1, 1, 2, 2, 3, 3]
    assert int(warmup.stage(jnp.int32(67), 100, 3)) == 2
    assert warmup.stage_steps(300, 100, 3) == [34, 33, 33, 200]
    assert warmup.stage_steps(50, 0, 3) == [0, 0, 0, 50]


def test_warmup_is_dgc_default_and_off_elsewhere():
    assert warmup.DGC_WARMUP_STEPS == 200
    assert inspect.signature(jc.dgc).parameters["warmup_steps"].default == 200
    assert inspect.signature(jc.compressed_allreduce).parameters["warmup_steps"].default == 0
    assert warmup.sparse_ratio(jc.top_k(0.01)) == 0.01
    assert warmup.sparse_ratio(jc.sign()) is None
    assert warmup.sparse_ratio(jc.random_k(0.01)) is None  # unbiased: rescaled instead


D = 64 * 64
RATIO = 0.01
WARMUP = 3  # one step per stage: densities 25%, 6.25%, 1.5625%, then 1%


def test_each_step_sends_the_stage_density_and_bytes_follow():
    tx = jc.compressed_allreduce(jc.top_k(RATIO), "data", strategy="allgather", warmup_steps=WARMUP)
    m = mesh()
    params = {"w": jnp.zeros((64, 64))}
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")
    step = per_device(
        lambda g, s: (lambda u, s: (u["w"], s))(*tx.update({"w": g[0]}, s)),
        (P("data"), specs),
        (P(), specs),
        m,
    )
    rng = np.random.default_rng(0)
    sent = []
    for _ in range(WARMUP + 2):
        g = rng.standard_normal((N, 64, 64)).astype(np.float32)
        before = np.asarray(jaxcomp_state(state).memory["w"])
        _, state = step(shard(g, m), state)
        after = np.asarray(jaxcomp_state(state).memory["w"])
        # What each device sent: its target g_i + e_i minus what stayed in e_i.
        sent.append([int(np.count_nonzero(g[i] + before[i] - after[i])) for i in range(N)])
    ks = [1024, 256, 64, 41, 41]  # ceil(density * 4096)
    assert sent == [[k] * N for k in ks]

    report = jc.comm_report(step, shard(np.ones((N, 64, 64), np.float32), m), state)
    each = report.branch_bytes()
    codecs = [jc.top_k(r) for r in (*warmup.ramp(RATIO), RATIO)]
    # All-gather: (n - 1) payloads of 8 bytes (value + index) per sent value, per stage, and
    # the gathered one-byte non-finite flag.
    for i, c in enumerate(codecs):
        assert each[0, i] == (N - 1) * (c.payload_bytes(D) + 1) == (N - 1) * (8 * ks[i] + 1)
    counts = warmup.stage_steps(10, WARMUP, len(codecs) - 1)
    assert counts == [1, 1, 1, 7]
    want = each[None] + sum(w * each[0, i] for i, w in enumerate(counts)) / 10
    assert report.mean_bytes_per_device(counts) == pytest.approx(want, rel=1e-6)
    plain = 4 * D * 2 * (N - 1) / N  # f32 pmean, ring model
    assert each[None] + each[0, len(codecs) - 1] < plain / 10
