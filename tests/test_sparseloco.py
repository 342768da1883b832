"""SparseLoCo and its chunked top-k codec: packed bits, per-chunk selection, decayed error
feedback, Templar's mean over senders, bytes. The contract items (conservation with
``ef_decay=1``, poison and freeze, specs, orbax, bytes of the compiled step) are the
``sparseloco-ef1`` row of tests/test_contract_replicas.py; the registry rows
``chunked_topk_*`` run the codec suite (tests/test_codecs.py)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import N, per_device, shard
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp._src import sparse_exchange
from jaxcomp._src.codecs.chunked import pack_stream, unpack_stream
from jaxcomp._src.sparseloco import density_codec, sparse_feedback


def test_index_and_value_bits_are_packed_end_to_end():
    # 12-bit indices straddle word boundaries: 8 of them fill exactly 3 words.
    codes = np.random.default_rng(0).integers(0, 4096, 101).astype(np.uint32)
    words = pack_stream(jnp.asarray(codes), 12)
    assert words.dtype == jnp.uint32 and words.shape == (38,)  # ceil(101 * 12 / 32)
    np.testing.assert_array_equal(unpack_stream(words, 12, 101), codes)
    # Templar's setting: 64 of 4096 per chunk, 12-bit indices, 2-bit values, one f32 scale.
    codec = jc.chunked_top_k(64, chunk=4096, bits=2)
    assert codec.index_bits(4096) == 12
    assert codec.payload_bytes(4096) == 64 * 12 // 8 + 64 * 2 // 8 + 4 == 116
    assert codec.payload_bytes(3 * 4096 + 5) == 4 * (4 * 64 * 12 // 32 + 4 * 64 * 2 // 32 + 4)
    assert jc.chunked_top_k(64, 4096, None).payload_bytes(4096) == 64 * 12 // 8 + 4 * 64


def test_top_k_in_every_chunk_and_two_bit_levels():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    exact = np.asarray(jc.chunked_top_k(5, chunk=256, bits=None).roundtrip(jnp.asarray(x)))
    for j in range(4):  # 3 full chunks and a padded one of 232 values
        part, got = x[256 * j : 256 * (j + 1)], exact[256 * j : 256 * (j + 1)]
        keep = np.argsort(-np.abs(part))[:5]
        want = np.zeros_like(part)
        want[keep] = part[keep]
        np.testing.assert_array_equal(got, want)
    two = np.asarray(jc.chunked_top_k(5, chunk=256, bits=2).roundtrip(jnp.asarray(x)))
    np.testing.assert_array_equal(two != 0, exact != 0)
    for j in range(4):
        s = np.abs(exact[256 * j : 256 * (j + 1)]).max()
        levels = np.array([-s, -s / 3, s / 3, s], np.float32)
        sent = two[256 * j : 256 * (j + 1)][exact[256 * j : 256 * (j + 1)] != 0]
        assert np.abs(sent[:, None] - levels[None]).min(1).max() < 1e-6 * s
        # each kept value is rounded to its nearest level: at most s / 3 away
        orig = exact[256 * j : 256 * (j + 1)][exact[256 * j : 256 * (j + 1)] != 0]
        assert np.abs(sent - orig).max() <= s / 3 + 1e-6


def test_one_bit_values_at_the_mean_magnitude():
    """``scale="mean"``: each kept value is sent as ``mean |v| sign(v)`` over its chunk's kept
    values (the least-squares scale of a sign), where ``"max"`` sends it at ``max |v|``; the
    same coordinates and bytes; a zero vector stays zero, a NaN flags its chunk."""
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    exact = np.asarray(jc.chunked_top_k(5, chunk=256, bits=None).roundtrip(jnp.asarray(x)))
    mean = jc.chunked_top_k(5, chunk=256, bits=1, scale="mean")
    peak = jc.chunked_top_k(5, chunk=256, bits=1)
    assert mean.payload_bytes(1000) == peak.payload_bytes(1000)
    got = np.asarray(mean.roundtrip(jnp.asarray(x)))
    np.testing.assert_array_equal(got != 0, exact != 0)
    for j in range(4):
        kept = exact[256 * j : 256 * (j + 1)][exact[256 * j : 256 * (j + 1)] != 0]
        sent = got[256 * j : 256 * (j + 1)][exact[256 * j : 256 * (j + 1)] != 0]
        np.testing.assert_allclose(sent, np.abs(kept).mean() * np.sign(kept), rtol=1e-6)
        # least squares: no other scale of the signs is closer to the kept values
        over = np.asarray(peak.roundtrip(jnp.asarray(x)))[256 * j : 256 * (j + 1)]
        np.testing.assert_allclose(np.abs(over[over != 0]), np.abs(kept).max(), rtol=1e-6)
        assert np.sum((sent - kept) ** 2) < np.sum((over[over != 0] - kept) ** 2)
    assert not np.any(np.asarray(mean.roundtrip(jnp.zeros(1000))))
    bad = x.copy()
    bad[300] = np.nan
    assert np.isnan(np.asarray(mean.encode(jnp.asarray(bad))[2])[1])


def test_one_bit_mean_scale_is_taken_over_the_real_values_only():
    """``scale="mean"`` on a last chunk of fewer than ``k`` values (its zero padding fills the
    other kept slots, which decode drops): each of its values is sent at their mean
    magnitude, not shrunk by the padding (20 of 47 kept slots: 0.43x before)."""
    x = np.random.default_rng(4).standard_normal(1024 + 20).astype(np.float32)
    got = np.asarray(jc.chunked_top_k(47, chunk=1024, bits=1, scale="mean").roundtrip(x))
    tail = x[1024:]
    np.testing.assert_allclose(got[1024:], np.abs(tail).mean() * np.sign(tail), rtol=1e-6)


#: Every value coding of the codec: float32, and ``bits`` bits at the largest kept magnitude
#: (1 bit at the mean too).
VALUE_CODINGS = [(None, "max"), (1, "max"), (1, "mean"), (2, "max"), (3, "max"), (8, "max")]


def sparse_vector() -> np.ndarray:
    """276 values in chunks of 64 (5 kept each): chunk 0 holds 3 nonzeros (and a -0.0), chunk
    1 none, chunk 2 sixteen, chunk 3 one, the short last chunk (20 values) two."""
    x = np.zeros(4 * 64 + 20, np.float32)
    x[[1, 7, 40]] = [0.5, -2.0, 1.25]
    x[5] = -0.0
    x[128:144] = np.random.default_rng(5).standard_normal(16)
    x[200] = -3.0
    x[[260, 275]] = [0.75, 4.0]
    return x


@pytest.mark.parametrize("bits, scale", VALUE_CODINGS)
def test_exact_zeros_are_never_sent_as_values(bits, scale):
    """A chunk with fewer than ``k`` nonzero values keeps zeros among its top ``k``: each
    repeats its chunk's first index on the wire, and decode drops it. Before, each decoded to
    a quantization level (``-s`` with 1 bit at the max, ``s/3`` with 2 bits, ``s/255`` with
    8): 9 nonzeros where ``x`` is 0 here (2 + 4 + 3 kept zeros). The bytes are unchanged (the
    formula of :func:`jaxcomp.chunked_top_k`)."""
    codec = jc.chunked_top_k(5, chunk=64, bits=bits, scale=scale)
    x = sparse_vector()
    d, payload = x.shape[0], codec.encode(jnp.asarray(x))
    got = np.asarray(codec.decode(payload, d))
    assert np.all(got[x == 0] == 0)  # nothing where nothing was
    small = np.ones(d, bool)
    small[128:192] = False  # every chunk but chunk 2 has at most 5 nonzeros: all of them sent
    np.testing.assert_array_equal(got[small] != 0, x[small] != 0)
    exact = np.asarray(jc.chunked_top_k(5, chunk=64, bits=None).roundtrip(jnp.asarray(x)))
    np.testing.assert_array_equal(got != 0, exact != 0)
    if bits is not None:  # the one value of chunk 3 arrives at its own magnitude
        assert got[200] == -3.0
    slots, index_bits = 5 * 5, 6
    values = 4 * slots if bits is None else 4 * math.ceil(slots * bits / 32) + 4 * 5
    want = 4 * math.ceil(slots * index_bits / 32) + values
    assert codec.payload_bytes(d) == want
    assert sum(a.nbytes for a in jax.tree.leaves(payload)) == want
    assert not np.any(np.asarray(codec.roundtrip(jnp.zeros(d))))  # a zero vector stays zero
    bad = x.copy()
    bad[3] = np.nan  # chunk 0 (3 nonzeros, 2 kept zeros): still flagged, never hidden
    flagged = np.asarray(codec.roundtrip(jnp.asarray(bad)))
    assert np.isnan(flagged[3]) and not np.any(np.isnan(flagged[64:]))


CODEC = jc.chunked_top_k(2, chunk=64, bits=None)


@functools.cache
def feedback_step(averaging: str):
    """One jitted exchange of SparseLoCo's feedback over 8 devices: (out, memory)."""
    tx = sparse_feedback(CODEC, "data", ef_decay=0.5, min_size=64, averaging=averaging)

    def step(d, e):
        out, state = tx.update([d[0][0], d[1][0]], jc.SparseFeedbackState([e[0], None]))
        return [o[None] for o in out], state.memory[0]

    return per_device(step, (P("data"), P("data")), (P(), P("data")))


