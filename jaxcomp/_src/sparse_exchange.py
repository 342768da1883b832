"""All-gather of chunked top-k payloads: what SparseLoCo and DeMo put on the wire.

Each device encodes its vectors with :func:`jaxcomp.chunked_top_k`, the payloads (packed
indices, packed value codes, per-chunk scales) travel in one bucketed ``all_gather``, and every
device decodes all of them into the same mean: over every device, or (Templar's merge) per
coordinate over the devices that sent it. Small vectors go through a float32 ``pmean``.
Nothing here holds state: the transforms keep their error feedback.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp._src import buckets, collectives, shards
from jaxcomp._src.axes import gather_to
from jaxcomp._src.codecs.base import Codec

#: How the gathered payloads are averaged: over every device, or per coordinate over the
#: devices whose payload holds it (Templar).
AVERAGING = ("all", "senders")


def check_averaging(averaging: Any) -> str:
    if averaging not in AVERAGING:
        raise ValueError(f"`averaging` must be one of {AVERAGING}, got {averaging!r}")
    return averaging


class Exchanged(NamedTuple):
    """What one exchange gives back, per vector (in the order given)."""

    means: list  # f32 vectors, identical on every device; NaN everywhere if `bad`
    sent: list  # f32 vectors: what this device's payload decodes to (the vector, if dense)
    bad: jax.Array  # bool[]: some device's input was not finite (identical on every device)


def exchange(
    vectors: list[jax.Array],
    codecs: list[Codec | None],
    axis_name: Any,
    *,
    averaging: str = "all",
    bucket_bytes: int = buckets.BUCKET_BYTES,
) -> Exchanged:
    """The mean over ``axis_name`` of each 1-D float32 vector: through its codec (one
    all-gather of every payload, bucketed), or by a float32 ``pmean`` where its codec is
    None. A chunked top-k payload is merged as ``averaging`` says; a dense codec's (every
    coordinate sent by every device, e.g. :func:`jaxcomp.sign`) is the mean over all devices
    either way. The non-finite flag is read from what every device received (the payloads'
    scales flag a NaN or inf), so it is the same everywhere: or-ed over the shards of one
    model too (:func:`jaxcomp._src.shards.any_shard`), where the vectors are shards."""
    sparse = [i for i, c in enumerate(codecs) if c is not None]
    dense = [i for i, c in enumerate(codecs) if c is None]
    payloads = [codecs[i].encode(vectors[i]) for i in sparse]
    gathered, held = buckets.exchange(
        payloads,
        lambda b: jax.lax.all_gather(b, axis_name, to=gather_to(axis_name)),
        bucket_bytes=bucket_bytes,
        with_buckets=True,
    )
    plain, held_plain = collectives.plain_mean(
        [vectors[i] for i in dense], axis_name, bucket_bytes, with_buckets=True
    )
    bad = collectives.local_nonfinite(
        [h for h in [*held, *held_plain] if jnp.issubdtype(h.dtype, jnp.floating)]
    )
    bad = shards.any_shard(bad)  # over the shards of one model too (FSDP inside, shard_axis)
    fill = jnp.where(bad, jnp.nan, 0.0)
    n = collectives.axis_size(axis_name)
    means: list[Any] = [None] * len(vectors)
    sent: list[Any] = [None] * len(vectors)
    for i, p, g in zip(sparse, payloads, gathered, strict=True):
        codec, d = codecs[i], vectors[i].shape[0]
        if averaging == "senders" and not codec.dense:
            means[i] = codec.decode_mean_of_senders(g, d, fill=fill)
        else:
            means[i] = codec.decode_sum(g, d, scale=1.0 / n, fill=fill)
        sent[i] = codec.decode(p, d)
    for i, m in zip(dense, plain, strict=True):
        means[i], sent[i] = collectives.poison(m, bad), vectors[i]
    return Exchanged(means, sent, bad)


def wire_bytes(sizes: list[int], codecs: list[Codec | None], n: int) -> float:
    """Ring-model bytes per device of one :func:`exchange` of vectors of ``sizes`` over ``n``
    devices: ``(n - 1) * payload_bytes`` per coded vector (all-gather), ``2 (n - 1) / n * 4 d``
    per vector without a codec (float32 pmean)."""
    total = 0.0
    for d, codec in zip(sizes, codecs, strict=True):
        if codec is not None:
            total += (n - 1) * codec.payload_bytes(d)
        else:
            total += 2 * (n - 1) / n * 4 * d
    return total
