"""Residual feedback encoded a chunk at a time (``fuse_residuals=True``) gives the bits of the
passes over whole leaves, keeps the memory on a non-finite step, and moves fewer bytes.

``jaxcomp._src.fused_residual``: one loop over cache-sized chunks of each leaf writes the
payload, the new memory (in place) and the old memory (over the donated gradient, copied back
on a non-finite step). Checked against ``fuse_residuals=False`` over 3 steps, the second with
a NaN on one device: outputs and memories bit for bit, on 8 devices (int8 gathered whole,
fp16 summed) and on one (sign with blocks).
"""

import functools
import math
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import fused_residual

#: One leaf of 2 chunks of 65,536 values (fused) and one below a chunk (not fused).
PARAMS = {"w": jnp.zeros((512, 256)), "b": jnp.zeros((3000,))}

CASES = {
    "int8 allgather, 8 devices": (jc.int_quant(8), "allgather", 8),
    "fp16 allreduce, 8 devices": (jc.cast("fp16", scaled=False), "auto", 8),
    "sign blocks, 1 device": (jc.sign(block_size=128), "auto", 1),
}


@functools.cache
def _steps(case: str, fuse: bool):
    """(outputs, memories) of 3 steps, a NaN on the last device in the second, and the
    compiled step's text."""
    codec, strategy, n = CASES[case]
    m = helpers.mesh(n)
    tx = jc.compressed_allreduce(
        codec, "data", error_feedback="residual", strategy=strategy, fuse_residuals=fuse
    )
    state = jc.sharded_init(tx, PARAMS, m, "data")
    specs = jc.state_specs(state, "data")

    def body(g, s):
        return tx.update(jax.tree.map(lambda a: a[0], g), s, PARAMS)

    step = jax.jit(jax.shard_map(body, mesh=m, in_specs=(P("data"), specs), out_specs=(P(), specs)))
    results, text = [], None
    for t in range(3):
        g = {k: helpers.stacked_normal(t, p.shape, n) * (t + 1) for k, p in PARAMS.items()}
        if t == 1:
            g["w"] = g["w"].at[n - 1, 5, 7].set(jnp.nan)
        g = jax.device_put(g, NamedSharding(m, P("data")))
        if text is None:
            text = step.lower(g, state).compile().as_text()
        out, state = jax.block_until_ready(step(g, state))
        results.append(jax.tree.map(np.asarray, (out, state.memory)))
    return results, text


