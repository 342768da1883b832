"""The two-phase server residual: each device keeps the error of the chunks it owns.

With ``two_phase`` device ``i`` owns chunk ``i`` of every segment (``c = ceil(d/n)`` floats,
``ceil(ceil(d/L)/n)`` hierarchically) and re-encodes that chunk's average; the re-encoding
error stays with it (1-bit Adam's server error). So the field holds exactly the owned
chunks: per compressed leaf (or, with ``granularity="flat"``, for the one flat vector) an
``f32[1, sum_s c_s]`` over its segments (unused where ``auto`` picks another strategy for
the segment: the field's leaves do not depend on ``n``). Its size does: built where the axis
is bound (``jc.sharded_init``, ``jax.pmap(tx.init, axis_name=...)``) it holds the owned
chunks only; built outside (``tx.init``) it has room for each whole vector, ``f32[1, d]``,
of which each device reads and writes its own chunk (flat exchanges only: a hierarchical
one refuses it, :func:`check_whole`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp._src import collectives, feedback
from jaxcomp._src import layout as layouts
from jaxcomp._src.codecs.base import Codec, ceil_div


class Chunks(NamedTuple):
    """Per whole (leaf, or the flat vector), per segment: the owned chunk's size, and whether
    the segment travels two-phase (the others keep an unused chunk, so that the field has
    the same leaves whatever strategy ``auto`` picks for ``n``)."""

    sizes: list[list[int]]
    used: list[list[bool]]


def chunk_sizes(
    plan: collectives.Segments, codec: Codec, strategy: str, n: int, n_inner: int
) -> Chunks:
    """The :class:`Chunks` of a gradient's segments over ``n`` (and ``n_inner``) devices."""
    pieces = plan.pieces()
    return Chunks(
        [[collectives.server_size(d, n, n_inner) for d in p] for p in pieces],
        [
            [
                collectives.choose_strategy(codec, ceil_div(d, n_inner), n, strategy) == "two_phase"
                for d in p
            ]
            for p in pieces
        ],
    )


def bound_sizes(axis_name: Any, inner_axis_name: Any) -> tuple[int, int] | None:
    """``(n, n_inner)`` where the axes are bound, else None (outside any mesh)."""
    n = collectives.bound_axis_size(axis_name)
    n_inner = 1 if inner_axis_name is None else collectives.bound_axis_size(inner_axis_name)
    return None if n is None or n_inner is None else (n, n_inner)


def zeros(
    layout: layouts.Layout,
    chunks: Chunks | None,
    flat: bool,
    used: bool = True,
    dtype: Any = jnp.float32,
) -> Any:
    """The initial field: zeros of the owned chunks of every compressed leaf (None if unused).

    Built outside the mesh (``chunks`` None, the number of devices unknown: ``tx.init``
    called directly, then ``jc.replicate`` for ``pmap``), every compressed leaf gets room
    for its whole vector, ``(1, d)``, of which each device reads and writes its own chunk:
    the same algorithm, ``n`` times the memory (a hierarchical exchange's update refuses
    it: it records no grid). ``jc.sharded_init`` and ``jax.pmap(tx.init, axis_name=...)``
    build the compact field.
    """
    if not used:
        return None
    if chunks is None:
        widths = [sum(layout.compressed_sizes)] if flat else list(layout.compressed_sizes)
    else:
        widths = [sum(c) for c in chunks.sizes]
    arrays = [jnp.zeros((1, w), dtype) for w in widths]
    if flat:
        return arrays[0] if arrays else None
    return layouts.like_compressed(layout, arrays) if arrays else None


def _wholes(field: Any, layout: layouts.Layout, flat: bool) -> list:
    if flat:
        return [field]
    if field is None:
        return [None] * layout.groups.count(layouts.COMPRESSED)
    slots = layouts.slots(field, layout)
    return [s for s, g in zip(slots, layout.groups, strict=True) if g == layouts.COMPRESSED]


