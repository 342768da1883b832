"""Specs of optax state arrays not shaped like their param, for ``jc.sharded_init``.

With ``param_specs`` that shard a leaf over a model axis (``AxisType.Auto``), the step is
manual over the data axis only: an optax transform chained after the exchange sees each
param and each of its state arrays whole (global) over the model axis. ``jc.sharded_init``
builds the state in a ``shard_map`` manual over every axis, each device from its block, and
lays the arrays out by specs: a state array shaped like its param (momentum, Adam's
moments) takes the param's spec. Arrays of other shapes got ``P()``, right for a scalar or
a placeholder, wrong for statistics of one dimension of the param: SM3's accumulators
(Anil, Gupta, Koren, Singer, "Memory-Efficient Adaptive Optimization", NeurIPS 2019:
``mu[i]`` of size ``d_i``) and Adafactor's factored row and column means (Shazeer and
Stern, 2018): a device's accumulator of a sharded dimension has that dimension's block
size, and jax's out_specs check refused the init.

Here each such array is compared between two abstract inits (``jax.eval_shape``, nothing
runs), of the params' global shapes and of each device's blocks. A dimension of size
``g_j`` globally and ``b_j < g_j`` in a block is one of a param's dimensions, ``d_i = g_j``
with block ``b_i = b_j``: it takes that dimension's entry of the param's spec, so the
global array is what ``tx.init`` of the global params builds, as the step reads it. An
array whose dimensions match no such dimension, or several with different entries, is
refused naming ``tx`` and the array (:func:`refine`). An array of the same shape in both
(a per-dimension accumulator of an unsharded dimension) is replicated over the axes its
spec does not name: the init types it as varying over the param's axes (derived from the
block), so each device's block is compared over those axes and the maximum kept, and
blocks that differ are refused (:func:`agreed`, :func:`check_agreed`), never one kept.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomp._src.axes import varying_axes


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _entry_axes(entry: Any) -> tuple:
    return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def _dim_entry(g: int, b: int, context: tuple) -> set:
    """The spec entries of every param dimension of global size ``g`` and block ``b``."""
    _, specs, shapes = context
    found = set()
    for spec, pair in zip(specs, shapes, strict=True):
        if len(pair) < 2:
            continue
        whole, block = pair
        for i, (gi, bi) in enumerate(zip(whole, block, strict=True)):
            if gi == g and bi == b and i < len(spec) and spec[i] is not None:
                found.add(spec[i])
    return found


def _spec_from_shapes(path: str, whole: tuple, block: tuple, context: tuple) -> P:
    """The spec that lays out an array of global shape ``whole`` from blocks ``block``."""
    entries = []
    for g, b in zip(whole, block, strict=True):
        if g == b:
            entries.append(None)
            continue
        found = _dim_entry(g, b, context)
        if len(found) != 1:
            raise ValueError(
                f"`tx`'s state array at {path} has shape {tuple(whole)} built from the params "
                f"and {tuple(block)} from each device's blocks, and its dimension of {g} "
                f"({b} in a block) is {'no' if not found else 'more than one'} param "
                f"dimension of those sizes sharded by `param_specs`"
                f"{'' if not found else ' (' + ', '.join(map(repr, sorted(map(str, found)))) + ')'}"
                ": jc.sharded_init cannot tell how to lay it out. Give the params this "
                "transform reads unsharded `param_specs` (P()), or build its state inside "
                "the step (docs/sharded.md)"
            )
        entries.append(found.pop())
    return P(*entries)


def refine(specs: Any, block: Any, whole: Any, context: tuple, is_jaxcomp: Any) -> Any:
    """``specs`` (of the state built from blocks) with each array outside a jaxcomp state
    whose block and global shapes differ laid out by :func:`_spec_from_shapes` where its
    spec is ``P()``; ``specs`` as they are where the two inits' trees differ (a jaxcomp
    state whose layout depends on the sizes: its own specs decide)."""
    flat_block, tree = jax.tree_util.tree_flatten_with_path(block, is_leaf=is_jaxcomp)
    flat_whole, tree_whole = jax.tree.flatten(whole, is_leaf=is_jaxcomp)
    if tree != tree_whole:
        return specs
    flat_specs = tree.flatten_up_to(specs)
    out = []
    for (path, b), w, s in zip(flat_block, flat_whole, flat_specs, strict=True):
        shaped = hasattr(b, "shape") and hasattr(w, "shape") and len(b.shape) == len(w.shape)
        if is_jaxcomp(b) or not shaped or s != P() or tuple(b.shape) == tuple(w.shape):
            out.append(s)
        else:
            where = jax.tree_util.keystr(path)
            out.append(_spec_from_shapes(where, tuple(w.shape), tuple(b.shape), context))
    return jax.tree.unflatten(tree, out)


def agreed(state: Any, specs: Any, is_jaxcomp: Any) -> tuple[Any, Any]:
    """Inside the init's ``shard_map``: ``(state, differs)``, each numeric array outside a
    jaxcomp state typed as varying over axes its spec does not name replaced by its maximum
    over them, and ``differs`` (a bool per array, the same on every device) set where the
    blocks were not all equal there."""
    leaves, tree = jax.tree.flatten(state, is_leaf=is_jaxcomp)
    out, differs = [], []
    for x, s in zip(leaves, tree.flatten_up_to(specs), strict=True):
        named = {a for e in (s if _is_spec(s) else ()) for a in _entry_axes(e)}
        numeric = not is_jaxcomp(x) and jnp.issubdtype(jnp.result_type(x), jnp.number)
        extra = tuple(sorted(varying_axes(x) - named)) if numeric else ()
        if not extra:
            out.append(x)
            differs.append(jnp.bool_(False))
            continue
        top = jax.lax.pmax(x, extra)
        differs.append(jnp.any(top != jax.lax.pmin(x, extra)))
        out.append(top)
    flags = jnp.stack(differs) if differs else jnp.zeros((0,), jnp.bool_)
    axes = tuple(sorted(varying_axes(flags)))
    if axes:
        flags = jax.lax.psum(flags.astype(jnp.int32), axes) > 0
    return jax.tree.unflatten(tree, out), flags


def check_agreed(flags: Any, state: Any, is_jaxcomp: Any) -> None:
    """Refuse, naming ``tx`` and the array, a replicated optax state array whose blocks the
    init built unequal on the devices of a param's axes (:func:`agreed`). Nothing to read
    where ``jc.sharded_init`` is traced (``jax.eval_shape`` of it: a restore target): no
    value exists there, and the init that fills the state checks."""
    if isinstance(flags, jax.core.Tracer):
        return
    flat, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_jaxcomp)
    for (path, _), bad in zip(flat, list(jax.device_get(flags)), strict=True):
        if bad:
            raise ValueError(
                f"`tx`'s state array at {jax.tree_util.keystr(path)} has the same shape built "
                "from the params and from each device's blocks, but the init gave the blocks "
                "of one param different values: it depends on the block's values, not on a "
                "whole param, and no layout holds it. Give the params this transform reads "
                "unsharded `param_specs` (P()), or build its state inside the step "
                "(docs/sharded.md)"
            )
