"""Quantizing codecs: fewer bits per coordinate, every coordinate sent.

identity, cast (bf16/fp16/fp8), blockwise int_quant, QSGD, TernGrad, natural
compression and MXNet's 2-bit threshold quantizer. Sub-byte codes are bit-packed into
uint32 words (:mod:`jaxcomp._src.codecs.packing`), so ``payload_bytes`` is what really travels.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes

from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import (
    F32_MAX,
    LARGE_DIVISOR,
    Codec,
    blocks,
    ceil_div,
    check_int,
    check_positive_float,
    check_vector,
    max_abs,
    mean_abs,
    per_value,
    require_key,
    safe_divide,
)
from jaxcomp._src.codecs.base import (
    scaled as fill_plus,
)


def _effective_block(block_size: int | None, d: int) -> int:
    """``None`` means one block for the whole vector."""
    return max(d, 1) if block_size is None else block_size


# --------------------------------------------------------------------------- identity


@dataclasses.dataclass(frozen=True)
class Identity(Codec):
    """No compression: the float32 vector itself (what plain ``pmean`` sends)."""

    flags_nonfinite = True  # scales (or the saturating cast) carry NaN/inf

    unbiased = True
    summable = True

    def encode(self, x, key=None):
        return check_vector(x, self)

    def decode(self, payload, d):
        return payload.astype(jnp.float32)

    def payload_bytes(self, d):
        return 4 * d

    def delta(self, d):
        return 1.0


def identity() -> Identity:
    """The identity codec: float32 on the wire, exact. A baseline and a test oracle.

    ``C(x) = x``; 4 bytes per value, summable (one ``psum``), unbiased, ``delta = 1``. With it
    :func:`jaxcomp.pmean` is plain ``jax.lax.pmean`` by another road: use it to check that
    a pipeline is right before compressing.
    """
    return Identity()


# --------------------------------------------------------------------------- cast

_CAST_DTYPES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "f16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "e4m3": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "fp8_e5m2": jnp.float8_e5m2,
    "e5m2": jnp.float8_e5m2,
}


def top_exponent(dtype) -> int:
    """``t = floor(log2 M)`` for the largest finite value ``M`` of ``dtype``: a scaled cast
    maps ``max |x|`` into ``[2^(t-1), 2^t)``, under ``M`` (fp16: 65504, ``t = 15``; fp8
    e4m3: 448, ``t = 8``; e5m2: 57344, ``t = 15``)."""
    return int(math.floor(math.log2(float(ml_dtypes.finfo(dtype).max))))


def power_of_two_scale(top: jax.Array, exponent: int) -> jax.Array:
    """``s = 2^(k - t)`` for ``top = f 2^k``, ``f`` in ``[0.5, 1)`` (``jnp.frexp``), ``t`` =
    ``exponent``, so that ``top / s`` lies in ``[2^(t-1), 2^t)``; the exponent of ``s`` is held
    to float32's normal range (``top = 0``: ``2^-t``) and to at most ``127 - t``, so that
    ``2^t s``, what ``top / s`` may round up to, stays finite in float32 (``top >= 2^127``:
    ``top / s`` in ``[2^t, 2^(t+1))``, saturating at the type's largest value, under
    ``2^(t+1)``). A non-finite ``top`` is returned as it is: NaN or inf, the flag of a
    non-finite vector. A power of two: ``x / s`` and ``q s`` are exact in float32.
    """
    _, k = jnp.frexp(top)
    e = jnp.clip(k - exponent, -126, 127 - exponent)
    bits = jax.lax.shift_left((e + 127).astype(jnp.int32), jnp.int32(23))
    s = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(jnp.isfinite(top), s, top)


@dataclasses.dataclass(frozen=True)
class Cast(Codec):
    """Round to a narrower float type (round-to-nearest-even), saturating at its max.

    Finite values above the type's largest finite value are clipped to it (a plain
    fp16 cast would turn 1e5 into inf); inf and NaN pass through as themselves.
    Relative error per coordinate <= 2^-(m+1) for m mantissa bits, inside the normal range.

    ``scaled``: the vector is first divided by a power of two ``s`` (one float32 per vector,
    on the wire after the values) that puts ``max |x|`` just under the type's largest value
    (fp16: in ``[2^14, 2^15)``), so every value within ``2^28`` of the largest is in fp16's
    normal range (see :func:`cast`).
    """

    flags_nonfinite = True  # scales (or the saturating cast) carry NaN/inf

    dtype_name: str = "bfloat16"
    scaled: bool = False

    @property
    def dtype(self):
        return jnp.dtype(_CAST_DTYPES[self.dtype_name])

    @property
    def summable(self):  # fp8 sums lose too much; psum only 16/32-bit floats
        return self.dtype.itemsize >= 2 and not self.scaled  # scales differ per device

    @property
    def elementwise(self):  # each coordinate on its own: roundtrip in any shape
        return not self.scaled

    @property
    def rounding_only(self):
        """A scaled 16-bit cast drops only a rounding of each value (see :func:`cast`); a
        scaled fp8 cast (``2^-4`` / ``2^-3`` of each value) is not: it keeps its memory."""
        return self.scaled and self.dtype.itemsize >= 2

    def encode(self, x, key=None):
        x = check_vector(x, self)
        if not self.scaled:
            return self._cast(x)
        scale = power_of_two_scale(max_abs(x[None, :])[0], top_exponent(self.dtype))
        return self._cast(x * (1.0 / scale)), scale[None]

    def _cast(self, x):
        """Round to the type, finite values saturating at its largest. Unscaled, inf stays
        inf. Scaled, ``x / s`` is never inf (a finite ``x`` over a finite ``s`` is under
        ``2^(t+1)``; an inf in ``x`` makes ``s`` inf and ``x / s`` NaN), so a clip alone
        (which keeps NaN) is the same, one select less per value in the encoding's pass."""
        big = float(ml_dtypes.finfo(self.dtype).max)
        if self.scaled:
            return jnp.clip(x, -big, big).astype(self.dtype)
        x = jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x)
        return x.astype(self.dtype)

    def decode(self, payload, d):
        if not self.scaled:
            return payload.astype(jnp.float32)
        values, scale = payload
        return values.astype(jnp.float32) * scale[0]

    def decode_sum(self, payloads, d, scale=1.0, fill=0.0):
        """Scaled: ``fill + s * sum_j q_j (s_j / s) scale``, the rows summed in units of their
        largest scale ``s = max_j s_j`` (:meth:`_sum_in_units`), so that rows near float32's
        largest value (each up to ``M s_j``, ``M`` the type's largest value) average without
        overflowing float32, and rows whose scale is float32's smallest normal (``2^-126``,
        ``max |x|`` under ``2^-111``) do not lose their mean: ``s_j scale`` would be
        subnormal, which XLA:CPU flushes to 0."""
        if not self.scaled:
            return super().decode_sum(payloads, d, scale, fill)
        top = self._largest_scale(payloads)
        return fill_plus(self._sum_in_units(payloads, d, top, scale), top, fill)

    @staticmethod
    def _largest_scale(payloads):
        """``max_j s_j`` of the rows' scales (scaled), as int32 bits (:func:`max_abs`: the
        scales are positive, NaN above inf above the rest, so NaN propagates for any number of
        rows, which a float max reduce need not do)."""
        return max_abs(payloads[1].reshape(1, -1))[0]

    def _sum_in_units(self, payloads, d, top, scale):
        """``sum_j q_j (s_j / top) scale`` (scaled): the rows' sum times ``scale`` in units of
        ``top``, each ``s_j / top`` a power of two (exact)."""
        values, scales = payloads
        return super().decode_sum((values, (scales / top) * scale), d)

    def encode_sum(self, payloads, d, scale=1.0, key=None):
        """Scaled: the mean of ``n`` rows (``scale <= 1/n``) re-encoded with the rows'
        largest scale ``s = max_j s_j``, a bound read from the payloads, not from the sum.

        Each row is decoded straight into units of ``s``: ``q_j * (s_j * scale / s)``, a
        power of two ``s_j / s <= 1`` times ``scale``. So every term is at most ``M scale``
        (``M`` the type's largest value, where ``q_j`` saturates), the sum at most ``M``
        (float32's rounding of it is clipped), and it is cast as it is formed (XLA fuses the
        two; a scale from ``max |mean|`` would write the mean out and read it twice). Summed
        in units of ``s``, finite rows never overflow float32 (in ``x``'s own units, rows
        near float32's largest value could), so the values sent are finite whenever ``s``
        is, and a non-finite row scale is the result's scale: the flag
        (:meth:`flag_arrays`). Values of the mean below ``2^-(t+13) s`` (``t`` =
        :func:`top_exponent`; fp16: ``2^-28`` of the rows' largest) leave fp16's normal
        range."""
        rows = jax.tree.leaves(payloads)[0].shape[0]
        if not self.scaled or scale * rows > 1.0:
            return super().encode_sum(payloads, d, scale, key)
        top = self._largest_scale(payloads)
        return self._cast(self._sum_in_units(payloads, d, top, scale)), top[None]

    def flag_arrays(self, payloads):
        """Scaled: the scales alone. A finite scale comes with finite values (saturated at
        the type's largest, :meth:`encode_sum` never overflows), and a NaN or inf in ``x``
        makes the scale NaN or inf, so the step's flag need not read the values."""
        if not self.scaled:
            return None
        return [p[1] for p in payloads]

    def chunk_unit(self, d):
        """Each value on its own: any chunk (None when ``scaled``: one scale for the whole)."""
        return None if self.scaled else 1

    def roundtrip(self, x, key=None):
        """``decode(encode(x))`` of a float array of any shape: elementwise unscaled; scaled,
        the whole array shares one scale (as the flat vector of its values would)."""
        if self.scaled:
            flat = jnp.ravel(x)
            return self.decode(self.encode(flat), flat.shape[0]).reshape(jnp.shape(x))
        check_vector(jnp.ravel(x), self)  # encode's checks (floating, size), in any shape
        return self._cast(x.astype(jnp.float32)).astype(jnp.float32)

    def payload_bytes(self, d):
        return d * self.dtype.itemsize + (4 if self.scaled else 0)


