"""Byte budgets (``jc.sparseloco_density``, ``jc.demo_topk``): on models of other shapes, the
lowered step sends at least the ratio asked, and one more value per chunk would not.

Each model is a tree of shapes (small, so each step lowers in about a second): the bytes are
read from the lowered program as ``jc.comm_report``'s logical collectives (nothing compiles:
the state is abstract, ``jax.eval_shape`` of ``jc.sharded_init``)
and compared with a float32 ``pmean`` of the same tree every step. The formulas of
``jc.sparseloco_ratio`` / ``jc.demo_ratio`` are checked to the byte against the same steps.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src.accounting import parse_stablehlo_collectives

N, H = 8, 30
F32 = np.float32


def model(d: int, layers: int, vocab: int = 256) -> dict:
    """The shapes of a small decoder (``benchmarks.char_transformer``'s leaves): per layer a
    ``d x 3d`` and a ``d x d`` attention matrix, a ``d x 4d`` and ``4d x d`` MLP, norms and
    biases; an embedding, positions and a head."""
    tree = {"embed": (vocab, d), "pos": (16, d), "head": (d, vocab), "head_b": (vocab,)}
    for i in range(layers):
        tree |= {f"{i}.qkv": (d, 3 * d), f"{i}.qkv_b": (3 * d,), f"{i}.out": (d, d)}
        tree |= {f"{i}.up": (d, 4 * d), f"{i}.down": (4 * d, d), f"{i}.ln": (d,)}
    return {k: np.zeros(s, F32) for k, s in tree.items()}


#: Leaves that fill no whole chunk of 256 (or 64 x 64), short leaves, one leaf far larger
#: than the others, a width under the chunk; the step count as an integer leaf.
MODELS = {
    "d24x1": model(24, 1),
    "d40x1": model(40, 1, vocab=300),
    "d48x2": model(48, 2),
    "d30x1": model(30, 1, vocab=97),
    "d64x1+step": {**model(64, 1), "step": np.zeros((), np.int32)},
}
#: DeMo's step lowered on three of them (its arithmetic, ``jc.demo_ratio``, on all five).
DEMO_LOWERED = ("d24x1", "d48x2", "d64x1+step")


def lowered_bytes(fn, *args) -> float:
    text = fn.lower(*args).as_text()
    return sum(c.bytes_per_device for c in parse_stablehlo_collectives(text, jax.device_count()))


def abstract(tree, mesh, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


@functools.cache
def pmean_bytes(name: str) -> float:
    """A float32 ``pmean`` of the floating leaves' gradients over 8 devices, every step."""
    params = {k: v for k, v in MODELS[name].items() if v.dtype == F32}
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    fn = jax.jit(
        jax.shard_map(
            lambda p: jax.lax.pmean(jax.lax.pcast(p, "data", to="varying"), "data"),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(),
        )
    )
    return lowered_bytes(fn, abstract(params, mesh, P()))


def sync_bytes(tx, params, replicas: int) -> float:
    """Bytes per device across the replicas of a sync step of ``tx`` (``jc.sparseloco``)."""
    shape = (replicas, N // replicas)
    mesh = jax.make_mesh(shape, ("replica", "data"), axis_types=(AxisType.Explicit,) * 2)
    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, mesh, "replica"), params)
    specs = jc.state_specs(state, "replica")
    stacked = jax.tree.map(lambda x: np.zeros((replicas, *x.shape), x.dtype), params)

    def step(r, s):
        p = jc.own(r)
        u, s = tx.update(jax.tree.map(lambda x: x + 1, p), jc.at_count(s, H - 1), p)
        return jc.slot(optax.apply_updates(p, u)), s

    fn = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("replica"), specs), out_specs=(P("replica"), specs)
        )
    )
    return lowered_bytes(fn, abstract(stacked, mesh, P("replica")), state)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sparseloco_density_meets_the_ratio_on_the_lowered_step(name):
    """The density sized for 300x at ``H = 30`` (8 replicas, or 2 of 4 devices against 8)
    gives a sync whose bytes over ``H`` are at least 300x under per-step ``pmean``'s, as
    ``jc.sparseloco_ratio`` says to the byte; ``k + 1`` per chunk would fall under 300x."""
    params = MODELS[name]
    replicas = 2 if name in ("d40x1", "d30x1") else N
    kw = dict(chunk=256, bits=1, min_size=0)
    density = jc.sparseloco_density(params, 300, H, replicas, devices=N, **kw)
    k = round(density * 256)
    assert density == k / 256 and 1 <= k < 256
    tx = jc.sparseloco(optax.sgd(0.1), "replica", H, density=density, value_scale="mean", **kw)
    ratio = pmean_bytes(name) / (sync_bytes(tx, params, replicas) / H)
    assert ratio >= 300
    assert ratio == pytest.approx(
        jc.sparseloco_ratio(params, H, replicas, devices=N, density=density, **kw), rel=1e-12
    )
    more = jc.sparseloco_ratio(params, H, replicas, devices=N, density=(k + 1) / 256, **kw)
    assert more < 300 <= ratio < 300 * (k + 1) / k


