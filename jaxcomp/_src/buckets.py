"""Payload buckets: many small encoded payloads, a few collectives.

A transform encodes leaf by leaf; sending each leaf's payload in its own collective costs a
launch and a latency per leaf, and an HLO that grows with the number of leaves. Here the
arrays of all payloads are grouped by dtype, laid end to end along their last axis into
buckets of about ``bucket_bytes``, sent with ONE collective per bucket, and split back::

    payloads (pytrees, per leaf) -> arrays by dtype -> [*lead, B] buckets -> collective
                                 -> [*lead', B] -> split -> payloads (pytrees, per leaf)

``lead`` leading axes of every array are kept as they are (two-phase rows ``[n, ...]`` are
split over devices by ``all_to_all``); the collective may add or drop leading axes
(``all_gather`` adds the device axis, ``psum_scatter`` drops one). An array of at least
``bucket_bytes / 16`` (2 MiB by default) travels alone, without a copy: concatenating it
would copy its bytes to save one collective launch, and on XLA:CPU that copy costs more
than the launch (measured: docs/hot-path.md, "Where the time of one update goes, op by
op"). Concatenation only ever touches arrays smaller than that, which are compressed
already.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._src.axes import varying_axes

#: Default bucket size: 32 MiB, about torch DDP's 25 MB; large enough that a bucket's
#: transfer time dwarfs a collective's latency on a 1-10 Gbit/s link.
BUCKET_BYTES = 2**25


#: An array of at least ``bucket_bytes // ALONE`` bytes travels in a bucket of its own.
ALONE = 16


def _kinds(arrays: list[jax.Array]) -> list[frozenset]:
    """Each array's manual axes it varies over beyond those every array varies over (jax's
    types; empty where jax does not track them). Arrays of different kinds never share a
    bucket: concatenated, a leaf identical on every device of an axis (a param replicated
    beside FSDP shards over ``"data"``, exchanged over ``"replica"``) came back typed as
    varying over ``"data"``, and the exchange's output no longer matched its input's type
    (``lax.cond`` refused the sync, ``shard_map`` its ``out_specs``)."""
    kinds = [varying_axes(a) for a in arrays]
    common = frozenset.intersection(*kinds) if kinds else frozenset()
    return [k - common for k in kinds]


def _plan(arrays: list[jax.Array], lead: int, bucket_bytes: int) -> list[list[int]]:
    """Indices of ``arrays`` per bucket: same dtype and kind (:func:`_kinds`), in order, at
    most ``bucket_bytes`` each (a bucket holds at least one array); an array of at least
    ``bucket_bytes // ALONE`` bytes is a bucket of its own (no concatenation copies it)."""
    by_dtype: dict[Any, list[int]] = {}
    plan: list[list[int]] = []
    for i, (a, kind) in enumerate(zip(arrays, _kinds(arrays), strict=True)):
        if a.size * a.dtype.itemsize >= max(bucket_bytes // ALONE, 1):
            plan.append([i])
        else:
            by_dtype.setdefault((jnp.dtype(a.dtype), kind), []).append(i)
    for members in by_dtype.values():
        current: list[int] = []
        size = 0
        for i in members:
            nbytes = arrays[i].size * arrays[i].dtype.itemsize
            if current and size + nbytes > bucket_bytes:
                plan.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            plan.append(current)
    return plan


def exchange(
    payloads: list[Any],
    collective: Callable[[jax.Array], jax.Array],
    *,
    lead: int = 0,
    bucket_bytes: int = BUCKET_BYTES,
    with_buckets: bool = False,
) -> Any:
    """``collective`` applied to every array of ``payloads``, one call per bucket.

    ``payloads`` is a list of pytrees of arrays (one per leaf or segment); each array keeps
    its first ``lead`` axes and is flattened after them. ``collective`` maps a bucket
    ``[*lead_dims, B]`` to ``[*out_dims, B]`` (same last axis). The result has the structure
    of ``payloads``, each array of shape ``(*out_dims, *array.shape[lead:])``;
    ``with_buckets``: also the list of what the collective returned, one array per bucket
    (to read something of all payloads at once, e.g. whether any is non-finite).
    """
    flat, treedef = jax.tree.flatten(payloads)
    if not flat:
        return (payloads, []) if with_buckets else payloads
    plan = _plan(flat, lead, bucket_bytes)
    out: list[Any] = [None] * len(flat)
    results = []
    for members in plan:
        parts = [flat[i].reshape(*flat[i].shape[:lead], -1) for i in members]
        bucket = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
        result = collective(bucket)
        results.append(result)
        out_dims = result.shape[:-1]
        offsets = np.cumsum([0] + [p.shape[-1] for p in parts]).tolist()
        for i, a, b in zip(members, offsets[:-1], offsets[1:], strict=True):
            piece = result if len(parts) == 1 else result[..., a:b]
            out[i] = piece.reshape(*out_dims, *flat[i].shape[lead:])
    tree = jax.tree.unflatten(treedef, out)
    return (tree, results) if with_buckets else tree


def check_bucket_bytes(bucket_bytes: Any) -> int:
    """``bucket_bytes`` as a positive int, else an error naming it."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int | np.integer):
        raise TypeError(f"`bucket_bytes` must be an int, got {type(bucket_bytes).__name__}")
    if bucket_bytes < 1 or not math.isfinite(bucket_bytes):
        raise ValueError(f"`bucket_bytes` must be >= 1, got {bucket_bytes}")
    return int(bucket_bytes)
