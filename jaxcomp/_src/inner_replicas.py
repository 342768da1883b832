"""The mesh axes over which the params are per-device replicas, while a replica transform
steps its inner optimizer.

``jc.local_sgd``, ``jc.diloco`` and ``jc.sparseloco`` over ``axis_name`` step an inner optax
optimizer on each device's replica (``jc.replica_params``): the params it sees differ per
device over ``axis_name``, typed so under ``shard_map(..., check_vma=True)``, because each
device holds a model of its own there, not a shard of one. With FSDP inside each replica
(params ``P("replica", "data")``) they differ over ``"data"`` too, where they *are* shards.
A transform inside the inner optimizer cannot tell the two from the types alone:
``jc.clip_by_global_norm(c, None, shard_axis="data")`` refused the replica axis as one
more shard axis, and its message's ``shard_axis=("data", "replica")`` would have summed the
squared norms of the replicas' own gradients into one factor (every replica clipped by the
norm of all of them). The replica transform says it here, for the trace of its inner
update: :func:`replica_axes` are the axes of the enclosing replica transforms (empty
outside one).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

_AXES = contextvars.ContextVar("inner_replica_axes", default=())


@contextlib.contextmanager
def stepping_inner(axes: tuple):
    """While entered, the params are per-device replicas over ``axes`` (and over the axes of
    any replica transform around this one)."""
    token = _AXES.set((*_AXES.get(), *axes))
    try:
        yield
    finally:
        _AXES.reset(token)


def replica_axes() -> tuple:
    """The axes over which the params are replicas: those of the replica transforms whose
    inner optimizer is being traced (empty outside one)."""
    return _AXES.get()


def own_axes(axes: Any) -> tuple:
    """``axes`` (a tuple of mesh axis names) and :func:`replica_axes`."""
    return (*axes, *replica_axes())