@pytest.mark.parametrize("name", sorted(MODELS))
def test_demo_topk_meets_the_ratio_on_the_lowered_step(name):
    """``jc.demo_topk`` for 40x (3-bit values, blocks of 32 x 32): the lowered DeMo step sends
    at least 40x fewer bytes than per-step ``pmean`` (``jc.demo_ratio`` to the byte); one
    more component per block would not."""
    params = {k: v for k, v in MODELS[name].items() if v.dtype == F32}
    topk = jc.demo_topk(params, 40, N, chunk=32, bits=3)
    assert jc.demo_ratio(params, N, chunk=32, topk=topk, bits=3) >= 40
    assert jc.demo_ratio(params, N, chunk=32, topk=topk + 1, bits=3) < 40
    if name not in DEMO_LOWERED:
        return
    tx = jc.demo(0.1, "data", chunk=32, topk=topk, bits=3)
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,))
    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, mesh, "data"), params)
    specs = jc.state_specs(state, "data")

    def step(p, s):
        u, s = tx.update(jax.lax.pcast(p, "data", to="varying"), s, p)
        return optax.apply_updates(p, u), s

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
    ratio = pmean_bytes(name) / lowered_bytes(fn, abstract(params, mesh, P()), state)
    assert ratio >= 40
    assert ratio == pytest.approx(jc.demo_ratio(params, N, chunk=32, topk=topk, bits=3), rel=1e-12)


def test_the_documented_densities_on_the_lm_models():
    """The arithmetic behind docs/lm.md's rows: on the LM benchmark's model (2 layers of
    ``d_model`` 128) 21 of 4096 give 3068x at ``H = 30`` on 8 replicas; on the fourth pair's
    (3 layers of 96) 2866x, and the density sized for 3000x is 19 of 4096 (3079x)."""
    from benchmarks.budget_bytes import Model, params_of

    bench, fourth = params_of(Model(128, 2)), params_of(Model(96, 3))
    kw = dict(bits=1, min_size=0)
    assert jc.sparseloco_ratio(bench, H, N, density=21 / 4096, **kw) == pytest.approx(3068, abs=1)
    assert jc.sparseloco_ratio(fourth, H, N, density=21 / 4096, **kw) == pytest.approx(2866, abs=1)
    assert jc.sparseloco_density(fourth, 3000, H, N, **kw) == 19 / 4096
    assert jc.sparseloco_density(fourth, 3000, H, N, other_bytes=7, **kw) == 19 / 4096
    assert jc.sparseloco_ratio(fourth, H, N, density=19 / 4096, **kw) == pytest.approx(3079, abs=1)


def test_out_of_reach_names_what_to_change():
    """Small leaves sent whole already over the budget: the message names ``min_size`` and
    ``small_codec`` (and the ratio they leave); one value per chunk over it: ``chunk``."""
    params = model(48, 3)
    with pytest.raises(ValueError, match=r"`min_size`=1024 .*alone give 2046x.*`small_codec`"):
        jc.sparseloco_density(params, 3000, H, N)
    assert jc.sparseloco_density(params, 3000, H, N, min_size=0, bits=1) > 0  # every leaf coded
    with pytest.raises(ValueError, match=r"one value per chunk \(k=1\) gives .*`chunk`"):
        jc.sparseloco_density(params, 1e5, H, N, min_size=0)
    with pytest.raises(ValueError, match=r"`min_size`=4096 .*alone give"):
        jc.demo_topk(params, 80, N, min_size=4096)
    with pytest.raises(ValueError, match=r"one component per block \(topk=1\) gives .*`chunk`"):
        jc.demo_topk(params, 1e4, N)


