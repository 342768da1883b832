"""Flax NNX: an ``nnx.Optimizer`` holding per-device jaxcomp state, and its ``nnx.shard_map`` specs.

``nnx.Optimizer(model, tx, wrt=nnx.Param)`` runs ``tx.init`` once, outside any mesh: every
error-feedback memory comes out as one device's ``(1, *shape)`` slot, and an
``nnx.shard_map`` that passes the optimizer as ``P()`` hands all devices that one copy and
keeps one device's copy on the way out. :func:`nnx_optimizer` builds the optimizer with the
state of :func:`jaxcomp.sharded_init` instead (per-device fields laid out ``P(axis_name)``
over the mesh, every empty slot left as optax's ``MaskedNode``, never wrapped in a
``Variable``), and :func:`nnx_state_specs` gives the ``nnx.StateSharding`` that
``nnx.shard_map``'s ``in_specs`` / ``out_specs`` take for it::

    optimizer = jc.nnx_optimizer(model, tx, mesh, "data")
    opt_specs = jc.nnx_state_specs(optimizer, "data")

Inside the step, :func:`nnx_local` gives the model to differentiate: its ``nnx.Param`` state
per device, what the forward writes elsewhere written back (BatchNorm statistics averaged)::

    with jc.nnx_local(model, "data") as local:
        loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)
    optimizer.update(model, grads)

Flax is imported only when these functions run: the library itself does not depend on it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import collectives, replicas, sharding, skeleton


def _is_variable(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.Variable)


def nnx_optimizer(
    model: Any,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: Any,
    *,
    wrt: Any = None,
    param_specs: Any = None,
) -> Any:
    """An ``nnx.Optimizer(model, tx, wrt=wrt)`` whose state is :func:`jaxcomp.sharded_init`'s.

    Per-device fields (error-feedback memories, per-device momenta) get one slot per device
    of ``axis_name``, laid out ``P(axis_name)``: the global array of a ``(64, 48)`` kernel's
    memory is ``(n, 64, 48)`` and each device of an ``nnx.shard_map`` sees its own
    ``(1, 64, 48)``. Every other field (keys, step counts) is replicated. The optimizer is
    a plain ``nnx.Optimizer``: ``optimizer.update(model, grads)`` inside the step, the state
    checkpoints like any NNX state. The model's ``wrt`` variables and the step count are
    placed on ``mesh`` too (replicated, or by ``param_specs``), as the step will hold them,
    and so are its other variables not on ``mesh`` yet (replicated: BatchNorm statistics,
    Dropout's RNG state), so that the step compiles once.

    Only the ``nnx.Param`` state is ``pcast`` in the step (:func:`nnx_local`):
    ``jax.lax.pcast(model, ...)`` returns a copy whose other variables (Dropout's RNG counts,
    BatchNorm's statistics) are its own, and what the forward writes there would be dropped
    without an error (the same dropout mask every step); :func:`nnx_local` writes it back
    into ``model``, the statistics averaged over the devices (docs/flax.md).

    The state is the per-device inits stacked along the device axis,
    ``s_0 = (init_1(params), ..., init_n(params))``: exactly
    ``jc.sharded_init(tx, params, mesh, axis_name)`` on the pure params.

    Args:
      model: the NNX module whose ``wrt`` variables ``tx`` updates.
      tx: any optax transform; jaxcomp transforms in it bind ``axis_name``.
      mesh: the mesh of the ``nnx.shard_map`` step.
      axis_name: the data axis (a name, or a tuple of names for a hierarchical exchange).
      wrt: the ``nnx.Optimizer`` filter of the updated variables (default ``nnx.Param``).
      param_specs: for params sharded over other mesh axes, as in
        :func:`jaxcomp.sharded_init`.

    Returns:
      An ``nnx.Optimizer`` with ``tx`` and the per-device state, ready for the
      ``nnx.shard_map`` whose optimizer spec is :func:`nnx_state_specs` of it.

    Raises:
      ValueError: ``axis_name`` outside its rule, ``tx`` a transform that keeps one
        model per device (``jc.diloco``, ``jc.local_sgd``, ``jc.sparseloco``,
        ``jc.gossip``: step their replicas on pure params), or ``param_specs`` None for
        params laid out over mesh axes (``nnx.with_partitioning``; the message names the
        argument; the rules: docs/errors.md).

    Example::

      optimizer = jc.nnx_optimizer(model, jc.sgd(0.05, jc.sign(), "data"), mesh, "data")
      opt_specs = jc.nnx_state_specs(optimizer, "data")

      @nnx.jit
      @nnx.shard_map(mesh=mesh, in_specs=(P(), opt_specs, P("data"), P("data")),
                     out_specs=P())
      def train_step(model, optimizer, x, y):
          with jc.nnx_local(model, "data") as local:  # Params per device: no implicit sum
              loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)
          optimizer.update(model, grads)
          return jax.lax.pmean(loss, "data")

    References:
      Flax NNX, ``nnx.Optimizer`` and ``nnx.shard_map``: https://flax.readthedocs.io;
      docs/flax.md.
    """
    from flax import nnx

    wrt = nnx.Param if wrt is None else wrt
    sharding.check_mesh_axes(mesh, axis_name, "axis_name")
    params = nnx.as_pure(nnx.state(model, wrt))
    if param_specs is None:
        _check_replicated(params)
    state = sharding.sharded_init(tx, params, mesh, axis_name, param_specs)
    _check_one_model(state)
    nnx.update(model, _placed(params, mesh, param_specs))
    nnx.update(model, _replicated(nnx.as_pure(nnx.state(model, nnx.Not(wrt))), mesh))
    optimizer = nnx.Optimizer(model, optax.identity(), wrt=wrt)
    optimizer.tx = tx
    optimizer.opt_state = nnx.data(jax.tree.map(nnx.OptArray, state))
    optimizer.step.set_value(jax.device_put(optimizer.step.get_value(), NamedSharding(mesh, P())))
    return optimizer


def _check_one_model(state: Any) -> None:
    """Refuse a ``tx`` that keeps one model per device (``jc.diloco``, ``jc.local_sgd``,
    ``jc.sparseloco``, ``jc.gossip``): an ``nnx.Optimizer`` updates one model, entered and
    returned replicated (``P()``). Under ``check_vma=True`` ``nnx.shard_map`` refused the
    per-device params on the way out with jax's "out_specs ... could not infer replication",
    naming no fix; under ``check_vma=False`` the model's arrays claimed to be replicated while
    each device held its own replica (docs/flax.md), so a read, a checkpoint or a reshard
    kept device 0's."""
    kinds = replicas.replica_states()
    found = [
        node
        for node in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, kinds))
        if isinstance(node, kinds)
    ]
    if found:
        raise ValueError(
            f"jc.nnx_optimizer: `tx` keeps one model per device ({type(found[0]).__name__}: "
            "jc.diloco, jc.local_sgd, jc.sparseloco and jc.gossip step each device's own "
            "params), and an nnx.Optimizer updates one model entered replicated (P()). Step "
            "the replicas on the model's pure params: graphdef, params = nnx.split(model, "
            "nnx.Param); replicas = jc.replica_params(nnx.to_pure_dict(params), mesh, "
            "axis_name), then jax.shard_map with jc.own / jc.slot (docs/local-sgd-diloco.md) "
            "and nnx.merge(graphdef, ...) in the loss."
        )


