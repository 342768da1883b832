"""DeMo: the block DCT, the top-k of each block's components, the sign update with decoupled
weight decay, and the bytes. The contract items (conservation with ``decay=1, sign=False``,
poison and freeze, specs, orbax, pmap) are the ``demo-accumulate`` row of
tests/test_contract.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.fft
from helpers import N, mesh, per_device, shard
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import demo as demo_lib

SHAPES = {"w": (100, 256), "b": (64,)}  # w: 2 x 4 blocks of 50 x 64 (none padded); b: dense
LR, WD, TOPK = 0.01, 0.1, 16


def test_block_dct_is_scipy_dct_and_inverts_exactly():
    d = demo_lib.dct_matrix(64)
    np.testing.assert_allclose(d @ d.T, np.eye(64), atol=1e-6)
    x = np.random.default_rng(0).standard_normal((130, 70)).astype(np.float32)
    shapes = ((130, 70), (300,), (3, 5, 64))
    ys = [np.random.default_rng(1).standard_normal(s).astype(np.float32) for s in shapes]

    @jax.jit  # one program for every check
    def run(x, ys):
        b = demo_lib.Blocks.of(x.shape, 64)
        back = [demo_lib.Blocks.of(y.shape, 64) for y in ys]
        return b.forward(x), [c.inverse(c.forward(y)) for c, y in zip(back, ys, strict=True)]

    coeffs, rounds = run(x, ys)
    # 130 rows (no divisor in [32, 64]): 3 blocks of 64, the last zero-padded; 70 columns:
    # 2 blocks of 35 (block_side), none padded
    coeffs = np.asarray(coeffs).reshape(3, 2, 64, 35)
    padded = np.pad(x, ((0, 62), (0, 0))).reshape(3, 64, 2, 35).transpose(0, 2, 1, 3)
    want = scipy.fft.dctn(padded, axes=(2, 3), norm="ortho")
    np.testing.assert_allclose(coeffs, want, atol=2e-5)
    for y, r in zip(ys, rounds, strict=True):
        np.testing.assert_allclose(r, y, atol=2e-5)


@functools.cache
def demo_step():
    tx = jc.demo(LR, "data", topk=TOPK, weight_decay=WD, min_size=1024)  # b: sent whole
    m = mesh()
    params = {
        k: np.random.default_rng(3).standard_normal(s).astype(np.float32) for k, s in SHAPES.items()
    }
    params = jax.device_put(params, NamedSharding(m, P()))
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(g, s, p):
        u, s = tx.update(jax.tree.map(lambda a: a[0], g), s, p)
        return u, s

    fn = per_device(step, (P("data"), specs, P()), (P(), specs), m)
    return fn, params, state


def grads() -> dict:
    rng = np.random.default_rng(4)
    return {k: rng.standard_normal((N, *s)).astype(np.float32) + 0.2 for k, s in SHAPES.items()}


def test_sign_update_of_the_mean_sent_components_and_weight_decay():
    fn, params, state = demo_step()
    g = grads()
    u, after = fn(shard(g), state, params)
    mom = np.asarray(after[0].momentum["w"])  # (n, 100, 256): what each device kept
    sent = g["w"] - mom  # m_i = g_i on the first step; what left it was sent
    blocks = demo_lib.Blocks.of((100, 256), 64)
    assert (blocks.b1, blocks.b2, blocks.size) == (50, 64, 100 * 256)  # 100 = 2 x 50: no padding
    k = 13  # TOPK scaled to a 50 x 64 block: ceil(16 x 3200 / 4096)
    for i in (0, 5):  # each device sent k components of each of the 8 blocks
        comps = np.asarray(blocks.forward(jnp.asarray(sent[i]))).reshape(-1, 50 * 64)
        assert comps.shape[0] == 8 and ((np.abs(comps) > 1e-4).sum(1) == k).all()
        kept = np.asarray(blocks.forward(jnp.asarray(mom[i]))).reshape(-1, 50 * 64)
        # the sent components are the largest of each block (8-bit values: within 1/255)
        big = np.abs(np.asarray(blocks.forward(jnp.asarray(g["w"][i])))).reshape(-1, 50 * 64)
        kth = np.sort(big, axis=1)[:, -k]
        assert (np.abs(kept) <= kth[:, None] * (1 + 2 / 255) + 1e-5).all()
    q = sent.mean(0)
    p = np.asarray(params["w"])
    sure = np.abs(q) > 1e-4
    want = -LR * (np.sign(q) + WD * p)
    np.testing.assert_allclose(np.asarray(u["w"])[sure], want[sure], rtol=1e-5, atol=1e-7)
    # a small leaf sends its whole momentum (pmean) and keeps none
    want_b = -LR * (np.sign(g["b"].mean(0)) + WD * np.asarray(params["b"]))
    np.testing.assert_allclose(np.asarray(u["b"]), want_b, rtol=1e-5, atol=1e-7)
    assert not np.asarray(after[0].momentum["b"]).any()


def test_bytes_are_the_model_and_beat_pmean_80x():
    fn, params, state = demo_step()
    report = jc.comm_report(fn.fn, shard(grads()), state, params)
    want = demo_lib.wire_bytes(params, N, topk=TOPK, min_size=1024)
    assert report.bytes_per_device == pytest.approx(want)
    # 64 x 64 blocks at the defaults: 16 x 12-bit indices + 16 x 8-bit values + a scale
    assert (
        demo_lib._codec(demo_lib.Blocks.of((64, 64), 64), 64, 16, 8).payload_bytes(4096)
        == (16 * 12 + 16 * 8) // 8 + 4
    )
    big = {"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32)}
    pmean = 2 * (N - 1) / N * 4 * 512 * 1024
    assert pmean / demo_lib.wire_bytes(big, N) == pytest.approx(4096 / 44, rel=1e-9)  # 93x
    # The LM benchmark's cpu model (2 layers, d_model 128: 19 leaves under 1024 values, 3840
    # values in all): sending the small leaves whole (min_size=1024) costs 53x, the default
    # (every leaf through DeMo: a 1 x 64 block of a vector sends 1 component) 86x.
    from flax import nnx

    from benchmarks.char_transformer import CharTransformer

    model = nnx.eval_shape(
        lambda: CharTransformer(context=64, d=128, layers=2, heads=4, rngs=nnx.Rngs(0))
    )
    lm = nnx.state(model)
    pmean = 2 * (N - 1) / N * 4 * sum(x.size for x in jax.tree.leaves(lm))
    assert pmean / demo_lib.wire_bytes(lm, N) >= 80
    assert pmean / demo_lib.wire_bytes(lm, N, min_size=1024) < 60
    # The LM recipe's 18 components of 4 bits: a 64 x 64 block costs the same 44 bytes as 16
    # of 8 bits (28 bytes of 12-bit indices, 12 of 4-bit values, in 32-bit words; a scale),
    # a 1 x 64 block of a vector less; on the LM model 94.7x fewer bytes than pmean.
    assert demo_lib._codec(demo_lib.Blocks.of((64, 64), 64), 64, 18, 4).payload_bytes(4096) == 44
    assert 94.5 < pmean / demo_lib.wire_bytes(lm, N, topk=18, bits=4) < 95
    # min_topk=4: every 1 x 64 block of a vector sends 4 components (6.3%, not 0.44%): 91.7x
    assert 91.5 < pmean / demo_lib.wire_bytes(lm, N, topk=18, bits=4, min_topk=4) < 92
    # The width rule's 20 components of 3 bits, on the three LM models of the docs (the
    # benchmark's; the held-out d_model 64, 3 layers; the third width, d_model 192, 6 heads):
    # over 80x fewer bytes than pmean on each.
    for (d, layers, heads), lo, hi in (
        ((128, 2, 4), 91.4, 91.5),
        ((64, 3, 4), 81.3, 81.4),
        ((192, 2, 6), 94.0, 94.1),
    ):
        model = nnx.eval_shape(
            lambda d=d, layers=layers, heads=heads: CharTransformer(
                context=64, d=d, layers=layers, heads=heads, rngs=nnx.Rngs(0)
            )
        )
        lm = nnx.state(model)
        pmean = 2 * (N - 1) / N * 4 * sum(x.size for x in jax.tree.leaves(lm))
        assert lo < pmean / demo_lib.wire_bytes(lm, N, topk=20, bits=3) < hi


def old_blocks(shape: tuple[int, ...], chunk: int) -> demo_lib.Blocks:
    """``Blocks.of`` before :func:`block_side`: ``min(chunk, dim)`` per dimension, the last
    block zero-padded."""
    rows, cols = demo_lib.matrix_shape(tuple(shape))
    return demo_lib.Blocks(tuple(shape), min(chunk, rows), min(chunk, cols))


def pmean_ratio(tree) -> float:
    """Ring-model bytes of a float32 pmean of ``tree`` over those of the width rule's DeMo
    (20 components of 3 bits per 64 x 64 block) at ``N`` devices."""
    size = sum(np.prod(np.shape(x)) for x in jax.tree.leaves(tree))
    return 2 * (N - 1) / N * 4 * size / demo_lib.wire_bytes(tree, N, topk=20, bits=3)


def test_block_side_divides_a_dimension_or_pads_it():
    side = demo_lib.block_side
    assert [side(n, 64) for n in (0, 1, 50, 64, 128, 384, 512)] == [0, 1, 50, 64, 64, 64, 64]
    # the largest divisor in [32, 64]: equal blocks, none padded
    assert [side(n, 64) for n in (96, 70, 100, 160, 288, 66)] == [48, 35, 50, 40, 48, 33]
    # no divisor in [32, 64] (a prime; 130 = 2 x 5 x 13; 65 = 5 x 13): 64, the last padded
    assert [side(n, 64) for n in (97, 130, 65)] == [64, 64, 64]
    assert (side(96, 128), side(200, 128), side(7, 1), side(9, 3)) == (96, 100, 1, 3)
    b = demo_lib.Blocks.of((96, 96), 64)
    assert (b.b1, b.b2, b.grid, b.size) == (48, 48, (2, 2), 96 * 96)
    assert demo_lib.Blocks.of((97, 97), 64) == old_blocks((97, 97), 64)  # 2 x 2 of 64, padded
    assert demo_lib.dct_matrix(48) is demo_lib.dct_matrix(48)  # built once per side
    assert not demo_lib.dct_matrix(48).flags.writeable


def _run_steps(tx, shapes: dict, steps: int = 2, report: bool = False):
    """``steps`` DeMo steps of ``tx`` on 8 devices from params of ``shapes``: the gradients,
    each step's update, the momentum after each, and (``report``) the compiled step's bytes
    per device."""
    m = mesh()
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    params = jax.device_put(params, NamedSharding(m, P()))
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(g, s, p):
        return tx.update(jax.tree.map(lambda a: a[0], g), s, p)

    fn = per_device(step, (P("data"), specs, P()), (P(), specs), m)
    gs = [
        {k: rng.standard_normal((N, *s)).astype(np.float32) + 0.2 for k, s in shapes.items()}
        for _ in range(steps)
    ]
    sent = jc.comm_report(fn.fn, shard(gs[0]), state, params).bytes_per_device if report else 0
    updates, moms = [], []
    for g in gs:
        u, state = fn(shard(g), state, params)
        updates.append(jax.tree.map(np.asarray, u))
        moms.append(jax.tree.map(np.asarray, state[0].momentum))
    return gs, updates, moms, sent


def test_multiples_of_the_chunk_are_cut_bit_for_bit_as_before(monkeypatch):
    """Dimensions that are multiples of ``chunk`` (or shorter) keep ``Blocks.of``'s blocks from
    before :func:`block_side`: on a 128 x 512 leaf beside a vector of 64, the same payload
    bytes and the same update and momentum bits over two steps of the width rule's setting,
    against the old rule patched in (a fold of more dimensions, ``(2, 64, 192)``, and a scalar
    were checked so once against the previous ``demo.py`` itself)."""
    shapes = {"w": (128, 512), "b": (64,)}

    def run():
        tx = jc.demo(LR, "data", decay=0.95, topk=20, bits=3, weight_decay=WD)
        zeros = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
        return *_run_steps(tx, shapes)[1:3], demo_lib.wire_bytes(zeros, N, topk=20, bits=3)

    new_u, new_m, new_bytes = run()
    monkeypatch.setattr(demo_lib.Blocks, "of", staticmethod(old_blocks))
    old_u, old_m, old_bytes = run()
    assert new_bytes == old_bytes > 0
    for new, old in ((new_u, old_u), (new_m, old_m)):
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old), strict=True):
            assert a.dtype == b.dtype == np.float32
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_error_feedback_on_blocks_that_divide_or_pad_a_dimension():
    """With ``decay=1, sign=False`` nothing is lost: after two steps, ``-(u_1 + u_2) / lr``
    (the means of what was sent) plus the devices' mean momentum is the mean of the
    gradients, on a 96 x 96 leaf (2 x 2 blocks of 48 x 48, none padded), a 97 x 97 one (prime:
    2 x 2 blocks of 64, zero-padded) and a vector of 97. Without padding what left a device's
    momentum at step 1 is sparse in the blocks' DCT: 12 components per block (20 scaled to
    48 x 48), the rest kept. The compiled step sends ``wire_bytes``."""
    shapes = {"w": (96, 96), "p": (97, 97), "v": (97,)}
    tx = jc.demo(0.1, "data", decay=1.0, sign=False, topk=20, bits=3)
    gs, us, moms, sent_bytes = _run_steps(tx, shapes, report=True)
    zeros = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    assert sent_bytes == demo_lib.wire_bytes(zeros, N, topk=20, bits=3)
    for k in shapes:
        fed = (gs[0][k] + gs[1][k]).mean(0)
        out = -(us[0][k] + us[1][k]) / 0.1 + moms[1][k].mean(0)
        np.testing.assert_allclose(out, fed, rtol=0, atol=1e-5 * np.abs(fed).max())
        assert np.abs(us[0][k]).max() > 0 and np.abs(moms[1][k]).max() > 0
    blocks = demo_lib.Blocks.of((96, 96), 64)
    for i in (0, 6):
        sent = gs[0]["w"][i] - moms[0]["w"][i]  # the momentum was g on the first step
        comps = np.abs(np.asarray(blocks.forward(jnp.asarray(sent)))).reshape(4, 48 * 48)
        assert ((comps > 1e-4 * comps.max()).sum(1) == 12).all()


def test_a_width_not_a_multiple_of_the_chunk_is_cut_without_padding():
    """docs/lm-held-out.md, "A third pair": on ``d_model`` 96 (2 layers, 3 heads) the
    width rule's 20 components of 3 bits save 82.5x against pmean (65.1x when a dimension of 96 was
    zero-padded to 128: a 96 x 96 matrix then travelled as four whole 64 x 64 blocks, 54.9x;
    now as four 48 x 48 blocks of 12 components, 85.3x), over the 80x of issue 24, and the
    compiled step's all-gather sends what ``wire_bytes`` says (on its 96 x 96 and 97 x 97
    leaves: ``test_error_feedback_on_blocks_that_divide_or_pad_a_dimension``; on the whole
    model, whose step takes a minute to compile here: the LM benchmark's bytes,
    docs/lm-measurements.md)."""
    from flax import nnx

    from benchmarks.char_transformer import CharTransformer

    model = nnx.eval_shape(
        lambda: CharTransformer(context=64, d=96, layers=2, heads=3, rngs=nnx.Rngs(0))
    )
    lm = [np.zeros(x.shape, np.float32) for x in jax.tree.leaves(nnx.state(model))]
    assert 82.4 < pmean_ratio(lm) < 82.5
    assert 85.3 < pmean_ratio({"w": np.zeros((96, 96), np.float32)}) < 85.4  # was 54.9
    # 4 blocks of 12 components: 48 x 12-bit indices, 48 x 3-bit values, 4 scales (168 padded)
    assert demo_lib.wire_bytes({"w": np.zeros((96, 96), np.float32)}, N, topk=20, bits=3) == (
        (N - 1) * 4 * (18 + 5 + 4)
    )
    assert 95.0 < pmean_ratio({"w": np.zeros((96, 384), np.float32)}) < 95.1
    # a 48 x 48 block: 12 indices of 12 bits (5 words), 12 values of 3 bits (2 words), a scale
    codec = demo_lib._codec(demo_lib.Blocks.of((96, 96), 64), 64, 20, 3)
    assert codec.payload_bytes(48 * 48) == 4 * (5 + 2) + 4
    assert demo_lib.wire_bytes(lm, N, topk=20, bits=3) == 23716  # 30044 zero-padded


def test_scalar_leaf_is_a_one_by_one_block():
    """A scalar leaf (a learned temperature or gain) is a 1 x 1 block: its one DCT component
    is itself, sent whole, so the update is ``-lr sign(mean_i g_i)`` and nothing is kept
    (``Blocks.of(())`` raised IndexError before). Its wire bytes are counted as sent."""
    tx = jc.demo(LR, "data")
    m = mesh()
    params = jax.device_put({"t": np.float32(1.0), "w": np.ones((4, 8), np.float32)},
                            NamedSharding(m, P()))  # fmt: skip
    state = jc.sharded_init(tx, params, m, "data")
    specs = jc.state_specs(state, "data")

    def step(g, s, p):
        return tx.update(jax.tree.map(lambda a: a[0], g), s, p)

    fn = per_device(step, (P("data"), specs, P()), (P(), specs), m)
    g = {"t": np.arange(N, dtype=np.float32) - 5.0, "w": np.ones((N, 4, 8), np.float32)}
    u, after = fn(shard(g), state, params)
    assert np.shape(u["t"]) == () and u["t"].dtype == np.float32
    assert float(u["t"]) == -LR * np.sign(g["t"].mean())  # mean -1.5: +lr
    assert not np.asarray(after[0].momentum["t"]).any()
    np.testing.assert_allclose(np.asarray(demo_lib.Blocks.of((), 64).forward(jnp.float32(3))), [3])
    one = demo_lib.wire_bytes({"t": params["t"]}, N)
    assert one == demo_lib.wire_bytes({"t": np.zeros((1,), np.float32)}, N) > 0
