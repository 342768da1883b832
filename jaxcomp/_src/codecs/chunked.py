"""Chunked top-k: the ``k`` largest magnitudes inside every fixed-size chunk, bit-packed.

SparseLoCo's and DeMo's sparsifier (Templar: chunks of 64 x 64 = 4096 values, 64 kept in
each). Selecting inside chunks instead of over the whole vector makes every payload shape
static and the indices short: an index within a chunk of ``c`` values needs
``ceil(log2 c)`` bits (12 for 4096), packed end to end into uint32 words across word
boundaries. Values are quantized to ``bits`` bits with one float32 scale per chunk. A chunk
with fewer than ``k`` nonzero values keeps zeros among its top ``k``: they are sent with the
chunk's first index repeated, and decode drops them (no level of a quantized value is 0).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.codecs.base import (
    Codec,
    ceil_div,
    check_int,
    check_vector,
    safe_divide,
    scaled,
)


def stream_words(n: int, bits: int) -> int:
    """uint32 words holding ``n`` codes of ``bits`` bits laid end to end (no bit wasted)."""
    return ceil_div(n * bits, 32)


def _group(bits: int) -> tuple[int, int]:
    """Codes and words of one repeating group: ``g`` codes of ``bits`` bits fill ``w`` words
    exactly (``g * bits == 32 * w``), so every code's word and shift are static."""
    g = 32 // math.gcd(bits, 32)
    return g, g * bits // 32


def pack_stream(codes: jax.Array, bits: int) -> jax.Array:
    """Pack ``codes`` (unsigned, ``< 2**bits``, 1-D) as a bit stream: code ``i`` occupies bits
    ``[i * bits, (i + 1) * bits)`` of the little-endian word stream; a code may straddle two
    words. Returns ``uint32[stream_words(len(codes), bits)]``."""
    n = codes.shape[0]
    g, w = _group(bits)
    rows = ceil_div(n, g)
    c = jnp.pad(codes.astype(jnp.uint32), (0, rows * g - n)).reshape(rows, g)
    words = [jnp.zeros((rows,), jnp.uint32) for _ in range(w)]
    for j in range(g):  # static: every code of column j has the same word and shift
        start = j * bits
        word, shift = divmod(start, 32)
        words[word] = words[word] | (c[:, j] << np.uint32(shift))
        if shift + bits > 32:  # the high part spills into the next word
            words[word + 1] = words[word + 1] | (c[:, j] >> np.uint32(32 - shift))
    return jnp.stack(words, axis=1).reshape(-1)[: stream_words(n, bits)]