def is_whole(field: Any, layout: layouts.Layout, flat: bool) -> bool:
    """Whether ``field`` was built outside the mesh: room for each whole vector. A None
    slot where a leaf is compressed (orbax restores a saved empty slot as None: a state of a
    larger ``min_size``) is not, nor a slot that is no array (gradients of another tree:
    the whole dict of a one-leaf state against a bare array): :func:`check_grid` asks
    before :func:`~jaxcomp._src.skeleton.check_state`, which names them."""
    sizes = [sum(layout.compressed_sizes)] if flat else list(layout.compressed_sizes)
    try:
        wholes = _wholes(field, layout, flat)
    except ValueError:  # a tree of other params ("Dict key mismatch"): check_fields names it
        return False
    return (
        field is not None
        and all(
            layouts.is_empty(w) or getattr(w, "shape", ())[-1:] == (d,)
            for w, d in zip(wholes, sizes, strict=True)
        )
        and any(not layouts.is_empty(w) for w in wholes)
    )


def grid(sizes: tuple[int, int] | None, used: bool) -> jax.Array | None:
    """The ``server_grid`` field of a hierarchical exchange: int8 zeros of shape ``sizes``,
    ``(H, L)``, where it keeps a server residual on a bound mesh; else None.

    Device ``(h, l)`` owns part ``h`` of inner chunk ``l`` (:class:`Owner`), chunk
    ``l H + h`` of the whole, but its row of the field's global array is ``h L + l``: the
    rows are the chunks in an order that depends on ``(H, L)``, not on ``H L`` alone. The
    shape records them, so that a restore onto another grid of as many devices (2 x 4 saved,
    4 x 2 or 8 x 1 restored: the same shapes) fails instead of adding each row's residual to
    another chunk's values."""
    if not used or sizes is None:
        return None
    return jnp.zeros(sizes, jnp.int8)


def stamp(axis_name: Any, inner_axis_name: Any, used: bool) -> jax.Array | None:
    """The ``server_chunk`` field where a server residual is kept (``used``; else None):
    int32 ``[1]`` per device, the index of the chunk whose residual its row of
    ``server_residual`` holds (:meth:`Owner.index`), or -1 outside the mesh (``tx.init``:
    each row has room for the whole vector; nothing is checked), so that the state has the
    same leaves built in the mesh and out of it (``jax.eval_shape(tx.init, params)`` gives
    the specs of the state ``tx.init`` builds inside a ``shard_map``).

    Each row of a per-device field is one device's, and nothing in the field's shape says
    whose: a state stepped with its rows on other devices than it was saved from (2 x 4
    hierarchical restored into a flat exchange of 8, where device ``(h, l)`` owns chunk
    ``h L + l`` instead of ``l H + h``; a flat exchange over ``("a", "b")`` stepped with
    ``P(("b", "a"))``; a hierarchical one with its axes swapped where ``H = L``) adds each
    row's residual to another chunk's values. The update compares the stamp with this
    device's chunk (:func:`misplaced`)."""
    if not used:
        return None
    if bound_sizes(axis_name, inner_axis_name) is None:
        return jnp.full((1,), -1, jnp.int32)
    return Owner(axis_name, inner_axis_name).index()[None]


def misplaced(state: Any, owner: Owner) -> jax.Array | None:
    """Whether this device's row of the state was laid out for another chunk than the one
    it owns here (its ``server_chunk`` stamp, :func:`stamp`), a bool scalar of this device;
    None where the state holds no stamp (by hand); never where it is -1 (built outside the
    mesh)."""
    got = getattr(state, "server_chunk", None)
    if got is None:
        return None
    got = jnp.ravel(got)
    return jnp.any((got != owner.index()) & (got >= 0))