def test_decayed_error_feedback_and_mean_of_senders():
    """Device i sends spikes of height i + 1 at coordinates 2i, 2i + 1 of a 128-vector (its
    two largest in chunk 0) and coordinate 127 (shared); a small leaf goes through pmean."""
    d = np.zeros((N, 128), np.float32)
    for i in range(N):
        d[i, 2 * i : 2 * i + 2] = i + 1
        d[i, 100] = 10.0 + i  # chunk 1: the largest, every device
        d[i, 127] = 5.0  # chunk 1: the second largest, every device
        d[i, 64] = 0.25  # never sent: stays in memory
    small = np.random.default_rng(2).standard_normal((N, 10)).astype(np.float32)
    memory = np.full((N, 1, 128), 2.0, np.float32)
    memory[:, 0, 64:] = 0.0
    memory[:, 0, 50:64] = 0.0
    outs = {}
    for averaging in ("all", "senders"):
        out, mem = feedback_step(averaging)(shard([d, small]), shard(memory))
        outs[averaging] = [np.asarray(o)[0] for o in out]
        # e <- 0.5 e + D; sent = C(e); e <- e - sent (identical for both averagings)
        target = 0.5 * memory[:, 0] + d
        sent = np.stack([np.asarray(CODEC.roundtrip(jnp.asarray(t))) for t in target])
        np.testing.assert_allclose(np.asarray(mem), target - sent, atol=1e-6)
        np.testing.assert_allclose(outs[averaging][1], small.mean(0), rtol=1e-6)
    all_, senders = outs["all"][0], outs["senders"][0]
    np.testing.assert_allclose(all_[100], np.mean(10.0 + np.arange(N)), rtol=1e-6)
    np.testing.assert_allclose(senders[100], np.mean(10.0 + np.arange(N)), rtol=1e-6)
    np.testing.assert_allclose(all_[127], 5.0, rtol=1e-6)
    # Coordinates 0..15: device 0..7's own spikes, 1 + 0.5 * 2 = 2 for device 0 ... sent by
    # one device each: the mean over all divides by 8, the mean over senders does not.
    target = 0.5 * memory[:, 0] + d
    for i in range(N):
        own = target[i, 2 * i]
        np.testing.assert_allclose(senders[2 * i], own, rtol=1e-6)
        np.testing.assert_allclose(all_[2 * i], own / N, rtol=1e-6)
    assert all_[64] == 0.0 and senders[64] == 0.0