@pytest.mark.parametrize("case", list(CASES))
def test_fused_steps_give_the_same_bits_and_keep_the_memory_on_a_nan_step(case):
    fused, text = _steps(case, True)
    plain, _ = _steps(case, False)
    assert " while(" in text  # the chunked loop is compiled in
    for a, b in zip(fused, plain, strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    # The NaN step: every output NaN, every memory as after the first step.
    assert np.isnan(fused[1][0]["w"]).all()
    for x, y in zip(jax.tree.leaves(fused[1][1]), jax.tree.leaves(fused[0][1]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert np.isfinite(fused[2][0]["w"]).all()


def test_chunk_sizes_divide_the_leaf_in_whole_units():
    int8, fp16, sign = jc.int_quant(8), jc.cast("fp16", scaled=False), jc.sign()
    assert fused_residual.chunk_size(int8, 4096 * 4096) == 65536
    assert fused_residual.chunk_size(int8, 3 * 65536) == 65536
    assert fused_residual.chunk_size(int8, 5 * 4096) == 10240  # two chunks
    assert fused_residual.chunk_size(int8, 4096 + 256) is None  # none large enough
    assert fused_residual.chunk_size(fp16, 1000 * 999) == 55500  # the largest divisor <= 65536
    assert fused_residual.chunk_size(sign, 2**20) is None  # one scale over the vector
    assert fused_residual.chunk_size(jc.int_quant(8, stochastic=True), 2**20) is None
    assert int8.chunk_unit(10**6) == 256 and jc.int_quant(4, 100).chunk_unit(1) == 200
    assert jc.sign(block_size=100).chunk_unit(1) == 800 and fp16.chunk_unit(1) == 1


@pytest.mark.parametrize("codec", [jc.int_quant(8), jc.int_quant(4, 64), jc.cast("bf16")])
def test_chunk_payloads_laid_end_to_end_are_the_payload(codec):
    d, c = 4 * 4096, 4096
    x = jax.random.normal(jax.random.PRNGKey(3), (d,)) * jnp.repeat(
        10.0 ** jnp.arange(-3, 1.0), d // 4
    )
    encode = jax.jit(codec.encode)
    whole = encode(x)
    parts = [encode(x[i : i + c]) for i in range(0, d, c)]
    for leaf, *pieces in zip(jax.tree.leaves(whole), *map(jax.tree.leaves, parts), strict=True):
        np.testing.assert_array_equal(leaf, jnp.concatenate(pieces))


def test_fused_int8_moves_fewer_bytes_and_copies_nothing_gradient_sized():
    """One device, the gradient and the memory donated: the compiled update holds no copy of
    a gradient-sized buffer outside the restore loop, and its traffic model is below the
    unfused update's traffic (int8: its words and scales, the words gathered, a chunk)."""
    from benchmarks.hot_path import hlo_traffic

    m = helpers.mesh(1)
    params = {"w": jnp.zeros((512, 512))}
    sizes = {}
    for fuse in (True, False):
        tx = jc.compressed_allreduce(jc.int_quant(8), "data", fuse_residuals=fuse)
        state = jc.sharded_init(tx, params, m, "data")
        specs = jc.state_specs(state, "data")

        def body(g, s, tx=tx):
            return tx.update(jax.lax.pcast(g, "data", to="varying"), s, params)

        step = jax.jit(
            jax.shard_map(body, mesh=m, in_specs=(P(), specs), out_specs=(P(), specs)),
            donate_argnums=(0, 1),
        )
        compiled = step.lower(params, state).compile()
        text = compiled.as_text()
        sizes[fuse] = (
            hlo_traffic(text) / (8 * 512 * 512),
            compiled.memory_analysis().temp_size_in_bytes / (4 * 512 * 512),
        )
        if fuse:
            # Copies of a gradient-sized buffer in any shape (jaxlib 0.12 copied the gradient
            # as f32[4,65536] twice per chunk before fused_residual read x at a dynamic offset).
            shapes = [re.search(r"= f32\[([\d,]+)\]", line) for line in text.splitlines()]
            big = [
                s[1]
                for line, s in zip(text.splitlines(), shapes, strict=True)
                if " copy(" in line and s and math.prod(map(int, s[1].split(","))) == 512 * 512
            ]
            assert len(big) <= 1, big  # the restore loop's copy (a non-finite step only)
    assert sizes[True][0] < 3.7 < 4.6 < sizes[False][0]
    assert sizes[True][1] < 0.6  # words, their gathered copy, one chunk of x


def test_one_bit_block_scales_in_chunks_round_within_a_few_ulp():
    """A 1-bit block scale (sign's mean of ``|x|``) is a float sum, which XLA may add in another
    order for another number of blocks: blocks of 100 values, encoded in chunks of 2,400,
    give the whole vector's sign words bit for bit and its scales within 4e-7 relative (at
    most 2.8e-7 measured on XLA:CPU), so ``fuse_residuals`` is bit for bit only where the
    scale is a maximum or there is none (``Codec.chunk_unit``)."""
    codec = jc.sign(block_size=100)
    c = codec.chunk_unit(1) * 3
    x = jax.random.normal(jax.random.PRNGKey(7), (4 * c,)) * 3.0
    encode = jax.jit(codec.encode)
    words, scales = encode(x)
    parts = [encode(x[i : i + c]) for i in range(0, 4 * c, c)]
    np.testing.assert_array_equal(words, np.concatenate([p[0] for p in parts]))
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), scales, rtol=4e-7, atol=0)