def _check_replicated(params: Any) -> None:
    """Without ``param_specs`` the params are placed replicated: refuse params the model
    already lays out over mesh axes (``nnx.with_partitioning`` under ``jax.set_mesh``), whose
    sharding that placement dropped with no error (a ``(16, 32)`` kernel of
    ``P(None, "model")`` came back ``P()``: every device held the whole kernel, and its
    memories ``P("data")`` the whole kernel per device too)."""
    laid = [
        x.sharding.spec
        for x in jax.tree.leaves(params)
        if isinstance(x, jax.Array)
        and isinstance(x.sharding, NamedSharding)
        and any(a is not None for a in x.sharding.spec)
    ]
    if laid:
        raise ValueError(
            f"jc.nnx_optimizer: the model's params are laid out over mesh axes ({laid[0]}) and "
            "`param_specs` is None, which would place them replicated: pass their specs, "
            "param_specs=nnx.as_pure(nnx.get_partition_spec(nnx.state(model, nnx.Param))), "
            "here and to jc.nnx_state_specs (with params=nnx.as_pure(nnx.state(model, "
            "nnx.Param))), or jax.device_put them replicated first"
        )


def _placed(params: Any, mesh: Any, param_specs: Any) -> Any:
    """``params`` laid out on ``mesh``: replicated, or by ``param_specs``."""
    if param_specs is None:
        return jax.device_put(params, NamedSharding(mesh, P()))
    specs = jax.tree.map(
        sharding.spec_of, param_specs, is_leaf=lambda x: isinstance(x, P | jax.sharding.Sharding)
    )
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def _replicated(state: Any, mesh: Any) -> Any:
    """The model's other variables (BatchNorm statistics, RNG keys and counts) replicated on
    ``mesh`` where they are not on it yet: left on one device, the first step was compiled
    for that placement and the second again for the step's own output (two compiles)."""

    def place(x):
        if not isinstance(x, jax.Array):
            return x
        on_mesh = isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh else jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(place, state)


