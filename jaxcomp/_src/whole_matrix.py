"""A warning where ``param_specs`` split a matrix that Muon orthogonalizes whole.

Muon (Jordan et al., 2024; ``optax.contrib.muon``) steps a 2-D leaf by the orthogonalized
momentum, ``O = UV^T`` for ``M = U S V^T``, approximated by Newton-Schulz iterations on the
whole matrix. Inside a ``shard_map`` that is manual over the axis a leaf is split on, each
device holds a block ``M_i`` and Muon returns ``U_i V_i^T`` of the block: the stacked blocks
are not the orthogonalization of ``M`` (block-wise orthogonalization, another optimizer),
with no error. MuLoCo (``jc.diloco(optax.contrib.muon(...), "replica", ...)``) with FSDP
shards ``P("data")`` inside each replica is such a run.

:func:`jaxcomp.sharded_init` sees both the state and ``param_specs``: a ``MuonState`` whose
momentum holds a 2-D leaf that its spec splits over a mesh axis of size > 1 that is not
``AxisType.Auto`` (an Explicit or Manual axis: a step's ``shard_map`` is manual over it, as
over the replica x data mesh's two axes) is named in a warning. Over an Auto axis (a data x
model mesh whose step is manual over the data axis only) Muon sees the global matrix.
jaxcomp cannot see other transforms that read a whole leaf (docs/sharded.md, Composition).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax
from jax.sharding import AxisType

# optax 0.2.8 keeps MuonState in optax.contrib._muon; absent, nothing is checked.
MUON_STATE = getattr(getattr(optax, "contrib", None), "MuonState", None)


def _muon_moments(state: Any) -> list:
    """The momentum trees (``mu``) of every ``MuonState`` nested in ``state``."""
    if MUON_STATE is None:
        return []
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MUON_STATE))
    return [x.mu for x in found if isinstance(x, MUON_STATE)]


def _split_axes(spec: Any, mesh: Any) -> tuple:
    """The mesh axes of size > 1, not ``AxisType.Auto``, that ``spec`` splits a leaf over."""
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    names = []
    for entry in tuple(spec):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and mesh.shape[name] > 1 and types.get(name) != AxisType.Auto:
                names.append(name)
    return tuple(names)


def split_muon_leaves(state: Any, params: Any, specs: list, mesh: Any, is_slot: Any) -> list:
    """``(path, axes)`` of each 2-D param that a ``MuonState`` in ``state`` orthogonalizes and
    its spec (``specs``: one per slot of ``params``, flattened with ``is_slot``) splits over
    the manual ``axes``; a momentum tree of another structure than the params is skipped."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_slot)
    split = {}
    for mu in _muon_moments(state):
        if jax.tree.structure(mu, is_leaf=is_slot) != treedef:
            continue
        moments = jax.tree.leaves(mu, is_leaf=is_slot)
        for (path, x), m, spec in zip(paths, moments, specs, strict=True):
            axes = _split_axes(spec, mesh)
            if axes and not is_slot(m) and len(getattr(x, "shape", ())) == 2:
                split[jax.tree_util.keystr(path)] = axes
    return sorted(split.items())


def warn_split_muon_leaves(split: list) -> None:
    """Warn, naming ``param_specs`` and each leaf, where Muon will orthogonalize blocks."""
    if not split:
        return
    named = ", ".join(f"{path} over {axes}" for path, axes in split)
    warnings.warn(
        "jc.sharded_init: param_specs split 2-D leaves that optax.contrib.muon "
        f"orthogonalizes ({named}): inside a shard_map manual over those axes each device "
        "orthogonalizes its own block, not the whole matrix (block-wise Muon, another "
        "update; docs/sharded.md). For Muon on the whole matrix give those leaves P() in "
        "param_specs (whole on every device) or leave them out of Muon "
        "(muon_weight_dimension_numbers); to keep block-wise Muon, filter this warning",
        stacklevel=3,
    )
