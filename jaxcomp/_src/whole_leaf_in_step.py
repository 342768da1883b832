"""A warning where a replica transform's inner optimizer, built inside the step, steps
blocks of leaves that it reads whole.

``jc.diloco``, ``jc.local_sgd`` and ``jc.sparseloco`` hold an inner optax optimizer. With
FSDP inside each replica (params ``P("replica", "data")``) and the state built by
``tx.init`` inside the step's ``shard_map``, :func:`jaxcomp.sharded_init` never sees
``param_specs``. The init sees two things at trace time: the inner state's types
(:mod:`whole_leaf_states`: Muon, Adafactor, NovoGrad, SM3) and, under
``shard_map(..., check_vma=True)``, each param's type: a param that differs per device over
a manual mesh axis of size > 1 beside the transform's own ``axis_name`` is a block of one
leaf there (per-device replicas from ``jc.replica_params`` differ over ``axis_name`` only).
The global shape is not in the type (inside ``shard_map`` a value's shape is its block's),
and it is not needed: the variance says the leaf is split. Without types (``jax.pmap``,
``check_vma=False``) nothing is seen, nor over an ``AxisType.Auto`` axis, where the step
sees the global leaf and nothing is wrong.

:func:`jaxcomp.sharded_init` traces ``tx.init`` in a ``shard_map`` manual over every mesh
axis, Auto ones too: its own check reads the axis types from ``param_specs`` and the mesh
(:mod:`whole_leaf`), and this one is kept quiet there (:func:`quiet`).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any

import jax
import optax

from jaxcomp._src import axes
from jaxcomp._src.whole_leaf import FIX, describe
from jaxcomp._src.whole_leaf_states import whole_leaf_readers

_QUIET = contextvars.ContextVar("whole_leaf_in_step_quiet", default=False)


@contextlib.contextmanager
def quiet():
    """No :func:`warn_inner_blocks` warning while this is entered (``jc.sharded_init``)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def _is_empty(x: Any) -> bool:
    """An empty slot of the params or of a per-leaf state field."""
    return x is None or isinstance(x, optax.MaskedNode)


def split_inner_leaves(inner_state: Any, params: Any, own: tuple) -> list:
    """``(path, axes, transforms)`` of each param that a transform in ``inner_state`` reads
    whole and that differs per device over the manual ``axes`` outside ``own``."""
    paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_empty)[0]
    readers = whole_leaf_readers(inner_state, params, _is_empty)
    split = []
    for (path, x), names in zip(paths, readers, strict=True):
        found = () if _is_empty(x) or not names else axes.split_over(x, own)
        if found:
            split.append((jax.tree_util.keystr(path), found, names))
    return sorted(split)


def warn_inner_blocks(name: str, inner_state: Any, params: Any, own: tuple) -> None:
    """Warn, naming ``name``'s ``inner`` optimizer and each leaf, where each device of the
    step will step its own block of a leaf that the inner optimizer reads whole."""
    if _QUIET.get():
        return
    split = split_inner_leaves(inner_state, params, own)
    if not split:
        return
    warnings.warn(
        f"{name}: the inner optimizer (`inner`) steps leaves whole, and the params it is "
        f"initialized with inside this shard_map are blocks of those leaves ({describe(split)}; "
        f"typed as differing per device over those axes beside {own}): each device steps "
        "its own block as if it were the leaf, another update with no error "
        f"(docs/sharded.md, Composition). {FIX}",
        stacklevel=2,
    )