def poison_misplaced(targets: list, state: Any, owner: Owner) -> list:
    """``targets`` (what this device sends), NaN where its row of ``state`` is another
    device's (:func:`misplaced`): the exchange flags the step as it flags a non-finite
    gradient, on every device (outputs NaN, the whole state kept, ``apply_if_finite``
    skips it), instead of adding the rows to other chunks' values. A select fused into the
    pass that forms ``g + e``; nothing where the state holds no stamp."""
    bad = misplaced(state, owner)
    if bad is None:
        return targets
    return [jnp.where(bad, jnp.nan, t) for t in targets]


def check_grid(state: Any, layout: layouts.Layout, flat: bool, axis_name: Any, inner: Any) -> None:
    """Refuse a hierarchical state whose owned chunks belong to another ``(H, L)``
    (:func:`grid`), or to an unknown one (no ``server_grid``: saved before the field), at
    trace time. A server residual built outside the mesh (room for whole vectors) is
    :func:`check_whole`'s, after the state's shapes and axes are checked."""
    field = getattr(state, "server_residual", None)
    if inner is None or field is None or is_whole(field, layout, flat):
        return
    want = bound_sizes(axis_name, inner)
    got = getattr(state, "server_grid", None)
    got = None if got is None else tuple(jnp.shape(got))
    if want is None or got == tuple(want):
        return
    held = (
        "holds no `server_grid` (a flat exchange's state, without `inner_axis_name`; one saved "
        "before 2026-11-27; or one built by hand), so the grid its `server_residual` chunks "
        "were laid out for is unknown"
        if got is None
        else f"has `server_grid` of shape {got}: its `server_residual` rows are the chunks "
        f"of a {got[0]} x {got[1]} mesh"
    )
    raise ValueError(
        f"jc.compressed_allreduce: the state {held}, but this step runs on `axis_name`="
        f"{axis_name!r} x `inner_axis_name`={inner!r} of {want[0]} x {want[1]} devices, where "
        "each device owns another chunk: every row would be added to another chunk's values. "
        "Restore the state onto a mesh of the sizes it was saved on, or take `server_residual` "
        "and `server_grid` from a fresh jc.sharded_init on this mesh (what the server held "
        "back is then dropped; docs/checkpoints.md)."
    )


def check_whole(state: Any, layout: layouts.Layout, flat: bool, axis_name: Any, inner: Any) -> None:
    """Refuse a hierarchical exchange's server residual built outside the mesh (``tx.init``:
    room for whole vectors, no ``server_grid``). Row ``h L + l`` holds device ``(h, l)``'s
    chunk ``l H + h`` at its place in the whole vector, a set of values that depends on
    ``(H, L)``; restored onto another grid of as many devices (same shapes), each device
    reads its new chunk from its row and the values of its old chunk outside it are never
    read again: what the server held back is dropped, with no grid to tell it."""
    field = getattr(state, "server_residual", None)
    if inner is None or field is None or not is_whole(field, layout, flat):
        return
    raise ValueError(
        "jc.compressed_allreduce: the state's `server_residual` was built outside the mesh "
        "(`tx.init`: room for each whole vector, and no `server_grid`), but this exchange "
        f"has `inner_axis_name`={inner!r} (`axis_name`={axis_name!r}): the chunk each row "
        "holds depends on the grid of both axes, which such a state does not record, so a "
        "restore onto another grid of as many devices would silently drop what the server "
        "held back. Build the state where the axes are bound: jc.sharded_init(tx, params, "
        "mesh, (axis_name, inner_axis_name)), or tx.init inside the shard_map "
        "(docs/checkpoints.md)."
    )


