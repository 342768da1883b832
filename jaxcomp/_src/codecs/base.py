"""The Codec type: a compressor is data (its hyperparameters) plus two pure functions.

A codec maps a 1-D float vector ``x`` of static size ``d`` to a *payload* (a pytree of
arrays whose shapes depend only on ``d``) and back. Codecs know nothing of devices or
axes: how payloads travel is the business of :mod:`jaxcomp._src.collectives`.

Conventions every codec follows:

* ``encode(x, key)`` works in float32 and never produces NaN from finite input; an
  all-zero ``x`` decodes to exactly zero.
* ``decode(payload, d)`` returns ``float32[d]``.
* ``payload_bytes(d)`` is an analytic formula and equals the summed ``nbytes`` of the
  payload arrays (tested for every codec and many sizes).
* ``unbiased``: ``E_key[decode(encode(x, key))] == x``.
* ``summable``: payloads of several devices can be added leaf-wise (``psum``) and decode
  to the sum of their decodings. Floating leaves are summed; integer leaves of a
  summable payload must be identical on every device (e.g. shared random indices) and
  are passed through unsummed.
* ``shared_randomness``: the key must be the same on every device (random-k), instead
  of independent noise per device (stochastic rounding).
* ``votes``: the payload is ``(sign words, block scales)`` — 1-bit signs packed 32 per
  uint32 word and one float32 scale per block — so devices can *count* their signs
  (``strategy="majority_vote"``). Collectives ask for this capability, never for a class.
* ``flags_nonfinite``: the payload's floating leaves are non-finite whenever ``x`` holds a
  NaN or an inf (a scale from ``max |x|`` or ``mean |x|``, or the saturating cast itself),
  so a transform detects a bad gradient from the small payload instead of another pass
  over ``x``.
* ``dense``: every coordinate travels (casts, quantizers, signs); False for sparse codecs
  (top-k, random-k, threshold), whose decoding is zero off the selected coordinates, so they
  cannot carry values that must all arrive (an FSDP weight all-gather).
* ``elementwise``: each coordinate is encoded and decoded on its own (casts), so
  :meth:`Codec.roundtrip` takes a float array of any shape and gives the values of the 1-D
  ``decode(encode(x))`` where they lie. A transform then forms a leaf's residual in the
  leaf's own shape, a pass that XLA writes in place over the memory.
* ``rounding_only``: every coordinate travels, rounded to a float type whose range the
  codec scales the vector into (a scaled 16-bit cast): ``|C(x)_i - x_i| <= 2^-(m+1) |x_i|``
  plus a term for values far below the largest (fp16: ``2^-28 max |x|``), for any ``x`` in
  float32's normal range. ``error_feedback="auto"`` keeps no memory for such a codec.
* ``delta(d)``: for biased contractive codecs, ``||C(x) - x||^2 <= (1 - delta) ||x||^2``
  (None where no such bound holds).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Payload = Any


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scaled(total: jax.Array, scale: float = 1.0, fill: jax.Array | float = 0.0) -> jax.Array:
    """``fill + scale * total``, skipping what is the identity (for :meth:`Codec.decode_sum`)."""
    if not (isinstance(scale, float | int) and scale == 1):
        total = total * scale
    if not (isinstance(fill, float | int) and fill == 0):
        total = total + fill
    return total


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def after(x: jax.Array, dep: jax.Array | None) -> jax.Array:
    """``x`` bit for bit, computed only once the scalar ``dep`` is (None: ``x`` as is).

    ``x``'s bits plus ``(bits(dep) & 0x7fffffff) >> 31``, always 0, which XLA does not
    fold: a data dependence that orders work where XLA:CPU would not (it drops
    ``optimization_barrier`` before scheduling). Used to keep a buffer from being made, or a
    collective from running, before what should precede it, so that fewer large buffers are
    live at once (a scatter's zero operand is otherwise copied from a constant at the
    program's start and held through it).
    """
    if dep is None:
        return x
    dep = dep.reshape(())
    width = _UINT[dep.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(dep, width) if dep.dtype != width else dep
    sign = jnp.array(1 << (8 * dep.dtype.itemsize - 1), width)
    zero = jax.lax.shift_right_logical(bits & ~sign, jnp.array(8 * dep.dtype.itemsize - 1, width))
    target = _UINT[x.dtype.itemsize]
    raw = jax.lax.bitcast_convert_type(x, target) if x.dtype != target else x
    raw = raw + zero.astype(target)
    return jax.lax.bitcast_convert_type(raw, x.dtype) if x.dtype != target else raw


def sum_of_decodes(codec: Codec, payloads, d: int, scale=1.0, fill=0.0) -> jax.Array:
    """``fill + sum_j scale * decode(payloads[j])``, one fused decode-and-add pass per device.

    Each decode is scaled before it is added (``scale = 1/n``: the mean), so a mean that fits
    float32 never overflows in the sum: ``n`` rows near float32's largest value, each finite,
    summed first and scaled after, made an inf (then NaN) mean where the mean itself is
    finite (sign, int, QSGD, natural, identity through ``allgather`` / ``two_phase``, until
    2026-11-27). Scaling by a power of two (``n`` = 2, 4, 8, ...) is exact, but XLA:CPU
    contracts the decode's multiply into the add differently, so the bits may move by the
    rounding of the adds (docs/strategies.md).

    Decoding the whole ``[n, d]`` stack and reducing it over the device axis was 6x slower
    than two decodes for d = 25M on XLA:CPU (1.6 s vs 0.25 s each; float16 casts 7-10x).
    """
    n = jax.tree.leaves(payloads)[0].shape[0]

    def term(j):
        return scaled(codec.decode(jax.tree.map(lambda a: a[j], payloads), d), scale)

    # Start from the first decode (not zeros): under shard_map the carry must have the same
    # varying axes as the payloads (two_phase decodes an all_to_all result).
    return scaled(jax.lax.fori_loop(1, n, lambda j, total: total + term(j), term(0)), 1.0, fill)


@dataclasses.dataclass(frozen=True)
class Codec:
    """Base class of every codec. Subclasses are frozen (hashable, static under jit).

    A codec ``C`` maps ``x`` (``float32[d]``) to a payload and back, ``C(x) =
    decode(encode(x, key), d)``, with ``payload_bytes(d)`` the exact bytes on the wire. Two
    families (Beznosikov, Horvath, Richtarik, Safaryan, "On Biased Compression for
    Distributed Learning", 2020; Karimireddy et al., ICML 2019):

    * ``unbiased``: ``E[C(x)] = x``, with a variance bound ``E||C(x) - x||^2 <= w ||x||^2``
      (QSGD, TernGrad, natural, random-k, stochastic rounding): use without error feedback;
    * contractive (``delta(d)`` not None): ``||C(x) - x||^2 <= (1 - delta) ||x||^2``
      (sign, top-k, deterministic int): use with error feedback.

    ``summable``: ``decode(sum_i payload_i) = sum_i decode(payload_i)``, so one ``psum`` of
    the payloads is enough (16/32-bit casts, shared-index random-k).
    """

    # Class-level properties; subclasses override.
    unbiased = False
    summable = False
    stochastic = False
    shared_randomness = False
    votes = False
    flags_nonfinite = False
    dense = True
    elementwise = False
    rounding_only = False

    @property
    def name(self) -> str:
        fields = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({fields})"

    def delta(self, d: int) -> float | None:
        """Contraction factor for a vector of size ``d``: ``||C(x)-x||^2 <= (1-delta)||x||^2``.

        None where the codec gives no such guarantee (unbiased codecs instead bound variance).
        The bound is for inputs in the normal float range: XLA (CPU, GPU) flushes subnormals
        to zero, so a vector of only subnormal values encodes as zero.
        """
        return None

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload, d: int) -> jax.Array:
        raise NotImplementedError

    def phase_codecs(self, c: int, n: int) -> tuple[Codec, Codec]:
        """The codecs of the two encodings of ``two_phase`` for chunks of ``c`` floats over
        ``n`` devices: each device's encoding of its chunk (phase 1) and the chunk owner's
        re-encoding of their mean (phase 2). ``(self, self)`` here; a codec may split its
        budget between the phases (``jc.top_k(r).phase_codecs``) as long as the two payloads
        add up to ``2 * payload_bytes(c)``, the bytes of ``two_phase`` in the cost model.

        Args:
          c: floats per chunk, ``ceil(d / n)``.
          n: devices on the axis.

        Returns:
          ``(first, second)``: the codec of each device's chunk and the owner's codec.
        """
        del c, n
        return self, self

    def encode_with_error(
        self, x: jax.Array, key: jax.Array | None = None
    ) -> tuple[Payload, jax.Array]:
        r"""The payload of ``x`` and what it drops: ``(encode(x), x - decode(encode(x)))``.

        Residual error feedback (Seide et al., 2014; Karimireddy et al., ICML 2019) keeps
        ``e' = x - C(x)`` with ``x = g + e``; the collectives take it from here, in the step
        that encodes, instead of forming ``(g + e) - C(g + e)`` after the exchange. This
        default decodes the payload; XLA fuses that decode into the pass that writes the new
        memory (no separate pass, no gradient-sized buffer of ``C(x)``). Reading the payload
        there is also what orders the memory's in-place write after the encoding: a codec
        that overrides this to form the error from its quantized values (int8:
        ``x - q s``) drops that edge, and XLA:CPU then copies the donated memory (measured on
        ``jc.sgd(int8)``: fewer temporaries, but a slower ``tx.update`` on one device). An
        override must return the same values, bit for bit (``tests/test_encode_error.py``).

        Args:
          x: ``float[d]``, the vector to send.
          key: the PRNG key of stochastic codecs (the same as :meth:`encode`'s).

        Returns:
          ``(payload, error)``: the payload of :meth:`encode` and ``error = x - decode(payload)``,
          ``float32[d]``.

        Example::

            payload, error = jc.int_quant(8).encode_with_error(x)   # error: x - C(x)
        """
        x = check_vector(x, self)
        payload = self.encode(x, key)
        return payload, x - self.decode(payload, x.shape[0])

    def payload_bytes(self, d: int) -> int:
        raise NotImplementedError

    def chunk_unit(self, d: int) -> int | None:
        """Values per independent unit of the encoding of a ``float32[d]``, or None.

        Where it is ``u``, for every ``c`` that is a multiple of ``u`` and divides ``d``,
        ``encode(x)`` is the payloads of ``x``'s chunks of ``c`` values laid end to end, leaf by
        leaf (blockwise scales, elementwise casts, deterministic): residual feedback can then
        encode a leaf a cache-sized chunk at a time (:mod:`jaxcomp._src.fused_residual`). Bit
        for bit where a block's scale is a maximum (``int_quant`` of 2 bits or more) or there
        is none (casts); a 1-bit block scale (``sign``'s mean or root mean square,
        ``int_quant(1)``) is a float sum, which XLA may add in another order for another
        number of blocks: the same codes, each scale within a few ulp (docs/hot-path-copies.md,
        "Chunked residuals"). None (the default): the payload depends on all of ``x`` (a
        scale or a selection over the whole vector, noise drawn for the whole).
        """
        del d
        return None

    def decode_sum(
        self, payloads: Payload, d: int, scale: float = 1.0, fill: jax.Array | float = 0.0
    ) -> jax.Array:
        """``fill + scale * sum_j decode(payloads[j])`` over a stack of payloads (leading
        axis = devices). ``scale = 1/n`` gives the mean; a NaN ``fill`` poisons every entry.

        The default decodes each device's payload and adds it to the running sum, one fused
        decode-and-add pass per device (:func:`sum_of_decodes`); sparse codecs override it
        with one scatter-add of the scaled values into a single dense buffer that starts at
        ``fill``, so neither the mean nor the poisoning costs another pass over ``d`` floats.
        """
        return sum_of_decodes(self, payloads, d, scale, fill)

    def encode_sum(
        self, payloads: Payload, d: int, scale: float = 1.0, key: jax.Array | None = None
    ) -> Payload:
        """``encode(decode_sum(payloads, d, scale), key)``: a ``two_phase`` chunk owner's
        re-encoding of the mean of the rows it received (``scale = 1/n``). The default is
        exactly that; a codec may take what its encoding needs of the sum from the payloads
        instead (the scaled cast: its scale from the rows' scales), so that the sum need
        not be written out before it is encoded."""
        return self.encode(self.decode_sum(payloads, d, scale), key)

    def flag_arrays(self, payloads: list) -> list | None:
        """The arrays of received payloads (one pytree per segment, stacked over devices)
        whose NaN or inf entries flag a non-finite input, for a ``flags_nonfinite`` codec; or
        None (the default): every floating array received. A codec whose payload values are
        finite whenever its scales are (the scaled cast) names the scales alone, so the
        step's flag reads ``n`` floats per segment instead of the received payloads."""
        del payloads
        return None

    def encode_rows_with_error(
        self, rows: jax.Array, keys: jax.Array | None = None
    ) -> tuple[Payload, jax.Array]:
        """:meth:`encode_rows` and each row's error ``rows - decode(encode(rows))``
        (``[r, c]``), one batched :meth:`encode_with_error`."""
        if keys is None:
            return jax.vmap(lambda row: self.encode_with_error(row, None))(rows)
        return jax.vmap(self.encode_with_error)(rows, keys)

    def encode_rows(self, rows: jax.Array, keys: jax.Array | None = None) -> Payload:
        """Encode each row of ``rows`` (``[r, c]``) on its own: a payload stacked on axis 0.

        ``keys``: one key per row (``[r, 2]``), or None for deterministic codecs. One batched
        computation (``vmap``), so the program does not grow with the number of rows.
        """
        if keys is None:
            return jax.vmap(lambda row: self.encode(row, None))(rows)
        return jax.vmap(self.encode)(rows, keys)

    def decode_rows(self, payloads: Payload, c: int) -> jax.Array:
        """Decode a stack of row payloads and lay the rows end to end: ``f32[rows * c]``."""
        return jax.vmap(lambda p: self.decode(p, c))(payloads).reshape(-1)

    def roundtrip(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """``decode(encode(x))``: what the receivers will see of ``x``."""
        return self.decode(self.encode(x, key), x.shape[0])

    def __str__(self) -> str:
        return self.name


#: Largest vector a codec encodes: int32 indices and offsets address at most 2^31 - 1 entries.
MAX_SIZE = 2**31 - 1


def check_vector(x: jax.Array, codec: Codec) -> jax.Array:
    """Validate a codec input: 1-D, floating; return it as float32."""
    if x.ndim != 1:
        raise ValueError(f"{codec.name}.encode expects a 1-D vector `x`, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{codec.name}.encode expects a floating `x`, got dtype {x.dtype}")
    if x.shape[0] > MAX_SIZE:
        raise ValueError(
            f"{codec.name}.encode: `x` has {x.shape[0]} elements, more than 2**31 - 1, where "
            "int32 indices and offsets overflow; split it (jc.pmean and the transforms do)"
        )
    return x.astype(jnp.float32)


def require_key(key: jax.Array | None, codec: Codec) -> jax.Array:
    if key is None:
        raise ValueError(f"{codec.name} is stochastic: pass a PRNG `key` to encode")
    return key


def is_number(value: Any) -> bool:
    """A real scalar given as an argument: a Python or NumPy int or float (``np.float32(0.5)``,
    ``np.int64(4)``, what a NumPy config or ``np.linspace`` sweep hands over), not a bool."""
    return not isinstance(value, bool | np.bool_) and isinstance(
        value, int | float | np.integer | np.floating
    )


def check_scalar_array(name: str, value: Any) -> None:
    """An array given for a number (a hyperparameter ``optax.inject_hyperparams`` passes, a
    tracer included) must be a 0-d int or float array: a bool array is refused as a bool
    is, and a larger array would fail in ``float()`` without naming the argument."""
    dtype = jnp.result_type(value)
    real = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    if jnp.ndim(value) != 0 or not real:
        raise TypeError(
            f"`{name}` must be a number or a 0-d int or float array, got "
            f"{type(value).__name__} of shape {jnp.shape(value)} and dtype {dtype}"
        )


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """Construction-time check of an integer argument, naming it in the error."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"`{name}` must be in {rng}, got {value}")
    return int(value)


def check_fraction(name: str, value: Any, lo_open: bool = False) -> float:
    """``value`` as a float in ``[0, 1)`` (``(0, 1)`` with ``lo_open``), else an error naming it."""
    if not is_number(value):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = (0.0 < value if lo_open else 0.0 <= value) and value < 1.0
    if not ok or not math.isfinite(value):
        raise ValueError(f"`{name}` must be in {'(0' if lo_open else '[0'}, 1), got {value}")
    return value


def check_fraction_array(name: str, value: Any) -> Any:
    """:func:`check_fraction`, or a 0-d int or float array returned as it is: a hyperparameter
    ``optax.inject_hyperparams`` passes (concrete to ``init``, traced to ``update``), checked
    in ``[0, 1)`` where concrete (:func:`check_scalar_array` refuses a bool or larger one)."""
    if not isinstance(value, jax.Array | np.ndarray):
        return check_fraction(name, value)
    check_scalar_array(name, value)
    if not isinstance(value, jax.core.Tracer):
        check_fraction(name, float(value))
    return value


def is_array(value: Any) -> bool:
    """An array given for a number: a hyperparameter ``optax.inject_hyperparams`` passes
    (concrete to ``init``, traced to ``update``)."""
    return isinstance(value, jax.Array | np.ndarray)


def check_decay(name: str, value: Any) -> Any:
    """A decay ``value`` in ``[0, 1]`` as a float (1: nothing decays, nothing is lost), else
    an error naming ``name``; or a 0-d int or float array (:func:`is_array`) returned as it
    is, checked in ``[0, 1]`` where concrete (:func:`check_scalar_array`)."""
    if is_array(value):
        check_scalar_array(name, value)
        if not isinstance(value, jax.core.Tracer):
            check_decay(name, float(value))
        return value
    if is_number(value) and value == 1:
        return 1.0
    return check_fraction(name, value)


def check_positive_float(name: str, value: Any, *, upper: float | None = None) -> float:
    if not is_number(value):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not np.isfinite(value) or value <= 0 or (upper is not None and value > upper):
        rng = f"(0, {upper}]" if upper is not None else "> 0 and finite"
        raise ValueError(f"`{name}` must be in {rng}, got {value}")
    return value


def blocks(x: jax.Array, block_size: int) -> jax.Array:
    """Zero-pad ``x`` to whole blocks and view it as ``[num_blocks, block_size]``."""
    d = x.shape[0]
    nb = ceil_div(d, block_size)
    return jnp.pad(x, (0, nb * block_size - d)).reshape(nb, block_size)


def per_value(per_block: jax.Array, block_size: int, d: int) -> jax.Array:
    """Broadcast one value per block back to the ``d`` coordinates it covers."""
    nb = per_block.shape[0]
    return jnp.broadcast_to(per_block[:, None], (nb, block_size)).reshape(-1)[:d]


#: Divisors above this are scaled by its inverse first (:func:`safe_divide`).
LARGE_DIVISOR = 2.0**64


def safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` with 0 where ``den == 0`` (a zero block stays zero, never NaN).

    A non-finite ``den`` still propagates: only exact zeros are guarded. Where ``|den| >
    2^64`` both are multiplied by ``2^-64`` first (exact: a power of two): XLA:CPU divides by
    multiplying with the reciprocal, which is subnormal for ``|den| > 2^126`` and flushed to
    zero, so ``3e38 / 3e38`` gave 0 (docs/errors.md). The same bits as ``num / den`` for
    every other ``den``.
    """
    zero = den == 0
    # 2^-64 or 1 per divisor: one multiply per value (x * 1 is x), not a select beside it.
    shrink = jnp.where(jnp.abs(den) > LARGE_DIVISOR, 1.0 / LARGE_DIVISOR, 1.0)
    num, den = num * shrink, den * shrink
    return jnp.where(zero, 0.0, num / jnp.where(zero, 1.0, den))


#: float32's largest finite value: where a square or a sum of finite values saturates.
F32_MAX = float(np.finfo(np.float32).max)


#: Rows are first folded ``ROW_GROUPS`` to one by elementwise max / add of equal column slices.
ROW_GROUPS = 8


def fold_rows(values: jax.Array, combine) -> jax.Array:
    """``[r, b] -> [r, b / 8]``: the 8 column groups combined elementwise (b % 8 == 0).

    An elementwise stage is fused with what produces ``values`` (a sum ``g + e``, an
    ``abs``); a reduce is not on XLA:CPU (its reduce kernels read a materialized input), so
    reducing ``[r, b]`` at once writes the whole producer out first: a gradient-sized
    temporary. Folded, only ``b / 8`` per row is written before the reduce.
    """
    r, b = values.shape
    if b % ROW_GROUPS or b < 8 * ROW_GROUPS:
        return values
    x = values.reshape(r, ROW_GROUPS, b // ROW_GROUPS)
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = combine(x[:, :half], x[:, half:])
    return x[:, 0]


#: From how many per-leaf scalars :func:`kept_sum` keeps one reduction. A chain of up to 8
#: copied into each reader costs little, and XLA's own form is kept there: the one-device hot
#: path's programs (6 leaves) stay as they were (padded, the int8 row's temporaries grew by
#: 0.04 copies of the gradient: a changed schedule).
KEEP_FROM = 9


def kept_sum(values: jax.Array) -> jax.Array:
    """``jnp.sum(values)`` (a short vector: one scalar per leaf) as one reduction that XLA
    keeps, so that the fusions reading the result read one scalar.

    XLA's simplifier turns ``reduce(concatenate(scalars))`` (``jnp.sum(jnp.stack(...))``)
    into a chain of scalar adds, and fusion then copies the whole chain into every fusion
    that reads the result: a flag or a norm read by each leaf's update costs ``leaves``
    instructions per leaf, the compiled step quadratic in the leaves (a 100-leaf 1-bit Adam
    step held half its instructions in such copies). A zero appended (``jnp.pad``) keeps the
    reduction whole (from :data:`KEEP_FROM` values). For a flag's sum of zeros and NaN the
    zero changes no bit; a sum of values may be added in another order than the chain's."""
    if values.shape[0] < KEEP_FROM:
        return jnp.sum(values)
    return jnp.sum(jnp.pad(values, (0, 1)))


def kept_any(flags: list[jax.Array]) -> jax.Array:
    """``any(flags)`` (boolean scalars, one per leaf) as one reduction XLA keeps
    (:func:`kept_sum`: ``jnp.any(jnp.stack(flags))`` became a chain of ors copied into every
    reader)."""
    stacked = jnp.stack(flags)
    return jnp.any(stacked if len(flags) < KEEP_FROM else jnp.pad(stacked, (0, 1)))


def kept_max(values: jax.Array, low: float) -> jax.Array:
    """``jnp.max(values)`` as one reduction XLA keeps (:func:`kept_sum`), ``low`` (at most
    every value) appended: the same maximum."""
    if values.shape[0] < KEEP_FROM:
        return jnp.max(values)
    return jnp.max(jnp.pad(values, (0, 1), constant_values=low))


def folded_sum(x: jax.Array) -> jax.Array:
    """``jnp.sum(x)``, the 8 column groups of ``x`` (read as one row) added first
    (:func:`fold_rows`): the elementwise producer of ``x`` is fused into that stage, so no
    temporary as large as ``x`` is written before the reduce (on XLA:CPU a scalar operand
    such as ``0`` or ``F32_MAX`` would otherwise be broadcast to ``x``'s size and written)."""
    return jnp.sum(fold_rows(x.reshape(1, -1), jnp.add))


def max_abs(xb: jax.Array) -> jax.Array:
    """``max_j |xb[b, j]|`` per row (0 for an empty row); NaN propagates. The same bits as
    ``jnp.max(jnp.abs(xb), axis=1)`` where a row holds no NaN, without a temporary as large
    as ``xb``; a row holding a NaN gives NaN, which ``jnp.max`` does not guarantee: XLA:CPU
    (jaxlib 0.10.2, 0.12.0.1) compiles a float max reduce over 4,096 values or more to a
    YNNPACK fusion that drops NaN (docs/errors.md).

    The folded rows are reduced as the integer bit patterns of ``|x|`` (int32 for float32,
    int16 / int8 for narrower floats: for non-negative floats and NaN, whose sign ``abs``
    clears, the integer order is the float order, NaN above inf): XLA:CPU fuses an integer
    reduce with its producer in one pass, while a float max reduce goes to its reduction
    kernel, which absorbed the fold's last ``maximum`` and computed each half of the fold in
    a fusion of its own, each reading ``xb`` once more.
    """
    folded = fold_rows(jnp.abs(xb), jnp.maximum)
    # The same for float16 / bfloat16 / float8 through the signed integer of their width: a
    # float max reduce of them drops NaN on XLA:CPU too (bfloat16, 1M values).
    signed = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}[folded.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(folded, signed)
    return jax.lax.bitcast_convert_type(jnp.max(bits, axis=1, initial=0), folded.dtype)


def max_abs_over(x: jax.Array, axis: int | None = None) -> jax.Array:
    """``jnp.max(jnp.abs(x), axis=axis, keepdims=True)`` (every axis when None; 0 where
    empty) by :func:`max_abs`: NaN propagates, the same bits for any other input.

    Use it (or :func:`max_abs`) for every max of data that can be non-finite: XLA:CPU
    (jaxlib 0.10.2 and 0.12.0.1) compiles a float max / min reduce over 4,096 values or
    more, and a ``maximum`` / ``minimum`` fused into a reduce, to a YNNPACK fusion that
    drops NaN (docs/errors.md), while an integer max reduce propagates it.
    """
    if axis is None:
        return max_abs(x.reshape(1, -1)).reshape((1,) * x.ndim)
    axis = axis % x.ndim
    moved = jnp.moveaxis(x, axis, -1)
    top = max_abs(moved.reshape(-1, x.shape[axis])).reshape(moved.shape[:-1])
    return jnp.expand_dims(top, axis)


#: :func:`all_finite` folds rows of this many values before its one reduce.
FINITE_ROW = 256


def all_finite(x: jax.Array) -> jax.Array:
    """``all(isfinite(x))`` (a bool scalar), without a temporary as large as ``x``.

    XLA:CPU writes the input of a reduction out first, so ``all(isfinite(x))`` writes one
    byte per value before reducing it. Here the flags ``|x| <= max`` (``max`` the largest
    finite value of the dtype: False exactly for NaN and +-inf, also in float8_e4m3fn, which
    has no inf, so ``|x| < inf`` would compare with NaN) of each row of :data:`FINITE_ROW`
    values are first and-ed in 8 column groups (:func:`fold_rows`, fused with the
    comparison), so only 1/8 of a byte per value is
    written (an fp16 payload of 16.7M values: 2.1 MB instead of 17 MB); the values left over
    after the last whole row are checked directly. The same value as ``all(isfinite(x))``
    for any shape and floating dtype (True for an empty ``x``).

    Args:
      x: a floating array of any shape.

    Returns:
      A bool scalar: True when no value of ``x`` is NaN or +-inf.
    """
    flat = x.reshape(-1)
    top = jnp.asarray(jnp.finfo(x.dtype).max, x.dtype)
    whole = flat.shape[0] // FINITE_ROW * FINITE_ROW
    finite = jnp.array(True)
    if whole:
        rows = (jnp.abs(flat[:whole]) <= top).reshape(-1, FINITE_ROW)
        finite = jnp.all(fold_rows(rows, jnp.logical_and))
    if whole < flat.shape[0]:
        finite = finite & jnp.all(jnp.abs(flat[whole:]) <= top)
    return finite


def mean_abs(xb: jax.Array, count: jax.Array) -> jax.Array:
    """``sum_j |xb[b, j]| / count[b]`` per row, summed pre-scaled so it never overflows.

    ``sum |x| / c`` overflows float32 once the row's sum leaves its range (two values of
    2e38, or one of 3e38 beside a few thousand of 1e35: what an error-feedback memory holds
    after a finite outlier), and the scale of every later step would be inf. Each term is
    divided first, so the result is at most ``max |x|``. NaN and inf still propagate. The
    terms are added in 8 column groups first (:func:`max_abs`), so the summation order is
    that of a pairwise tree, not of one reduce. The folded rows reach the reduce through
    :func:`after` (the same bits): XLA:CPU's reduce kernel otherwise takes the fold's last
    add into itself and computes each of its two operands in a fusion of its own, each
    reading ``xb`` (with residual feedback, ``g`` and ``e``) once more.
    """
    terms = jnp.abs(xb) * (1.0 / count.astype(jnp.float32))[:, None]
    return jnp.sum(after(fold_rows(terms, jnp.add), xb[0, 0] if xb.size else None), axis=1)


def scaled_norm(x: jax.Array, axis: Any = None, keepdims: bool = False) -> jax.Array:
    """The 2-norm ``sqrt(sum x^2)`` over ``axis``, computed as ``m sqrt(sum (x/m)^2)`` with
    ``m = max |x|``, so that it overflows only where the norm itself exceeds float32's range
    (``sum x^2`` overflows from ``|x| ~ 1.8e19``) and never underflows to 0 for tiny ``x``.

    A zero ``x`` has norm 0; NaN and inf propagate (``m`` by :func:`max_abs_over`: a float
    max can drop a NaN on XLA:CPU, and ``m = 0`` would then scale it away).
    """
    biggest = max_abs_over(x, axis)
    unit = safe_divide(x, biggest)
    norm = biggest * jnp.sqrt(jnp.sum(unit * unit, axis=axis, keepdims=True))
    return norm if keepdims else jnp.squeeze(norm, axis=axis)


def saturating_square(x: jax.Array) -> jax.Array:
    """``min(x^2, F32_MAX)``: a finite ``x`` has a finite square (``x^2`` is inf from
    ``|x| ~ 1.8e19``), so a second-moment estimate fed a finite outlier stays finite and
    decays back. Elementwise, NaN stays NaN and an inf saturates too (the exchange flags that
    step); summed in one reduce on XLA:CPU, the ``minimum`` can turn a NaN into ``F32_MAX``
    (docs/errors.md): read the flag from the input, not from such a sum."""
    return jnp.minimum(x * x, F32_MAX)


def scaled_global_norm_parts(arrays: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(m, r)``: the global 2-norm of ``arrays`` (in float32) is ``m r``, ``m = max |x|``
    and ``r = sqrt(sum (x / m)^2)`` in ``[1, sqrt(d)]`` (``(0, 0)`` for zeros or no values).
    Each part is finite for finite input even where the norm itself overflows float32
    (:func:`clip_scales` reads them), and a NaN or inf reaches ``r``: the divisor is ``m``
    where it is finite and nonzero, else 1, so a NaN that the float max dropped on XLA:CPU
    (docs/errors.md) still reaches the sum, even where the max came out 0. The library's one
    overflow-safe global norm: ``jc.clip_by_global_norm``, DGC's ``clip_norm`` and
    SparseLoCo's payload clip read it (and :func:`scaled_global_norm`)."""
    arrays = [jnp.asarray(a, jnp.float32) for a in arrays if jnp.size(a)]
    if not arrays:
        return jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32)
    # One reduction, not a chain of maxima that fusion copies into each leaf's divide
    # (kept_sum). The sum of squares stays a chain: kept as one reduction it changed the bits
    # of a clipped step (XLA fused the leaves' sums apart).
    top = kept_max(jnp.stack([jnp.max(jnp.abs(a)) for a in arrays]), 0.0)
    safe = jnp.where(jnp.isfinite(top) & (top > 0), top, 1.0)
    total = sum(jnp.sum(jnp.square(safe_divide(a, safe))) for a in arrays)
    return top, jnp.sqrt(total)


def scaled_global_norm(arrays: list[jax.Array]) -> jax.Array:
    """:func:`scaled_norm` over several arrays together (optax's ``global_norm``, guarded):
    finite up to float32's range, 0 for zeros, NaN or inf for non-finite input."""
    biggest, root = scaled_global_norm_parts(arrays)
    return biggest * root


def clip_scales(top: jax.Array, root: jax.Array, limit: Any) -> tuple[jax.Array, jax.Array]:
    r"""Scalars ``(pre, factor)`` with ``(x * pre) * factor = x min(1, limit / |g|)`` for every
    value ``x`` of a gradient ``g`` whose norm is ``|g| = top * root`` (Pascanu et al., 2013).

    ``|g|`` may overflow float32 while every value is finite (``|x| ~ 1.8e19`` squares to
    inf; ``d`` values near ``F32_MAX`` have a norm near ``F32_MAX sqrt(d)``): ``limit / |g|``
    was then 0 and the clipped gradient all zeros. Above ``2^64`` the norm is therefore formed
    as ``(top 2^-64) root`` and the values scaled by ``pre = 2^-64`` with it (exact: a power of
    two), which also keeps ``limit / |g|`` off the subnormals XLA:CPU flushes to 0 (its
    reciprocal of a divisor above ``2^126``). For any other gradient ``pre = 1`` and
    ``factor = limit / |g|``: the same bits as ``x * (limit / |g|)``. A NaN norm leaves ``g``
    as it is (``factor = 1``), an infinite ``top`` makes ``factor = 0`` (its inf becomes
    NaN): a non-finite gradient stays non-finite.
    """
    norm = top * root  # inf where it overflows: over the limit, and above 2^64
    over = norm > limit
    pre = jnp.where(over & (norm > LARGE_DIVISOR), 1.0 / LARGE_DIVISOR, 1.0)
    scaled = (top * pre) * root  # finite for finite top: at most 2^64 sqrt(d)
    factor = jnp.where(over, limit / jnp.where(scaled > 0, scaled, 1.0), 1.0)
    return pre, factor
