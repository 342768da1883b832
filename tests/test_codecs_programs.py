"""The compiled shape of each codec's exchange: what keeps it fast, read from the HLO.

Speed is measured in benchmarks/, not asserted in tests; but the program that makes a codec
fast has a shape, and a regression to the slow form changes that shape deterministically.
Each row compiles (and does not run) one error-feedback step through the all-gather of one
64 x 64 leaf (``d`` values) on the 8-device mesh and asserts, over XLA's optimized HLO:

* no ``sort`` of a leaf-sized operand: top-k selects with XLA's TopK (larger leaves: the
  two-stage or sampled selections), never a full sort. When the scatter's zeros waited on
  the gathered indices (``_scatter``'s ``after(operand, indices[0])``), XLA no longer
  recognized the local ``top_k`` and lowered it to a sort of the whole leaf: a 1% top-k
  all-gather step ran 10-25x slower on XLA:CPU (benchmarks/topk_speed.py), caught here by
  this assertion;
* no float32 array of ``n * d`` values: the gathered payloads are decoded one device at a
  time into the sum (dense codecs), or scattered at once (sparse ones), never decoded into an
  ``[n, d]`` stack (6x slower for d = 25M, :func:`jaxcomp._src.codecs.base.sum_of_decodes`);
* sparse codecs: every device's slots go into the mean through ONE scatter-add of the
  ``n * k`` gathered indices (flattened: ``s32[n k]``), and no loop runs over the gathered
  replicas (no loop carries the ``[n, k]`` stack: a scatter per device, serialized);
* dense codecs: at most one loop carries the ``[n, ...]`` gathered payloads (the
  decode-and-add over devices).

A compile per row, its state abstract (``jax.eval_shape``): about 0.3 s of CPU a row.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import N, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc

SHAPE = (64, 64)  # 2-D: DGC sparsifies leaves of more than one dimension
D = SHAPE[0] * SHAPE[1]

# name -> (transform, slots per device of the leaf: None for dense codecs)
ROWS = {
    "topk": (lambda: _allgather(jc.top_k(0.01)), jc.top_k(0.01).size(D)),
    "randk": (lambda: _allgather(jc.random_k(0.01)), jc.random_k(0.01).size(D)),
    "threshold": (lambda: _allgather(jc.threshold(0.5, 64)), 64),
    "dgc": (lambda: jc.dgc(0.01, "data", min_size=1, warmup_steps=0), 41),  # 1% from step 0
    "sign": (lambda: _allgather(jc.sign()), None),
    "int8": (lambda: _allgather(jc.int_quant(8)), None),
    "qsgd": (lambda: _allgather(jc.qsgd(16)), None),
}


def _allgather(codec):
    return jc.compressed_allreduce(codec, "data", strategy="allgather", min_size=1)


def compiled_text(name: str) -> str:
    """The optimized HLO of one step of row ``name`` (its state abstract: compiled, not
    run)."""
    tx, m = ROWS[name][0](), mesh()
    params = {"w": jnp.zeros(SHAPE, jnp.float32)}
    state = jax.eval_shape(lambda p: jc.sharded_init(tx, p, m, "data"), params)
    specs = jc.state_specs(state, "data")

    def step(g, s):
        u, s = tx.update({"w": g[0]}, s, params)
        return u["w"][None], s

    fn = jax.jit(
        jax.shard_map(step, mesh=m, in_specs=(P("data"), specs), out_specs=(P("data"), specs))
    )
    g = jax.ShapeDtypeStruct((N, *SHAPE), jnp.float32, sharding=NamedSharding(m, P("data")))
    return fn.lower(g, state).compile().as_text()


def _dims(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every ``dtype[d0,d1,...]`` array type written in ``text``."""
    found = re.findall(r"\b([a-z]+[0-9]+)\[([0-9,]*)\]", text)
    return [(t, tuple(int(x) for x in d.split(",") if x)) for t, d in found]


def _instructions(text: str, op: str) -> list[str]:
    """The result types of every ``op(`` instruction (``%x = TYPE op(...)``)."""
    return re.findall(rf"= (.*?) {op}\(", text)


def _decodes_gathered_stack(loop_type: str, d: int) -> bool:
    """Whether a loop builds a ``d``-leaf's sum (carries ``f32[d]``) from the stack of
    gathered payloads (carries an array of leading dimension ``n``): a loop over replicas."""
    dims = _dims(loop_type)
    return ("f32", (d,)) in dims and any(len(x) >= 2 and x[0] == N for _, x in dims)


@pytest.mark.parametrize("name", list(ROWS))
def test_exchange_program_keeps_its_fast_shape(name):
    text, d, slots = compiled_text(name), D, ROWS[name][1]
    assert _instructions(text, "all-gather"), "the all-gather strategy gathers"
    sorts = [x for t in _instructions(text, "sort") for _, x in _dims(t) if math.prod(x) == d]
    assert not sorts, f"a sort of the whole leaf (XLA's TopK lost): {sorts}"
    stacks = [x for t, x in _dims(text) if t == "f32" and math.prod(x) == N * d]
    assert not stacks, f"float32 arrays of n * d values (a decoded [n, d] stack): {stacks}"
    loops = [t for t in _instructions(text, "while") if _decodes_gathered_stack(t, d)]
    if slots is None:
        assert len(loops) <= 1, f"loops over the gathered payloads: {loops}"
        return
    assert not loops, f"a loop over the gathered replicas (a scatter per device): {loops}"
    flat = {x for t, x in _dims(text) if t == "s32" and x in ((N * slots,), (N * slots, 1))}
    assert flat, f"no scatter of the n * k = {N * slots} gathered slots at once"
