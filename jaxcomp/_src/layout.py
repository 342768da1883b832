"""Which leaves of a gradient tree get compressed, and per-leaf vectors and state trees.

Every leaf of a gradient tree falls in one of three groups:

* ``compressed`` — floating leaves with at least ``min_size`` elements that the mask allows;
* ``plain`` — floating leaves that are small (biases, norms) or masked out: plain ``pmean``;
* ``passthrough`` — integer/bool leaves: returned untouched.

Each compressed leaf is worked on as its own float32 vector (a free reshape), and per-leaf
state mirrors the gradient tree with ``optax.MaskedNode()`` at the other leaves, as
``optax.masked`` does (an empty subtree, so it adds no leaf for jax, orbax or flax.nnx; as
optax's ``mu`` mirrors
the params): never one concatenation of all leaves, which costs a pass and, in a data x
model mesh, an all-gather of model-sharded gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

COMPRESSED, PLAIN, PASSTHROUGH = "compressed", "plain", "passthrough"


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of how a tree's leaves are grouped (hashable: safe under jit)."""

    treedef: Any
    groups: tuple[str, ...]  # per leaf
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @property
    def compressed_sizes(self) -> tuple[int, ...]:
        return tuple(
            int(np.prod(s))
            for s, g in zip(self.shapes, self.groups, strict=True)
            if g == COMPRESSED
        )

    @property
    def compressed_size(self) -> int:
        """``d``: the number of elements that go through the codec."""
        return sum(self.compressed_sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        sizes = self.compressed_sizes
        return tuple(np.cumsum((0,) + sizes[:-1]).tolist()) if sizes else ()


def resolve_mask(mask: Any, tree: Any) -> Any:
    """``mask`` as a tree of bools: None (all True), a tree of bools, or a callable on the tree."""
    if mask is None:
        return jax.tree.map(lambda _: True, tree)
    m = mask(tree) if callable(mask) else mask
    try:
        return jax.tree.map(lambda _, b: bool(b), tree, m)
    except ValueError as e:
        raise ValueError(f"`mask` must have the structure of the gradient tree: {e}") from None


def layout_of(tree: Any, min_size: int = 0, mask: Any = None) -> Layout:
    """Group the leaves of ``tree`` (arrays or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(tree)
    flags = jax.tree.leaves(resolve_mask(mask, tree))
    groups = []
    # np.shape / jnp.result_type, not .shape / .dtype: a Python number among the params (a
    # scale held as 1.0) is a leaf too, as optax's init takes it.
    shapes = tuple(tuple(np.shape(leaf)) for leaf in leaves)
    dtypes = tuple(jnp.dtype(jnp.result_type(leaf)) for leaf in leaves)
    for shape, dtype, allowed in zip(shapes, dtypes, flags, strict=True):
        if not jnp.issubdtype(dtype, jnp.floating):
            groups.append(PASSTHROUGH)
        elif allowed and int(np.prod(shape)) >= max(min_size, 1):
            groups.append(COMPRESSED)
        else:
            groups.append(PLAIN)
    return Layout(treedef, tuple(groups), shapes, dtypes)


def leaves_of(tree: Any, layout: Layout, group: str) -> list[jax.Array]:
    """The leaves of ``tree`` in ``group`` (``COMPRESSED``, ``PLAIN`` or ``PASSTHROUGH``), in
    tree order. ``tree`` has the gradient's structure."""
    return [
        leaf for leaf, g in zip(jax.tree.leaves(tree), layout.groups, strict=True) if g == group
    ]


def compressed_vectors(tree: Any, layout: Layout) -> list[jax.Array]:
    """Each compressed leaf of ``tree`` as a float32 vector (a free reshape for float32)."""
    return [jnp.ravel(leaf).astype(jnp.float32) for leaf in leaves_of(tree, layout, COMPRESSED)]


def like_compressed(layout: Layout, values: list[Any]) -> Any:
    """A tree with the gradient's structure: ``values`` at the compressed leaves (in order),
    ``optax.MaskedNode()`` elsewhere (per-leaf state, as optax's ``mu`` mirrors the params;
    ``None`` in ``values`` also becomes a ``MaskedNode``)."""
    it = iter(values)
    leaves = [_slot(next(it)) if g == COMPRESSED else optax.MaskedNode() for g in layout.groups]
    return jax.tree.unflatten(layout.treedef, leaves)


def like_plain(layout: Layout, values: list[Any]) -> Any:
    """As :func:`like_compressed`, for the plain (uncompressed floating) leaves."""
    it = iter(values)
    leaves = [_slot(next(it)) if g == PLAIN else optax.MaskedNode() for g in layout.groups]
    return jax.tree.unflatten(layout.treedef, leaves)


def like_floats(layout: Layout, compressed: list[Any], plain: list[Any]) -> Any:
    """As :func:`like_compressed`, with ``compressed`` at the compressed leaves and ``plain``
    at the plain ones (every floating leaf; passthrough leaves empty)."""
    sources = {COMPRESSED: iter(compressed), PLAIN: iter(plain)}
    leaves = [
        _slot(next(sources[g])) if g in sources else optax.MaskedNode() for g in layout.groups
    ]
    return jax.tree.unflatten(layout.treedef, leaves)


def split_floats(layout: Layout, arrays: list[Any]) -> tuple[list[Any], list[Any]]:
    """The arrays of a field built by :func:`like_floats` (tree order) split back into
    (compressed, plain), each in tree order."""
    groups = [g for g in layout.groups if g != PASSTHROUGH]
    compressed = [a for a, g in zip(arrays, groups, strict=True) if g == COMPRESSED]
    plain = [a for a, g in zip(arrays, groups, strict=True) if g == PLAIN]
    return compressed, plain


def _slot(value: Any) -> Any:
    return optax.MaskedNode() if value is None else value


def is_empty(x: Any) -> bool:
    """A slot of a per-leaf state field that holds nothing."""
    return isinstance(x, optax.MaskedNode)


def slots(field: Any, layout: Layout) -> list[Any]:
    """Every slot of a per-leaf state field, one per gradient leaf (empty ones included),
    aligned with ``layout`` (empty subtrees of the gradient itself, e.g. the
    ``optax.MaskedNode`` of ``optax.partition``, are no slots)."""
    return layout.treedef.flatten_up_to(field)


def field_leaves(field: Any) -> list[jax.Array]:
    """The arrays of a per-leaf state field (empty slots skipped), in tree order."""
    return jax.tree.leaves(field)


def saturating_cast(x: jax.Array, dtype: Any) -> jax.Array:
    """``x.astype(dtype)``, finite values clipped to the dtype's range (inf/NaN pass as they are).

    A compressed mean is an estimate: random-k scales values by ``d/k``, so the estimate of a
    float16 leaf near its max can exceed 65504 although the true mean does not; a plain cast
    would turn that into inf (finite in, non-finite out).
    """
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4 or not jnp.issubdtype(dtype, jnp.floating):
        return x.astype(dtype)
    big = float(jnp.finfo(dtype).max)
    return jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x).astype(dtype)