def test_sync_bytes_at_templar_density_and_h30():
    """At the defaults a 64 x 64 chunk costs 116 bytes; all-gathered over 8 devices at H = 30
    against a per-step f32 pmean (ring model) the saving is 30 * 16384 * 2 (n-1)/n / ((n-1)
    116) = 1059x for the compressed leaves."""
    codec = jc.chunked_top_k(64, 4096, 2)
    d = 4096 * 256
    pmean = 2 * (N - 1) / N * 4 * d
    sync = (N - 1) * codec.payload_bytes(d)
    assert 30 * pmean / sync == np.float64(30 * 16384 * 2 / N / 116)
    assert 1058 < 30 * pmean / sync < 1060


def test_encode_keeps_the_top_k_of_xla_cpu():
    """The kept zeros' mark reads slot 0's index without slicing ``lax.top_k``'s indices: a
    slice made XLA:CPU sort every chunk in full instead of its TopK (1145 ms against 69 ms
    for 8 vectors of 470,784 values, load 8). The compiled encode holds no sort."""
    codec = jc.chunked_top_k(64, chunk=4096, bits=2)
    hlo = jax.jit(codec.encode).lower(jnp.zeros(3 * 4096, jnp.float32)).compile().as_text()
    if jax.default_backend() == "cpu":
        assert " sort(" not in hlo