#: The cast types that are scaled unless ``scaled=`` says otherwise: fp16 and both fp8 types,
#: whose ranges (fp16: 6.1e-5 to 65504; e4m3: 0.016 to 448; e5m2: 6.1e-5 to 57344, normal)
#: are narrower than a gradient's. bfloat16 has float32's exponent range.
SCALED_BY_DEFAULT = ("float16", "float8_e4m3fn", "float8_e5m2")


def cast(dtype="bfloat16", scaled: bool | None = None) -> Cast:
    """Cast to ``dtype`` on the wire: bf16/fp16 or fp8 e4m3/e5m2; fp16 and fp8 scaled by default.

    Halves (16-bit) or quarters (8-bit) the traffic. As torch's ``fp16_compress_hook`` and
    Horovod's ``Compression.fp16``, but saturating instead of overflowing to inf, and (fp16,
    fp8) scaled into the type's range.

    Unscaled, ``C(x)_i = round_t(clip(x_i, -M, M))`` with ``M`` the largest finite value of the
    type and round-to-nearest-even, so the relative error is ``<= 2^-(m+1)`` for ``m``
    mantissa bits (fp16: m = 10, bf16: 7, e4m3: 3, e5m2: 2) inside the normal range; values
    below it lose relative precision (fp16's smallest normal is 6.1e-5) and are flushed to
    zero below its smallest subnormal (6e-8). Unscaled 16-bit payloads are ``summable``: one
    ``psum``, added in the narrow type.

    Scaled (``scaled=True``; the default for fp16 and both fp8 types), as a loss scale per
    vector (Micikevicius et al. 2018) chosen from the vector itself: with ``s = 2^(k - t)``
    for ``max |x| = f 2^k`` (``f`` in ``[0.5, 1)``; ``t = floor(log2 M)``, fp16 and e5m2:
    15, e4m3: 8), ``C(x)_i = s round_t(x_i / s)``, and the payload is the ``d`` narrow
    values and ``s`` as one float32 (``2d + 4`` bytes for fp16, ``d + 4`` for fp8). Dividing
    by a power of two is exact, so the only error is the type's rounding; with ``max |x| / s``
    in ``[2^(t-1), 2^t)`` and the type's smallest normal ``2^-e`` (fp16 and e5m2: ``2^-14``,
    e4m3: ``2^-6``)::

        |C(x)_i - x_i| <= 2^-(m+1) |x_i| + 2^-(e+t-1) max_j |x_j|

    fp16: ``2^-11 |x_i| + 2^-28 max|x|``; e4m3: ``2^-4 |x_i| + 2^-13 max|x|``; e5m2:
    ``2^-3 |x_i| + 2^-28 max|x|`` (the second term bounds the values below the normal
    range, flushed to zero or not) for any ``x`` in float32's normal range, tiny or huge: no
    value saturates and no gradient small against the type's range is lost. Unscaled
    (``scaled=False``), e4m3 saturates at 448 and rounds values under ``2^-10`` to zero: a
    gradient of size 1e-4 is sent as zeros.

    Error feedback: a scaled 16-bit cast drops only a rounding of ``2^-11`` (fp16) of every
    value, nothing a memory need carry: ``error_feedback="auto"`` keeps none for it
    (``rounding_only``). A scaled fp8 cast rounds ``2^7`` (e4m3) / ``2^8`` (e5m2) times
    more coarsely, to nearest and so with the same sign step after step for a slowly
    moving gradient, and flushes values under ``2^-13 max|x|`` (e4m3): ``"auto"`` keeps a
    residual memory ``e <- g + e - C(g + e)`` (``|e_i| <= 2^-4 |g_i + e_i| + 2^-13 max``),
    which re-sends that rounding (measured: docs/choosing-a-codec.md, "fp8 casts are
    scaled by default").
    Stateless collectives (``jc.pmean``, ``jc.psum``, ...) have no memory either way. Each
    device has its own scale, so the payloads are not summable: strategy ``auto`` sends a
    scaled 16-bit cast ``two_phase`` (``jc.choose_strategy``), whose sums are in float32,
    and fp8 by the bytes (``allgather`` or ``two_phase``). A non-finite ``x`` gives a
    non-finite scale (the flag a transform reads).

    Args:
      dtype: ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` (or their jnp dtypes).
      scaled: divide by a power-of-two scale of the vector first (above); None (default):
        True for fp16, fp8_e4m3 and fp8_e5m2, False for bf16 (float32's exponent range).
        ``scaled=False`` is the plain cast (fp16: summable, one ``psum``; ``d`` bytes for fp8),
        right only where the values are known to sit in the type's range.

    Raises:
      ValueError: at construction, ``dtype`` outside its rule (the message names the argument; the
        rules: docs/errors.md).
      TypeError: at construction, ``scaled`` of the wrong kind.

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018 (fp16 ranges, loss scaling);
      Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019;
      Micikevicius et al., "FP8 Formats for Deep Learning", 2022 (e4m3 / e5m2).
    """
    name = None
    if isinstance(dtype, str):
        name = dtype.lower()
    else:
        try:
            name = jnp.dtype(dtype).name
        except TypeError:
            name = None
    if name not in _CAST_DTYPES:
        raise ValueError(
            f"`dtype` must be one of bf16, fp16, fp8_e4m3, fp8_e5m2 (or float32), got {dtype!r}"
        )
    if scaled is not None and not isinstance(scaled, bool):
        raise TypeError(f"`scaled` must be None, True or False, got {scaled!r}")
    dtype_name = jnp.dtype(_CAST_DTYPES[name]).name
    if scaled is None:
        scaled = dtype_name in SCALED_BY_DEFAULT
    return Cast(dtype_name, scaled)


