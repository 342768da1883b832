"""Sign compression: one bit per coordinate (signSGD, scaled sign / 1-bit SGD, EF-signSGD)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import (
    Codec,
    blocks,
    ceil_div,
    check_int,
    check_vector,
    max_abs,
    mean_abs,
    per_value,
)

_SCALES = (None, "mean")


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

    ``block_size=None`` uses one scale per vector. Zero maps to the positive sign.
    """

    scale: str | None = "mean"
    block_size: int | None = None

    votes = True  # payload: (packed sign words, f32 block scales)
    flags_nonfinite = True  # a non-finite block gives a non-finite scale

    def _block(self, d: int) -> int:
        return max(d, 1) if self.block_size is None else self.block_size

    def delta(self, d):
        return None if self.scale is None else 1.0 / self._block(d)

    def encode(self, x, key=None):
        x = check_vector(x, self)
        d = x.shape[0]
        bs = self._block(d)
        xb = blocks(x, bs)
        if self.scale == "mean":
            count = jnp.clip(d - jnp.arange(xb.shape[0]) * bs, 1, bs)
            scale = mean_abs(xb, count)  # summed pre-scaled: never overflows
        else:  # 1 for a non-zero block, 0 for a zero block; NaN/inf propagate through 0 * max
            absmax = max_abs(xb)
            scale = (absmax > 0).astype(jnp.float32) + 0.0 * absmax
        return packing.pack((x < 0).astype(jnp.uint32), 1), scale

    def decode(self, payload, d):
        words, scale = payload
        negative = packing.unpack(words, 1, d)
        return jnp.where(negative == 1, -1.0, 1.0) * per_value(scale, self._block(d), d)

    def payload_bytes(self, d):
        return 4 * packing.packed_words(d, 1) + 4 * ceil_div(d, self._block(d))


def sign(scale: str | None = "mean", block_size: int | None = None) -> Sign:
    """1-bit sign codec: ``scale=None`` (signSGD) or ``"mean"`` (scaled sign, 1-bit SGD).

    ``C(x)_i = scale_B * sign(x_i)`` with ``scale_B = ||x_B||_1 / |B|`` per block ``B``
    (``"mean"``) or 1 (``None``); signs are bit-packed 32 to a uint32 word, plus one float32
    per block. Scaled sign is contractive, ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / |B|``, so
    with residual error feedback it converges like SGD. See :class:`Sign`.

    ~32x smaller than float32. Biased: use it with error feedback (``scale="mean"``) or with
    ``strategy="majority_vote"`` (``scale=None``).

    Args:
      scale: ``"mean"`` (scaled sign) or None (plain signs, signSGD).
      block_size: values per scale, or None for one scale per vector.

    References:
      Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its Application to
      Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014;
      Bernstein, Wang, Azizzadenesheli, Anandkumar, "signSGD: Compressed Optimisation for
      Non-Convex Problems", ICML 2018 (and "signSGD with Majority Vote", ICLR 2019);
      Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes", ICML 2019.
    """
    if scale not in _SCALES:
        raise ValueError(f"`scale` must be one of {_SCALES}, got {scale!r}")
    if block_size is not None:
        block_size = check_int("block_size", block_size, 1)
    return Sign(scale, block_size)
