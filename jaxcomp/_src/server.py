"""The two-phase server residual: each device keeps the error of the chunks it owns.

With ``two_phase`` device ``i`` owns chunk ``i`` of every segment (``c = ceil(d/n)`` floats,
``ceil(ceil(d/L)/n)`` hierarchically) and re-encodes that chunk's average; the re-encoding
error stays with it (1-bit Adam's server error). So the field holds exactly the owned
chunks: per compressed leaf (or, with ``granularity="flat"``, for the one flat vector) an
``f32[1, sum_s c_s]`` over its segments that travel two-phase, None where none does. Its
size depends on ``n``: the state must be built where the axis is bound
(``jc.sharded_init``, ``jax.pmap(tx.init, axis_name=...)``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp._src import collectives
from jaxcomp._src import layout as layouts
from jaxcomp._src.codecs.base import Codec, ceil_div


def chunk_sizes(
    plan: collectives.Segments, codec: Codec, strategy: str, n: int, n_inner: int
) -> list[list[int]]:
    """Per whole (leaf, or the flat vector), per segment: its owned chunk (0 if not two-phase)."""
    return [
        [
            collectives.server_size(d, n, n_inner)
            if collectives.choose_strategy(codec, ceil_div(d, n_inner), n, strategy) == "two_phase"
            else 0
            for d in pieces
        ]
        for pieces in plan.pieces()
    ]


def bound_sizes(axis_name: Any, inner_axis_name: Any) -> tuple[int, int] | None:
    """``(n, n_inner)`` where the axes are bound, else None (outside any mesh)."""
    n = collectives.bound_axis_size(axis_name)
    n_inner = 1 if inner_axis_name is None else collectives.bound_axis_size(inner_axis_name)
    return None if n is None or n_inner is None else (n, n_inner)


def zeros(layout: layouts.Layout, chunks: list[list[int]] | None, flat: bool) -> Any:
    """The initial field: zeros of the owned chunks; None where nothing travels two-phase,
    and None everywhere when ``chunks`` is None (built outside the mesh)."""
    if chunks is None:
        return None
    arrays = [jnp.zeros((1, sum(c)), jnp.float32) if sum(c) else None for c in chunks]
    if flat:
        return arrays[0] if arrays else None
    return layouts.like_compressed(layout, arrays) if any(a is not None for a in arrays) else None


def _wholes(field: Any, layout: layouts.Layout, flat: bool) -> list:
    if flat:
        return [field]
    if field is None:
        return [None] * layout.groups.count(layouts.COMPRESSED)
    slots = jax.tree.leaves(field, is_leaf=lambda x: x is None)
    return [s for s, g in zip(slots, layout.groups, strict=True) if g == layouts.COMPRESSED]


def read(field: Any, layout: layouts.Layout, chunks: list[list[int]], flat: bool) -> list:
    """The owned chunk of every segment (``f32[c]``), None where it is not two-phase."""
    if field is None and any(map(sum, chunks)):
        raise ValueError(
            "the two-phase server residual is missing from the state: it holds the chunk each "
            "device owns, so its size depends on the number of devices, and a state built "
            "outside the mesh has none. Build the state with jc.sharded_init(tx, params, mesh, "
            "axis_name) under shard_map, or jax.pmap(tx.init, axis_name=...) under pmap."
        )
    out = []
    for whole, sizes in zip(_wholes(field, layout, flat), chunks, strict=True):
        offset = 0
        for c in sizes:
            out.append(jnp.ravel(whole)[offset : offset + c] if c else None)
            offset += c
    return out


def write(new: list, layout: layouts.Layout, chunks: list[list[int]], flat: bool) -> Any:
    """The field holding ``new`` (per segment, None where not two-phase)."""
    it = iter(new)
    arrays = []
    for sizes in chunks:
        parts = [next(it) for _ in sizes]
        kept = [p for p, c in zip(parts, sizes, strict=True) if c]
        arrays.append(
            jnp.concatenate(kept)[None] if len(kept) > 1 else kept[0][None] if kept else None
        )
    if flat:
        return arrays[0]
    return layouts.like_compressed(layout, arrays) if any(a is not None for a in arrays) else None