@functools.cache
def spike_step(bits: int | None, averaging: str):
    """One jitted exchange of SparseLoCo's feedback over 8 devices of a 512-vector through
    top-4 of every 64 values: (mean, memory)."""
    codec = jc.chunked_top_k(4, chunk=64, bits=bits)
    tx = sparse_feedback(codec, "data", ef_decay=0.5, min_size=0, averaging=averaging)

    def step(d, e):
        out, state = tx.update([d[0]], jc.SparseFeedbackState([e[0]]))
        return out[0][None], state.memory[0]

    return per_device(step, (P("data"), P("data")), (P(), P("data")))


@pytest.mark.parametrize("bits, averaging", [(None, "senders"), (2, "senders"), (1, "all")])
def test_kept_zeros_neither_count_as_senders_nor_enter_the_memory(bits, averaging):
    """Device i sends one spike, ``i + 1`` at coordinate ``64 i + 3`` (its chunk's only nonzero
    value; the three other kept slots hold zeros, the other chunks nothing). The mean over
    senders is each spike itself (before: divided by the devices whose kept zeros landed on
    it, and 2-bit zeros sent as ``s/3``); the memory stays zero (before: minus the zeros'
    levels). The compiled step sends what ``sparse_exchange.wire_bytes`` says. A NaN still
    makes every output NaN and leaves every memory as it was."""
    d = np.zeros((N, 512), np.float32)
    for i in range(N):
        d[i, 64 * i + 3] = i + 1
    step = spike_step(bits, averaging)
    args = (shard(d), shard(np.zeros((N, 1, 512), np.float32)))
    out, memory = step(*args)
    want = d.sum(0) / (N if averaging == "all" else 1)
    np.testing.assert_array_equal(np.asarray(out)[0], want)
    np.testing.assert_array_equal(np.asarray(memory), 0.0)
    codec = jc.chunked_top_k(4, chunk=64, bits=bits)
    report = jc.comm_report(step.fn, *args)
    assert report.bytes_per_device == sparse_exchange.wire_bytes([512], [codec], N)
    d[0, 100] = np.nan  # a chunk of one NaN and three kept zeros: flagged, memory kept
    memory = np.full((N, 1, 512), 0.25, np.float32)
    out, after = step(shard(d), shard(memory))
    assert np.all(np.isnan(np.asarray(out)))
    np.testing.assert_array_equal(np.asarray(after), memory[:, 0])


@functools.cache
def small_codec_step():
    """One jitted exchange over 8 devices with the small leaf (10 values) through 1-bit
    signs at the mean magnitude: (out, memory of the large leaf, memory of the small one)."""
    tx = sparse_feedback(
        CODEC, "data", ef_decay=0.5, min_size=64, averaging="senders", small_codec=jc.sign()
    )

    def step(d, e):  # e[j]: this device's block (1, 1, s); its memory slot is (1, s)
        out, state = tx.update([d[0][0], d[1][0]], jc.SparseFeedbackState([e[0][0], e[1][0]]))
        return [o[None] for o in out], state.memory[0][None], state.memory[1][None]

    return per_device(step, (P("data"), P("data")), (P(), P("data"), P("data")))


