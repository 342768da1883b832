"""Residual error feedback fused with the encoding: one loop over cache-sized chunks of a leaf.

Residual feedback sends ``C(x)`` with ``x = g + e`` and keeps ``e' = x - C(x)`` (Seide et
al. 2014; Karimireddy et al. 2019). Written as whole-leaf operations, XLA:CPU (no
multi-output fusion) compiles the scales, the codes and the residual into passes of their own,
each reading ``g`` and ``e`` from memory again. Here a leaf of ``d`` values is viewed as
``[d / c, c]`` (a free reshape) and one ``fori_loop`` takes a chunk of ``c`` values at a time:
``x`` of the chunk is written to a chunk-sized buffer, and its scales, its payload and the
new memory are computed from there while it is in cache. Memory traffic per leaf: read ``g``
and ``e``; write the payload, ``e'`` (in place over the donated memory) and the old ``e``
(over the donated gradient, already read).

The memory is written before the exchange, but whether the step is finite is known only
after it (from the payloads every device received). So the old memory is kept, chunk by
chunk, in the gradient's buffer, and :func:`restore` copies it back on a non-finite step (a
loop of zero or one trips: nothing on a finite step). Checking the gradient first instead
(one reduction over it and a scalar psum) was measured: the reduction alone cost about 1.5
copies of the gradient's time on XLA:CPU, more than the loop saved (docs/hot-path-copies.md,
"Chunked residuals").

This needs a codec whose payload of ``x`` is its chunks' payloads laid end to end
(:meth:`~jaxcomp._src.codecs.base.Codec.chunk_unit`: blockwise scales, elementwise casts) and
a leaf sent whole (``allgather``: ``C(x)``; ``allreduce``: ``n C(x / n)``), as
:func:`jaxcomp._src.collectives.elementwise_error` forms it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp._src import collectives, skeleton
from jaxcomp._src.codecs.base import Codec, after

#: Values per chunk the loop aims at: 64Ki float32 values (256 KiB per array; ``g``, ``e``
#: and the payload of a chunk fit a core's L2 cache). Measured: docs/hot-path-copies.md.
CHUNK = 1 << 16

#: A leaf is fused only where a chunk of at least ``CHUNK / MIN_FRACTION`` values divides it
#: (fewer, smaller iterations cost more in loop overhead than they save).
MIN_FRACTION = 16


def chunk_size(codec: Codec, d: int, target: int | None = None) -> int | None:
    """The largest ``c <= target`` that divides ``d``, is a multiple of the codec's
    :meth:`~jaxcomp._src.codecs.base.Codec.chunk_unit` and leaves at least two chunks; None
    where there is none of at least ``target / MIN_FRACTION`` values (or no unit).
    ``target``: None is :data:`CHUNK`."""
    target = CHUNK if target is None else target
    unit = codec.chunk_unit(d)
    if unit is None or d < 2 * unit:
        return None
    floor = max(unit, target // MIN_FRACTION)
    c = min(target, d // 2) // unit * unit
    while c >= floor:
        if d % c == 0:
            return c
        c -= unit
    return None


def encode_in_place(
    codec: Codec, strategy: str, n: int, g: jax.Array, e: jax.Array, c: int
) -> tuple[object, jax.Array, jax.Array]:
    """This device's payload of ``x = g + e``, its new residual memory, and the old memory
    kept in the gradient's buffer, one chunk at a time.

    ``strategy``: ``"allgather"`` (payload ``encode(x)``, ``e' = x - decode``) or
    ``"allreduce"`` (payload ``encode(x / n)``, ``e' = x - n decode``: a mean that fits the
    payload's type never overflows in the sum). Per chunk ``j``, in cache::

        x_j  = g_j + e_j                      # written to a chunk-sized buffer
        p_j  = encode(x_j)                    # blockwise: encode(x)'s part (Codec.chunk_unit)
        g_j <- e_j                            # the old memory, over the gradient read
        e_j <- x_j - decode(p_j)              # the new memory, in place

    Whether the step is finite is known only after the exchange; :func:`restore` then puts
    the old memory back from the gradient's buffer (a non-finite step keeps it, bit for bit).

    Args:
      codec: a codec with a ``chunk_unit``.
      strategy: ``"allgather"`` or ``"allreduce"``.
      n: devices on the axis.
      g: ``float32[d]``, this device's gradient leaf (donated, its buffer takes the old
        memory).
      e: its memory, float32 of ``d`` values in any shape (``[1, *leaf]``): donated, it is
        written in place.
      c: values per chunk (:func:`chunk_size`).

    Returns:
      ``(payload, e', old)``: the payload of :meth:`Codec.encode` of the whole ``x`` (or
      ``x / n``; bit for bit, or a 1-bit block scale a few ulp apart:
      :meth:`~jaxcomp._src.codecs.base.Codec.chunk_unit`), and ``e' = x - decode`` of that
      payload, so the feedback is exact either way; the new memory in ``e``'s shape; the old
      memory, ``f32[d]``.
    """
    d = g.shape[0]
    rows = d // c
    gv, ev = g.reshape(rows, c), e.reshape(rows, c)
    shapes = jax.eval_shape(lambda x: codec.encode(x), jax.ShapeDtypeStruct((c,), jnp.float32))
    # The stacked payload: each chunk's leaves, one row per chunk (varying like ``g``).
    stacked = jax.tree.map(
        lambda s: skeleton.varying_like(jnp.zeros((rows, *s.shape), s.dtype), g), shapes
    )
    # x of one chunk, written once (one value more than a chunk, so XLA does not take the
    # update for the whole buffer): the scales, the payload and the residual read it there
    # instead of each reading slices of g and e.
    scratch = skeleton.varying_like(jnp.zeros((c + 1,), jnp.float32), g)

    def body(i, carry):
        gv, ev, stacked, scratch = carry
        old = jax.lax.dynamic_index_in_dim(ev, i, keepdims=False)
        x = jax.lax.dynamic_index_in_dim(gv, i, keepdims=False) + old
        scratch = jax.lax.dynamic_update_slice_in_dim(scratch, x, 0, 0)
        # Read back from an offset XLA cannot prove is 0: newer XLA (jaxlib 0.12) folds
        # ``scratch[:c]`` of the update into ``x`` itself, so each reader recomputes ``g + e``
        # from ``g``'s buffer and the in-place write of ``g`` below costs two copies of ``g``.
        x = jax.lax.dynamic_slice_in_dim(scratch, after(jnp.int32(0), i), c)
        payload, sent = collectives.whole_payload(codec, strategy, n, x)
        stacked = jax.tree.map(
            lambda s, p: jax.lax.dynamic_update_index_in_dim(s, p, i, 0), stacked, payload
        )
        # Each in-place write after the reads of what it overwrites (XLA:CPU computes each
        # payload leaf in a loop of its own and recomputes cheap values where they are read,
        # so the edges are taken from written buffers): else XLA copies g or e.
        gv = jax.lax.dynamic_update_index_in_dim(gv, after(old, scratch[c]), i, 0)
        residual = after(x - sent, gv[i, 0])
        for leaf in jax.tree.leaves(stacked):
            residual = after(residual, leaf[i].reshape(-1)[-1])
        return gv, jax.lax.dynamic_update_index_in_dim(ev, residual, i, 0), stacked, scratch

    gv, ev, stacked, _ = jax.lax.fori_loop(0, rows, body, (gv, ev, stacked, scratch))
    payload = jax.tree.map(lambda s: s.reshape(-1, *s.shape[2:]), stacked)
    return payload, ev.reshape(e.shape), gv.reshape(d)


def restore(bad: jax.Array, memory: jax.Array, old: jax.Array) -> jax.Array:
    """``memory``, or ``old`` (reshaped) where the step was not finite (``bad``, the same on
    every device): a loop of zero or one trips, which XLA runs over ``memory``'s buffer in
    place (a ``cond`` would copy the memory into a buffer of its own every step)."""
    return jax.lax.fori_loop(0, bad.astype(jnp.int32), lambda _, m: old.reshape(m.shape), memory)
