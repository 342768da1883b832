"""Compressed collectives: ``psum`` / ``pmean`` with a codec, and the strategies behind them.

A strategy decides how payloads travel over the ``n`` devices of ``axis_name``. With a
payload of ``P(m)`` bytes for ``m`` floats, the ring-model bytes each device sends are:

=================  =================================  =========================================
strategy           bytes per device                   when
=================  =================================  =========================================
``allreduce``      ``2 (n-1)/n * P(d)``               summable payloads (identity, cast bf16/fp16)
``allgather``      ``(n-1) * P(d)``                   any codec; grows linearly with n
``two_phase``      ``2 (n-1) * P(ceil(d/n))``         any codec; ~ ``2 P(d)`` whatever n
                   ``~= 2 (n-1)/n * P(d)``
=================  =================================  =========================================

Plain ``pmean`` of float32 sends ``2 (n-1)/n * 4d``. So all-gather saves ``8d / (n P)`` —
at n = 8 int8 saves nothing and 1-bit only 8x — while two-phase keeps ``4d / P`` (1-bit:
~32x) at any n.

``two_phase`` (reduce-scatter style): split the vector into n chunks, encode each,
``all_to_all`` so device i receives everybody's chunk i, decode and average it, re-encode the
average, ``all_gather`` the re-encoded chunks, decode. The second encode adds a second
compression error; the optax transform keeps it in a server-side residual (as 1-bit Adam's
server error), the stateless :func:`psum` cannot.

With ``allreduce`` the payload is also *added* in its own type (fp16 sums round at
~2^-11 of the running sum): error feedback cannot see that rounding, it happens in the
network. Integer payloads are never summed in their narrow type (int8 sums overflow).

``auto`` picks, per vector, the strategy with the fewest bytes in the table above; a
summable codec always uses ``allreduce`` (same bytes as two-phase, exact sums).
Non-finite input anywhere makes the output non-finite everywhere: one scalar flag is
all-reduced per call (8 bytes) so a NaN is never hidden behind a codec that would drop it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp import buckets
from jaxcomp.codecs.base import Codec, ceil_div

STRATEGIES = ("auto", "allreduce", "allgather", "two_phase")


class Reduced(NamedTuple):
    """What one compressed reduction of a vector gives back."""

    mean: jax.Array  # f32[d]: the mean over the axis, identical on every device
    sent: jax.Array  # f32[d]: what this device's contribution decodes to (for error feedback)
    server_residual: jax.Array  # f32[d]: the chunk owner's re-encoding error (two_phase), else 0


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def check_codec(codec: Any) -> Codec:
    if not isinstance(codec, Codec):
        raise TypeError(
            f"`codec` must be a jaxcomp codec (e.g. jc.int_quant(8)), got {type(codec).__name__}"
        )
    return codec


def axis_size(axis_name: Any) -> int:
    """Size of a bound mesh axis (or tuple of axes), with a clear error when it is not bound."""
    try:
        return int(jax.lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not bound here: call jaxcomp collectives inside "
            f"jax.shard_map (or jax.pmap) over a mesh that has axis {axis_name!r} ({e})"
        ) from None


def strategy_bytes(codec: Codec, d: int, n: int) -> dict[str, float]:
    """Ring-model bytes per device of each strategy that ``codec`` supports (the auto model)."""
    out = {}
    if codec.summable:
        out["allreduce"] = 2 * (n - 1) / n * codec.payload_bytes(d)
    out["allgather"] = (n - 1) * codec.payload_bytes(d)
    out["two_phase"] = 2 * (n - 1) * codec.payload_bytes(ceil_div(d, n)) if d else 0.0
    return out


def choose_strategy(codec: Codec, d: int, n: int, strategy: str = "auto") -> str:
    """Resolve ``"auto"`` (and validate an explicit choice) for a vector of size ``d``."""
    check_strategy(strategy)
    if strategy == "allreduce" and not codec.summable:
        raise ValueError(
            f"`strategy`='allreduce' needs a summable codec; {codec.name} is not "
            f"(use 'allgather', 'two_phase' or 'auto')"
        )
    if strategy != "auto":
        return strategy
    if codec.summable:
        return "allreduce"
    costs = strategy_bytes(codec, d, n)
    return min(("allgather", "two_phase"), key=lambda s: (costs[s], s != "allgather"))


def device_key(key: jax.Array | None, codec: Codec, axis_name: Any) -> jax.Array | None:
    """Independent noise per device, or the same key everywhere for shared randomness."""
    if key is None:
        if codec.stochastic or codec.shared_randomness:
            raise ValueError(f"{codec.name} is stochastic: pass `key=` (a PRNG key)")
        return None
    if codec.shared_randomness:
        return key
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def _split(key: jax.Array | None, num: int):
    return [None] * num if key is None else list(jax.random.split(key, num))


def _vmap_encode(codec: Codec, chunks: jax.Array, key: jax.Array | None):
    if key is None:
        return jax.vmap(lambda c: codec.encode(c, None))(chunks)
    return jax.vmap(codec.encode)(chunks, jax.random.split(key, chunks.shape[0]))


def _sum_float_leaves(payload, axis_name):
    """psum the floating leaves of a summable payload; shared integer leaves pass through."""
    return jax.tree.map(
        lambda a: jax.lax.psum(a, axis_name) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        payload,
    )


def _allreduce(x, axis_name, codec, key, n):
    payload = codec.encode(x, key)
    total = codec.decode(_sum_float_leaves(payload, axis_name), x.shape[0])
    return Reduced(total / n, codec.decode(payload, x.shape[0]), jnp.zeros_like(x))


def _allgather(x, axis_name, codec, key, n):
    payload = codec.encode(x, key)
    gathered = jax.lax.all_gather(payload, axis_name, to="invarying")
    total = codec.decode_sum(gathered, x.shape[0])
    return Reduced(total / n, codec.decode(payload, x.shape[0]), jnp.zeros_like(x))


def _two_phase(x, axis_name, codec, key, n, server_residual):
    d = x.shape[0]
    c = ceil_div(d, n)
    chunks = jnp.pad(x, (0, n * c - d)).reshape(n, c)
    worker_key, owner_key = _split(key, 2)
    payloads = _vmap_encode(codec, chunks, worker_key)
    sent = jax.vmap(lambda p: codec.decode(p, c))(payloads).reshape(-1)[:d]
    # Row j of `received` is device j's encoding of the chunk this device owns.
    received = jax.tree.map(lambda a: jax.lax.all_to_all(a, axis_name, 0, 0, tiled=False), payloads)
    me = jax.lax.axis_index(axis_name)
    server = jnp.pad(server_residual, (0, n * c - d))
    own_residual = jax.lax.dynamic_slice(server, (me * c,), (c,))
    own = codec.decode_sum(received, c) / n + own_residual
    own_payload = codec.encode(own, owner_key)
    own_error = own - codec.decode(own_payload, c)
    server = jax.lax.dynamic_update_slice(jnp.zeros_like(server), own_error, (me * c,))[:d]
    gathered = jax.lax.all_gather(own_payload, axis_name, to="invarying")
    mean = jax.vmap(lambda p: codec.decode(p, c))(gathered).reshape(-1)[:d]
    return Reduced(mean, sent, server)


def reduce_vector(
    x: jax.Array,
    axis_name: Any,
    codec: Codec,
    strategy: str,
    key: jax.Array | None = None,
    server_residual: jax.Array | None = None,
) -> Reduced:
    """Mean over ``axis_name`` of a float32 vector, through ``codec`` with ``strategy``.

    ``key`` is the step's key, the same on every device; per-device noise is derived here.
    ``server_residual`` (two_phase only) is added to the owned chunk before re-encoding.
    """
    n = axis_size(axis_name)
    d = x.shape[0]
    strategy = choose_strategy(codec, d, n, strategy)
    if d == 0:
        return Reduced(x, x, x)
    k = device_key(key, codec, axis_name)
    if strategy == "allreduce":
        return _allreduce(x, axis_name, codec, k, n)
    if strategy == "allgather":
        return _allgather(x, axis_name, codec, k, n)
    if server_residual is None:
        server_residual = jnp.zeros_like(x)
    return _two_phase(x, axis_name, codec, k, n, server_residual)


def any_nonfinite(tree: Any, axis_name: Any) -> jax.Array:
    """True on every device when any float leaf on any device holds NaN or inf (one scalar psum)."""
    flags = [
        jnp.logical_not(jnp.all(jnp.isfinite(leaf)))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    local = jnp.any(jnp.stack(flags)) if flags else jnp.bool_(False)
    return jax.lax.psum(local.astype(jnp.int32), axis_name) > 0


def poison(x: jax.Array, bad: jax.Array) -> jax.Array:
    """``x``, or NaN everywhere when ``bad``: a non-finite input is never hidden."""
    return jnp.where(bad, jnp.nan, x)


def reduce_segments(
    segments: list[jax.Array],
    axis_name: Any,
    codec: Codec,
    strategy: str,
    key: jax.Array | None,
    server_residual: jax.Array | None = None,
) -> Reduced:
    """Reduce each segment (a leaf, or one flat bucket) on its own; concatenate the results.

    ``key`` is folded with the segment index, so every segment draws its own randomness.
    """
    sizes = [s.shape[0] for s in segments]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = []
    for i, (seg, off) in enumerate(zip(segments, offsets, strict=True)):
        seg_key = None if key is None else jax.random.fold_in(key, i)
        srv = None if server_residual is None else server_residual[off : off + seg.shape[0]]
        parts.append(reduce_vector(seg, axis_name, codec, strategy, seg_key, srv))
    if not parts:
        empty = jnp.zeros((0,), jnp.float32)
        return Reduced(empty, empty, empty)
    return Reduced(*(jnp.concatenate(field) for field in zip(*parts, strict=True)))


GRANULARITIES = ("leaf", "flat")


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"`granularity` must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


def segments_of(vector: jax.Array, layout: buckets.Layout, granularity: str) -> list[jax.Array]:
    """Per-leaf segments (``"leaf"``: scales and selection per layer) or one bucket (``"flat"``)."""
    if granularity == "flat":
        return [vector] if vector.shape[0] else []
    return buckets.split_compressed(vector, layout)


def pmean(
    tree: Any,
    axis_name: Any,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    strategy: str = "auto",
    min_size: int = 0,
    granularity: str = "leaf",
) -> Any:
    """Compressed ``jax.lax.pmean``: the mean of ``tree`` over ``axis_name``, through ``codec``.

    Stateless (no error feedback): use :func:`jaxcomp.compressed_allreduce` to keep what the
    codec drops. Floating leaves with at least ``min_size`` elements are compressed, smaller
    ones go through plain ``pmean``, integer leaves are returned untouched. Each leaf keeps its
    dtype; the work is in float32.

    Args:
      tree: a pytree of arrays (the per-device value), inside ``shard_map``/``pmap``.
      axis_name: the mesh axis to reduce over.
      codec: a jaxcomp codec.
      key: PRNG key, the same on every device (required by stochastic codecs; per-device
        noise is derived by folding in the device index).
      strategy: ``"auto"``, ``"allreduce"``, ``"allgather"`` or ``"two_phase"``.
      min_size: leaves smaller than this go through plain ``pmean``.
      granularity: ``"leaf"`` (compress each leaf on its own: per-layer scales) or ``"flat"``
        (all compressed leaves as one vector: fewer collectives).

    Returns:
      The mean, same structure and dtypes as ``tree``, identical on every device.
    """
    check_codec(codec)
    check_strategy(strategy)
    check_granularity(granularity)
    axis_size(axis_name)
    layout = buckets.layout_of(tree, min_size)
    x = buckets.flatten_compressed(tree, layout)
    reduced = reduce_segments(segments_of(x, layout, granularity), axis_name, codec, strategy, key)
    bad = any_nonfinite(tree, axis_name)
    mean = poison(reduced.mean, bad) if x.shape[0] else reduced.mean
    return buckets.rebuild(tree, layout, mean, lambda a: jax.lax.pmean(a, axis_name))


def psum(
    tree: Any,
    axis_name: Any,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    strategy: str = "auto",
    min_size: int = 0,
    granularity: str = "leaf",
) -> Any:
    """Compressed ``jax.lax.psum``: :func:`pmean` times the axis size. Same arguments."""
    n = axis_size(axis_name)
    mean = pmean(
        tree,
        axis_name,
        codec,
        key=key,
        strategy=strategy,
        min_size=min_size,
        granularity=granularity,
    )
    scale = lambda m: (  # noqa: E731
        (m.astype(jnp.float32) * n).astype(m.dtype) if jnp.issubdtype(m.dtype, jnp.floating) else m
    )
    return jax.tree.map(scale, mean)