def test_small_leaves_through_a_dense_codec_keep_decayed_memory():
    """``small_codec=jc.sign()``: the small leaf gets a memory, sends C(0.5 e + D) (every
    sign at the mean magnitude: 8 bytes for 10 values), averaged over all devices; a zero
    step stays zero; a NaN on one device poisons every output and keeps every memory."""
    rng = np.random.default_rng(3)
    d = rng.standard_normal((N, 128)).astype(np.float32)
    small = rng.standard_normal((N, 10)).astype(np.float32)
    memory = [rng.standard_normal((N, 1, s)).astype(np.float32) for s in (128, 10)]
    out, _, mem_small = small_codec_step()(shard([d, small]), shard(memory))
    target = 0.5 * memory[1][:, 0] + small
    sent = np.stack([np.abs(t).mean() * np.where(t >= 0, 1.0, -1.0) for t in target])
    np.testing.assert_allclose(np.asarray(out[1]).reshape(-1), sent.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mem_small), (target - sent)[:, None], atol=1e-6)
    assert jc.sign().payload_bytes(10) == 8
    # A zero step with an empty memory: zero out, zero memory, no NaN.
    zeros = [np.zeros_like(d), np.zeros_like(small)]
    out, m_big, m_small = small_codec_step()(
        shard(zeros), shard([np.zeros_like(m) for m in memory])
    )
    for a in (*out, m_big, m_small):
        assert np.all(np.asarray(a) == 0.0)
    # A NaN in one device's small leaf: every output NaN, both memories as they were.
    bad = small.copy()
    bad[3, 4] = np.nan
    out, m_big, m_small = small_codec_step()(shard([d, bad]), shard(memory))
    assert np.all(np.isnan(np.asarray(out[0]))) and np.all(np.isnan(np.asarray(out[1])))
    np.testing.assert_array_equal(np.asarray(m_big), memory[0])
    np.testing.assert_array_equal(np.asarray(m_small), memory[1])


def test_clip_bounds_a_small_leaf_by_what_its_own_codec_sends():
    """``clip=True`` with ``small_codec``: each device's small leaf is scaled by the norm of
    what the small codec sends (every sign of ``e + D`` at their mean magnitude), so
    ``|sent_i| = |D_i|``. Scaled by the chunked top-k's norm instead (one value of the 10),
    the signs went out longer than ``D_i`` (4.43 here, ``|D_i| = 2``)."""
    tx = sparse_feedback(
        CODEC, "data", ef_decay=1.0, min_size=64, averaging="all", clip=True, small_codec=jc.sign()
    )

    def step(d, e):  # e: this device's block (1, 1, 10); its memory slot is (1, 10)
        out, state = tx.update([d[0]], jc.SparseFeedbackState([e[0]]))
        return out[0][None], state.memory[0][None]

    rng = np.random.default_rng(6)
    e = (4.0 * np.where(rng.standard_normal((N, 1, 10)) < 0, -1.0, 1.0)).astype(np.float32)
    d = np.zeros((N, 10), np.float32)
    d[:, 0] = 2.0 * np.sign(e[:, 0, 0])  # |D_i| = 2, along e's first value
    fn = per_device(step, (P("data"), P("data")), (P(), P("data")))
    out, memory = fn(shard(d), shard(e))
    sent = (e[:, 0] + d) - np.asarray(memory)[:, 0]
    np.testing.assert_allclose(np.linalg.norm(sent, axis=1), 2.0, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out).reshape(-1), sent.mean(0), rtol=1e-5, atol=1e-6)


def test_kept_zeros_stay_zero_through_pmean_and_its_two_phase_owners():
    """``jc.pmean`` through the chunked top-k, all-gather and two-phase (each chunk's owner
    decodes the devices' rows into their sum and re-encodes it, which keeps zeros again):
    device i's one spike at ``128 i + 3``, every other kept slot a zero, arrives as ``(i +
    1) / 8`` and nothing arrives anywhere else."""
    d = np.zeros((N, 1024), np.float32)
    for i in range(N):
        d[i, 128 * i + 3] = i + 1
    codec = jc.chunked_top_k(4, chunk=64, bits=2)
    for strategy in ("allgather", "two_phase"):
        f = per_device(
            lambda v, s=strategy: jc.pmean(v[0], "data", codec, strategy=s)[None], P("data"), P()
        )
        np.testing.assert_array_equal(np.asarray(f(shard(d)))[0], d.mean(0), err_msg=strategy)


