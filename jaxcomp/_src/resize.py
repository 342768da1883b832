"""Checkpoints across device counts: per-device state moved from ``n`` devices to ``m``.

A jaxcomp state saved on ``n`` devices holds ``n`` rows in every per-device field (error
feedback memories, worker momenta, the two-phase server residual's owned chunks). Restoring
it on ``m`` devices with orbax's ``strict=False`` would cut or pad those rows, and with them
what error feedback holds back. :func:`resize_state` moves each field by what it means:

* Memories of a MEAN exchange (residual ``e_i``, EF21 ``h_i``, DGC's ``u_i`` and ``v_i``,
  PowerSGD's error, worker momenta, pending pseudo-gradients, an inner optimizer's moments):
  device ``i`` adds its row to what it sends and the exchange divides by the number of
  devices, so what the rows stand for is their mean, ``(1/n) sum_i e_i`` (what is held back
  of the mean update; EF21's invariant ``h = mean_i h_i``). The fold keeps that mean:
  ``n -> m = n / k`` gives each new device the average of its ``k`` old ones; ``n -> m = k n``
  gives each new device a copy of its old one. (Keeping the plain sum instead would scale
  the held-back update by ``n / m``.) In general old device ``i`` goes to new device
  ``floor(i m / n)`` (or new ``j`` takes old ``floor(j n / m)``), weighted so that
  ``(1/m) sum_j e'_j = (1/n) sum_i e_i``.
* The two-phase server residual (each device owns the chunk ``ceil(d / n)`` of a leaf's
  re-encoding error, already in units of the mean): the chunks are joined into the leaf's
  whole residual and cut again into ``m`` chunks, a copy (padding past the leaf's ``d``
  values belongs to no parameter and is dropped). Its ``server_chunk`` stamps (row ``i``
  holds chunk ``i``) are checked and stamped again ``0 .. m - 1``.
* CHOCO gossip's public copies and their mixes (``jc.gossip`` with a codec) are tied to
  the topology of the ``n`` devices: refused (start the gossip again from the mean model).
* Integer per-device leaves (an inner optimizer's step count): new device ``j`` takes the
  row of the first old device folded into it.
* Replicated fields (PowerSGD's ``Q``, EF21's estimate, keys, step counts, replicated
  momenta, outer optimizer states) are kept as they are: they are the same on every device
  and do not depend on the number of devices. Keys stay: each device derives its own with
  ``fold_in(key, axis_index)``.

Anything else (a per-device field whose shape depends on the device count in another way,
a hierarchical two-axis layout) is refused with the field named.
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import collectives, sharding


def _check_axis(mesh: Any, axis_name: Any) -> str:
    if isinstance(axis_name, tuple | list):
        raise ValueError(
            f"`axis_name` {axis_name!r}: resize_state moves state over one data axis; a "
            "hierarchical (two-axis) state's chunk layout depends on both axes"
        )
    if axis_name not in getattr(mesh, "shape", {}):
        raise ValueError(
            f"`axis_name` {axis_name!r} is not an axis of `mesh` (axes: {tuple(mesh.shape)})"
        )
    return axis_name


def _abstract(tx: Any, params: Any, axis_name: str, n: int) -> tuple[Any, Any]:
    """Per-device abstract state of ``tx`` on ``n`` devices and its ``state_specs``."""
    abstract = sharding.abstract_init(
        tx, params, types.SimpleNamespace(shape={axis_name: n}), axis_name
    )
    return abstract, sharding.state_specs(abstract, axis_name)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _per_device(spec: Any, axis_name: str) -> bool:
    return isinstance(spec, P) and len(spec) > 0 and spec[0] == axis_name


def restore_target(
    tx: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    num_devices: int,
) -> Any:
    """The abstract state of ``tx`` as saved on ``num_devices`` devices, laid out on ``mesh``.

    An orbax restore target for a checkpoint written on another number of devices: every
    leaf a ``jax.ShapeDtypeStruct`` with the saved global shape (per-device fields
    ``(num_devices, ...)``) and a replicated ``NamedSharding`` on ``mesh`` (every process
    reads the whole state; :func:`resize_state` then moves it to ``mesh``).

    Args:
      tx: the optimizer the state belongs to.
      params: the params (arrays or ``ShapeDtypeStruct``s), for the shapes.
      mesh: the mesh to restore onto.
      axis_name: the data axis.
      num_devices: the size of the data axis when the checkpoint was saved.

    Returns:
      A tree like the state, of ``jax.ShapeDtypeStruct``.

    Raises:
      ValueError: ``num_devices`` outside its rule (the message names the argument;
        the rules: docs/errors.md).

    Example::

        target = jc.restore_target(tx, params, mesh4, "data", num_devices=8)
        saved = ocp.StandardCheckpointer().restore(path, target)
        state = jc.resize_state(saved, tx, params, mesh4, "data")
    """
    _check_axis(mesh, axis_name)
    if (
        isinstance(num_devices, bool)
        or not isinstance(num_devices, int | np.integer)
        or num_devices < 1
    ):
        raise ValueError(f"`num_devices` must be an int >= 1, got {num_devices!r}")
    num_devices = int(num_devices)
    abstract, specs = _abstract(tx, params, axis_name, num_devices)
    replicated = NamedSharding(mesh, P())

    def saved(a, spec):
        shape = (num_devices, *a.shape[1:]) if _per_device(spec, axis_name) else a.shape
        return jax.ShapeDtypeStruct(shape, a.dtype, sharding=replicated)

    return jax.tree.map(saved, abstract, specs)


def _check_no_topology(state: Any, n: int, m: int) -> None:
    """Refuse fields tied to the mixing matrix of ``n`` devices (``TOPOLOGY_FIELDS``:
    CHOCO gossip's public copies ``x_hat_i`` and their mixes ``s_i = sum_j w_ij x_hat_j``).
    Folded, ``s_j`` no longer mixes the new copies by the new matrix, and the replicas stop
    agreeing, even restarted equal (docs/checkpoints.md)."""
    marked = lambda x: bool(getattr(type(x), "TOPOLOGY_FIELDS", ()))  # noqa: E731
    for node in jax.tree.leaves(state, is_leaf=marked):
        if not marked(node):
            continue
        for field in type(node).TOPOLOGY_FIELDS:
            if jax.tree.leaves(getattr(node, field)):
                raise ValueError(
                    f"`state` field `{field}` of {type(node).__name__} holds the mixing of "
                    f"the {n} devices' topology (CHOCO gossip's public copies): folded onto "
                    f"{m} devices the replicas would stop agreeing. Start the gossip again "
                    "on the new mesh from one model, p = jc.mean_replica(replicas): "
                    "jc.replica_params(p, mesh, axis_name) and jc.sharded_init(tx, p, mesh, "
                    "axis_name) (exact gossip, codec=None, keeps no such field and moves)"
                )


def _fold(rows: np.ndarray, m: int) -> np.ndarray:
    """``n`` rows to ``m``, keeping the mean over rows (integer rows: the first folded in).

    Floats narrower than float32 (a bf16 moment) are summed in float32."""
    n = rows.shape[0]
    group = np.arange(n) * m // n  # n >= m: old row i goes to new row group[i]
    source = np.arange(m) * n // m  # n < m: new row j takes old row source[j]
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        return rows[np.searchsorted(group, np.arange(m))] if n >= m else rows[source]
    wide = rows.astype(np.promote_types(np.float32, np.result_type(rows.dtype, np.float32)))
    if n >= m:
        out = np.zeros((m, *rows.shape[1:]), wide.dtype)
        np.add.at(out, group, wide)
        return (out * wide.dtype.type(m / n)).astype(rows.dtype)
    copies = np.bincount(source, minlength=n)[source]
    weight = (m / n / copies).astype(wide.dtype).reshape(-1, *([1] * (rows.ndim - 1)))
    return (wide[source] * weight).astype(rows.dtype)


def _rechunk(rows: np.ndarray, width: int, m: int, where: str) -> np.ndarray:
    """A server residual's ``n`` owned chunks as ``m`` chunks of ``width``.

    Device ``i`` owns values ``[i c, (i + 1) c)`` of the whole (leaf, or flat) vector, so
    the rows joined are the whole vector and its padding; cut again, every real value stays
    (a vector of ``d`` values fits ``n c >= d`` and ``m width >= d``), padding is dropped.
    """
    n, old = rows.shape
    if n * old > collectives.MAX_SEGMENT:
        raise ValueError(
            f"`state` field `{where}`: cannot move a server residual of {n} x {old} values: "
            "a vector over 2**31 - 1 values travels in several segments, chunked apart"
        )
    whole = rows.reshape(-1)[: m * width]
    return np.pad(whole, (0, m * width - whole.size)).reshape(m, width)


def _restamp(rows: np.ndarray, m: int, where: str) -> np.ndarray:
    """A flat exchange's ``server_chunk`` stamps on ``m`` devices: new device ``j`` owns
    chunk ``j`` of the re-cut residual (:func:`_rechunk`). Rows saved for other chunks than
    their own (row ``i`` stamped ``j != i``: a state stepped or saved in another layout,
    a hierarchical exchange's) would be re-cut into other chunks' values: refused."""
    n = rows.shape[0]
    if not np.array_equal(rows.reshape(n, -1)[:, 0], np.arange(n)):
        raise ValueError(
            f"`state` field `{where}` stamps its rows {rows.reshape(n, -1)[:, 0].tolist()}, "
            f"not 0 to {n - 1}: the rows of its server residual are not the chunks of a flat "
            "exchange in the order of `axis_name` (a hierarchical exchange's state, or one "
            "laid out for another order of the axes), and re-cut they would land on other "
            "chunks' values (docs/checkpoints.md)"
        )
    return np.arange(m, dtype=rows.dtype).reshape(m, *rows.shape[1:])


def _whole(x: Any) -> np.ndarray:
    """All of ``x`` as numpy on this process. A per-device field of a live state of several
    processes (``P(axis_name)`` over devices this process cannot address) is gathered from
    the others: ``jax.device_get`` refused it with jax's "Fetching value for `jax.Array`
    that spans non-addressable ... devices is not possible", naming no argument, although
    the same call on one process moves it (docs/multihost.md)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _move_leaf(old: Any, saved: Any, new: Any, per_device: bool, where: str) -> np.ndarray:
    """One leaf: as saved on ``n`` devices (``saved``: its expected global shape) to its
    global shape ``new`` on ``m`` devices."""
    old = _whole(old)
    if old.shape != tuple(saved.shape):
        raise ValueError(
            f"`state` field `{where}` has shape {old.shape}, but `tx` keeps "
            f"{tuple(saved.shape)} there: is it the state of this `tx` and these params (a "
            "server residual built outside the mesh, by tx.init, cannot be moved)?"
        )
    if not per_device:
        return old
    if "server_chunk" in where:
        return _restamp(old, new.shape[0], where)
    if old.shape[1:] == tuple(new.shape[1:]):
        return _fold(old, new.shape[0])
    if "server_residual" in where and old.ndim == 2:
        return _rechunk(old, new.shape[1], new.shape[0], where)
    raise ValueError(
        f"`state` field `{where}`: cannot move a per-device leaf of shape {old.shape[1:]} "
        f"on {old.shape[0]} devices and {tuple(new.shape[1:])} on {new.shape[0]}: "
        "resize_state moves leaves shaped alike on both, and two-phase server residuals"
    )


def resize_state(
    state: Any,
    tx: optax.GradientTransformation,
    params: Any,
    mesh: jax.sharding.Mesh,
    axis_name: str,
) -> Any:
    r"""A state saved on ``n`` devices, moved to the ``m`` devices of ``mesh``'s data axis.

    Per-device fields are folded so that their mean over devices, what they stand for in a
    mean exchange, is kept (see the module docstring for every field):

    .. math::

        e'_j = \frac{m}{n} \sum_{i:\ \lfloor i m / n \rfloor = j} e_i \quad (n \ge m),
        \qquad e'_j = \frac{m}{n\, c_i}\, e_{i}, \ i = \lfloor j n / m \rfloor \quad (n < m)

    (``c_i``: the number of new devices that take old device ``i``), so that
    ``(1/m) sum_j e'_j = (1/n) sum_i e_i`` (``8 -> 4``: each new device holds the average
    of two old ones; ``4 -> 8``: each old row is copied to two devices). The two-phase
    server residual is re-cut into ``m`` owned chunks; replicated fields (keys, counts,
    PowerSGD's ``Q``, EF21's estimate) are kept.
    The work runs on the host (numpy), on the whole state: a state :func:`restore_target`
    laid out is whole on every process already; a live state laid out over the devices of
    several processes is gathered first (every process calls this with the same state).

    Args:
      state: the state with global arrays as saved (per-device fields ``(n, ...)``), e.g.
        restored with :func:`restore_target`, or a live ``jc.sharded_init`` state.
      tx: the optimizer the state belongs to (for the state's layout on ``m`` devices).
      params: the params (arrays or ``ShapeDtypeStruct``s, replicated over the data axis:
        not ``param_specs`` model shards, not replica stacks).
      mesh: the new mesh; its ``axis_name`` has ``m`` devices.
      axis_name: the data axis (one axis; hierarchical states are refused).

    Returns:
      The state for ``m`` devices, placed on ``mesh`` with ``jc.state_specs`` shardings:
      ready for the ``shard_map`` step built on ``mesh``.

    Raises:
      ValueError: ``state`` of another structure or with a field it cannot move (named), or
        ``axis_name`` not one axis of ``mesh``.

    Example::

        ckpt = ocp.StandardCheckpointer()
        ckpt.save(path, state8)                            # on 8 devices
        ...                                                 # later, on 4 devices:
        saved = ckpt.restore(path, jc.restore_target(tx, params, mesh4, "data", 8))
        state4 = jc.resize_state(saved, tx, params, mesh4, "data")

    References:
      Error feedback's invariant (what is held back is delayed, not lost): Karimireddy et
      al., 2019, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes";
      EF21's ``h = mean_i h_i``: Richtarik et al., 2021, "EF21".
    """
    _check_axis(mesh, axis_name)
    m = mesh.shape[axis_name]
    abstract, specs = _abstract(tx, params, axis_name, m)
    per_device = [_per_device(s, axis_name) for s in jax.tree.leaves(specs, is_leaf=_is_spec)]
    with_path, old_def = jax.tree_util.tree_flatten_with_path(state)
    new_leaves, new_def = jax.tree.flatten(abstract)
    if old_def != new_def:
        raise ValueError(
            "`state` does not have the structure of tx.init(params) (is it the state of "
            f"this `tx`?): {str(old_def)[:200]} vs {str(new_def)[:200]}"
        )
    rows = [np.shape(x)[0] for (_, x), p in zip(with_path, per_device, strict=True) if p]
    n = rows[0] if rows else m
    if n != m:
        _check_no_topology(state, n, m)
    saved = jax.tree.leaves(_abstract(tx, params, axis_name, n)[0])
    placed = []
    for (path, x), s, a, p, sp in zip(
        with_path,
        saved,
        new_leaves,
        per_device,
        jax.tree.leaves(specs, is_leaf=_is_spec),
        strict=True,
    ):
        where = jax.tree_util.keystr(path)
        lead = (n, *s.shape[1:]) if p else s.shape
        goal = (m, *a.shape[1:]) if p else a.shape
        moved = _move_leaf(
            x, jax.ShapeDtypeStruct(lead, s.dtype), jax.ShapeDtypeStruct(goal, a.dtype), p, where
        )
        placed.append(jax.device_put(moved, NamedSharding(mesh, sp)))
    return jax.tree.unflatten(new_def, placed)