def unpack_stream(words: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of :func:`pack_stream`: ``uint32[n]`` codes."""
    g, w = _group(bits)
    rows = ceil_div(n, g)
    full = jnp.pad(words, (0, rows * w - words.shape[0])).reshape(rows, w)
    mask = np.uint32((1 << bits) - 1)
    cols = []
    for j in range(g):
        word, shift = divmod(j * bits, 32)
        code = full[:, word] >> np.uint32(shift)
        if shift + bits > 32:
            code = code | (full[:, word + 1] << np.uint32(32 - shift))
        cols.append(code & mask)
    return jnp.stack(cols, axis=1).reshape(-1)[:n]


#: How the per-chunk scale ``s`` of the kept values is taken: their largest magnitude (every
#: value inside ``[-s, s]``), or, for 1-bit values only, the mean magnitude of the nonzero ones
#: (``s sign(v)`` closest to ``v`` in L2 over them).
SCALES = ("max", "mean")


def quantize(v: jax.Array, bits: int, scale: str = "max") -> tuple[jax.Array, jax.Array]:
    """Rows of values ``[rows, k]`` to ``bits``-bit codes on ``2**bits`` evenly spaced levels of
    ``[-s, s]``, ``s = max |v|`` per row (``scale="mean"``, 1 bit: ``s = sum |v| / #{v != 0}``,
    the least-squares scale of ``s sign(v)`` over the nonzero values: the zero padding of a
    chunk shorter than ``k``, whose slots are dropped, does not shrink it), float32; a row
    holding a NaN or inf gets a NaN scale, so the payload flags it. Returns
    ``(codes uint32[rows, k], scale f32[rows])``."""
    top = 2**bits - 1
    finite = jnp.all(jnp.isfinite(v), axis=1)
    mag = jnp.abs(jnp.where(jnp.isfinite(v), v, 0.0))
    if scale == "mean":
        nonzero = jnp.maximum(jnp.sum(mag > 0, axis=1), 1).astype(jnp.float32)
        total = jnp.sum(mag, axis=1)
        # Finite values whose sum overflows: the terms divided first (at most max |v|).
        s = jnp.where(jnp.isfinite(total), total / nonzero, jnp.sum(mag / nonzero[:, None], 1))
    else:
        s = jnp.max(mag, axis=1)
    # safe_divide: XLA:CPU's v / s flushed to 0 for s > 2^126 (every code the middle one).
    unit = safe_divide(jnp.where(jnp.isfinite(v), v, 0.0), s[:, None])
    q = jnp.round((unit + 1.0) * (top / 2))
    codes = jnp.clip(q, 0, top).astype(jnp.uint32)
    return codes, jnp.where(finite, s, jnp.nan)


def mark_zeros(idx: jax.Array, v: jax.Array) -> jax.Array:
    """The indices ``[rows, k]`` to send: a kept zero (``v == 0``; a chunk with fewer than
    ``k`` nonzero values keeps some) repeats its chunk's first index, which no other kept
    value has (``lax.top_k``'s indices are distinct), so decode drops it (:func:`repeats_first`)
    instead of sending its quantization level (``-s`` with 1 bit, ``+-s/3`` with 2) as a value.
    Costs no bits; slot 0 holds the largest magnitude, zero only where every kept value is.

    Slot 0's index is read by a row maximum, not a slice: a slice of ``lax.top_k``'s indices
    makes XLA:CPU replace its TopK by a full sort of every chunk (measured 30x slower)."""
    later = jnp.arange(idx.shape[1]) > 0
    first = jnp.max(jnp.where(later, -1, idx), axis=1, keepdims=True)
    return jnp.where((v == 0) & later, first, idx)


def repeats_first(local: jax.Array) -> jax.Array:
    """Slots ``[rows, k]`` that repeat their chunk's first index (slot 0 itself excluded): the
    kept zeros :func:`mark_zeros` marked."""
    return (local == local[:, :1]) & (jnp.arange(local.shape[1]) > 0)


def dequantize(codes: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    """Inverse of :func:`quantize`: ``s * (2 q / (2**bits - 1) - 1)``, f32 ``[rows, k]``."""
    top = 2**bits - 1
    return scale[:, None] * (codes.astype(jnp.float32) * (2.0 / top) - 1.0)


def quantize_groups(v: jax.Array, bits: int, scale: str, group: int) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize` with one scale per ``group`` consecutive rows of ``v`` ``[rows, k]``
    (the last group short): the rows of a group quantized as one row of ``group k`` values.
    The padding rows are zeros, which neither the max nor the mean of the nonzero values
    reads. ``group=1``: :func:`quantize` itself. Returns ``(codes uint32[rows, k],
    scale f32[ceil(rows / group)])``."""
    rows, k = v.shape
    n = ceil_div(rows, group)
    padded = jnp.pad(v, ((0, n * group - rows), (0, 0))).reshape(n, group * k)
    codes, s = quantize(padded, bits, scale)
    return codes.reshape(n * group, k)[:rows], s


def dequantize_groups(codes: jax.Array, scale: jax.Array, bits: int, group: int) -> jax.Array:
    """Inverse of :func:`quantize_groups`: each row decoded with its group's scale."""
    return dequantize(codes, jnp.repeat(scale, group)[: codes.shape[0]], bits)


@dataclasses.dataclass(frozen=True)
class ChunkedTopK(Codec):
    r"""Top-``k`` in every chunk of ``chunk`` values: indices in ``ceil(log2 c)`` bits, values
    in ``bits`` bits (None: float32) with one float32 scale per chunk. See
    :func:`chunked_top_k`.

    Attributes:
      k: values kept per chunk.
      chunk: values per chunk (one scale each).
      bits: bits per kept value, or None for float32 values.
      scale: the chunk's value scale, ``"max"`` or ``"mean"`` (as :func:`chunked_top_k`).
      sub_chunk: None, or the values of each sub-chunk the top-k runs in: ``k / (chunk /
        sub_chunk)`` kept in each, indices in ``ceil(log2 sub_chunk)`` bits.
    """

    k: int = 64
    chunk: int = 4096
    bits: int | None = 2
    scale: str = "max"
    sub_chunk: int | None = None

    flags_nonfinite = True
    dense = False  # only the k selected coordinates of each chunk travel

    @property
    def group(self) -> int:
        """Top-k rows (sub-chunks) per float32 scale: ``chunk / sub_chunk``, 1 without."""
        return 1 if self.sub_chunk is None else self.chunk // self.sub_chunk

    def layout(self, d: int) -> tuple[int, int, int]:
        """``(c, kc, rows)`` of the top-k: the values of a row for ``d`` values (``min(chunk,
        d)``, or ``min(sub_chunk, d)``), the values kept per row (``k``, or ``k / group`` per
        sub-chunk; scaled down with a shorter row: the same density) and the number of rows
        (the last one zero-padded)."""
        if d == 0:
            return 1, 0, 0
        size, k = self.chunk // self.group, self.k // self.group
        c = min(size, d)
        kc = k if c == size else max(1, math.ceil(k * c / size - 1e-9))
        return c, min(kc, c), ceil_div(d, c)

    def scales(self, d: int) -> int:
        """Float32 scales of ``d`` values: one per ``group`` rows of :meth:`layout`."""
        return ceil_div(self.layout(d)[2], self.group)

    def index_bits(self, d: int) -> int:
        c = self.layout(d)[0]
        return max(1, math.ceil(math.log2(c)))

    def delta(self, d):
        if d == 0:
            return 1.0
        if self.bits is not None:
            return None  # quantized values: no worst-case contraction bound
        c, kc, _ = self.layout(d)
        return kc / c  # per chunk ||x - C(x)||^2 <= (1 - kc / c) ||x||^2 (padding is zero)

    def payload_bytes(self, d):
        c, kc, rows = self.layout(d)
        n = kc * rows
        index = 4 * stream_words(n, self.index_bits(d))
        if self.bits is None:
            return index + 4 * n
        return index + 4 * stream_words(n, self.bits) + 4 * self.scales(d)

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        c, kc, rows = self.layout(d)
        if d == 0:
            empty = (jnp.zeros((0,), jnp.uint32),) * (1 if self.bits is None else 2)
            return (*empty, jnp.zeros((0,), jnp.float32))
        blocks = jnp.pad(x, (0, rows * c - d)).reshape(rows, c)
        # NaN sorts above every number in lax.top_k: a non-finite chunk sends it.
        _, idx = jax.lax.top_k(jnp.abs(blocks), kc)
        v = jnp.take_along_axis(blocks, idx, axis=1)
        index = pack_stream(mark_zeros(idx, v).reshape(-1), self.index_bits(d))
        if self.bits is None:
            return index, v.reshape(-1)
        codes, scale = quantize_groups(v, self.bits, self.scale, self.group)
        return index, pack_stream(codes.reshape(-1), self.bits), scale

    def _slots(self, payload, d):
        """Global indices ``int32[rows * kc]`` and the decoded values ``f32[rows * kc]`` of one
        payload; index ``d`` (dropped by the scatters) where a slot sends nothing: a kept zero
        (:func:`mark_zeros`), a slot decoding to 0, and the padding (``>= d`` already)."""
        c, kc, rows = self.layout(d)
        local = unpack_stream(payload[0], self.index_bits(d), rows * kc).reshape(rows, kc)
        local = local.astype(jnp.int32)
        if self.bits is None:
            values = payload[1].reshape(rows, kc)
        else:
            codes = unpack_stream(payload[1], self.bits, rows * kc).reshape(rows, kc)
            values = dequantize_groups(codes, payload[2], self.bits, self.group)
        base = (jnp.arange(rows, dtype=jnp.int32) * c)[:, None]
        keep = jnp.logical_not(repeats_first(local)) & (values != 0)
        return jnp.where(keep, base + local, d).reshape(-1), values.reshape(-1)

    def decode(self, payload, d):
        if d == 0:
            return jnp.zeros((0,), jnp.float32)
        indices, values = self._slots(payload, d)
        return jnp.zeros((d,), jnp.float32).at[indices].add(values, mode="drop")

    def decode_sum(self, payloads, d, scale=1.0, fill=0.0):
        """``fill + scale * sum``: one scatter-add of every device's slots."""
        if d == 0:
            return jnp.zeros((0,), jnp.float32)
        indices, values = jax.vmap(lambda p: self._slots(p, d))(payloads)
        out = jnp.full((d,), fill, jnp.float32)
        return out.at[indices.reshape(-1)].add(scaled(values.reshape(-1), scale), mode="drop")

    def decode_mean_of_senders(self, payloads, d, fill=0.0):
        """Templar's merge: each coordinate is the mean over the devices whose payload holds
        it (``sum / count``; 0 where none sent it), not over every device."""
        if d == 0:
            return jnp.zeros((0,), jnp.float32)
        indices, values = jax.vmap(lambda p: self._slots(p, d))(payloads)
        n, idx = indices.shape[0], indices.reshape(-1)
        # Summed pre-scaled by 1/n (a mean that fits float32 never overflows), then n / count.
        total = jnp.zeros((d,), jnp.float32).at[idx].add(values.reshape(-1) / n, mode="drop")
        count = jnp.zeros((d,), jnp.float32).at[idx].add(1.0, mode="drop")
        return fill + total * (n / jnp.maximum(count, 1.0))


def chunked_top_k(
    k: int = 64,
    chunk: int = 4096,
    bits: int | None = 2,
    scale: str = "max",
    sub_chunk: int | None = None,
) -> ChunkedTopK:
    r"""Top-k inside fixed chunks: the ``k`` largest ``|x_i|`` of every ``chunk`` values.

    ``x`` (``d`` values) is cut into ``ceil(d / chunk)`` chunks (the last zero-padded); in
    each, the ``k`` entries of largest magnitude are kept. A vector shorter than ``chunk`` is
    one chunk of ``d`` values keeping ``ceil(k d / chunk)`` (the same density). Each index
    within its chunk of ``c`` values takes ``b_i = ceil(log2 c)`` bits (12 for 4096), packed
    end to end; values take ``bits`` bits on ``2^bits`` evenly spaced levels of
    ``[-s, s]``, ``s = max |v|`` over the chunk's kept values (one float32 per chunk)::

        C(x)_i = s_j (2 q_i / (2^bits - 1) - 1)   for the kept i of chunk j,   0 elsewhere
        payload_bytes(d) = 4 ceil(K b_i / 32) + 4 ceil(K bits / 32) + 4 R   (K = k R, R chunks)

    (``bits=None``: float32 values, ``4 ceil(K b_i / 32) + 4 K``, contractive with
    ``delta = k / chunk``). At ``k=64, chunk=4096, bits=2`` a chunk costs 116 bytes
    against 16384 in float32 (141x). Biased: use it with error feedback. A zero chunk decodes
    to zero; a NaN or inf makes its chunk's scale NaN (non-finite is never hidden).

    Exact zeros stay zero: ``C(x)_i = 0`` wherever ``x_i = 0``. A chunk with fewer than ``k``
    nonzero values (a sparse gradient, unused embedding rows, a zero leaf) keeps zeros among
    its top ``k``, which ``lax.top_k`` puts last (the zero padding of a short last chunk lies
    past ``d``: its slots were always dropped). Each is sent with the index of the chunk's
    first slot (its largest value, an index no other kept value has), and decode drops every
    later slot repeating it, so a zero is neither decoded to a level (``-s`` with 1 bit,
    ``s/3`` with 2: no level is 0) nor counted as a sender by Templar's merge. It costs no
    bits: the payload and ``payload_bytes`` are unchanged.

    With ``sub_chunk`` the top-k runs inside each sub-chunk of ``sub_chunk`` values, ``k_s =
    k / (chunk / sub_chunk)`` kept in each, and the chunk's ``chunk / sub_chunk`` sub-chunks
    share its one scale (over all their kept values). An index then takes ``ceil(log2
    sub_chunk)`` bits: at ``chunk=1024`` a sent value costs ``10 + bits + 32 / k`` bits
    without, ``7 + bits + 32 / k`` with ``sub_chunk=128``, so the same bytes carry more
    values; the top ``k_s`` of every sub-chunk keep less of ``|x|^2`` than the top ``k`` of
    the chunk, whose largest values may bunch in one sub-chunk (docs, "LM measurements:
    3000x", the sub-chunk screen). A leaf shorter than ``sub_chunk`` is one sub-chunk keeping
    ``ceil(k_s d / sub_chunk)``::

        payload_bytes(d) = 4 ceil(K b_s / 32) + 4 ceil(K bits / 32) + 4 ceil(R_s / g)
        (b_s = ceil(log2 min(sub_chunk, d)), R_s sub-chunks, K = k_s R_s, g = chunk / sub_chunk)

    Args:
      k: values kept per chunk, in ``[1, chunk]``.
      chunk: values per chunk, ``>= 1`` (Templar: 4096, i.e. 64 x 64).
      bits: bits per value, in ``[1, 8]`` (2: SparseLoCo), or None for float32 values.
      scale: ``"max"`` (``s = max |v|`` over the chunk's kept values) or, with ``bits=1``
        only, ``"mean"`` (``s`` = the mean ``|v|`` of the nonzero kept values: each sent as
        ``s sign(v)``, the least-squares scale of a sign, where ``"max"`` sends every kept
        value at the largest one's magnitude). The same bytes.
      sub_chunk: None (the top-k over the whole chunk) or the values of each sub-chunk the
        top-k runs in, a divisor of ``chunk``; ``k`` must then be a multiple of ``chunk /
        sub_chunk`` (``k_s`` kept per sub-chunk). One scale per chunk either way.

    Returns:
      A :class:`ChunkedTopK` codec.

    Raises:
      ValueError: at construction, ``k``, ``chunk``, ``bits``, ``scale`` or ``sub_chunk``
        outside its rule (the message names the argument; the rules: docs/errors.md).
      TypeError: at construction, ``k``, ``chunk``, ``bits`` or ``sub_chunk`` of the wrong
        kind.

    Example::

        codec = jc.chunked_top_k(64, chunk=4096, bits=2)   # 1.56% density, 2-bit values
        codec = jc.chunked_top_k(64, chunk=1024, bits=1, scale="mean", sub_chunk=128)
        tx = optax.chain(jc.compressed_allreduce(codec, "data"), optax.sgd(0.1))

    References:
      Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
      SparseLoCo", arXiv 2508.15706, 2025; Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum
      Optimization", arXiv 2411.19870, 2024.
    """
    chunk = check_int("chunk", chunk, 1, 2**30)
    k = check_int("k", k, 1, chunk)
    if bits is not None:
        bits = check_int("bits", bits, 1, 8)
    if scale not in SCALES:
        raise ValueError(f"`scale` must be one of {SCALES}, got {scale!r}")
    if scale == "mean" and bits != 1:
        raise ValueError(f"`scale`='mean' needs `bits`=1 (a sign and its scale), got {bits!r}")
    sub_chunk = check_sub_chunk(sub_chunk, chunk)
    if sub_chunk is not None and k % (chunk // sub_chunk):
        raise ValueError(
            f"`k`={k} must be a multiple of `chunk` / `sub_chunk` = {chunk // sub_chunk} "
            f"(the same number kept in every sub-chunk of {sub_chunk} values)"
        )
    return ChunkedTopK(k, chunk, bits, scale, sub_chunk)


def check_sub_chunk(sub_chunk: object, chunk: int) -> int | None:
    """``sub_chunk`` None, or an int dividing ``chunk``, else an error naming it."""
    if sub_chunk is None:
        return None
    sub_chunk = check_int("sub_chunk", sub_chunk, 1, chunk)
    if chunk % sub_chunk:
        raise ValueError(f"`sub_chunk` must divide `chunk`={chunk}, got {sub_chunk}")
    return sub_chunk


__all__ = ["ChunkedTopK", "chunked_top_k", "pack_stream", "stream_words", "unpack_stream"]