def sub_chunk_reference(x: np.ndarray, k_s: int, sub: int, group: int) -> np.ndarray:
    """The top ``k_s`` of every ``sub`` values of ``x`` in one bit at the mean magnitude of
    the kept values of its ``group`` sub-chunks (one scale per chunk), in NumPy."""
    rows = -(-x.size // sub)
    blocks = np.pad(x, (0, rows * sub - x.size)).reshape(rows, sub)
    kept = np.zeros_like(blocks)
    for r in range(rows):
        top = np.argsort(-np.abs(blocks[r]), kind="stable")[:k_s]
        kept[r, top] = blocks[r, top]
    for g in range(0, rows, group):
        part = kept[g : g + group]
        part[:] = np.abs(part[part != 0]).mean() * np.sign(part)
    return kept.reshape(-1)[: x.size]


def test_sub_chunks_keep_their_own_top_k_under_the_chunks_scale():
    """``sub_chunk=64`` in chunks of 256, ``k=8``: the top 2 of every 64 values (not the top
    8 of the 256), indices in 6 bits instead of 8, one 1-bit scale per 256 values (the mean
    magnitude of the chunk's 8 kept values); bytes to the word, the arrays as counted; a last
    chunk of one short sub-chunk and a leaf shorter than a sub-chunk."""
    x = np.random.default_rng(7).standard_normal(300).astype(np.float32)
    codec = jc.chunked_top_k(8, chunk=256, bits=1, scale="mean", sub_chunk=64)
    whole = jc.chunked_top_k(8, chunk=256, bits=1, scale="mean")
    assert codec.layout(300) == (64, 2, 5) and codec.scales(300) == 2
    assert codec.index_bits(300) == 6 and whole.index_bits(300) == 8
    # 5 sub-chunks x 2 kept: 10 indices of 6 bits (2 words), 10 signs (1 word), 2 scales;
    # the whole-chunk top-8 keeps 8 in each chunk (the last one padded): 16 in 8 bits.
    assert codec.payload_bytes(300) == 4 * 2 + 4 * 1 + 4 * 2 == 20
    assert whole.payload_bytes(300) == 4 * 4 + 4 * 1 + 4 * 2 == 28
    payload = codec.encode(jnp.asarray(x))
    assert sum(4 * p.size for p in payload) == 20
    got = np.asarray(codec.decode(payload, 300))
    np.testing.assert_allclose(got, sub_chunk_reference(x, 2, 64, 4), rtol=1e-6)
    assert all(np.count_nonzero(got[i : i + 64]) == 2 for i in range(0, 256, 64))
    short = x[:40]  # one sub-chunk of 40 values: ceil(2 * 40 / 64) = 2 kept, 6-bit indices
    assert codec.layout(40) == (40, 2, 1) and codec.payload_bytes(40) == 4 + 4 + 4
    np.testing.assert_allclose(
        np.asarray(codec.roundtrip(jnp.asarray(short))), sub_chunk_reference(short, 2, 64, 4)
    )
    bad = x.copy()
    bad[270] = np.inf  # the last chunk's scale flags it; the first chunk's stays finite
    scale = np.asarray(codec.encode(jnp.asarray(bad))[2])
    assert np.isfinite(scale[0]) and np.isnan(scale[1])
    assert not np.any(np.asarray(codec.roundtrip(jnp.zeros(300))))


def test_sub_chunks_without_value_bits_and_at_two_bits():
    """Float32 values: exactly each sub-chunk's top ``k_s`` (no scale on the wire); 2 bits:
    the levels of the largest kept magnitude of the whole chunk."""
    x = np.random.default_rng(8).standard_normal(512).astype(np.float32)
    exact = jc.chunked_top_k(8, chunk=256, bits=None, sub_chunk=32)
    got = np.asarray(exact.roundtrip(jnp.asarray(x)))
    for i in range(0, 512, 32):
        part = x[i : i + 32]
        want = np.where(np.abs(part) >= np.sort(np.abs(part))[-1], part, 0.0)
        np.testing.assert_array_equal(got[i : i + 32], want)  # k_s = 8 / 8 = 1
    assert exact.payload_bytes(512) == 4 * 3 + 4 * 16  # 16 indices of 5 bits, 16 float32
    two = np.asarray(jc.chunked_top_k(8, chunk=256, bits=2, sub_chunk=32).roundtrip(x))
    np.testing.assert_array_equal(two != 0, got != 0)
    for c in (0, 256):
        s = np.abs(got[c : c + 256]).max()
        sent = np.abs(two[c : c + 256][two[c : c + 256] != 0]) / s
        assert np.abs(sent[:, None] - np.array([1 / 3, 1.0])).min(1).max() < 1e-6


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(k=8, chunk=256, sub_chunk=48), "`sub_chunk` must divide `chunk`=256"),
        (dict(k=6, chunk=256, sub_chunk=64), "`k`=6 must be a multiple of"),
        (dict(k=8, chunk=256, sub_chunk=512), "`sub_chunk` must be in [1, 256]"),
    ],
)
def test_sub_chunk_out_of_rule_is_named(kw, name):
    with pytest.raises(ValueError) as err:
        jc.chunked_top_k(**kw)
    assert name in str(err.value)
    with pytest.raises(TypeError, match="`sub_chunk` must be an int"):
        jc.chunked_top_k(8, 256, sub_chunk=64.0)


