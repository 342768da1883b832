"""Sign compression: one bit per coordinate (signSGD, scaled sign / 1-bit SGD, EF-signSGD)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import (
    Codec,
    blocks,
    ceil_div,
    check_int,
    check_vector,
    fold_rows,
    max_abs,
    mean_abs,
    per_value,
    safe_divide,
)

_SCALES = (None, "mean", "rms")


@dataclasses.dataclass(frozen=True)
class Sign(Codec):
    """``C(x) = scale * sign(x)``, signs bit-packed 32 per uint32 word.

    * ``scale=None`` — signSGD (Bernstein et al., 2018): decodes to +-1. One float32 per block
      still travels: 1 where the block has a non-zero value, 0 for an all-zero block (so a
      zero gradient decodes to zero, never to +-1), NaN where the block is not finite.
    * ``scale="mean"`` — scaled sign (1-bit SGD, Seide et al., 2014; EF-signSGD, Karimireddy
      et al., 2019): ``scale = ||x_B||_1 / |B|`` per block. With error feedback it converges
      like SGD. Contractive: ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / |B|``, so
      ``delta = ||x||_1^2 / (|B| ||x||^2) >= 1 / |B|``.
    * ``scale="rms"`` — signs scaled by the block's root mean square ``||x_B||_2 /
      sqrt(|B|)`` (the compressed momentum of DeepSpeed's 1-bit Adam): ``||C(x)|| = ||x||``.
      The mean minimizes ``||C(x) - x||``, so every step moves less than ``x`` (by ``||x||_1 /
      (sqrt(|B|) ||x||_2)``, far below 1 for a heavy-tailed vector) and error feedback pays
      the rest late; the root mean square keeps the step's norm. Not contractive for every
      ``x`` (``delta`` is None). Computed as a scaled norm (:func:`root_mean_square`): a
      finite block gives a finite scale at most ``max |x|``.

    ``block_size=None`` uses one scale per vector. Zero maps to the positive sign: one bit
    has no zero, so a coordinate that is exactly zero inside a non-zero block decodes to
    ``+-scale``. ``exact_zeros=True`` adds one bit per packed word (32 coordinates), set where
    the word's 32 values are all zero: those decode to exactly 0 (an embedding row of a token
    not seen, 32-aligned, stays put), and the scale is taken over the other values only
    (``"rms"`` keeps ``||C(x)|| = ||x||``, ``"mean"`` is their mean ``|x|``). 1/32 more bits.
    """

    scale: str | None = "mean"
    block_size: int | None = None
    exact_zeros: bool = False

    flags_nonfinite = True  # a non-finite block gives a non-finite scale

    @property
    def votes(self) -> bool:
        """``(packed sign words, f32 block scales)`` payloads (without the zero words)."""
        return not self.exact_zeros

    def _block(self, d: int) -> int:
        return max(d, 1) if self.block_size is None else self.block_size

    def delta(self, d):
        return 1.0 / self._block(d) if self.scale == "mean" else None

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        bs = self._block(d)
        xb = blocks(x, bs)
        count = jnp.clip(d - jnp.arange(xb.shape[0]) * bs, 1, bs)
        if self.scale == "mean" and self.block_size is None and not self.exact_zeros:
            return signs_and_mean_abs(xb, count, d)  # one pass (blocks: see chunk_unit)
        signs = packing.pack((x < 0).astype(jnp.uint32), 1)
        if self.exact_zeros:
            nonzero = nonzero_words(x)
            sent = blocks(per_value(nonzero, 32, d), bs)  # 1.0 where the value's word is sent
            count = jnp.maximum(jnp.sum(sent, axis=1), 1.0)  # an all-zero block: scale 0
        if self.scale == "mean":
            scale = mean_abs(xb, count)  # summed pre-scaled: never overflows
        elif self.scale == "rms":
            scale = root_mean_square(xb, count.astype(jnp.float32))
        else:  # 1 for a non-zero block, 0 for a zero block; NaN/inf propagate through 0 * max
            absmax = max_abs(xb)
            scale = (absmax > 0).astype(jnp.float32) + 0.0 * absmax
        if self.exact_zeros:
            return signs, scale, packing.pack(nonzero.astype(jnp.uint32), 1)
        return signs, scale

    def decode(self, payload, d):
        words, scale = payload[:2]
        negative = packing.unpack(words, 1, d)
        x = jnp.where(negative == 1, -1.0, 1.0) * per_value(scale, self._block(d), d)
        if self.exact_zeros:
            nonzero = packing.unpack(payload[2], 1, packing.packed_words(d, 1))
            x = jnp.where(per_value(nonzero, 32, d) == 1, x, 0.0)
        return x

    def chunk_unit(self, d):
        """Whole blocks of whole words; None with one scale for the whole vector (or the
        words of exact zeros, packed over the whole vector)."""
        if self.block_size is None or self.exact_zeros:
            return None
        return math.lcm(self.block_size, 32)

    def payload_bytes(self, d):
        words = packing.packed_words(d, 1)
        zero_words = 4 * packing.packed_words(words, 1) if self.exact_zeros else 0
        return 4 * words + 4 * ceil_div(d, self._block(d)) + zero_words


def _add_pairs(a, b):
    return a[0] + b[0], a[1] + b[1]


def signs_and_mean_abs(xb: jax.Array, count: jax.Array, d: int) -> tuple[jax.Array, jax.Array]:
    """The packed sign words of the ``d`` values of ``xb`` (``[blocks, block_size]``, zero
    padded) and each block's ``sum_j |xb[b, j]| / count[b]``, in one pass over ``xb``.

    Each word ``w = sum_k [x_{32w+k} < 0] << k`` and its 32 values' share of the block's mean,
    ``p_w = sum_k |x_{32w+k}| / count``, are one variadic reduce over ``[blocks, words, 32]``:
    a single loop with two outputs, where XLA:CPU (jaxlib 0.10.2) otherwise compiles one loop
    per output, each reading ``xb`` (with residual feedback ``g`` and ``e``): the signs' pass
    and the scale's pass become one. The block's scale is then ``sum_w p_w``, a reduce over
    ``block_size / 32`` partial sums. The words are those of ``packing.pack(x < 0, 1)``; the
    scale adds the same pre-scaled terms as :func:`~jaxcomp._src.codecs.base.mean_abs` (at
    most ``max |x|``, never overflowing; NaN and inf propagate), 32 at a time and then the
    partial sums, so its last bits may differ from that order's by a few ulp (a sum of
    positive terms in another order; tests/test_hot_path_exact.py bounds it by ``1e-6``
    relative).
    Needs whole words per block: ``block_size % 32 == 0``, or one block (padded here to whole
    words: the padding is zero, negative nowhere, adding nothing). :class:`Sign` uses it for
    one scale per vector only: block scales are encoded a chunk at a time by
    ``fuse_residuals=True``, whose chunks give the whole leaf's bits only where both compile
    the scale's sum alike, which the two passes do for blocks of 128 (docs/hot-path-copies.md).
    """
    nb, bs = xb.shape
    rows = jnp.pad(xb, ((0, 0), (0, -bs % 32))).reshape(nb, ceil_div(bs, 32), 32)
    codes = (rows < 0).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    terms = jnp.abs(rows) * (1.0 / count.astype(jnp.float32))[:, None, None]
    zero = (jnp.uint32(0), jnp.float32(0.0))
    words, partial = jax.lax.reduce((codes, terms), zero, _add_pairs, (2,))
    return words.reshape(-1)[: packing.packed_words(d, 1)], jnp.sum(partial, axis=1)


def nonzero_words(x: jax.Array) -> jax.Array:
    """``float32[ceil(d / 32)]``: 1 where a packed word's 32 values hold a non-zero (or a
    non-finite) value, 0 where all are exactly zero.

    Float32 words are tested on the bits of ``|x|`` (``x``'s int32 bits, sign cleared), the
    values below the smallest normal float counted as zero, as XLA's float compare (which
    flushes denormals) counts them: XLA:CPU fuses an integer reduce with its producer, while
    the float max of ``|x|`` went to its reduction kernel, which read ``|x|`` written out
    whole first (a temporary as large as ``x``)."""
    xb = blocks(x, 32)
    if xb.dtype != jnp.float32:
        return (max_abs(xb) != 0).astype(jnp.float32)  # a NaN kept (docs/errors.md)
    magnitude = jax.lax.bitcast_convert_type(xb, jnp.int32) & 0x7FFFFFFF
    return (jnp.max(magnitude, axis=1) >= _SMALLEST_NORMAL_BITS).astype(jnp.float32)


#: The int32 bits of float32's smallest normal value, 2^-126.
_SMALLEST_NORMAL_BITS = 0x00800000


def root_mean_square(xb: jax.Array, count: jax.Array) -> jax.Array:
    """``sqrt(sum_j xb[b, j]^2 / count[b])`` per row as ``m sqrt(sum (x / m)^2 / count)``
    (``m = max |x|``): at most ``m``, so a finite row never overflows; 0 for a zero row;
    NaN and inf propagate. Rows above ``2^64`` are scaled by ``2^-64`` (exact) before the
    division, whose reciprocal XLA would otherwise flush to zero (:func:`safe_divide`).

    The maximum and the sum of squares fold each row's 8 column groups first
    (:func:`max_abs`, :func:`fold_rows`; the sum is then that of a pairwise tree of 8
    groups): a two-phase worker's rows, reduced at once, were written out whole as ``x / m``
    before the reduce (a temporary as large as ``x``; folded: a quarter of it). A lone
    vector's reduce had the squares fused in; folded, it writes that quarter too.
    """
    biggest = max_abs(xb)
    unit = safe_divide(xb, biggest[:, None])  # rows above 2^64 scaled by 2^-64 there
    squares = fold_rows(unit * unit, jnp.add)
    return biggest * jnp.sqrt(jnp.sum(squares, axis=1) / count)


def sign(
    scale: str | None = "mean", block_size: int | None = None, exact_zeros: bool = False
) -> Sign:
    """1-bit sign codec: ``scale=None`` (signSGD), ``"mean"`` (scaled sign, 1-bit SGD) or
    ``"rms"`` (signs that keep the norm: 1-bit Adam's compressed momentum).

    ``C(x)_i = scale_B * sign(x_i)`` with ``scale_B = ||x_B||_1 / |B|`` per block ``B``
    (``"mean"``), ``||x_B||_2 / sqrt(|B|)`` (``"rms"``) or 1 (``None``); signs are bit-packed
    32 to a uint32 word, plus one float32 per block (the same bytes for every scale). Scaled
    sign is contractive, ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / |B|``, so with residual
    error feedback it converges like SGD; ``"rms"`` keeps ``||C(x)|| = ||x||`` (each step as
    long as the vector it stands for), the default codec of :func:`jaxcomp.onebit_adam` and
    :func:`jaxcomp.zero_one_adam`. See :class:`Sign`.

    ~32x smaller than float32. Biased: use it with error feedback (``scale="mean"`` or
    ``"rms"``) or with ``strategy="majority_vote"`` (``scale=None``).

    Args:
      scale: ``"mean"`` (scaled sign), ``"rms"`` (root mean square: the norm kept) or None
        (plain signs, signSGD).
      block_size: values per scale, or None for one scale per vector.
      exact_zeros: False (default): a value exactly zero decodes to ``+scale`` (a sign has no
        zero). True: one more bit per 32 values marks the words whose values are all zero,
        which decode to 0 (the scales are taken over the other values); ``payload_bytes``
        counts it (1/32 more sign bits). Not for ``strategy="majority_vote"``.

    Returns:
      A :class:`Sign` codec.

    Raises:
      ValueError: at construction, ``scale`` or ``block_size`` outside its rule (the message names
        the argument; the rules: docs/errors.md).
      TypeError: at construction, ``block_size`` or ``exact_zeros`` of the wrong kind.

    Example::

        c = jc.sign(scale="rms")
        x_hat = c.decode(c.encode(x), x.shape[0])   # ||x_hat|| == ||x||

    References:
      Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its Application to
      Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014;
      Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed Optimisation for
      Non-Convex Problems", ICML 2018 (and "signSGD with Majority Vote", ICLR 2019);
      Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019;
      Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication
      Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021 (``"rms"``).
    """
    if scale not in _SCALES:
        raise ValueError(f"`scale` must be one of {_SCALES}, got {scale!r}")
    if block_size is not None:
        block_size = check_int("block_size", block_size, 1)
    if not isinstance(exact_zeros, bool):
        raise TypeError(f"`exact_zeros` must be True or False, got {exact_zeros!r}")
    return Sign(scale, block_size, exact_zeros)