# --------------------------------------------------------------------------- int_quant

#: ``1.5 * 2^23``: adding it to a float32 ``|y| < 2^22`` rounds ``y`` to the nearest integer,
#: ties to even, and leaves that integer in the low bits of the sum's mantissa.
_ROUNDER = 12582912.0
_ROUNDER_BITS = 0x4B400000  # the float32 bits of _ROUNDER


def rounded_codes(y: jax.Array, levels: int) -> jax.Array:
    """``uint32`` codes ``clip(round(y), -L, L) + L`` of float32 ``y``, NaN -> ``L``.

    The same codes as ``(clip(nan_to_num(round(y)), -L, L) + L).astype(uint32)``, bit for
    bit, with round-to-nearest-even done by the float32 adder: ``y`` is clipped to
    ``[-L, L]``, then ``bits(y + 1.5 * 2^23) - bits(1.5 * 2^23) = round(y)`` for ``|y| < 2^22``
    (the sum's exponent is fixed, the low bits of its mantissa hold the integer), so no
    ``round`` or float-to-unsigned conversion runs per value (measured: docs/hot-path.md,
    "Where the time of one update goes, op by op"). The clip matters where ``L / max|x_B|``
    overflows to inf (a block whose largest value is below ``L / F32_MAX``, e.g. ``3.7e-37``
    for int8): ``y = +-inf`` then saturates to the end codes, as ``nan_to_num`` did, instead
    of spilling into the neighbouring codes of the packed word. NaN (an inf or NaN in a
    block whose scale is then non-finite, or ``0 * inf``) gives the middle code ``L``.

    Args:
      y: float32 values, ``x / s`` of a block (any shape).
      levels: ``L``, the levels a side.

    Returns:
      ``uint32`` codes in ``[0, 2L]``, the shape of ``y``.

    Example::

        rounded_codes(jnp.array([0.5, 1.5, -200.0, jnp.nan]), 127)  # [127, 129, 0, 127]
    """
    y = jnp.clip(y, -levels, levels)
    biased = jax.lax.bitcast_convert_type(y + _ROUNDER, jnp.uint32)
    code = biased - jnp.uint32(_ROUNDER_BITS - levels)
    return jnp.where(y == y, code, jnp.uint32(levels))


