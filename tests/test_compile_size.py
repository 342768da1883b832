"""The compiled step grows linearly with the leaves, and a recipe traces its exchange once.

Two causes of the 1-bit Adam / 0/1 Adam compile times of ``benchmarks/compile_size.py
--recipes`` (docs/hot-path.md, "Compile time"), pinned on small trees, compiled, not run:

* a scalar formed from every leaf (the non-finite flag, a global norm's maximum) and read by
  every leaf's update: XLA's simplifier turned ``jnp.sum(jnp.stack(per_leaf))`` into a chain of
  scalar adds (``jnp.any`` into ors, ``jnp.max`` into maxima), and fusion copied that chain
  into each reader: fusions of ``leaves`` parameters, one per leaf and use, a program quadratic
  in the leaves. Now no fused computation takes as many parameters as there are leaves;
* 1-bit Adam's ``lax.cond`` traced its exchange twice (the warm-up branch for the payloads'
  shapes), 0/1 Adam's ``lax.switch`` three times: now once.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, per_device
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import collectives, onebit_adam, periodic
from jaxcomp._src.codecs.base import scaled_global_norm_parts

LEAVES = 24
WIDEST = 11  # 10 at 12 leaves (before: 21; below KEEP_FROM = 9 leaves, as before)
FUSION = re.compile(r"^%fused_computation[\w.\-]* \((.*?)\) ->", re.M)


def widest_fusion(text: str) -> int:
    """The most parameters any fused computation of the HLO ``text`` takes."""
    return max(
        (len(re.findall(r"param_\d+", m.group(1))) for m in FUSION.finditer(text)), default=0
    )


def leaves(n: int = LEAVES, shape=(16, 16)) -> list:
    return [jnp.full(shape, i + 1.0, jnp.float32) for i in range(n)]


# Each: a scalar of every leaf -> read by every leaf (where / divide).
READERS = {
    "local_nonfinite": lambda xs: [
        jnp.where(collectives.local_nonfinite(xs), x, 2 * x + 1) for x in xs
    ],
    "periodic_nonfinite": lambda xs: [jnp.where(periodic._nonfinite(xs), x, 2 * x + 1) for x in xs],
    "global_norm_max": lambda xs: [x / scaled_global_norm_parts(xs)[0] for x in xs],
}


# The same, the scalar reduced as before (jnp.sum / jnp.any / jnp.max of the stack).
STACKED = {
    "local_nonfinite": lambda xs: [
        jnp.where(jnp.isnan(jnp.sum(jnp.stack([jnp.sum(a * 0.0) for a in xs]))), x, 2 * x + 1)
        for x in xs
    ],
    "periodic_nonfinite": lambda xs: [
        jnp.where(jnp.any(jnp.stack([~jnp.all(jnp.isfinite(a)) for a in xs])), x, 2 * x + 1)
        for x in xs
    ],
    "global_norm_max": lambda xs: [
        x / jnp.max(jnp.stack([jnp.max(jnp.abs(a)) for a in xs])) for x in xs
    ],
}


@pytest.mark.parametrize("name", list(READERS))
def test_scalar_of_every_leaf_is_not_copied_into_each_reader(name):
    fn = jax.jit(READERS[name])
    xs = leaves()
    text = fn.lower(xs).compile().as_text()
    # Before: a fusion of >= 24 parameters per leaf (the chain copied); now a few each.
    assert widest_fusion(text) <= 6, widest_fusion(text)
    bad = [x.at[0, 0].set(jnp.nan) if i == 7 else x for i, x in enumerate(xs)]
    for given in (xs, bad):  # the same values as the stacked reduction's (a NaN: flagged)
        np.testing.assert_array_equal(np.stack(fn(given)), np.stack(jax.jit(STACKED[name])(given)))


def onebit_step(n_leaves: int):
    m = mesh(2)
    params = {f"w{i:02d}": jnp.zeros((32, 32), jnp.float32) for i in range(n_leaves)}
    tx = jc.onebit_adam(1e-3, "data", freeze_step=2, min_size=16)
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")
    step = per_device(lambda g, s: tx.update(g, s, params), (P("data"), specs), (P(), specs), m)
    grads = jax.device_put(
        {k: jnp.ones((64, 32), jnp.float32) for k in params}, NamedSharding(m, P("data"))
    )
    return step, grads, state


def test_onebit_adam_step_has_no_fusion_as_wide_as_the_leaves():
    step, grads, state = onebit_step(12)
    text = step.lower(grads, state).compile().as_text()
    # Before: fusions of 21 parameters at 12 leaves (the flag's chain copied in each).
    assert widest_fusion(text) <= WIDEST, widest_fusion(text)


@pytest.mark.parametrize("recipe", ["onebit_adam", "zero_one_adam"])
def test_recipe_traces_its_exchange_once(recipe, monkeypatch):
    calls = []
    original = onebit_adam.compressed_allreduce

    def counting(*args, **kwargs):
        inner = original(*args, **kwargs)

        def update(*a, **k):
            calls.append(1)
            return inner.update(*a, **k)

        return inner._replace(update=update)

    monkeypatch.setattr(onebit_adam, "compressed_allreduce", counting)
    m = mesh(2)
    params = {"w": jnp.zeros((32, 32), jnp.float32), "v": jnp.zeros((64,), jnp.float32)}
    make = {
        "onebit_adam": lambda: jc.onebit_adam(1e-3, "data", freeze_step=2, min_size=16),
        "zero_one_adam": lambda: jc.zero_one_adam(1e-3, "data", var_freeze_step=4, min_size=16),
    }
    tx = make[recipe]()
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")
    step = per_device(lambda g, s: tx.update(g, s, params), (P("data"), specs), (P(), specs), m)
    grads = jax.device_put(
        jax.tree.map(lambda p: jnp.ones((2 * p.shape[0], *p.shape[1:])), params),
        NamedSharding(m, P("data")),
    )
    step.lower(grads, state)
    assert len(calls) == 1  # before: 2 (1-bit Adam), 3 (0/1 Adam)
    out, _ = step(grads, state)  # and the step still runs
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out))