def nnx_state_specs(
    optimizer: Any, axis_name: Any, param_specs: Any = None, params: Any = None, mesh: Any = None
) -> Any:
    """The ``nnx.StateSharding`` of an ``nnx.Optimizer`` holding jaxcomp state.

    Each per-device field of a jaxcomp state gets ``P(axis_name)`` (behind it the param's
    own spec, given ``param_specs``), every other variable (the step count, keys, other
    optax states) ``P()``: exactly :func:`jaxcomp.state_specs` of the optimizer's pure
    state, keyed by the optimizer's variable paths, the form ``nnx.shard_map``'s
    ``in_specs`` and ``out_specs`` take.

    Args:
      optimizer: an ``nnx.Optimizer`` (from :func:`nnx_optimizer`, or any whose state was
        placed the same way).
      axis_name: the data axis (a name or a tuple of names).
      param_specs: params sharded over other mesh axes, as in :func:`jaxcomp.state_specs`
        (``nnx.as_pure(nnx.get_partition_spec(nnx.state(model, nnx.Param)))``).
      params: the params' shapes where ``param_specs`` are not arrays (as there; required
        then: ``nnx.as_pure(nnx.state(model, nnx.Param))``).
      mesh: the mesh, to check ``axis_name`` and read block shapes (as there).

    Returns:
      ``nnx.StateSharding`` mapping every variable path of ``optimizer`` to its
      ``PartitionSpec``.

    Raises:
      TypeError: ``optimizer`` of the wrong kind.
      ValueError: ``param_specs`` of ``PartitionSpec`` without ``params`` (no shapes).

    Example::

      opt_specs = jc.nnx_state_specs(optimizer, "data")
      nnx.shard_map(step, mesh=mesh, in_specs=(P(), opt_specs, P("data")), out_specs=P())
    """
    from flax import nnx

    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            "jc.nnx_state_specs: `optimizer` must be an nnx.Optimizer (jc.nnx_optimizer(model, "
            f"tx, mesh, axis_name)), got {type(optimizer).__name__}; for a pure optax state "
            "use jc.state_specs(state, axis_name)."
        )
    pure = nnx.as_pure(optimizer.opt_state)
    specs = sharding.state_specs(pure, axis_name, param_specs, params, mesh)
    by_variable: dict[int, P] = {}

    def record(variable, spec):
        if _is_variable(variable):
            by_variable[id(variable)] = spec if isinstance(spec, P) else P()

    jax.tree.map(record, optimizer.opt_state, specs, is_leaf=_is_variable)
    flat = {
        path: by_variable.get(id(node), P())
        for path, node in nnx.iter_graph(optimizer)
        if _is_variable(node)
    }
    return nnx.StateSharding(nnx.from_flat_state(flat))