def in_levels(xb: jax.Array, absmax: jax.Array, levels: int) -> jax.Array:
    """``xb[b] * L / absmax[b]`` per row: a value's place on the ``L`` levels of its block.

    One division per block, a multiply per value (2x faster on XLA:CPU than ``x / s``):
    ``|q s - x| <= s / 2`` up to float32 rounding of ``L / absmax``. A zero block stays
    zero; a non-finite ``absmax`` gives ``inv = 0`` here and a non-finite scale in the
    payload. ``L / absmax`` is subnormal, and XLA flushes it to zero, for ``absmax > L 2^126``,
    inside float32's range for ``L < 4`` (int2: ``absmax > 8.5e37``, int3: ``> 2.6e38``):
    there the block and ``absmax`` are scaled by ``2^-64`` first (exact), a select per value
    that int4 and int8 (``L >= 7``) never need.
    """
    if levels * 2.0**126 < F32_MAX:
        large = absmax > LARGE_DIVISOR
        xb = jnp.where(large[:, None], xb * (1.0 / LARGE_DIVISOR), xb)
        absmax = jnp.where(large, absmax * (1.0 / LARGE_DIVISOR), absmax)
    inv = jnp.where(absmax > 0, levels / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    return xb * inv[:, None]


@dataclasses.dataclass(frozen=True)
class IntQuant(Codec):
    """Blockwise symmetric integer quantization (absmax scaling), bit-packed.

    For a block ``x_B`` of ``block_size`` values and ``L = 2^(bits-1) - 1`` levels each side,
    ``s = max|x_B| / L`` and ``q = round(x / s)`` in ``[-L, L]`` (or stochastic rounding
    ``floor(x / s + u)``, ``u ~ U[0,1)``, which is unbiased). Sent: ``bits`` per value plus one
    float32 scale per block. Deterministic error per value ``<= s / 2 = absmax / (2L)``.

    ``bits == 1`` is the degenerate case without a zero level: deterministic sends the sign
    with ``s = mean|x_B|`` (scaled sign), stochastic sends ``+-absmax`` with
    ``P(+) = (1 + x/absmax) / 2`` (unbiased).

    References: Dettmers, "8-bit approximations for parallelism in deep learning" (2016);
    ZeRO++ qgZ (Wang et al., 2023); EQuARX (2025).
    """

    flags_nonfinite = True  # scales (or the saturating cast) carry NaN/inf

    bits: int = 8
    block_size: int = 256
    stochastic: bool = False

    @property
    def unbiased(self):
        return self.stochastic

    @property
    def levels(self) -> int:
        return max(2 ** (self.bits - 1) - 1, 1)

    def delta(self, d):
        if self.stochastic or self.bits == 1:
            return None
        bound = min(self.block_size, max(d, 1)) / (4 * self.levels**2)
        return 1.0 - bound if bound < 1 else None

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        u = None
        if self.stochastic:
            nb = ceil_div(d, self.block_size)
            u = jax.random.uniform(require_key(key, self), (nb * self.block_size,), jnp.float32)
        # Whole blocks that also fill whole words are a view of x; only the rest is padded.
        # (Padding all of x made XLA:CPU write two padded copies of it: 2x slower for 25M.)
        unit = math.lcm(self.block_size, packing.codes_per_word(self.bits))
        m = d // unit * unit
        if m in (0, d):
            return self._encode_blocks(x, u)
        head = self._encode_blocks(x[:m], None if u is None else u[:m])
        tail = self._encode_blocks(x[m:], None if u is None else u[m:])
        return tuple(jnp.concatenate(parts) for parts in zip(head, tail, strict=True))

    def _encode_blocks(self, x, u):
        """(packed codes, per-block scales) of ``x``; ``u``: uniform noise, one per padded value."""
        d = x.shape[0]
        xb = blocks(x, self.block_size)
        absmax = max_abs(xb)
        if self.stochastic:
            u = u[: xb.size].reshape(xb.shape)
        if self.bits == 1:
            if self.stochastic:
                scale = absmax
                p_pos = 0.5 * (1.0 + safe_divide(xb, scale[:, None]))
                code = (u < p_pos).astype(jnp.uint32)
            else:
                count = jnp.clip(d - jnp.arange(xb.shape[0]) * self.block_size, 1, self.block_size)
                scale = mean_abs(xb, count)  # summed pre-scaled: never overflows
                code = (xb >= 0).astype(jnp.uint32)
        else:
            L = self.levels
            scale = absmax / L
            y = in_levels(xb, absmax, L)
            if self.stochastic:
                q = jnp.clip(jnp.nan_to_num(jnp.floor(y + u)), -L, L)
                code = (q + L).astype(jnp.uint32)
            else:
                code = rounded_codes(y, L)
        return packing.pack(code.reshape(-1)[:d], self.bits), scale

    def decode(self, payload, d):
        words, scale = payload
        code = packing.unpack(words, self.bits, d).astype(jnp.int32)
        if self.bits == 1:
            q = (2 * code - 1).astype(jnp.float32)
        else:
            q = (code - self.levels).astype(jnp.float32)
        return q * per_value(scale, self.block_size, d)

    def payload_bytes(self, d):
        return 4 * packing.packed_words(d, self.bits) + 4 * ceil_div(d, self.block_size)

    def chunk_unit(self, d):
        """Whole blocks that fill whole words (deterministic rounding: stochastic noise is
        drawn for the whole vector)."""
        if self.stochastic:
            return None
        return math.lcm(self.block_size, packing.codes_per_word(self.bits))


def int_quant(bits: int = 8, block_size: int = 256, stochastic: bool = False) -> IntQuant:
    """Blockwise integer quantization to ``bits`` in 1..8, one float32 scale per block.

    For each block ``x_B`` of ``block_size`` values, with ``L = 2^(bits-1) - 1`` levels a side:
    ``s = max|x_B| / L``, ``q_i = round(x_i / s)`` in ``[-L, L]`` (``stochastic=True``:
    ``floor(x_i / s + u_i)``, ``u_i ~ U[0, 1)``, unbiased), decoded as ``q_i * s``. The
    deterministic error is at most ``s / 2`` per value. ``bits=1`` sends signs with
    ``s = mean|x_B|`` (or ``+-max|x_B|`` stochastically). See :class:`IntQuant`.

    Bytes per value: ``bits/8`` (packed ``32 // bits`` to a uint32) plus ``4/block_size``.
    int8 is ~3.9x smaller than float32, int4 ~7.5x.

    Args:
      bits: bits per value, 1..8.
      block_size: values per float32 scale, >= 1.
      stochastic: stochastic rounding (unbiased; then error feedback defaults to none).

    Raises:
      ValueError: at construction, ``bits`` or ``block_size`` outside its rule (the message names
        the argument; the rules: docs/errors.md).
      TypeError: at construction, ``bits``, ``block_size`` or ``stochastic`` of the wrong kind.

    References:
      Dettmers, "8-bit Approximations for Parallelism in Deep Learning", ICLR 2016;
      Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
      Training", 2023 (qgZ: blockwise int4 gradients).
    """
    bits = check_int("bits", bits, 1, 8)
    block_size = check_int("block_size", block_size, 1)
    if not isinstance(stochastic, bool):
        raise TypeError(f"`stochastic` must be a bool, got {stochastic!r}")
    return IntQuant(bits, block_size, stochastic)


# --------------------------------------------------------------------------- QSGD


@dataclasses.dataclass(frozen=True)
class QSGD(Codec):
    """QSGD (Alistarh et al., 2017): stochastic rounding of ``|x_i| / ||x||`` to ``s`` levels.

    Per bucket of ``bucket_size`` values, with ``l_i = floor(s |x_i| / ||x|| + u_i)``:
    ``Q(x)_i = ||x|| * sign(x_i) * l_i / s``. Unbiased, with variance
    ``E||Q(x) - x||^2 <= min(n / s^2, sqrt(n) / s) ||x||^2`` for a bucket of n values.
    Sent: ``ceil(log2(2s + 1))`` bits per value (sign and level in one code) plus one float32
    norm per bucket. 16 levels (4-bit codes + sign) is the paper's no-loss setting.
    """

    flags_nonfinite = True  # scales (or the saturating cast) carry NaN/inf

    levels: int = 16
    bucket_size: int = 512

    unbiased = True
    stochastic = True

    @property
    def bits(self) -> int:
        return math.ceil(math.log2(2 * self.levels + 1))

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        xb = blocks(x, self.bucket_size)
        # max_abs, not jnp.max: XLA:CPU's float max over 4,096 values or more can drop a NaN
        # (a bucket's absmax then 0 and its norm 0: the NaN sent as 0, the payload finite).
        absmax = max_abs(xb)
        # ||x|| computed as absmax * ||x / absmax|| so 1e30 entries do not overflow. A norm
        # past float32's range (finite values: 600 of 2e37) is sent as F32_MAX: any norm at
        # least max |x_i| keeps Q unbiased (l_i / s <= 1), where inf decoded 0 * inf = NaN.
        norm = absmax * jnp.sqrt(jnp.sum(safe_divide(xb, absmax[:, None]) ** 2, axis=1))
        norm = jnp.where(jnp.isfinite(absmax), jnp.minimum(norm, F32_MAX), norm)
        r = safe_divide(jnp.abs(xb), norm[:, None]) * self.levels
        u = jax.random.uniform(require_key(key, self), xb.shape, jnp.float32)
        lvl = jnp.clip(jnp.nan_to_num(jnp.floor(r + u)), 0, self.levels)
        code = (jnp.where(xb < 0, -lvl, lvl) + self.levels).astype(jnp.uint32)
        return packing.pack(code.reshape(-1)[:d], self.bits), norm

    def decode(self, payload, d):
        words, norm = payload
        code = packing.unpack(words, self.bits, d).astype(jnp.int32) - self.levels
        return code.astype(jnp.float32) / self.levels * per_value(norm, self.bucket_size, d)

    def payload_bytes(self, d):
        return 4 * packing.packed_words(d, self.bits) + 4 * ceil_div(d, self.bucket_size)


def qsgd(levels: int = 16, bucket_size: int = 512) -> QSGD:
    """QSGD with ``levels`` in 1..127 quantization levels, one norm per bucket.

    Per bucket of ``bucket_size`` values, with ``s = levels`` and ``u_i ~ U[0, 1)``::

        l_i = floor(s |x_i| / ||x|| + u_i),     Q(x)_i = ||x|| * sign(x_i) * l_i / s

    Unbiased, ``E||Q(x) - x||^2 <= min(n / s^2, sqrt(n) / s) ||x||^2`` for a bucket of ``n``
    values. ``ceil(log2(2s + 1))`` bits per value plus one float32 norm per bucket. See
    :class:`QSGD`.

    Args:
      levels: quantization levels ``s``, 1..127 (16: the paper's no-loss setting).
      bucket_size: values per norm, >= 1.

    Raises:
      ValueError: at construction, ``levels`` or ``bucket_size`` outside its rule (the message names
        the argument; the rules: docs/errors.md).
      TypeError: at construction, ``levels`` or ``bucket_size`` of the wrong kind.

    References:
      Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD via
      Gradient Quantization and Encoding", NeurIPS 2017.
    """
    levels = check_int("levels", levels, 1, 127)
    bucket_size = check_int("bucket_size", bucket_size, 1)
    return QSGD(levels, bucket_size)


# --------------------------------------------------------------------------- TernGrad


@dataclasses.dataclass(frozen=True)
class TernGrad(Codec):
    """TernGrad (Wen et al., 2017): ``s * sign(x_i) * b_i`` with ``b_i ~ Bernoulli(|x_i| / s)``.

    ``s = max|x|`` per block (``block_size=None``: one block per vector, the paper's
    per-layer scaler). Values in {-s, 0, s}: 2-bit codes, 16 per uint32, plus one float32
    scale per block. Unbiased; variance ``<= s ||x||_1 - ||x||^2``.
    """

    flags_nonfinite = True  # scales (or the saturating cast) carry NaN/inf

    block_size: int | None = None

    unbiased = True
    stochastic = True

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        xb = blocks(x, _effective_block(self.block_size, d))
        # max_abs, not jnp.max: XLA:CPU's float max over 4,096 values or more can drop a NaN
        # (a finite scale, the NaN value then sent as 0: a NaN gradient hidden).
        scale = max_abs(xb)
        p = safe_divide(jnp.abs(xb), scale[:, None])
        u = jax.random.uniform(require_key(key, self), xb.shape, jnp.float32)
        keep = u < p
        code = jnp.where(keep, jnp.where(xb < 0, 2, 1), 0).astype(jnp.uint32)
        return packing.pack(code.reshape(-1)[:d], 2), scale

    def decode(self, payload, d):
        words, scale = payload
        code = packing.unpack(words, 2, d)
        tern = jnp.where(code == 1, 1.0, jnp.where(code == 2, -1.0, 0.0))
        return tern * per_value(scale, _effective_block(self.block_size, d), d)

    def payload_bytes(self, d):
        return 4 * packing.packed_words(d, 2) + 4 * ceil_div(
            d, _effective_block(self.block_size, d)
        )


def terngrad(block_size: int | None = None) -> TernGrad:
    """TernGrad ternary quantization; ``block_size=None`` scales per vector (per layer).

    ``C(x)_i = s * sign(x_i) * b_i`` with ``s = max|x_B|`` and ``b_i ~ Bernoulli(|x_i| / s)``:
    values in ``{-s, 0, s}``, unbiased, variance ``<= s ||x||_1 - ||x||^2``. 2-bit codes,
    16 per uint32 word, plus one float32 scale per block. See :class:`TernGrad`.

    Args:
      block_size: values per scale, or None for one scale per vector (the paper's per-layer
        scaler).

    Raises:
      ValueError: at construction, ``block_size`` outside its rule (the message names the argument;
        the rules: docs/errors.md).
      TypeError: at construction, ``block_size`` of the wrong kind.

    References:
      Wen, Xu, Yan, Wu, Wang, Chen, Li, "TernGrad: Ternary Gradients to Reduce Communication
      in Distributed Deep Learning", NeurIPS 2017.
    """
    if block_size is not None:
        block_size = check_int("block_size", block_size, 1)
    return TernGrad(block_size)


# --------------------------------------------------------------------------- natural


@dataclasses.dataclass(frozen=True)
class Natural(Codec):
    """Natural compression (Horvath et al., 2019): stochastic rounding to a power of two.

    ``x = sign * 2^e * (1 + m)`` with ``m`` in [0, 1) is sent as ``sign * 2^e`` with
    probability ``1 - m`` and ``sign * 2^(e+1)`` with probability ``m`` — unbiased, variance
    ``<= ||x||^2 / 8``. Only the sign bit and the 8 exponent bits travel: 9 bits per value
    (1-bit signs packed 32 per word, exponents 4 per word). Denormals round to 0 or to the
    smallest normal, also unbiased; inf and NaN decode to inf.
    """

    unbiased = True
    stochastic = True

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        u = jax.lax.bitcast_convert_type(x, jnp.uint32)
        sign = u >> 31
        exponent = (u >> 23) & 0xFF
        mantissa = u & 0x7FFFFF
        r = jax.random.bits(require_key(key, self), (d,), jnp.uint32) >> 9  # uniform in [0, 2^23)
        up = (r < mantissa) & (exponent < 254)  # never round a finite value up to inf
        exponent = exponent + up.astype(jnp.uint32)
        return packing.pack(sign, 1), packing.pack(exponent, 8)

    def decode(self, payload, d):
        signs, exponents = payload
        sign = packing.unpack(signs, 1, d)
        exponent = packing.unpack(exponents, 8, d)
        return jax.lax.bitcast_convert_type((sign << 31) | (exponent << 23), jnp.float32)

    def payload_bytes(self, d):
        return 4 * packing.packed_words(d, 1) + 4 * packing.packed_words(d, 8)


def natural() -> Natural:
    """Natural compression: unbiased rounding to powers of two, 9 bits per value.

    With ``x = sign * 2^e * (1 + m)``, ``m`` in ``[0, 1)``: ``C(x) = sign * 2^e`` with
    probability ``1 - m`` and ``sign * 2^(e+1)`` with probability ``m``. Unbiased, variance
    ``E||C(x) - x||^2 <= ||x||^2 / 8``. Only the sign bit and the 8 exponent bits travel.
    See :class:`Natural`.

    References:
      Horvath, Ho, Horvath, Sahu, Canini, Richtarik, "Natural Compression for Distributed
      Deep Learning", 2019.
    """
    return Natural()


# --------------------------------------------------------------------------- MXNet 2-bit


@dataclasses.dataclass(frozen=True)
class Threshold2Bit(Codec):
    """MXNet's 2-bit compression: ``x >= t -> +t``, ``x <= -t -> -t``, else 0.

    Codes are 2 bits, 16 per uint32 word; no scale travels (``t`` is static). What is not
    sent stays in the error-feedback residual and goes out once it grows past ``t`` — use
    it with ``error_feedback="residual"`` (MXNet always does).
    """

    threshold: float = 0.5

    def encode(self, x, key=None):
        x = check_vector(x, self)
        code = jnp.where(x >= self.threshold, 1, jnp.where(x <= -self.threshold, 2, 0))
        return packing.pack(code.astype(jnp.uint32), 2)

    def decode(self, payload, d):
        code = packing.unpack(payload, 2, d)
        t = jnp.float32(self.threshold)
        return jnp.where(code == 1, t, jnp.where(code == 2, -t, 0.0))

    def payload_bytes(self, d):
        return 4 * packing.packed_words(d, 2)


def threshold_2bit(threshold: float = 0.5) -> Threshold2Bit:
    """MXNet-style 2-bit threshold quantization (16x smaller than float32).

    ``C(x)_i = t`` if ``x_i >= t``, ``-t`` if ``x_i <= -t``, else ``0``: 2-bit codes, 16 per
    uint32 word, no scale on the wire (``t`` is static). Biased: what is not sent must stay
    in the residual error-feedback memory (the default) and goes out once it grows past
    ``t``, as in MXNet, so pick ``t`` near the typical gradient magnitude. Not contractive:
    a device sends at most ``t`` per value and step, so where its gradient stays above ``t``
    its memory grows by ``|g| - t`` every step, without bound, and training converges to the
    point where the mean of the clipped gradients vanishes, not to the optimum of the mean
    loss (measured: docs/choosing-a-codec.md, "What each exchange converges to"). ``t``
    above every device's gradient keeps the memory under ``t``.

    Args:
      threshold: ``t`` > 0.

    Raises:
      ValueError: at construction, ``threshold`` outside its rule (the message names the argument;
        the rules: docs/errors.md).
      TypeError: at construction, ``threshold`` of the wrong kind.

    References:
      Apache MXNet, "Gradient Compression" (``kvstore.set_gradient_compression``, type
      ``2bit``); the threshold-and-residual idea is Strom, "Scalable Distributed DNN
      Training Using Commodity GPU Cloud Computing", Interspeech 2015.
    """
    return Threshold2Bit(check_positive_float("threshold", threshold))


__all__ = ["identity", "cast", "int_quant", "qsgd", "terngrad", "natural", "threshold_2bit"]
