"""Sparsifying codecs: send a few coordinates (values and int32 indices), drop the rest.

``top_k`` (largest magnitudes), ``random_k`` (indices from a key shared by all devices) and
``threshold`` (Strom: everything above ``tau``, up to a fixed capacity). Every payload has
a static shape: ``k`` int32 indices and ``k`` values, where

    k = max(1, ceil(ratio * d))   for d > 0,     k = 0 for d == 0.

The values can be sent as float32 (``values=None``), 16-bit floats (``"fp16"``, ``"bf16"``),
int8 with one float32 scale (``"int8"``), or bit-packed signs with one float32 mean magnitude
(``"sign"``: sparse ternary compression, Sattler et al. 2019). Exact payload bytes::

    4k (indices) + { 4k | 2k | k + 4 | 4 * ceil(k / 32) + 4 }    (None | fp16/bf16 | int8 | sign)

Decoding is a scatter-add into zeros. Slots a codec cannot fill (``threshold`` when fewer
than ``capacity`` values pass, ``top_k(approx="sample")`` when fewer than ``k`` reach the
sampled threshold) carry the out-of-range index ``d`` and are dropped by the scatter, so
they decode to nothing whatever the value mode. :meth:`SparseCodec.decode_sum` scatter-adds
the payloads of all devices into one dense buffer, so the all-gather strategy costs one
``f32[d]`` buffer, not one per device.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import (
    F32_MAX,
    Codec,
    after,
    check_int,
    check_positive_float,
    check_vector,
    max_abs,
    require_key,
    safe_divide,
    scaled,
)

VALUE_MODES = (None, "fp16", "bf16", "int8", "sign")
_FLOAT16 = {"fp16": jnp.float16, "bf16": jnp.bfloat16}

#: Top-k selection methods (``top_k(approx=...)``); see :class:`TopK`.
APPROX_METHODS = ("exact", "blocked", "sample", "approx_max_k", "auto")
#: What ``approx=True`` means below :data:`APPROX_SAMPLE_FROM`: the fastest method measured
#: there on XLA:CPU and on an H100 (``benchmarks/topk_speed.py``; measured:
#: docs/choosing-a-codec.md, docs/speed.md).
APPROX_DEFAULT = "blocked"
#: From this ratio on ``approx=True`` means ``"auto"``: the sampled threshold on CPU, blocked
#: elsewhere. On XLA:CPU the blocked selection's second stage grows as ``k * sqrt(d / k)``
#: and the sampled threshold's cost hardly moves with ``k``, so the two cross between 0.3%
#: and 1%; on an H100 blocked stays the faster at every ratio (measured:
#: docs/choosing-a-codec.md, docs/speed.md).
APPROX_SAMPLE_FROM = 0.006
#: Where ``approx="auto"`` uses the sampled threshold (``jax.lax.platform_dependent``).
SAMPLE_PLATFORMS = ("cpu",)

#: The approximate (two-stage) selection is used when ``d`` is at least this large.
APPROX_MIN_SIZE = 1 << 14


def count_for(ratio: float, d: int) -> int:
    """``k = max(1, ceil(ratio * d))`` for ``d > 0`` (``0`` for ``d == 0``), at most ``d``."""
    if d <= 0:
        return 0
    # The 1e-9 slack keeps float noise (0.07 * 100 = 7.000000000000001) from adding one.
    return min(d, max(1, math.ceil(ratio * d - 1e-9)))


def check_values(values):
    if values not in VALUE_MODES:
        raise ValueError(f"`values` must be one of {VALUE_MODES}, got {values!r}")
    return values


def check_approx(approx, ratio: float = 0.0) -> str:
    """``approx`` as a selection method name: False -> ``"exact"``, True -> the fastest
    measured for ``ratio`` (:data:`APPROX_DEFAULT`, or ``"auto"`` from
    :data:`APPROX_SAMPLE_FROM` on)."""
    if approx is False:
        return "exact"
    if approx is True:
        return "auto" if ratio >= APPROX_SAMPLE_FROM else APPROX_DEFAULT
    if isinstance(approx, str) and approx in APPROX_METHODS:
        return approx
    if not isinstance(approx, str):
        raise TypeError(f"`approx` must be a bool or one of {APPROX_METHODS}, got {approx!r}")
    raise ValueError(f"`approx` must be a bool or one of {APPROX_METHODS}, got {approx!r}")


def check_ratio(ratio) -> float:
    return check_positive_float("ratio", ratio, upper=1.0)


# --------------------------------------------------------------------------- value coding


def _encode_values(v: jax.Array, valid: jax.Array | None, mode) -> tuple:
    """Encode ``k`` selected float32 values (0 in invalid slots) as the value part of a payload."""
    if mode is None:
        return (v,)
    if mode in _FLOAT16:
        dtype = _FLOAT16[mode]
        big = float(ml_dtypes.finfo(dtype).max)
        return (jnp.where(jnp.isfinite(v), jnp.clip(v, -big, big), v).astype(dtype),)
    if mode == "int8":
        # max_abs, not jnp.max: XLA:CPU's float max over 4,096 values or more can drop a NaN.
        scale = max_abs(v[None, :])[0] / 127.0
        q = jnp.clip(jnp.nan_to_num(jnp.round(safe_divide(v, scale))), -127, 127)
        return q.astype(jnp.int8), scale
    # "sign": one mean magnitude over the filled slots, signs packed 32 to a word.
    filled = v.shape[0] if valid is None else jnp.sum(valid)
    count = jnp.maximum(filled, 1).astype(jnp.float32)
    scale = jnp.sum(jnp.abs(v) / count)
    return packing.pack((v < 0).astype(jnp.uint32), 1), scale


def _decode_values(parts: tuple, k: int, mode) -> jax.Array:
    """Inverse of :func:`_encode_values`: ``float32[k]``."""
    if mode is None or mode in _FLOAT16:
        return parts[0].astype(jnp.float32)
    if mode == "int8":
        q, scale = parts
        return q.astype(jnp.float32) * scale
    words, scale = parts
    negative = packing.unpack(words, 1, k)
    return jnp.where(negative == 1, -scale, scale)


def _value_bytes(k: int, mode) -> int:
    if mode is None:
        return 4 * k
    if mode in _FLOAT16:
        return 2 * k
    if mode == "int8":
        return k + 4
    return 4 * packing.packed_words(k, 1) + 4


#: Scatter dimensions of a 1-D ``f32[d]`` scatter-add at ``int32[m, 1]`` indices.
_SCATTER_DIMS = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)


def _scatter(indices: jax.Array, values: jax.Array, d: int, fill=0.0) -> jax.Array:
    """Dense ``f32[d]``: ``fill`` everywhere, ``values`` added at ``indices``; index ``d`` (an
    unfilled slot) is dropped.

    ``jax.lax.scatter_add`` itself, not ``.at[].add``: indices here are never negative, and
    the negative-index wrap that ``.at[]`` adds made XLA write a fresh int32 copy of every
    index (at a 25% density, all-gathered over 8 devices: one copy of the params)."""
    # The zeros are made once the values are (not copied from a constant at the start). Made
    # once the all-gathered indices were, a 1% top-k all-gather step ran 10x slower on
    # XLA:CPU (25x at its default optimization level), the same temporaries for DGC.
    operand = jnp.full((d,), fill, jnp.float32)
    if jnp.ndim(fill) == 0 and indices.shape[0]:
        operand = after(operand, values[0])
    return jax.lax.scatter_add(
        operand,
        indices[:, None],
        values.astype(jnp.float32),
        _SCATTER_DIMS,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


# --------------------------------------------------------------------------- selection


def _block_size(d: int, k: int) -> int | None:
    """Block size of the two-stage selection, or None where plain ``lax.top_k`` is cheaper.

    The cost is about ``d/B`` (stage 1) plus ``k*B`` (stage 2) compared values, smallest at
    ``B = sqrt(d/k)`` (a power of two in [4, 256]).
    """
    if d < APPROX_MIN_SIZE or k == 0:
        return None
    b = 2 ** round(math.log2(math.sqrt(d / k)))
    b = min(max(b, 4), 256)
    if d // b < k or d // b + k * b > d // 2:
        return None
    return b


def two_stage_top_k(x: jax.Array, k: int, block_size: int) -> jax.Array:
    """Indices of the ``k`` largest ``|x_i|`` (``x`` 1-D), without sorting all of it.

    Stage 1: the maxima of blocks of ``block_size`` entries (one pass over the data), and the
    ``k`` blocks with the largest maxima. Every entry of the true top-k lies in one of those
    blocks: the blocks whose maximum is at least the k-th largest value ``v_k`` are at most
    ``k`` (their maxima are distinct entries ``>= v_k``), so the top-k blocks include them.
    Stage 2: ``lax.top_k`` over those ``k * block_size`` candidates (and the ``< block_size``
    entries of the last, partial block). The result is the same set as ``lax.top_k`` of the
    whole vector whenever ``v_k`` is unique; with ties at ``v_k`` another equally large
    entry may be picked.
    """
    d = x.shape[0]
    nb = d // block_size
    main = x[: nb * block_size].reshape(nb, block_size)
    # |.| is recomputed where it is used, so XLA never writes a |x| copy of the whole vector.
    # max_abs, not jnp.max: XLA:CPU's float max over 4,096 values or more can drop a NaN, and
    # a NaN's block then lost to the finite ones (exact top-k ranks a NaN first).
    _, blocks = jax.lax.top_k(max_abs(main), k)
    candidates = jnp.abs(main[blocks]).reshape(-1)
    tail = jnp.abs(x[nb * block_size :])
    _, pos = jax.lax.top_k(jnp.concatenate([candidates, tail]), k)
    in_block = pos < k * block_size
    block_pos = jnp.minimum(pos, k * block_size - 1)
    from_blocks = blocks[block_pos // block_size] * block_size + block_pos % block_size
    return jnp.where(in_block, from_blocks, nb * block_size + pos - k * block_size).astype(
        jnp.int32
    )


#: DGC's band for the number of values over a sampled threshold: ``[0.8 k, 1.3 k]`` (Lin et al.
#: re-adjust the threshold when the count falls outside it).
SAMPLE_BAND = (0.8, 1.3)
#: The sampled threshold aims at ``SAMPLE_TARGET * k`` values, inside the band and below
#: ``k``: then every value over it fits in the ``k`` slots and is one of the true top-k, and
#: the final ``top_k`` over the ``1.3 k`` candidates is skipped (at 1% of 25M floats on
#: XLA:CPU that sort cost as much as the rest of the selection). About 5% fewer than ``k``
#: values are sent; they wait in the error-feedback memory or DGC's accumulation.
SAMPLE_TARGET = 0.95
#: The sample holds at least this many expected members of the top-k (more than
#: ``sample_ratio * d`` when ``d`` or ``k`` is small): the count over its threshold then has a
#: relative standard deviation of about ``1 / sqrt(32) = 18%`` before re-adjustment.
SAMPLE_MIN_HITS = 32
#: ... and at most this many (fewer than ``sample_ratio * d`` when ``k`` is large): the count's
#: relative standard deviation is then ~4%, and ranking the sample (a sort on XLA:CPU) stays
#: cheap (a 1% sample of 25M floats would be 250k values to sort).
SAMPLE_MAX_HITS = 512
#: At most this many re-adjustments (each one more pass over the vector).
SAMPLE_ROUNDS = 4


def sample_size(d: int, k: int, sample_ratio: float) -> int | None:
    """Size ``m`` of DGC's random sample, or None where it would be half the vector or more, or
    where the capacity ``1.3 k`` covers the vector (the exact ``lax.top_k`` is then as cheap,
    and it is exact)."""
    if k == 0 or SAMPLE_BAND[1] * k >= d:
        return None
    m = min(math.ceil(sample_ratio * d), math.ceil(SAMPLE_MAX_HITS * d / k))
    m = max(m, math.ceil(SAMPLE_MIN_HITS * d / k))
    return m if 2 * m <= d else None


def _compaction_block(d: int, capacity: int) -> int:
    """Block size ``B`` of :func:`sampled_top_k`'s two compactions (:func:`first_true`, a
    cumsum, over the ``d / B`` block flags, then over the ``capacity * B`` candidates): smallest at
    ``B = sqrt(d / capacity)``, a power of 2 in [4, 256]."""
    b = 2 ** round(math.log2(math.sqrt(d / max(capacity, 1))))
    return int(min(max(b, 4), 256))


def first_true(mask: jax.Array, size: int, group: int = 8) -> jax.Array:
    """``jnp.nonzero(mask, size=size, fill_value=len(mask))[0]``: the positions of the first
    ``size`` true entries of the 1-D ``mask``, in order, ``len(mask)`` in unfilled slots.

    In groups of ``group`` entries: the running count of true entries per group
    (``ends``, a cumsum over ``len(mask) / group`` entries), then for the ``j``-th true entry
    a binary search of ``j`` in ``ends`` gives its group, and a count inside that one group
    its position. ``jnp.nonzero`` runs a cumsum over the whole mask and scatters every entry
    into a histogram; on XLA:CPU this is the faster of the two.
    """
    n = mask.shape[0]
    groups = -(-n // group)
    flags = jnp.pad(mask, (0, groups * group - n)).reshape(groups, group)
    # Column by column: a sum over axis 1 made XLA:CPU write the whole mask out as int32
    # first (as large as the float32 vector: at a 25% density the selection's peak).
    per_group = sum(flags[:, c].astype(jnp.int32) for c in range(group))
    ends = jnp.cumsum(per_group, dtype=jnp.int32)
    j = jnp.arange(size, dtype=jnp.int32)
    owner = jnp.searchsorted(ends, j + 1, side="left")  # the group of the (j+1)-th true entry
    found = owner < groups
    owner = jnp.minimum(owner, groups - 1)
    rank = j - (ends[owner] - per_group[owner])  # its rank among the true entries of the group
    # The first column whose running count passes `rank`, one column at a time: a
    # [size, group] cumsum here was the selection's largest temporary (at a 25% density,
    # 1.3 k * 8 int32, 2.6 times the vector).
    running = jnp.zeros((size,), jnp.int32)
    offset = jnp.zeros((size,), jnp.int32)
    for column in range(group):
        running = running + flags[owner, column].astype(jnp.int32)
        offset = offset + (running <= rank).astype(jnp.int32)
    return jnp.where(found, owner * group + offset, n)


def _total(counts: jax.Array, row: int = 1024) -> jax.Array:
    """``sum(counts)`` in two levels (rows of ``row``, then the row sums). Fused with the
    per-block counts that produce it, XLA:CPU made the one-level sum a scalar loop 7x slower
    than the counts themselves (25M floats, blocks of 8)."""
    whole = counts.shape[0] // row * row
    rows = jnp.sum(counts[:whole].reshape(-1, row), axis=1, dtype=counts.dtype)
    return jnp.sum(rows, dtype=counts.dtype) + jnp.sum(counts[whole:], dtype=counts.dtype)


def _row_counts(flags: jax.Array) -> jax.Array:
    """``jnp.sum(flags, axis=1)`` in int32 for a bool ``[r, b]`` (``b`` a power of 2), by
    halving the columns elementwise: fused with what produces ``flags``, where a reduce
    made XLA:CPU write them out whole as int32 first (as large as the float32 vector)."""
    b = flags.shape[1]
    if b & (b - 1):
        return jnp.sum(flags, axis=1, dtype=jnp.int32)
    x = flags.astype(jnp.int32)
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def _passes(magnitude: jax.Array, t: jax.Array) -> jax.Array:
    """``|x| >= t`` for the sampled threshold, written ``~(|x| < t)`` so that NaN passes
    (never hidden), and never true for an exact zero: a sample of zeros (a mostly-zero
    gradient, e.g. of an embedding) gives ``t = 0``, and every zero would pass and crowd the
    few non-zero entries out of the fixed capacity."""
    return ~(magnitude < t) & ((magnitude != 0) | (t > 0))


def sampled_top_k(
    x: jax.Array, k: int, key: jax.Array | None, sample_ratio: float
) -> tuple[jax.Array, jax.Array]:
    """DGC's selection (Lin et al., 2018): a threshold from a random sample, static shapes.

    1. Draw ``m = sample_ratio * d`` coordinates at random, clipped to ``[32 d / k,
       512 d / k]`` (32 to 512 expected top-k members; from ``key``, a fixed sample when
       ``key`` is None) and take the threshold ``t`` = the ``r = ceil(0.95 k m / d)``-th
       largest ``|x_j|`` of the sample: about ``0.95 k`` entries of ``x`` are expected to
       reach it, whatever the distribution (ranks, not moments).
    2. Count ``c = #{i : |x_i| >= t}`` (one pass, per block of ``B`` entries). While ``c``
       is outside DGC's band ``[0.8 k, 1.3 k]`` (at most 4 times, each a ``lax.cond``, so
       under ``vmap`` every round runs): move to rank ``r <- r * 0.95 k / c`` of the sample
       and count again (:data:`SAMPLE_TARGET`).
    3. Fixed capacity: the entries over ``t`` are gathered into ``C = ceil(1.3 k)``
       candidate slots — the first ``C`` blocks holding one are compacted with
       :func:`first_true` over the ``d / B`` block flags, then the entries over ``t``
       in them (a cumsum over ``C * B``, not over ``d``). When more than ``k`` pass, the
       ``k`` largest candidates are kept (as DGC does), else all of them.

    So whenever ``k <= c <= C`` the result is exactly the top-k; when ``c < k`` it is the
    ``c`` largest entries (all of them in the true top-k) and ``k - c`` unfilled slots. NaN
    passes every threshold (never hidden).

    Returns:
      ``(indices, filled)``: int32[k] and bool[k]; unfilled slots hold index ``d``.
    """
    d = x.shape[0]
    m = sample_size(d, k, sample_ratio)
    if m is None:
        return select_top_k(x, k, "exact"), jnp.ones((k,), bool)
    capacity = min(d, math.ceil(SAMPLE_BAND[1] * k))
    if key is None:
        key = jax.random.PRNGKey(0)
    rank0 = min(m, math.ceil(SAMPLE_TARGET * k * m / d))
    depth = min(m, 4 * rank0)
    # 32 random bits modulo d: uniform up to a relative error of d / 2^32.
    where = (jax.random.bits(key, (m,), jnp.uint32) % np.uint32(d)).astype(jnp.int32)
    ranked = jax.lax.top_k(jnp.abs(x[where]), depth)[0]  # ranked[r - 1]: r-th largest

    b = _compaction_block(d, capacity)
    nb = d // b
    main = x[: nb * b].reshape(nb, b)
    tail = x[nb * b :]

    def counts(rank):
        t = ranked[rank - 1]
        per_block = _row_counts(_passes(jnp.abs(main), t))
        total = _total(per_block) + jnp.sum(_passes(jnp.abs(tail), t), dtype=jnp.int32)
        return rank, per_block, total

    def readjust(state):
        rank, _, total = state
        step = jnp.round(rank * SAMPLE_TARGET * k / jnp.maximum(total, 1).astype(jnp.float32))
        return counts(jnp.clip(step, 1, depth).astype(jnp.int32))

    state = counts(jnp.int32(rank0))
    # The rank takes the count's type (varying per device under shard_map), or lax.cond below
    # rejects branches whose outputs differ in their manual axis types.
    state = (state[0] + jnp.zeros_like(state[2]), *state[1:])
    for _ in range(SAMPLE_ROUNDS):  # unrolled: lax.cond skips a round that is not needed
        total = state[2]
        outside = (total < SAMPLE_BAND[0] * k) | (total > SAMPLE_BAND[1] * k)
        state = jax.lax.cond(outside, readjust, lambda s: s, state)
    rank, per_block, total = state
    t = ranked[rank - 1]

    slots = min(nb, capacity)
    if slots == nb:  # every block is a candidate: compact over x itself, no copy of it
        return _first_over(x, t, capacity, k, total)
    blocks = first_true(per_block > 0, slots)
    cand = jnp.abs(main[jnp.minimum(blocks, nb - 1)])  # (slots, b)
    flat = jnp.concatenate([cand.reshape(-1), jnp.abs(tail)])
    keep = jnp.concatenate(
        [(_passes(cand, t) & (blocks < nb)[:, None]).reshape(-1), _passes(jnp.abs(tail), t)]
    )
    # Second compaction, over the slots * b candidates: the first `capacity` entries over t.
    pos = first_true(keep, capacity)
    filled = pos < flat.shape[0]
    pos = jnp.minimum(pos, flat.shape[0] - 1)

    def largest(pos, filled):  # more than k passed: the k largest of them
        _, best = jax.lax.top_k(jnp.where(filled, flat[pos], -1.0), k)
        return pos[best], filled[best]

    def all_of_them(pos, filled):  # at most k passed: they fill the first slots, in order
        return pos[:k], filled[:k]

    # The top_k over `capacity` slots costs as much as the rest at ratios of 1%: skip it when
    # every entry over t fits (always the case when the count lands in [0.8 k, k]).
    pos, filled = jax.lax.cond(total > k, largest, all_of_them, pos, filled)
    in_block = pos < slots * b
    block_pos = jnp.minimum(pos, slots * b - 1)
    from_blocks = blocks[block_pos // b] * b + block_pos % b
    indices = jnp.where(in_block, from_blocks, nb * b + pos - slots * b)
    return jnp.where(filled, indices, d).astype(jnp.int32), filled


def _first_over(x: jax.Array, t, capacity: int, k: int, total) -> tuple[jax.Array, jax.Array]:
    """:func:`sampled_top_k`'s step 3 where the candidate blocks would be all of ``x`` (dense
    ratios): the first ``capacity`` entries with ``|x_i| >= t``, in order, and of them the
    ``k`` largest when more than ``k`` pass. The same indices as compacting the blocks
    (the passing entries of the blocks that hold one, in order, are those of ``x``), without
    the gathered and ``|.|`` copies of the whole vector that the blocks cost."""
    d = x.shape[0]
    pos = first_true(_passes(jnp.abs(x), t), capacity)
    filled = pos < d
    pos = jnp.minimum(pos, d - 1)

    def largest(pos, filled):
        _, best = jax.lax.top_k(jnp.where(filled, jnp.abs(x[pos]), -1.0), k)
        return pos[best], filled[best]

    pos, filled = jax.lax.cond(total > k, largest, lambda p, f: (p[:k], f[:k]), pos, filled)
    return jnp.where(filled, pos, d).astype(jnp.int32), filled


def max_k_indices(x: jax.Array, k: int) -> jax.Array:
    """``jax.lax.approx_max_k`` of ``|x|`` (recall target 0.95): fast on TPU, exact elsewhere."""
    return jax.lax.approx_max_k(jnp.abs(x), k, recall_target=0.95)[1].astype(jnp.int32)


def select_top_k(x: jax.Array, k: int, method: str = "exact") -> jax.Array:
    """int32 indices of the ``k`` largest ``|x_i|``: ``"exact"``, ``"blocked"`` (the same set,
    faster for large vectors) or ``"approx_max_k"``. (``"sample"``: :func:`sampled_top_k`.)"""
    if k == 0:
        return jnp.zeros((0,), jnp.int32)
    if method == "approx_max_k":
        return max_k_indices(x, k)
    block = _block_size(x.shape[0], k) if method == "blocked" else None
    if block is None:
        return jax.lax.top_k(jnp.abs(x), k)[1].astype(jnp.int32)
    return two_stage_top_k(x, k, block)


# --------------------------------------------------------------------------- codecs


@dataclasses.dataclass(frozen=True)
class SparseCodec(Codec):
    """Shared machinery of the sparse codecs: payload ``(indices, *value_parts)``."""

    dense = False  # only the k selected coordinates travel

    def size(self, d: int) -> int:
        """``k``: the number of (index, value) slots in the payload for a vector of size ``d``."""
        raise NotImplementedError

    def _payload(self, indices, v, d, valid=None):
        """``(indices, *value parts)``. With ``values="sign"`` a selected exact zero (top-k of a
        vector with fewer than ``k`` nonzeros, a random-k draw of a zero) has no sign to
        send: it becomes an unfilled slot (index ``d``, dropped by decode) and stays out of
        the mean magnitude, instead of arriving as ``+scale``. No byte changes."""
        if self.values == "sign":
            nonzero = v != 0  # NaN is nonzero: sent, so it is flagged
            valid = nonzero if valid is None else valid & nonzero
            indices = jnp.where(nonzero, indices, d)
        return (indices.astype(jnp.int32), *_encode_values(v, valid, self.values))

    def decode(self, payload, d):
        indices, *parts = payload
        return _scatter(indices, _decode_values(tuple(parts), indices.shape[0], self.values), d)

    def decode_sum(self, payloads, d, scale=1.0, fill=0.0):
        """``fill + scale * sum`` of the decodings of stacked payloads: ONE scatter-add of
        every device's scaled slots into a buffer that starts at ``fill``."""
        indices, *parts = payloads
        k = indices.shape[-1]
        values = jax.vmap(lambda *p: _decode_values(p, k, self.values))(*parts)
        return _scatter(indices.reshape(-1), scaled(values.reshape(-1), scale), d, fill)

    def payload_bytes(self, d):
        k = self.size(d)
        return 4 * k + _value_bytes(k, self.values)