@contextlib.contextmanager
def nnx_local(
    model: Any,
    axis_name: Any,
    *,
    wrt: Any = None,
    average_batch_stats: bool = True,
    per_device_rngs: bool = True,
) -> Iterator[Any]:
    r"""The model to differentiate inside a data-parallel NNX step: its ``wrt`` state
    (default ``nnx.Param``) made per device, the rest written back into ``model`` on exit.

    The params enter ``nnx.shard_map`` replicated (``P()``): differentiated as they are,
    ``jax.grad`` all-reduces their gradients in float32 (the transpose of the implicit
    broadcast), and jaxcomp refuses the summed gradients. The ``local`` model yielded here
    holds ``jax.lax.pcast(params, axis_name, to="varying")`` beside the model's other
    variables, so each device differentiates its own loss. A ``pcast`` of the whole model
    would return a copy whose other variables (Dropout's RNG counts, BatchNorm's running
    statistics) are the copy's own, and what the forward writes there would be dropped with
    no error (the same dropout mask every step); on leaving the block they are written back
    with ``nnx.update``. Statistics each device computed from its own batch differ per
    device, and ``nnx.shard_map`` refuses to return them replicated: with
    ``average_batch_stats`` (default) every floating ``nnx.BatchStat`` that differs per
    device is replaced by its mean over ``axis_name`` (synchronized BatchNorm):

    .. math:: \mu \leftarrow \frac{1}{n} \sum_i \mu_i

    The model's RNG keys (``nnx.RngKey``: Dropout's stream) enter replicated too, and every
    device would draw the same dropout mask from them: with ``per_device_rngs`` (default)
    the local model's keys are ``fold_in(key, axis_index(axis_name))``, so each device draws
    its own masks, as data parallelism over ``n`` devices draws one mask per example of the
    global batch (the usual ``fold_in`` of the device index, as for stochastic rounding).
    The model keeps its own keys (the folded ones are never written back: they differ per
    device, and a key the forward sets again, as ``nnx.remat`` or ``nnx.jit`` inside it do,
    is derived from them); the counts advance as before, so the next step draws new masks.
    The params stay the same on every device: only their gradients see the masks, and the
    exchange averages those. Every stream the model holds is folded, not only dropout's: a
    forward that needs the same draw on every device passes ``per_device_rngs=False``.

    Nothing is written back if the block raises (``local`` holds copies of the model's
    variables). Nested blocks, or an axis bound by ``jax.vmap``, pcast nothing twice.

    Args:
      model: the NNX module of the step (entered ``nnx.shard_map`` as ``P()``).
      axis_name: the data axis (a name, or a tuple of names).
      wrt: the filter of the differentiated variables (default ``nnx.Param``; the
        ``wrt`` of :func:`nnx_optimizer`).
      average_batch_stats: average the per-device ``nnx.BatchStat`` values over
        ``axis_name`` on the way out (True), or write them back as they are (False: return
        them per device yourself).
      per_device_rngs: fold the device's index over ``axis_name`` into the local model's
        RNG keys (True: each device its own dropout masks), or keep the replicated keys
        (False: every device draws the same masks).

    Yields:
      The model to differentiate, ``nnx.merge(graphdef, pcast(params), rest, copy=True)``.

    Raises:
      ValueError: ``axis_name`` not bound where the block is entered (inside
        ``nnx.shard_map``).
      TypeError: ``axis_name`` not a name or a tuple of names.

    Example::

      @nnx.jit(donate_argnums=(0, 1))
      @nnx.shard_map(mesh=mesh, in_specs=(P(), opt_specs, P("data"), P("data")),
                     out_specs=P())
      def train_step(model, optimizer, x, y):
          with jc.nnx_local(model, "data") as local:
              loss, grads = nnx.value_and_grad(loss_fn)(local, x, y)
          optimizer.update(model, grads)  # the jaxcomp exchange averages the gradients
          return jax.lax.pmean(loss, "data")

    References:
      Flax NNX, ``nnx.split`` / ``nnx.merge`` / ``nnx.update``: https://flax.readthedocs.io;
      Ioffe, Szegedy, "Batch Normalization", ICML 2015 (synchronized statistics: the mean
      over the devices' batches); docs/flax.md.
    """
    from flax import nnx

    wrt = nnx.Param if wrt is None else wrt
    collectives.check_axis_name(axis_name)
    collectives.axis_size(axis_name)  # a named error where the axis is not bound
    graphdef, params, rest = nnx.split(model, wrt, ...)
    # copy=True: nnx.merge reuses the Variables of `rest` by default, so the forward's
    # writes (per device, unaveraged) would reach `model` even if the block raised.
    local = nnx.merge(graphdef, _per_device(params, axis_name), rest, copy=True)
    folded = _fold_rng_keys(local, wrt, axis_name) if per_device_rngs else frozenset()
    yield local
    written = nnx.state(local, nnx.Not(wrt))
    if folded:
        written = nnx.filter_state(written, nnx.Not(lambda path, _: tuple(path) in folded))
    if average_batch_stats:
        stats = nnx.state(local, nnx.All(nnx.BatchStat, nnx.Not(wrt)))
        nnx.update(written, _per_device_means(stats, axis_name))
    nnx.update(model, written)


