"""Bad axes, walked over the public API: every factory and collective names the argument.

Each public transform factory refuses ``axis_name=None`` (ValueError: it would reduce over no
axis at all) and a non-str name (TypeError) at construction; ``inner_axis_name`` likewise.
At trace time a name the mesh lacks is a ValueError ("... is not bound here") from every
collective (from every update: item 7 of the contract suites), and ``jc.sharded_init`` /
``jc.state_specs`` name an axis the mesh lacks. Traced with ``jax.eval_shape``: nothing
compiles.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SGD = optax.sgd(0.1)
S = jc.sign()

# name -> factory of the transform over a given axis (every public factory with an axis).
FACTORIES = {
    "compressed_allreduce": lambda ax: jc.compressed_allreduce(S, ax, min_size=4),
    "dgc": lambda ax: jc.dgc(0.5, ax, min_size=4),
    "powersgd": lambda ax: jc.powersgd(1, ax, min_size=4),
    "sgd": lambda ax: jc.sgd(0.1, S, ax, min_size=4),
    "onebit_adam": lambda ax: jc.onebit_adam(0.1, ax, freeze_step=2),
    "zero_one_adam": lambda ax: jc.zero_one_adam(0.1, ax, var_freeze_step=2),
    "local_sgd": lambda ax: jc.local_sgd(SGD, ax, 2),
    "diloco": lambda ax: jc.diloco(SGD, ax, 2),
    "gossip": lambda ax: jc.gossip(SGD, ax),
    "delayed": lambda ax: jc.delayed(SGD, axis_name=ax),
}
INNER = {
    "compressed_allreduce": lambda ax: jc.compressed_allreduce(S, "data", inner_axis_name=ax),
    "dgc": lambda ax: jc.dgc(0.5, "data", inner_axis_name=ax),
    "powersgd": lambda ax: jc.powersgd(1, "data", inner_axis_name=ax),
}
BAD = [(None, ValueError), ((), ValueError), (3, TypeError), (("data", 1.5), TypeError)]


def _named(exc_info, arg="axis_name"):
    assert re.search(rf"`{arg}`", str(exc_info.value)), str(exc_info.value)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factories_refuse_bad_axis_names_at_construction(name):
    for bad, exc in BAD:
        if name == "delayed" and bad is None:
            continue  # delayed(tx) without an axis: tx averages (documented)
        with pytest.raises(exc) as info:
            FACTORIES[name](bad)
        assert type(info.value) is exc, (bad, info.value)
        _named(info)
    for bad, exc in BAD[1:]:
        if name in INNER:
            with pytest.raises(exc) as info:
                INNER[name](bad)
            _named(info, "inner_axis_name")


def test_accumulate_refuses_a_missing_transform():
    with pytest.raises(TypeError, match=r"`tx` must be an optax GradientTransformation"):
        jc.accumulate(None, 4)


PARAMS = {"w": jnp.zeros((8, 4)), "b": jnp.zeros((4,))}


# Every transform's update over an axis the mesh lacks: item 7 of tests/test_contract.py and
# tests/test_contract_replicas.py. The collectives:
@pytest.mark.parametrize(
    "call",
    [
        lambda x: jc.pmean(x, "batch", S),
        lambda x: jc.psum(x, "batch", jc.int_quant(8)),
        lambda x: jc.consensus_distance(x, "batch"),
    ],
    ids=["pmean", "psum", "consensus_distance"],
)
def test_collectives_over_an_axis_the_mesh_lacks_say_so(call):
    m = mesh()
    f = jax.shard_map(call, mesh=m, in_specs=P("data"), out_specs=P())
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(m, P("data")))
    with pytest.raises(ValueError, match=r"`axis_name` 'batch' is not bound"):
        jax.eval_shape(f, x)


def test_an_unbound_axis_says_which_axes_are_bound():
    """A misspelt axis names the axes bound there; an update outside any shard_map says so.
    Until 2026-11-27 both said only "call jaxcomp collectives inside jax.shard_map (or
    jax.pmap) over a mesh that has axis 'batch'", naming neither the axis to use nor that
    the update ran under jax.jit with no shard_map at all."""
    m = mesh()
    f = jax.shard_map(lambda x: jc.pmean(x, "batch", S), mesh=m, in_specs=P("data"), out_specs=P())
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(m, P("data")))
    with pytest.raises(ValueError, match=r"the axes bound here are \('data',\): build the"):
        jax.eval_shape(f, x)
    tx = jc.sgd(0.1, S, "data")
    grads = {"w": jnp.ones(16)}
    for update in (tx.update, jax.jit(tx.update)):  # eagerly, and under jax.jit alone
        with pytest.raises(ValueError, match=r"no axis is bound here at all: this runs outside"):
            update(grads, tx.init(grads), grads)


@pytest.mark.parametrize("bad, exc", BAD, ids=["None", "empty", "int", "tuple-with-float"])
def test_pmean_refuses_a_bad_axis_name(bad, exc):
    m = mesh()
    f = jax.shard_map(lambda x: jc.pmean(x, bad, S), mesh=m, in_specs=P("data"), out_specs=P())
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(m, P("data")))
    with pytest.raises(exc) as info:
        jax.eval_shape(f, x)
    _named(info)


def test_sharded_init_and_state_specs_name_the_axis_the_mesh_lacks():
    tx = jc.sgd(0.1, S, "data")
    with pytest.raises(ValueError, match=r"`axis_name`='batch' names \['batch'\] axis"):
        jc.sharded_init(tx, PARAMS, mesh(), "batch")
    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, mesh(), "data"), PARAMS)
    with pytest.raises(ValueError, match=r"`axis_name`='batch' names \['batch'\] axis"):
        jc.state_specs(state, "batch", mesh=mesh())
    with pytest.raises(ValueError, match=r"`axis_name` is required"):
        jc.state_specs(state, None)
