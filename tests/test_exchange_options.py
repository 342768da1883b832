"""``jc.diloco`` / ``jc.local_sgd`` pass the exchange options (``min_size``, ``strategy``, ...)
to their codec's ``jc.compressed_allreduce``, and say so where the codec compresses nothing.

Read from the abstract state (``jax.eval_shape`` of ``jc.sharded_init``): nothing compiles.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mesh

import jaxcomp as jc

SMALL = {"w": jnp.zeros((16, 32)), "b": jnp.zeros((32,))}  # every leaf under 1024 floats


def exchange_state(tx):
    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, mesh(), "data"), SMALL)
    (ex,) = state.exchange
    return ex


def test_codec_that_compresses_nothing_warns_and_min_size_fixes_it():
    int4 = jc.int_quant(4)
    with pytest.warns(UserWarning, match=r"compresses none of the params.*min_size=1024"):
        ex = exchange_state(jc.diloco(optax.sgd(0.1), "data", 4, codec=int4))
    assert ex.memory is None  # int4 held nothing back: every leaf went as plain float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex = exchange_state(jc.diloco(optax.sgd(0.1), "data", 4, codec=int4, min_size=0))
    assert [m.shape for m in ex.memory] == [(8, 32), (8, 16, 32)]  # b, w: per device


def test_local_sgd_passes_the_strategy():
    sign = jc.sign()
    auto = exchange_state(jc.local_sgd(optax.sgd(0.1), "data", 2, codec=sign, min_size=0))
    gathered = jc.local_sgd(optax.sgd(0.1), "data", 2, codec=sign, min_size=0, strategy="allgather")
    # auto at 8 devices: two_phase, whose chunk owners keep a server residual; allgather none.
    assert auto.server_residual is not None
    assert exchange_state(gathered).server_residual is None


@pytest.mark.parametrize("mask", ["topk", "random"])
def test_sparseloco_warns_by_its_own_min_size(mask):
    """``jc.sparseloco`` builds its exchange itself; the nothing-compressed warning read the
    codec exchange's default ``min_size`` (1024) instead of sparseloco's, so it told a user
    who had passed ``min_size=0`` to pass ``min_size=0``. It warns at the default only."""
    with pytest.warns(UserWarning, match=r"compresses none of the params.*min_size=1024"):
        exchange_state(jc.sparseloco(optax.sgd(0.1), "data", 4, mask=mask))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exchange_state(jc.sparseloco(optax.sgd(0.1), "data", 4, mask=mask, min_size=0))
        if mask == "topk":  # a small_codec codes the leaves under min_size: no warning
            exchange_state(jc.sparseloco(optax.sgd(0.1), "data", 4, small_codec=jc.sign()))
