"""Bit packing: small unsigned codes into uint32 words, so the wire carries real bits.

``bits`` codes per element are packed ``32 // bits`` to a word (1 bit: 32 per word,
2 bits: 16, 4 bits: 8, 8 bits: 4; 3 bits: 10 and 5 bits: 6, leaving 2 bits of the word
unused). Element ``i`` lands in word ``i // per_word`` at bit offset
``bits * (i % per_word)``. Padding codes are zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp._src.codecs.base import ceil_div


def codes_per_word(bits: int) -> int:
    if not 1 <= bits <= 32:
        raise ValueError(f"`bits` must be in [1, 32], got {bits}")
    return 32 // bits


def packed_words(d: int, bits: int) -> int:
    """Number of uint32 words holding ``d`` codes of ``bits`` bits."""
    return ceil_div(d, codes_per_word(bits))


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack ``codes`` (unsigned ints < 2**bits, any int dtype, 1-D) into ``uint32`` words.

    ``word_j = sum_k codes[j * per + k] << (bits * k)`` with ``per = 32 // bits``: the fields
    are disjoint, so the sum is the OR of the shifted codes and lowers to one reduce. One bit
    per code is packed in two stages, 8 codes to a byte and then 4 bytes to a word
    (``word_j = sum_b octet_{4j+b} << 8b``, ``octet_m = sum_i codes[8m + i] << i``): the same
    words, in less CPU time on XLA:CPU than one 32-lane reduce (measured: docs/hot-path.md,
    "Where the time of one update goes, op by op").

    Args:
      codes: 1-D unsigned codes, each ``< 2**bits``.
      bits: bits per code, 1..8 (``32 // bits`` codes to a word).

    Returns:
      ``uint32[packed_words(d, bits)]``; the last word's unused fields are 0.
    """
    per = codes_per_word(bits)
    d = codes.shape[0]
    n = packed_words(d, bits)
    c = jnp.pad(codes.astype(jnp.uint32), (0, n * per - d)).reshape(n, per)
    if bits == 1:
        c = c.reshape(n, 4, 8)
        octets = jnp.sum(c << jnp.arange(8, dtype=jnp.uint32), axis=2, dtype=jnp.uint32)
        return jnp.sum(octets << (8 * jnp.arange(4, dtype=jnp.uint32)), axis=1, dtype=jnp.uint32)
    shifts = (jnp.arange(per, dtype=jnp.uint32) * bits)[None, :]
    return jnp.sum(c << shifts, axis=1, dtype=jnp.uint32)


def unpack(words: jax.Array, bits: int, d: int) -> jax.Array:
    """Inverse of :func:`pack`: ``uint32[d]`` codes."""
    per = codes_per_word(bits)
    shifts = (jnp.arange(per, dtype=jnp.uint32) * bits)[None, :]
    mask = jnp.uint32((1 << bits) - 1) if bits < 32 else jnp.uint32(0xFFFFFFFF)
    codes = (words[:, None] >> shifts) & mask
    return codes.reshape(-1)[:d]