def test_sparseloco_sub_chunk_keeps_ceil_density_per_sub_chunk_and_is_refused_with_a_mask():
    """``jc.sparseloco(density=d, chunk=c, sub_chunk=s)``: ``ceil(d s)`` per sub-chunk (8 of
    128 at 64 / 1024); with a shared mask ``sub_chunk`` is refused, naming it."""
    jc.sparseloco(optax.sgd(0.1), "data", 30, density=64 / 1024, chunk=1024, sub_chunk=128)
    made = density_codec(64 / 1024, 1024, 1, "mean", 128)
    assert (made.k, made.sub_chunk, made.layout(4096)) == (64, 128, (128, 8, 32))
    assert density_codec(60 / 1024, 1024, 1, "mean", 128).k == 64  # ceil(7.5) = 8 per 128
    with pytest.raises(ValueError, match="`sub_chunk` applies to `mask`='topk'"):
        jc.sparseloco(optax.sgd(0.1), "data", 30, mask="random", sub_chunk=128)
    with pytest.raises(ValueError, match="`sub_chunk` must divide `chunk`=1024"):
        jc.sparseloco(optax.sgd(0.1), "data", 30, chunk=1024, sub_chunk=100)


@functools.cache
def sub_chunk_step():
    """One exchange of SparseLoCo's feedback over 8 devices of a 512-vector, top 2 of every
    64 values under one 1-bit mean scale per 256, Templar's mean over senders."""
    codec = jc.chunked_top_k(8, chunk=256, bits=1, scale="mean", sub_chunk=64)
    tx = sparse_feedback(codec, "data", ef_decay=0.5, min_size=0, averaging="senders")

    def step(d, e):
        out, state = tx.update([d[0]], jc.SparseFeedbackState([e[0]]))
        return out[0][None], state.memory[0]

    return codec, per_device(step, (P("data"), P("data")), (P(), P("data")))


def test_sub_chunk_exchange_keeps_what_it_did_not_send():
    """Through the all-gather: each device's memory is ``e - C(e)`` with ``C`` the sub-chunk
    codec, and the mean over senders of every coordinate is the mean of the values sent."""
    d = np.random.default_rng(9).standard_normal((N, 512)).astype(np.float32)
    memory = np.random.default_rng(10).standard_normal((N, 1, 512)).astype(np.float32)
    codec, step = sub_chunk_step()
    out, mem = step(shard(d), shard(memory))
    target = 0.5 * memory[:, 0] + d
    sent = np.stack([sub_chunk_reference(t, 2, 64, 4) for t in target])
    np.testing.assert_allclose(np.asarray(mem), target - sent, atol=1e-5)
    count = np.maximum((sent != 0).sum(0), 1)
    np.testing.assert_allclose(np.asarray(out)[0], sent.sum(0) / count, rtol=1e-5, atol=1e-6)
    assert codec.payload_bytes(512) == 4 * 3 + 4 * 1 + 4 * 2