def _fold_rng_keys(local: Any, wrt: Any, axis_name: Any) -> frozenset:
    """Fold this device's index over ``axis_name`` into each ``nnx.RngKey`` of ``local``
    (outside ``wrt``) that does not differ per device yet (a nested block folds nothing
    twice); returns the folded keys' variable paths, to leave them out of what is written
    back (per device, they cannot go back into the replicated model)."""
    from flax import nnx

    names = set(collectives.axis_names(axis_name))
    tracked = skeleton.tracks_variance(axis_name)
    selected = nnx.filterlib.to_predicate(wrt)
    index = jax.lax.axis_index(axis_name)
    folded = set()
    for path, variable in nnx.iter_graph(local):
        if not isinstance(variable, nnx.RngKey) or selected(path, variable):
            continue
        key = variable.get_value()
        if tracked and names <= skeleton.varying_axes(key):
            continue
        variable.set_value(jax.random.fold_in(key, index))
        folded.add(tuple(path))
    return frozenset(folded)


def _per_device(params: Any, axis_name: Any) -> Any:
    """``jax.lax.pcast(params, axis_name, to="varying")``, each leaf over the manual axes it
    does not vary over yet (:func:`~jaxcomp._src.skeleton.varying_over`): a nested
    :func:`nnx_local` pcasts nothing again, nor does an axis bound by ``jax.vmap``."""
    names = collectives.axis_names(axis_name)
    return jax.tree.map(lambda x: skeleton.varying_over(x, names), params)


def _per_device_means(state: Any, axis_name: Any) -> Any:
    """``state`` with each floating leaf that differs per device of ``axis_name`` replaced by
    its mean over the axis (every floating leaf where jax does not track variance:
    ``pmap``, ``check_vma=False``, where a mean of equal values is the value)."""
    names = set(collectives.axis_names(axis_name))
    tracked = skeleton.tracks_variance(axis_name)

    def mean(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        if tracked and not names & skeleton.varying_axes(x):
            return x
        return jax.lax.pmean(x, axis_name)

    return jax.tree.map(mean, state)