def test_a_ratio_the_whole_chunk_meets_gives_density_one():
    """A ratio under what sending every value of every chunk reaches: the largest ``k``."""
    params = MODELS["d24x1"]
    assert jc.sparseloco_density(params, 1.0, H, N, chunk=64, bits=1, min_size=0) == 1.0
    assert jc.demo_topk(params, 0.5, N, chunk=8) == 64


@pytest.mark.parametrize("name", ["d40x1", "d48x2"])
def test_sub_chunk_density_meets_the_ratio_on_the_lowered_step(name):
    """With ``sub_chunk=64`` in chunks of 256 the density is ``k / 64`` per sub-chunk and the
    lowered sync (6-bit indices, one scale per 256) sends at least 300x fewer bytes at ``H =
    30``, as ``jc.sparseloco_ratio`` says to the byte; ``k + 1`` per sub-chunk falls under it.
    The same bytes keep more values than the top-k over whole chunks of 256."""
    params = MODELS[name]
    replicas = 2 if name == "d40x1" else N
    kw = dict(chunk=256, bits=1, min_size=0)
    density = jc.sparseloco_density(params, 300, H, replicas, devices=N, sub_chunk=64, **kw)
    k = round(density * 64)
    assert density == k / 64 and 1 <= k < 64
    tx = jc.sparseloco(
        optax.sgd(0.1), "replica", H, density=density, value_scale="mean", sub_chunk=64, **kw
    )
    ratio = pmean_bytes(name) / (sync_bytes(tx, params, replicas) / H)
    sized = jc.sparseloco_ratio(params, H, replicas, devices=N, density=density, sub_chunk=64, **kw)
    assert ratio >= 300 and ratio == pytest.approx(sized, rel=1e-12)
    more = (k + 1) / 64
    assert (
        jc.sparseloco_ratio(params, H, replicas, devices=N, density=more, sub_chunk=64, **kw) < 300
    )
    whole = jc.sparseloco_density(params, 300, H, replicas, devices=N, **kw)
    assert density > whole


def test_sub_chunk_density_on_the_lm_models():
    """docs/lm-byte-budgets.md's sub-chunk rows: at 3000x, ``H = 30``, 2 replicas of 4 (every
    leaf, 1-bit values) chunks of 1024 keep 47 of each 1024 on the held-out pair's model (3
    layers of 64; 3029x), sub-chunks of 128 keep 8 of each 128, 64 of each 1024 (3057x;
    3128x on the benchmark's model, 2 layers of 128), and sub-chunks of 24 (5-bit indices)
    under one scale per 1536 keep 2 of each 24, 85 of each 1024 (3103x; 3184x; on the third,
    fourth and fifth pairs' models 3161x, 3171x, 3196x)."""
    from benchmarks.budget_bytes import Model, params_of

    held_out, bench = params_of(Model(64, 3)), params_of(Model(128, 2))
    kw = dict(devices=N, chunk=1024, bits=1, min_size=0, other_bytes=7)
    assert jc.sparseloco_density(held_out, 3000, H, 2, **kw) == 47 / 1024
    assert jc.sparseloco_density(held_out, 3000, H, 2, sub_chunk=128, **kw) == 8 / 128
    sub = dict(density=8 / 128, sub_chunk=128, **kw)
    assert jc.sparseloco_ratio(held_out, H, 2, **sub) == pytest.approx(3057, abs=1)
    assert jc.sparseloco_ratio(bench, H, 2, **sub) == pytest.approx(3128, abs=1)
    kw24 = {**kw, "chunk": 1536, "sub_chunk": 24}
    assert jc.sparseloco_density(held_out, 3000, H, 2, **kw24) == 2 / 24
    assert jc.sparseloco_density(bench, 3000, H, 2, **kw24) == 2 / 24
    assert jc.sparseloco_ratio(held_out, H, 2, density=2 / 24, **kw24) == pytest.approx(3103, abs=1)
    assert jc.sparseloco_ratio(bench, H, 2, density=2 / 24, **kw24) == pytest.approx(3184, abs=1)
    # the same setting on the other pairs' models (docs/lm.md's row): third (2 layers of 96),
    # fourth (3 of 96), fifth (2 of 160): 3161x, 3171x, 3196x
    for model, ratio in ((Model(96, 2), 3161), (Model(96, 3), 3171), (Model(160, 2), 3196)):
        other = params_of(model)
        assert jc.sparseloco_density(other, 3000, H, 2, **kw24) == 2 / 24
        assert jc.sparseloco_ratio(other, H, 2, density=2 / 24, **kw24) == pytest.approx(
            ratio, abs=1
        )