@dataclasses.dataclass(frozen=True)
class TopK(SparseCodec):
    r"""Top-k sparsification: the ``k`` coordinates of largest ``|x_i|``, values and indices.

    ``C(x) = x * 1[i in S]`` where ``S`` holds the ``k`` largest magnitudes. Biased and
    contractive: ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``, so ``delta = k/d`` (with float32
    values; see :meth:`delta` for the quantized modes). Use it with error feedback: what is
    not sent stays in the residual and goes out once it has grown (Stich et al., 2018).

    Selection (``approx``), every one with static shapes:

    * ``"exact"`` (``approx=False``): ``jax.lax.top_k`` over all of ``|x|``.
    * ``"blocked"`` (``approx=True`` below ``ratio`` 0.6%: the fastest measured there on
      XLA:CPU, :data:`APPROX_DEFAULT`): two stages (:func:`two_stage_top_k`: block maxima,
      then top-k over the candidate blocks) for vectors of at least ``APPROX_MIN_SIZE``
      entries where it pays; the same set as exact top-k whenever the k-th largest magnitude
      is unique.
    * ``"sample"``: DGC's sampled threshold (:func:`sampled_top_k`, Lin et al. 2018): a
      threshold from a random sample of ``sample_ratio * d`` entries (32 to 512 expected
      top-k members), aimed at ``0.95 k`` entries and re-adjusted while the count over it is
      outside ``[0.8 k, 1.3 k]``, at most ``k`` sent (fixed capacity). The exact top-k when
      at least ``k`` entries reach the threshold, else the ``>= 0.8 k`` largest (typically
      ``0.95 k``); tested on Gaussian, Student-t(2), Cauchy and log-normal
      vectors (at least ``0.8 k`` of the true top-k kept, ``tests/test_sparse.py``). Uses
      ``key`` when given (a fresh sample per step and device), a fixed sample otherwise. At
      1% it is faster than blocked on XLA:CPU and slower on an H100.
    * ``"auto"`` (``approx=True`` from ``ratio`` 0.6% on, :data:`APPROX_SAMPLE_FROM`):
      ``"sample"`` when the program runs on CPU, ``"blocked"`` on GPU and TPU, chosen when
      it is lowered (``jax.lax.platform_dependent``), so one jitted step is fast on both.
    * ``"approx_max_k"``: ``jax.lax.approx_max_k`` (recall target 0.95), fast on TPU; an
      exact sort on CPU.

    With static shapes the sampled threshold still needs a count pass and two compactions,
    so at 0.1% it is slower than blocked on XLA:CPU (blocked is then close to a copy, several
    times faster than exact); its cost hardly grows with ``k``, and at 1% it is the fastest on
    CPU (see :data:`APPROX_SAMPLE_FROM`). On an H100 blocked is the fastest at every ratio
    (measured with ``benchmarks/topk_speed.py``: docs/choosing-a-codec.md,
    docs/speed.md).

    Per layer or whole model: ``compressed_allreduce(..., granularity="leaf")`` (the
    default) selects ``k = ratio * d_leaf`` in every leaf; ``granularity="flat"`` selects
    ``k = ratio * d`` over all compressed leaves at once, so layers with large gradients can
    take more of the budget. Per leaf is the default: it trained better in every measurement
    (``benchmarks/sparse_convergence.py``, 1% with residual error feedback and momentum SGD;
    measured: docs/choosing-a-codec.md), and no layer can starve the others. At 0.1%, error
    feedback followed by the optimizer's momentum is unstable either way: use
    :func:`jaxcomp.dgc`, which applies momentum before sparsifying.

    References: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
    EMNLP 2017; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018; Lin et al., "Deep
    Gradient Compression", ICLR 2018; Sattler et al., "Sparse Binary Compression" (sparse
    ternary values), 2019; Shi et al., "A Distributed Synchronous SGD Algorithm with Global
    Top-k Sparsification" (gTop-k, the two_phase idea), ICDCS 2019.
    """

    ratio: float = 0.01
    approx: str = "exact"
    values: str | None = None
    sample_ratio: float = 0.01

    def size(self, d):
        return count_for(self.ratio, d)

    def delta(self, d):
        k = self.size(d)
        if d == 0:
            return 1.0
        if self.approx in ("sample", "approx_max_k", "auto"):
            return None  # ~0.8 k/d or more in practice, no worst-case bound
        if self.values is None:
            return k / d
        if self.values == "sign":
            # ||x - C(x)||^2 = ||x||^2 - ||v||_1^2 / k, and ||v||_1^2 / k >= ||v||^2 / k
            # >= ||x||^2 / d for the top-k values v.
            return 1.0 / d
        if self.values == "int8":
            # per value error <= max|v| / 254, so ||v - q||^2 <= k / 254^2 * ||v||^2
            keep = 1.0 - k / 254.0**2
            return keep * k / d if keep > 0 else None
        return None  # fp16/bf16: ~k/d inside the normal range, no bound for subnormals

    def phase_codecs(self, c, n):
        r"""The two-phase split of the ``2k`` slots of a chunk: ``k1`` per device, ``k2``
        for the owner, so that the owner can send every coordinate it receives::

            k1 = max(1, floor(2k / (n + 1)), 2k - c),   k2 = 2k - k1 <= c

        (``min(n k1, c) <= k2`` once ``2k >= n + 1``: the owner's sum has at most ``n k1``
        and at most ``c`` non-zeros.)
        ``k`` is :meth:`size` of the chunk (``c`` floats). Through ``two_phase`` each device
        sends the top ``k1`` of its chunks; the owner adds the ``n`` sparse chunks (at most
        ``n k1`` distinct coordinates) and sends the top ``k2`` of the sum, all of it when
        ``n k1 <= k2``: the mean of what the devices sent arrives whole, and error feedback
        has one compression to correct, the devices' own. An even split (``k`` and ``k``)
        re-sparsifies up to ``n k`` coordinates to ``k`` and leaves most of the mean in the
        owner's server residual, sent steps later (gTop-k, Shi et al., ICDCS 2019, the even
        split without that residual). The bytes are those of the even split when the
        payload's bytes are linear in ``k`` (values None, fp16, bf16, int8); otherwise
        (``values="sign"`` packs 32 signs a word, where the two payloads' bytes may differ
        from twice ``k``'s) both phases keep ``k``, as they do where ``k1`` would not be
        smaller than ``k`` (one device, ``k = 1``).

        Args:
          c: floats per chunk, ``ceil(d / n)``.
          n: devices on the axis.

        Returns:
          ``(first, second)``: top-k at ``k1 / c`` and at ``k2 / c`` (or ``(self, self)``).

        Example::

            first, second = jc.top_k(0.01).phase_codecs(8192, 8)   # k = 82: k1 = 18, k2 = 146
        """
        k = self.size(c)
        k1 = max(1, (2 * k) // (n + 1), 2 * k - c)
        k2 = 2 * k - k1
        if k1 >= k:
            return self, self
        first = dataclasses.replace(self, ratio=k1 / c)
        second = dataclasses.replace(self, ratio=k2 / c)
        if first.payload_bytes(c) + second.payload_bytes(c) != 2 * self.payload_bytes(c):
            return self, self
        return first, second

    def encode(self, x, key=None):
        x = check_vector(x, self)
        if self.approx == "auto":  # the platform is known when the program is lowered
            sample = {p: lambda v: self._encode(v, key, "sample") for p in SAMPLE_PLATFORMS}
            return jax.lax.platform_dependent(
                x, default=lambda v: self._encode(v, key, "blocked"), **sample
            )
        return self._encode(x, key, self.approx)

    def _encode(self, x, key, method):
        d, k = x.shape[0], self.size(x.shape[0])
        if method != "sample":
            indices = select_top_k(x, k, method)
            return self._payload(indices, x[indices], d)
        indices, filled = sampled_top_k(x, k, key, self.sample_ratio)
        v = jnp.where(filled, x[jnp.minimum(indices, max(d - 1, 0))], 0.0)
        return self._payload(indices, v, d, filled)


@dataclasses.dataclass(frozen=True)
class RandomK(SparseCodec):
    r"""Random-k sparsification, scaled to be unbiased; indices from a key shared by all devices.

    The ``d`` coordinates are cut into ``k`` contiguous strata of sizes ``s_j`` in
    ``{floor(d/k), ceil(d/k)}``, and one coordinate ``i_j`` is drawn uniformly in each. The
    payload carries ``s_j * x_{i_j}``, so ``E[C(x)] = x``: coordinate ``i`` is sent with
    probability ``1/s_j`` and scaled by ``s_j``. The price is variance::

        E||C(x) - x||^2 = sum_i (s_{j(i)} - 1) x_i^2  <=  (ceil(d/k) - 1) ||x||^2   (~ d/k)

    which at 1% is ~99 ||x||^2: averaged over ``n`` devices that share the indices the
    variance does not shrink with ``n`` for correlated gradients. Prefer top-k with error
    feedback for training; random-k is the unbiased baseline (Stich et al., 2018; Wangni et
    al., 2018). Drawing per stratum costs ``O(k)`` instead of the ``O(d log d)`` of a uniform
    ``k``-subset, and has the same per-coordinate variance when ``k`` divides ``d``.

    ``shared_randomness``: the key must be the same on every device (``jc.pmean`` and the
    transforms do this), so all devices pick the same indices. With float32 or 16-bit values
    the payloads are ``summable``: the values are ``psum``-ed and the identical indices never
    travel. Unbiased only with ``values=None``; the sent values are ``~d/k`` times the inputs,
    so ``"fp16"`` saturates early (at 65504): prefer ``"bf16"``.

    References: Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
    Wangni, Wang, Liu, Zhang, "Gradient Sparsification for Communication-Efficient
    Distributed Optimization", NeurIPS 2018.
    """

    ratio: float = 0.01
    values: str | None = None

    stochastic = True
    shared_randomness = True

    @property
    def unbiased(self):
        return self.values is None

    @property
    def summable(self):
        return self.values is None or self.values in _FLOAT16

    def size(self, d):
        return count_for(self.ratio, d)

    def phase_codecs(self, c, n):
        r"""``two_phase``'s codecs: random-k for each device's chunk, and for the owner the
        exact top-k of the same ``k`` slots, which re-sends every coordinate it received.

        Every device draws chunk ``j``'s indices from the same key, so the owner's sum of the
        ``n`` chunks has at most ``k`` nonzeros, already scaled by the strata sizes ``s``.
        A second random-k would draw other indices from another key and scale again: the
        mean arrives unbiased but through ``~k^2 / c`` coordinates scaled by ``s^2``, a
        variance ``~(c/k)^2`` instead of ``c/k`` (at 5%: 13 of 4,096 values nonzero, a single
        mean 22x its norm away instead of 4.3x; SGD on a convex problem diverged where
        ``allgather`` converged). Top-k of a vector with at most ``k`` nonzeros keeps them all
        (exact, no key), at the same bytes (``k`` indices and ``k`` values). Values that a
        ``values`` mode rounds are rounded again by the owner, as before; what that drops
        stays in the owner's server residual.

        Args:
          c: floats per chunk, ``ceil(d / n)``.
          n: devices on the axis.

        Returns:
          ``(self, jc.top_k(k / c, values=self.values))`` with ``k = self.size(c)``.
        """
        del n
        k = self.size(c)
        if k == 0:
            return self, self
        second = TopK(ratio=k / c, approx="exact", values=self.values)
        if second.size(c) != k or second.payload_bytes(c) != self.payload_bytes(c):
            return self, self
        return self, second

    def strata(self, d: int):
        """Static ``(starts, sizes)`` of the ``k`` strata (int32 numpy arrays)."""
        k = self.size(d)
        bounds = (np.arange(k + 1, dtype=np.int64) * d) // max(k, 1)
        return bounds[:-1].astype(np.int32), np.diff(bounds).astype(np.int32)

    def indices(self, key: jax.Array, d: int) -> jax.Array:
        """The ``k`` indices drawn from ``key`` (one per stratum, increasing)."""
        starts, sizes = self.strata(d)
        # 32 random bits modulo the stratum size: uniform up to a relative error of s / 2^32.
        bits = jax.random.bits(key, (starts.shape[0],), jnp.uint32)
        offset = (bits % jnp.asarray(sizes, jnp.uint32)).astype(jnp.int32)
        return jnp.asarray(starts) + offset

    def encode(self, x, key=None):
        x = check_vector(x, self)
        key = require_key(key, self)
        d = x.shape[0]
        _, sizes = self.strata(d)
        indices = self.indices(key, d)
        picked = x[indices]
        # s_j x_i past float32's range (|x_i| > F32_MAX / s_j) saturates, as a cast does:
        # a finite input never sends inf; inf and NaN stay themselves.
        v = picked * jnp.asarray(sizes, jnp.float32)
        v = jnp.where(jnp.isfinite(picked), jnp.clip(v, -F32_MAX, F32_MAX), v)
        return self._payload(indices, v, d)


@dataclasses.dataclass(frozen=True)
class Threshold(SparseCodec):
    r"""Threshold sparsification (Strom, 2015): send the ``x_i`` with ``|x_i| > tau``.

    Static shapes: at most ``capacity`` values travel (``min(capacity, d)`` slots). When more
    than ``capacity`` coordinates pass, the ``capacity`` largest are sent (the rest stay in the
    error-feedback residual); when fewer pass, the free slots carry index ``d`` and decode to
    nothing. Strom sends ``+-tau`` (1 bit per value); ``values="sign"`` is the closest here
    (one mean magnitude instead of ``tau``). Not contractive (``|x| <= tau`` everywhere sends
    nothing): use it with residual error feedback.

    Reference: Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing", Interspeech 2015.
    """

    tau: float = 1e-3
    capacity: int = 1024
    values: str | None = None

    def size(self, d):
        return min(self.capacity, max(d, 0))

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        indices = select_top_k(x, self.size(d), "blocked")
        v = x[indices]
        # NaN passes (never hidden); finite values at or below tau do not.
        valid = ~(jnp.abs(v) <= self.tau)
        return self._payload(jnp.where(valid, indices, d), jnp.where(valid, v, 0.0), d, valid)


# --------------------------------------------------------------------------- factories


def top_k(
    ratio: float = 0.01,
    approx: bool | str = False,
    values: str | None = None,
    sample_ratio: float | None = None,
) -> TopK:
    """Top-k sparsification: the ``k = max(1, ceil(ratio * d))`` largest magnitudes.

    ``C(x)_i = x_i`` for the ``k`` indices of largest ``|x_i|``, 0 elsewhere; ``k`` values
    and ``k`` int32 indices travel (static shapes). Contractive with
    ``delta = k / d``: ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``, so residual error feedback keeps
    what is not sent until it grows large enough (Stich et al., 2018). See :class:`TopK`.

    Args:
      ratio: fraction of coordinates sent, in (0, 1]: a fraction, not a percentage.
        ``top_k(1)`` sends every coordinate (no compression); 1% is ``top_k(0.01)``, the codec
        that ``jc.get_codec("topk1%")`` names (registry names are percentages).
      approx: how the ``k`` entries are selected (see :class:`TopK`): ``False`` /
        ``"exact"`` (``jax.lax.top_k``), ``"blocked"`` (two-stage, the same set as exact
        top-k, faster on large vectors), ``"sample"`` (DGC's sampled threshold, fixed
        capacity ``k``), ``"approx_max_k"`` (``jax.lax.approx_max_k``: fast on TPU),
        ``"auto"`` (``"sample"`` on CPU, ``"blocked"`` elsewhere), or ``True``: the fastest
        measured for ``ratio``, ``"blocked"`` below 0.6% and ``"auto"`` from there on
        (:data:`APPROX_SAMPLE_FROM`).
      values: how values travel: None (float32), ``"fp16"``, ``"bf16"``, ``"int8"`` or
        ``"sign"`` (sparse ternary compression).
      sample_ratio: where the selection samples (``approx="sample"`` or ``"auto"``, or
        ``True`` from ``ratio`` 0.6% on), the fraction of entries sampled to estimate the
        threshold, in (0, 1] (DGC: 0.01; clipped to ``[32 d / k, 512 d / k]`` entries).
        None: 0.01. Only with a sampling ``approx``: the other selections read no sample, and
        a ``sample_ratio`` given with one of them is refused rather than ignored.

    Raises:
      ValueError: at construction, ``ratio``, ``approx``, ``values`` or ``sample_ratio`` outside its
        rule (the message names the argument; the rules: docs/errors.md), or ``sample_ratio``
        given with an ``approx`` that does not sample (``False``, ``"exact"``, ``"blocked"``,
        ``"approx_max_k"``, or ``True`` below ``ratio`` 0.6%).
      TypeError: at construction, ``ratio``, ``approx`` or ``sample_ratio`` of the wrong kind.

    Example::

        tx = optax.chain(
            jc.compressed_allreduce(jc.top_k(0.01), "data"),  # residual error feedback
            optax.sgd(0.1, momentum=0.9),
        )

    At 0.1% and below use :func:`jaxcomp.dgc` instead (momentum before sparsification).

    References:
      Aji, Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017;
      Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
      Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k
      Sparsification for Low Bandwidth Networks" (gTop-k), ICDCS 2019.
    """
    ratio = check_ratio(ratio)
    method = check_approx(approx, ratio)
    return TopK(ratio, method, check_values(values), check_sample_ratio(sample_ratio, method))


#: The selections that read ``sample_ratio`` (``"auto"`` samples on CPU).
SAMPLING_METHODS = ("sample", "auto")


def check_sample_ratio(sample_ratio, method: str) -> float:
    """``sample_ratio`` in (0, 1], or the default 0.01 for None; refused (ValueError naming
    it) where the selection ``method`` does not sample, since it would be ignored there."""
    if sample_ratio is None:
        return 0.01
    sample_ratio = check_positive_float("sample_ratio", sample_ratio, upper=1.0)
    if method not in SAMPLING_METHODS:
        raise ValueError(
            f"`sample_ratio` is read only by a sampling selection (approx='sample' or 'auto', "
            f"or True from ratio {APPROX_SAMPLE_FROM}); approx={method!r} does not sample and "
            f"would ignore sample_ratio={sample_ratio!r}: drop it or pass approx='sample'"
        )
    return sample_ratio


def random_k(ratio: float = 0.01, values: str | None = None) -> RandomK:
    """Random-k sparsification scaled by ``d/k`` (unbiased), indices shared by all devices.

    One coordinate ``i_j`` drawn uniformly in each of ``k`` contiguous strata of size
    ``s_j ~ d/k``, sent as ``s_j x_{i_j}``: ``E[C(x)] = x`` and
    ``E||C(x) - x||^2 <= (ceil(d/k) - 1) ||x||^2``. The indices come from a key that is the
    same on every device, so payloads of all devices add (summable: one ``psum`` of the
    ``k`` values). See :class:`RandomK`.

    Args:
      ratio: fraction of coordinates sent, in (0, 1].
      values: how values travel (see :func:`top_k`); None keeps it unbiased.

    Raises:
      ValueError: at construction, ``ratio`` or ``values`` outside its rule (the message names the
        argument; the rules: docs/errors.md).
      TypeError: at construction, ``ratio`` of the wrong kind.

    References:
      Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018;
      Wangni, Wang, Liu, Zhang, "Gradient Sparsification for Communication-Efficient
      Distributed Optimization", NeurIPS 2018.
    """
    return RandomK(check_ratio(ratio), check_values(values))


def threshold(tau: float, capacity: int, values: str | None = None) -> Threshold:
    """Strom's threshold sparsification: ``|x_i| > tau``, at most ``capacity`` values.

    ``C(x)_i = x_i`` where ``|x_i| > tau`` (the ``capacity`` largest of them when more
    pass: XLA needs a static payload size), 0 elsewhere. Biased; with residual error
    feedback a coordinate is sent once its accumulated value passes ``tau``. See
    :class:`Threshold`.

    Args:
      tau: the threshold, > 0.
      capacity: the most values sent per vector (static payload size), >= 1.
      values: how values travel (see :func:`top_k`).

    Raises:
      ValueError: at construction, ``tau`` or ``capacity`` outside its rule (the message names the
        argument; the rules: docs/errors.md).
      TypeError: at construction, ``tau`` or ``capacity`` of the wrong kind.

    References:
      Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
      Interspeech 2015.
    """
    tau = check_positive_float("tau", tau)
    capacity = check_int("capacity", capacity, 1)
    return Threshold(tau, capacity, check_values(values))


__all__ = [
    "APPROX_METHODS",
    "VALUE_MODES",
    "count_for",
    "random_k",
    "sampled_top_k",
    "threshold",
    "top_k",
    "two_stage_top_k",
]
