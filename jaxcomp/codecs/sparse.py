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
than ``capacity`` values pass) carry the out-of-range index ``d`` and are dropped by the
scatter, so they decode to nothing whatever the value mode. :meth:`SparseCodec.decode_sum`
scatter-adds the payloads of all devices into one dense buffer, so the all-gather strategy
costs one ``f32[d]`` buffer, not one per device.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxcomp.codecs import packing
from jaxcomp.codecs.base import (
    Codec,
    check_int,
    check_positive_float,
    check_vector,
    require_key,
    safe_divide,
)

VALUE_MODES = (None, "fp16", "bf16", "int8", "sign")
_FLOAT16 = {"fp16": jnp.float16, "bf16": jnp.bfloat16}

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
        scale = jnp.max(jnp.abs(v), initial=0.0) / 127.0
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


def _scatter(indices: jax.Array, values: jax.Array, d: int) -> jax.Array:
    """Dense ``f32[d]``: ``values`` added at ``indices``; index ``d`` (unfilled slot) is dropped."""
    return jnp.zeros((d,), jnp.float32).at[indices].add(values, mode="drop")


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
    _, blocks = jax.lax.top_k(jnp.max(jnp.abs(main), axis=1), k)
    candidates = jnp.abs(main[blocks]).reshape(-1)
    tail = jnp.abs(x[nb * block_size :])
    _, pos = jax.lax.top_k(jnp.concatenate([candidates, tail]), k)
    in_block = pos < k * block_size
    block_pos = jnp.minimum(pos, k * block_size - 1)
    from_blocks = blocks[block_pos // block_size] * block_size + block_pos % block_size
    return jnp.where(in_block, from_blocks, nb * block_size + pos - k * block_size).astype(
        jnp.int32
    )


def select_top_k(x: jax.Array, k: int, approx: bool) -> jax.Array:
    """int32 indices of the ``k`` largest ``|x_i|``."""
    if k == 0:
        return jnp.zeros((0,), jnp.int32)
    block = _block_size(x.shape[0], k) if approx else None
    if block is None:
        return jax.lax.top_k(jnp.abs(x), k)[1].astype(jnp.int32)
    return two_stage_top_k(x, k, block)


# --------------------------------------------------------------------------- codecs


@dataclasses.dataclass(frozen=True)
class SparseCodec(Codec):
    """Shared machinery of the sparse codecs: payload ``(indices, *value_parts)``."""

    def size(self, d: int) -> int:
        """``k``: the number of (index, value) slots in the payload for a vector of size ``d``."""
        raise NotImplementedError

    def _payload(self, indices, v, valid=None):
        return (indices.astype(jnp.int32), *_encode_values(v, valid, self.values))

    def decode(self, payload, d):
        indices, *parts = payload
        return _scatter(indices, _decode_values(tuple(parts), indices.shape[0], self.values), d)

    def decode_sum(self, payloads, d):
        """Sum of the decodings of stacked payloads: ONE scatter-add of every device's slots."""
        indices, *parts = payloads
        k = indices.shape[-1]
        values = jax.vmap(lambda *p: _decode_values(p, k, self.values))(*parts)
        return _scatter(indices.reshape(-1), values.reshape(-1), d)

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

    ``approx=False`` selects with ``jax.lax.top_k`` over all of ``|x|``. ``approx=True`` uses
    a two-stage selection (:func:`two_stage_top_k`: block maxima, then top-k over the
    candidate blocks) for vectors of at least ``APPROX_MIN_SIZE`` entries where it pays:
    it returns the same set as exact top-k when the k-th largest magnitude is unique. At
    0.1% of 16M floats on CPU it takes 61-69 ms against 202-246 ms for ``lax.top_k``
    (3.3-3.6x; about one memory pass, the time of a copy of the array), see
    ``benchmarks/topk_speed.py``. DGC's sampled threshold (Lin et al., 2018) was measured
    too: picking the values over a threshold with static shapes needs a compaction (cumsum /
    ``jnp.nonzero(size=k)``) of the whole vector, 516-664 ms on XLA:CPU, slower than
    ``lax.top_k`` itself (and 86% recall); ``jax.lax.approx_max_k`` is an exact sort off TPU
    (207-212 ms).

    Per layer or whole model: ``compressed_allreduce(..., granularity="leaf")`` (the
    default) selects ``k = ratio * d_leaf`` in every leaf; ``granularity="flat"`` selects
    ``k = ratio * d`` over all compressed leaves at once, so layers with large gradients can
    take more of the budget. Measured on digits (64-256-10 MLP, 8 devices, 300 steps of
    momentum SGD, 3 seeds, held-out accuracy; uncompressed 97.5%): at 1% with residual error
    feedback, per leaf 97.7% and flat 96.7% — per leaf is the default, and no layer can starve
    the others. At 0.1%, error feedback followed by the optimizer's momentum is unstable either
    way (per leaf 86.1%, flat 92.2%, no feedback at all 92.8%): use :func:`jaxcomp.dgc`, which
    applies momentum before sparsifying (97.2% at 0.1%).

    References: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
    EMNLP 2017; Stich et al., "Sparsified SGD with Memory", NeurIPS 2018; Lin et al., "Deep
    Gradient Compression", ICLR 2018; Sattler et al., "Sparse Binary Compression" (sparse
    ternary values), 2019; Shi et al., "A Distributed Synchronous SGD Algorithm with Global
    Top-k Sparsification" (gTop-k, the two_phase idea), ICDCS 2019.
    """

    ratio: float = 0.01
    approx: bool = False
    values: str | None = None

    def size(self, d):
        return count_for(self.ratio, d)

    def delta(self, d):
        k = self.size(d)
        if d == 0:
            return 1.0
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

    def encode(self, x, key=None):
        x = check_vector(x, self)
        indices = select_top_k(x, self.size(x.shape[0]), self.approx)
        return self._payload(indices, x[indices])


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
        return self._payload(indices, x[indices] * jnp.asarray(sizes, jnp.float32))


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
        indices = select_top_k(x, self.size(d), approx=True)
        v = x[indices]
        # NaN passes (never hidden); finite values at or below tau do not.
        valid = ~(jnp.abs(v) <= self.tau)
        return self._payload(jnp.where(valid, indices, d), jnp.where(valid, v, 0.0), valid)


# --------------------------------------------------------------------------- factories


def top_k(ratio: float = 0.01, approx: bool = False, values: str | None = None) -> TopK:
    """Top-k sparsification: the ``k = max(1, ceil(ratio * d))`` largest magnitudes.

    Args:
      ratio: fraction of coordinates sent, in (0, 1].
      approx: use the fast two-stage selection for large vectors (same set as exact top-k
        when the k-th largest magnitude is unique).
      values: how values travel: None (float32), ``"fp16"``, ``"bf16"``, ``"int8"`` or
        ``"sign"`` (sparse ternary compression).

    Example::

        tx = optax.chain(
            jc.compressed_allreduce(jc.top_k(0.01), "data"),  # residual error feedback
            optax.sgd(0.1, momentum=0.9),
        )

    At 0.1% and below use :func:`jaxcomp.dgc` instead (momentum before sparsification).
    """
    if not isinstance(approx, bool):
        raise TypeError(f"`approx` must be a bool, got {approx!r}")
    return TopK(check_ratio(ratio), approx, check_values(values))


def random_k(ratio: float = 0.01, values: str | None = None) -> RandomK:
    """Random-k sparsification scaled by ``d/k`` (unbiased), indices shared by all devices.

    Args:
      ratio: fraction of coordinates sent, in (0, 1].
      values: how values travel (see :func:`top_k`); None keeps it unbiased.
    """
    return RandomK(check_ratio(ratio), check_values(values))


def threshold(tau: float, capacity: int, values: str | None = None) -> Threshold:
    """Strom's threshold sparsification: ``|x_i| > tau``, at most ``capacity`` values.

    Args:
      tau: the threshold, > 0.
      capacity: the most values sent per vector (static payload size), >= 1.
      values: how values travel (see :func:`top_k`).
    """
    tau = check_positive_float("tau", tau)
    capacity = check_int("capacity", capacity, 1)
    return Threshold(tau, capacity, check_values(values))


__all__ = ["VALUE_MODES", "count_for", "random_k", "threshold", "top_k", "two_stage_top_k"]
