"""Params trees as users build them: custom pytree nodes, wrappers around the transforms.

A transform's update must not depend on how the params' leaves are held: the same leaves in
a plain dict and in a user's own pytree node give the same numbers, bit for bit.
"""

import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh, per_device, shard
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import skeleton


class Pair:
    """A user's pytree node without ``__eq__`` (``register_pytree_node``): two of them with
    equal leaves compare unequal, as any Python object without ``__eq__``."""

    def __init__(self, w, b):
        self.w, self.b = w, b


jax.tree_util.register_pytree_node(Pair, lambda p: ((p.w, p.b), None), lambda _, c: Pair(*c))

RNG = np.random.default_rng(0)
W = (0.1 * RNG.standard_normal((16, 12))).astype(np.float32)
B = (0.1 * RNG.standard_normal(12)).astype(np.float32)
G = {
    "w": RNG.standard_normal((8, 16, 12)).astype(np.float32),
    "b": RNG.standard_normal((8, 12)).astype(np.float32),
}


def _updates(tx, params, grads):
    """One jc.sharded_init + shard_map step: the replicated update as numpy leaves."""
    m = mesh()
    params = shard(params, m, P())
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(g, s, p):
        g = jax.tree.map(lambda a: a[0], g)
        p = jax.lax.pcast(p, "data", to="varying")
        return tx.update(g, s, p)[0]

    out = per_device(step, (P("data"), specs, P()), P(), m)(shard(grads, m), state, params)
    return [np.asarray(a) for a in jax.tree.leaves(out)]


def test_state_check_accepts_a_custom_pytree_node_without_eq():
    tx = jc.sgd(0.1, jc.sign(), "data")
    state = tx.init(Pair(W, B))
    # The state built for these params passes the check a step makes ...
    want = {"momentum": jax.eval_shape(lambda: state[0].momentum)}
    skeleton.check_fields("sgd", state[0], want)
    # ... and the step gives the numbers of the same leaves in a dict, bit for bit.
    got = _updates(tx, Pair(W, B), Pair(G["w"], G["b"]))
    want = _updates(tx, {"a": W, "b": B}, {"a": G["w"], "b": G["b"]})
    assert len(got) == 2
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    # b is small (plain pmean); sign is biased, so jc.sgd looks ahead: -lr (1 + beta) mean g.
    np.testing.assert_allclose(want[1], -0.1 * 1.9 * G["b"].mean(0), rtol=1e-5)


def test_param_specs_of_another_tree_are_refused_naming_param_specs():
    """A transform's ``param_specs`` (data x model mesh) of a tree other than the gradients'
    failed in jax's "pytree structure error ... shard_map in_specs" (a key more or less) or
    "zip() argument 3 is longer" (one P() for the tree); refused at trace time now."""
    m = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    params = {"w": W, "b": B}
    for bad in ({"w": P(None, "model")}, P()):
        tx = jc.compressed_allreduce(jc.int_quant(8), "data", param_specs=bad)
        state = jc.sharded_init(tx, params, m, "data")

        def step(g, s, tx=tx):
            return tx.update(jax.tree.map(lambda a: a[0], g), s, params)[0]

        f = jax.shard_map(
            step,
            mesh=m,
            in_specs=(P("data"), jc.state_specs(state, "data")),
            out_specs=P(),
            axis_names={"data"},
        )
        # on the data axis, as in_specs says: jax 0.12 checks a numpy input's sharding too
        grads = shard(jax.tree.map(lambda a: np.stack([a] * 4), params), m)
        with pytest.raises(ValueError, match=r"`param_specs` must be a tree like the params"):
            jax.jit(f).lower(grads, state)


