"""A state from ``tx.init(params)`` handed to :func:`jaxcomp.state_specs`: refused, naming
``state`` and :func:`jaxcomp.sharded_init`.

``tx.init`` gives every per-device field (error-feedback memory, worker momentum) one slot,
``(1, *shape)``, on one device; ``jc.sharded_init`` gives it one slot per device of the
mesh, ``(n, *shape)``, laid out ``P(axis_name)``. Specs of the first put ``P(axis_name)``
on an axis of size 1, and ``jax.shard_map`` then refuses the call with "8 does not evenly
divide 1", naming neither the state's origin nor the fix.

Told apart without the mesh: every per-device leaf a concrete array of leading size 1,
held uncommitted by a single device in a process of several devices (``tx.init`` of host
or uncommitted params), or laid out on a mesh whose data axis holds several devices
(``tx.init`` of params placed replicated, ``P()``). ``jc.sharded_init``'s arrays over an
axis of one device, the same moved onto that device (``jax.device_put(state, device)``:
committed, a one-device mesh's state as well as a misplaced one, which jax's own check
meets at the step) and ``jax.eval_shape``'s (no sharding to read) are not refused.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P


def _one_slot(leaf: Any, names: tuple) -> bool:
    """``leaf`` is a concrete array whose leading axis of size 1 cannot be one slot per
    device: held by one device, or on a mesh whose ``names`` hold several devices."""
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        return False
    if leaf.ndim == 0 or leaf.shape[0] != 1:
        return False
    sharding = leaf.sharding
    if isinstance(sharding, SingleDeviceSharding):  # placed on purpose: maybe a one-device mesh's
        return jax.device_count() > 1 and not leaf.committed
    if isinstance(sharding, NamedSharding) and all(n in sharding.mesh.shape for n in names):
        return math.prod(sharding.mesh.shape[n] for n in names) > 1
    return False


def check_not_plain_init(state: Any, specs: Any, axis_name: Any) -> None:
    """A ValueError naming ``state`` where every per-device leaf (spec led by ``axis_name``)
    is ``tx.init``'s single slot (module docstring); nothing otherwise."""
    names = tuple(axis_name) if isinstance(axis_name, tuple | list) else (axis_name,)
    found = []  # (path, is one slot on one device) of each per-device leaf

    def visit(path, spec, leaf):
        if isinstance(spec, P) and len(spec) and spec[0] is not None:
            found.append((jax.tree_util.keystr(path), _one_slot(leaf, names)))
        return spec

    jax.tree_util.tree_map_with_path(visit, specs, state, is_leaf=lambda s: isinstance(s, P))
    if not found or not all(plain for _, plain in found):
        return
    raise ValueError(
        f"`state`: its per-device fields (at {[p for p, _ in found[:4]]}) hold a single "
        f"slot, shape (1, ...): a state from tx.init(params). Each device of the mesh "
        f"needs its own slot, laid out over {axis_name!r}: build the state with "
        f"jc.sharded_init(tx, params, mesh, {axis_name!r}) and pass "
        f"jc.state_specs(state, {axis_name!r}) as the step's specs (Flax NNX: "
        f"jc.nnx_optimizer and jc.nnx_state_specs)"
    )
