"""Residual error feedback conserves what it is given, for the value actually returned.

Over the devices, ``n * out + sum_i e_i' (+ n * s', two-phase's server residual, in units of
the mean) = sum_i g_i + sum_i e_i (+ n * s)``, with ``out`` the output in the leaf's dtype.
For a bfloat16 / float16 leaf that output is ``cast(mean)``; the memories were formed against
the float32 mean, and the rounding (1e-3 of the update for bfloat16, 1e-4 for float16,
relative) was lost every step until every memory took it (``feedback.with_rounding``).
One program per transform, a bfloat16 and a float16 leaf in the same tree.
"""

import jax
import numpy as np
import pytest
from helpers import N, is_jaxcomp, mesh, per_device
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SHAPE = (32, 48)
DTYPES = {"bf16": jax.numpy.bfloat16, "f16": jax.numpy.float16}
RESIDUAL = ("memory", "server_residual")
TRANSFORMS = {
    "powersgd": (lambda: jc.powersgd(2, "data", start_step=1, min_size=1024), ("error",)),
    "sign-two_phase": (
        lambda: jc.compressed_allreduce(
            jc.sign(), "data", error_feedback="residual", strategy="two_phase"
        ),
        RESIDUAL,
    ),
    "int8-allgather": (
        lambda: jc.compressed_allreduce(
            jc.int_quant(8), "data", error_feedback="residual", strategy="allgather"
        ),
        RESIDUAL,
    ),
    "dgc": (
        lambda: jc.dgc(0.05, "data", momentum=0.0, warmup_steps=0, sample_ratio=None),
        ("accumulation", "server_residual"),
    ),
}


def held(state, fields, key):
    """Over the devices, what the state holds back for leaf ``key`` (float64, flat)."""
    total = np.zeros(int(np.prod(SHAPE)))
    nodes = [n for n in jax.tree.leaves(state, is_leaf=is_jaxcomp) if is_jaxcomp(n)]
    for node in nodes:
        for field in fields:
            tree = getattr(node, field, None)
            if not isinstance(tree, dict) or not hasattr(tree.get(key), "shape"):
                continue
            a = np.asarray(tree[key], np.float64)
            if field == "server_residual":  # the owned chunks, in units of the mean
                total += N * a.reshape(-1)[: total.size]
            else:
                total += a.reshape(N, -1).sum(0)
    return total


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_narrow_leaves_conserve_the_returned_output(name):
    make, fields = TRANSFORMS[name]
    tx = make()
    m = mesh()
    p = jax.device_put({k: np.zeros(SHAPE, d) for k, d in DTYPES.items()}, NamedSharding(m, P()))
    state = jc.sharded_init(tx, p, m, "data")
    specs = jc.state_specs(state, "data")
    step = per_device(lambda g, s: tx.update(jc.own(g), s, p), (P("data"), specs), (P(), specs), m)
    for t in range(2):  # the warm-up step of powersgd (dense), then a compressed one
        rng = np.random.default_rng(t)
        g = {k: (1.7 * rng.standard_normal((N, *SHAPE)) + 0.3).astype(d) for k, d in DTYPES.items()}
        before = {k: held(state, fields, k) for k in DTYPES}
        out, state = step(jax.device_put(g, NamedSharding(m, P("data"))), state)
        for k in DTYPES:
            assert out[k].dtype == DTYPES[k]
            given = np.asarray(g[k], np.float64).reshape(N, -1).sum(0) + before[k]
            kept = N * np.asarray(out[k], np.float64).reshape(-1) + held(state, fields, k)
            err = np.linalg.norm(kept - given) / np.linalg.norm(given)
            assert err < 1e-6, (name, k, t, err)  # float32 rounding (seen: <= 7e-8)
