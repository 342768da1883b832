"""A replica transform's inner update that differs per device where its param does not.

Inside ``jc.diloco``, ``jc.local_sgd`` or ``jc.sparseloco`` over ``"replica"`` with FSDP
over ``"data"`` inside each replica, a leaf kept whole on the replica's devices (a bias or
a norm scale ``P()`` beside ``P("data")`` shards) is typed, under
``shard_map(..., check_vma=True)``, as the same on every device of ``"data"``, and so is its
gradient (jax sums it there). Its inner update must be too: the devices of a replica hold
one copy of it. An update typed as differing over ``"data"`` mixed each device's shards
into it: a norm of the whole tree taken per shard (``optax.clip_by_global_norm(c)``:
``u = g min(1, c / ||g||)`` with ``||g||`` of this device's shards, so each device scales
the whole leaf by another factor), or a gradient not summed over ``"data"``. The replicas
of that leaf would go apart within the replica; jax refused it only at the sync, with
"cond branches must have equal output types". Refused here, naming ``inner``.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxcomp._src import axes


def _extra_axes(u: Any, p: Any, own: tuple) -> tuple:
    """The manual axes of size > 1 outside ``own`` that ``u`` differs over and ``p`` not."""
    return axes.split_over(u, axes.varying_axes(p) | set(own))


def check_inner_update(name: str, updates: Any, params: Any, own: tuple) -> None:
    """Refuse, naming ``inner``, an inner update that differs per device over a manual axis
    (outside the transform's ``own`` axes) where its param is typed as the same."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    leaves = jax.tree.structure(params).flatten_up_to(updates)
    for (path, p), u in zip(paths, leaves, strict=True):
        extra = _extra_axes(u, p, own) if hasattr(u, "dtype") else ()
        if extra:
            raise ValueError(
                f"{name}: the inner optimizer (`inner`) returned an update of "
                f"{jax.tree_util.keystr(path)} that differs per device over {extra} where "
                "the param is the same on every device there (a leaf kept whole beside "
                "FSDP shards): a value of the whole tree taken from each device's shards "
                "went into it, as optax.clip_by_global_norm's norm of the local shards (each "
                "device scales the leaf by another factor), or its gradient was not summed "
                f"over {extra}. Clip FSDP shards with jc.clip_by_global_norm(c, None, "
                f"shard_axis={extra[0]!r}) in the inner chain (docs/sharded.md, Clipping)"
            )
