"""Donated steps update every state array in place: the compiled program aliases each one.

The error-feedback memories are as large as the gradient; a step that donates its state but
whose program does not alias a memory to its new value allocates (and on XLA:CPU, page
faults) a fresh gradient-sized buffer per leaf and step.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from tests.helpers import mesh, shard

PARAMS = {"w": jnp.zeros((64, 48)), "b": jnp.zeros((48,)), "v": jnp.zeros((2048,))}

TRANSFORMS = {
    "sign": lambda: jc.compressed_allreduce(jc.sign(), "data", min_size=100),
    "int8_two_phase": lambda: jc.compressed_allreduce(
        jc.int_quant(8), "data", min_size=100, strategy="two_phase"
    ),
    "fp16": lambda: jc.compressed_allreduce(jc.cast("fp16", scaled=False), "data", min_size=100),
    "dgc": lambda: jc.dgc(0.01, "data", min_size=100, warmup_steps=0),
    "powersgd": lambda: jc.powersgd(4, "data", min_size=100, start_step=0),
}


def _aliased_parameters(hlo: str) -> set[int]:
    header = hlo.splitlines()[0]
    m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
    assert m, header[:300]
    return {int(p) for p in re.findall(r"\}: \((\d+),", m.group(1))}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_donated_step_aliases_every_state_array(name):
    m = mesh()
    tx = optax.chain(TRANSFORMS[name](), optax.sgd(0.1))
    params = jax.tree.map(lambda a: shard(a, m, P()), PARAMS)
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(params, state, grads):
        grads = jax.tree.map(lambda a: a[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    fn = jax.jit(
        jax.shard_map(step, mesh=m, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)),
        donate_argnums=(0, 1),
    )
    grads = jax.tree.map(lambda a: shard(jnp.ones((8, *a.shape))), PARAMS)
    hlo = fn.lower(params, state, grads).compile().as_text()
    aliased = _aliased_parameters(hlo)
    n_params, n_state = len(jax.tree.leaves(params)), len(jax.tree.leaves(state))
    assert set(range(n_params + n_state)) <= aliased, (sorted(aliased), n_params, n_state)