class Owner:
    """Where this device's chunk of a segment lies: chunk ``outer`` of inner chunk ``inner``."""

    def __init__(self, axis_name: Any, inner_axis_name: Any):
        self.n = collectives.axis_size(axis_name)
        self.outer = jax.lax.axis_index(axis_name)
        if inner_axis_name is None:
            self.n_inner, self.inner = 1, 0
        else:
            self.n_inner = collectives.axis_size(inner_axis_name)
            self.inner = jax.lax.axis_index(inner_axis_name)

    def index(self) -> jax.Array:
        """The index of the chunk this device owns, ``inner n + outer`` (``l H + h``; flat:
        the device's index along ``axis_name``), int32."""
        return (self.inner * self.n + self.outer).astype(jnp.int32)

    def _grid(self, d: int) -> tuple[int, int]:
        c1 = ceil_div(d, self.n_inner)
        return c1, ceil_div(c1, self.n)

    def take(self, vector: jax.Array) -> jax.Array:
        """This device's chunk of a whole-vector residual ``f32[d]``."""
        c1, c2 = self._grid(vector.shape[0])
        inner = jnp.pad(vector, (0, self.n_inner * c1 - vector.shape[0])).reshape(self.n_inner, c1)
        part = jax.lax.dynamic_index_in_dim(inner, self.inner, keepdims=False)
        return jax.lax.dynamic_slice(
            jnp.pad(part, (0, self.n * c2 - c1)), (self.outer * c2,), (c2,)
        )

    def put(self, vector: jax.Array, chunk: jax.Array) -> jax.Array:
        """``vector`` with this device's chunk replaced by ``chunk``."""
        d = vector.shape[0]
        c1, c2 = self._grid(d)
        inner = jnp.pad(vector, (0, self.n_inner * c1 - d)).reshape(self.n_inner, c1)
        part = jax.lax.dynamic_index_in_dim(inner, self.inner, keepdims=False)
        part = jax.lax.dynamic_update_slice(
            jnp.pad(part, (0, self.n * c2 - c1)), chunk, (self.outer * c2,)
        )
        inner = jax.lax.dynamic_update_index_in_dim(inner, part[:c1], self.inner, 0)
        return inner.reshape(-1)[:d]


def read(field: Any, layout: layouts.Layout, chunks: Chunks, flat: bool, owner: Owner) -> list:
    """The owned chunk of every segment (``f32[c]``), None where it is not two-phase."""
    whole_room = is_whole(field, layout, flat)
    out = []
    for whole, sizes, used, pieces in zip(
        _wholes(field, layout, flat),
        chunks.sizes,
        chunks.used,
        _piece_sizes(layout, flat),
        strict=True,
    ):
        offset = 0
        for c, u, d in zip(sizes, used, pieces, strict=True):
            width = d if whole_room else c
            part = jnp.ravel(whole)[offset : offset + width]
            out.append(None if not u else owner.take(part) if whole_room else part)
            offset += width
    return out


def _piece_sizes(layout: layouts.Layout, flat: bool) -> list[list[int]]:
    plan = collectives.segments_for(list(layout.compressed_sizes), "flat" if flat else "leaf")
    return plan.pieces()


def write(
    new: list, field: Any, layout: layouts.Layout, chunks: Chunks, flat: bool, owner: Owner
) -> Any:
    """``field`` with the owned chunks replaced by ``new`` (per segment, None where not
    two-phase: kept as it was), in the layout of ``field`` (owned chunks, or whole vectors)."""
    whole_room = is_whole(field, layout, flat)
    it = iter(new)
    arrays = []
    for whole, sizes, pieces in zip(
        _wholes(field, layout, flat), chunks.sizes, _piece_sizes(layout, flat), strict=True
    ):
        vector, offset, kept = jnp.ravel(whole), 0, []
        for c, d in zip(sizes, pieces, strict=True):
            width = d if whole_room else c
            part, chunk = vector[offset : offset + width], next(it)
            if chunk is not None:
                chunk = feedback.to_memory(chunk, vector.dtype)
                part = owner.put(part, chunk) if whole_room else chunk
            kept.append(part)
            offset += width
        arrays.append((kept[0] if len(kept) == 1 else jnp.concatenate(kept))[None])
    if flat:
        return arrays[0]
    return layouts.like_compressed(layout, arrays)
