"""A warning where ``param_specs`` split a leaf that an optax transform steps whole.

Some optax transforms read a whole leaf to step it (:mod:`whole_leaf_states`: Muon's
orthogonalization of the matrix, Adafactor's row and column means, NovoGrad's and SM3's
norms and maxima). Inside a ``shard_map`` that is manual over the axis a leaf is split on,
each device holds a block ``M_i`` and the transform steps it as if it were the leaf:
Muon returns ``U_i V_i^T`` of the block, not the orthogonalization of ``M`` (block-wise
Muon, another optimizer), NovoGrad divides by the block's norm, with no error. MuLoCo
(``jc.diloco(optax.contrib.muon(...), "replica", ...)``) with FSDP shards ``P("data")``
inside each replica is such a run.

:func:`jaxcomp.sharded_init` sees both the state and ``param_specs``: a state of one of those
transforms holding a leaf that its spec splits over a mesh axis of size > 1 that is not
``AxisType.Auto`` (an Explicit or Manual axis: a step's ``shard_map`` is manual over it, as
over the replica x data mesh's two axes) is named in a warning. Over an Auto axis (a data x
model mesh whose step is manual over the data axis only) the transform sees the global leaf.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from jax.sharding import AxisType

from jaxcomp._src.whole_leaf_states import reads, whole_leaf_readers

# The way out, shared by the warnings of jc.sharded_init and of a step's tx.init.
FIX = (
    "Keep those leaves whole on every device of the replica (P() in param_specs and the "
    "step's specs), or step them with an optimizer that reads each value alone "
    "(optax.multi_transform; Muon: muon_weight_dimension_numbers); to keep the block-wise "
    "step, filter this warning"
)


def _split_axes(spec: Any, mesh: Any) -> tuple:
    """The mesh axes of size > 1, not ``AxisType.Auto``, that ``spec`` splits a leaf over."""
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    names = []
    for entry in tuple(spec):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and mesh.shape[name] > 1 and types.get(name) != AxisType.Auto:
                names.append(name)
    return tuple(names)


def split_leaves(state: Any, params: Any, specs: list, mesh: Any, is_slot: Any) -> list:
    """``(path, axes, transforms)`` of each param that a transform in ``state`` reads whole
    (:func:`whole_leaf_readers`) and its spec (``specs``: one per slot of ``params``,
    flattened with ``is_slot``) splits over the manual ``axes``."""
    paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_slot)[0]
    readers = whole_leaf_readers(state, params, is_slot)
    split = []
    for (path, _), names, spec in zip(paths, readers, specs, strict=True):
        axes = _split_axes(spec, mesh)
        if axes and names:
            split.append((jax.tree_util.keystr(path), axes, names))
    return sorted(split)


def describe(split: list) -> str:
    """``split``'s leaves, their axes and transforms, and what each transform reads."""
    leaves = ", ".join(
        f"{path} over {axes} by {' and '.join(names)}" for path, axes, names in split
    )
    used = sorted({n for _, _, names in split for n in names})
    return f"{leaves}; " + "; ".join(f"{n} {reads(n)}" for n in used)


def warn_split_leaves(split: list) -> None:
    """Warn, naming ``param_specs``, each leaf and its transform, where each device will step
    its own block of a leaf that the transform reads whole."""
    if not split:
        return
    warnings.warn(
        "jc.sharded_init: param_specs split leaves that an optax transform in tx steps "
        f"whole ({describe(split)}): inside a shard_map manual over those axes each device "
        "steps its own block as if it were the leaf, another update with no error "
        f"(docs/sharded.md, Composition). {FIX}",
        stacklevel=3,
    )