@pytest.mark.parametrize("empty", [None, optax.MaskedNode()], ids=["None", "MaskedNode"])
def test_an_empty_param_slot_keeps_the_model_sharding_of_the_others(empty):
    """Params with an empty slot (``b``: None or ``optax.MaskedNode``) on a data x model
    mesh: the spec at that slot (None or ``P()``) is read as the slot's, and ``w``'s memory
    keeps its model axis. Until 2026-11-27 a None spec laid every memory out ``P('data')``
    (``w``'s memory gathered on every model shard, silently) and ``P()`` failed with
    "zip() argument 2 is longer than argument 1"; one ``P()`` for a subtree is refused."""
    m = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    tx = jc.compressed_allreduce(jc.int_quant(8), "data", min_size=10)
    params = {"w": W, "b": empty}
    for b_spec in (None, P()) if empty is None else (P(),):
        specs = {"w": P(None, "model"), "b": b_spec}
        state = jc.sharded_init(tx, params, m, "data", param_specs=specs)
        assert state.memory["w"].sharding.spec == P("data", None, "model")
        laid = jc.state_specs(state, "data", param_specs=specs, params=params)
        assert laid.memory == {"w": P("data", None, "model"), "b": empty}
    with pytest.raises(ValueError, match=r"`param_specs` must be a tree like the params"):
        jc.sharded_init(tx, {"w": {"x": W}}, m, "data", param_specs={"w": P()})


def _index_block(containing: str) -> str:
    """The (indented) python block of docs/index.md that contains ``containing``."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "index.md").read_text()
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)
    found = [textwrap.dedent(b) for _, b in blocks if containing in b]
    assert len(found) == 1, found
    return found[0]


def test_one_exchange_in_front_of_multi_transform_keeps_the_replicas_equal():
    """docs/index.md: labels split after one exchange, whose mask= sends the adamw leaf
    through plain pmean; every device holds the same params, b stepped by adamw of the mean.
    Two exchanges chained: the second refuses the first one's mean, naming `updates`."""
    ns = {"jc": jc, "optax": optax}
    exec(_index_block("optax.multi_transform"), ns)
    params = {"w": W, "b": B}
    m = mesh()

    def replicas(tx):
        state = jc.sharded_init(tx, shard(params, m, P()), m, "data")
        specs = jc.state_specs(state, "data")

        def step(p, s, g):
            u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
            return jax.tree.map(lambda a: a[None], optax.apply_updates(p, u))

        f = per_device(step, (P(), specs, P("data")), P("data"), m)
        return f(shard(params, m, P()), state, shard(G, m))

    out = replicas(ns["tx"])
    for leaf in jax.tree.leaves(out):  # the eight copies of every param are one
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaf)[:1].repeat(8, 0))
    adamw = optax.adamw(1e-3)
    u, _ = adamw.update(G["b"].mean(0), adamw.init(B), B)
    np.testing.assert_allclose(np.asarray(out["b"])[0], B + np.asarray(u), rtol=0, atol=1e-7)
    twice = optax.chain(jc.sgd(0.1, jc.sign(), "data"), jc.compressed_allreduce(jc.sign(), "data"))
    with pytest.raises(ValueError, match=r"`updates`.*exchange once"):
        replicas(twice)


def test_python_numbers_among_the_params_init_as_their_arrays():
    """A Python float or int leaf (a scale held as 1.0, as optax's init takes it) raised
    AttributeError "'float' object has no attribute 'dtype'" in tx.init of every exchange
    (the layout read leaf.dtype / leaf.shape); it inits as jnp.asarray of it does."""
    params = {"w": W, "scale": 1.0, "steps": 3}
    arrays = jax.tree.map(jnp.asarray, params)
    for tx in (
        jc.compressed_allreduce(jc.sign(), "data", min_size=0),
        jc.dgc(0.1, "data", min_size=0),
        jc.powersgd(2, "data", min_size=0),
        jc.gossip(optax.sgd(0.1), "data", codec=jc.sign()),
    ):
        got, want = (
            jax.tree.map(lambda a: (a.shape, a.dtype), tx.init(p)) for p in (params, arrays)
        )
        assert got == want