def assemble(tree: Any, layout: Layout, compressed: list[jax.Array], plain: list[jax.Array]) -> Any:
    """The output tree: compressed leaves from their vectors (saturating cast to the leaf's
    dtype), plain leaves from ``plain`` (already in their dtype), passthrough leaves as they
    were."""
    sources = {COMPRESSED: iter(compressed), PLAIN: iter(plain)}
    out = []
    for leaf, g, shape, dtype in zip(
        jax.tree.leaves(tree), layout.groups, layout.shapes, layout.dtypes, strict=True
    ):
        if g == COMPRESSED:
            out.append(saturating_cast(next(sources[g]).reshape(shape), dtype))
        elif g == PLAIN:
            out.append(next(sources[g]).reshape(shape).astype(dtype))
        else:
            out.append(leaf)
    return jax.tree.unflatten(layout.treedef, out)


def _is_slot(x: Any) -> bool:
    """An empty slot of a per-leaf tree (None, ``optax.MaskedNode``): counted as a leaf."""
    return x is None or isinstance(x, optax.MaskedNode)


def leaf_paths(tree: Any) -> list[str]:
    """The key path of every leaf of ``tree``, empty slots included (``''`` for a bare
    array): dicts and FrozenDicts of the same keys read the same (an NNX state's leaves add
    ``.value``: ``['w'].value``, so its pure dict is another tree)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_slot)[0]
    return [jax.tree_util.keystr(p) for p, _ in leaves]


def _structure(tree: Any) -> str:
    text = str(jax.tree.structure(tree, is_leaf=_is_slot))
    return text if len(text) < 200 else text[:200] + "..."


def check_same_tree(transform: str, updates: Any, reference: Any, what: str) -> None:
    """Refuse gradients (``updates``) whose tree is not ``reference``'s, leaf for leaf by key
    path: a bare array against a dict of one leaf of the same shape passed the shape checks
    and failed deep inside (AttributeError, "Expected dict, got Array"). ``what`` names the
    reference (the params, or a state field initialized for them)."""
    got, want = leaf_paths(updates), leaf_paths(reference)
    if got == want:
        return
    first = next(
        (
            f"{a or '<root>'} against {b or '<root>'}"
            for a, b in zip(got, want, strict=False)
            if a != b
        ),
        f"{len(got)} leaves against {len(want)}",
    )
    cause = (
        "the state was initialized for other params"
        if what.startswith("the state")
        else "the gradients must have the tree of the params"
    )
    raise ValueError(
        f"{transform}: the gradients (`updates`) have the tree structure {_structure(updates)} "
        f"but {what} has {_structure(reference)} (first difference: {first}): {cause}. Pass "
        "gradients of the params tree the state was initialized for (e.g. jax.grad of the "
        "loss with respect to those params, not a bare array for a dict of one leaf), or "
        "initialize the state with these params."
    )


def check_like_params(updates: Any, params: Any, transform: str) -> None:
    """Raise if the gradient tree does not match ``params`` leaf for leaf (shapes, in order,
    and key paths: :func:`check_same_tree`).

    The state of a transform holds flat vectors, so a gradient tree of the same total size
    but other leaves would silently pair its memory with the wrong entries; the ``params``
    optax passes to ``update`` (every chain and ``nnx.Optimizer`` do) tell the tree it was
    initialized for. Skipped when ``params`` is None.
    """
    if params is None:
        return
    got = [tuple(jnp.shape(x)) for x in jax.tree.leaves(updates)]
    want = [tuple(jnp.shape(x)) for x in jax.tree.leaves(params)]
    if got == want:  # the same shapes in order: the same tree too (a bare array is not)
        check_same_tree(transform, updates, params, "the params passed to update (`params`)")
        return
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(updates)]
    if len(got) != len(want):
        detail = f"{len(got)} gradient leaves but {len(want)} params leaves"
    else:
        i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        detail = f"gradient leaf {paths[i]} has shape {got[i]}, its params leaf {want[i]}"
    raise ValueError(
        f"{transform}: the gradient tree does not match the params tree ({detail}). The "
        "update's gradients must have the structure of the params the state was initialized "
        "for."
    )
