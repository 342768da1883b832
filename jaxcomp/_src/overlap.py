"""The one-step-delayed data-parallel step as two programs on two host threads, so they overlap.

XLA:CPU runs a program's all-reduce synchronously (an ``all-reduce``, not an
``all-reduce-start`` / ``-done`` pair), and two programs dispatched back to back on one device
run one after the other even with asynchronous dispatch. Two programs launched from two host
threads do run at the same time. :func:`overlapped_step` builds :func:`jaxcomp.delayed`'s step
that way: the exchange of the previous step's gradients (and the update it feeds) in one
program on a worker thread, the forward and backward of this step in another on the caller's
thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from jax._src import config as jax_config  # trace_context(): the key of jax's jit cache
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._src import periodic, sharding, skeleton
from jaxcomp._src.delayed import DelayedState, delayed


def _signature(tree: Any) -> tuple:
    """What a compiled program depends on: the tree's structure, each leaf's type (shape,
    dtype, weak type; for jax arrays the sharding) and the thread's jax settings (what jax's
    own jit cache keys on)."""
    leaves, structure = jax.tree.flatten(tree)
    types = tuple((jax.typeof(a), _sharding_key(a)) for a in leaves)
    return structure, types, jax_config.trace_context()


def _sharding_key(a: Any) -> Any:
    """``a``'s sharding, with a NamedSharding's spec padded to the array's rank: ``P()`` and
    ``P(None, None)`` lay a 2-D array out alike (a program's outputs carry the latter)."""
    sharding = getattr(a, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = (*sharding.spec, *[None] * (np.ndim(a) - len(sharding.spec)))
    return sharding.mesh, spec, sharding.memory_kind


def _check_loss(loss_fn: Any) -> Callable:
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be a function loss_fn(params, *batch) -> scalar, got {loss_fn!r}"
        )
    return loss_fn


class OverlappedStep:
    """The step :func:`overlapped_step` returns: ``init(params)``,
    ``step(params, state, *batch) -> (params, state)`` and ``close()``; see there.

    Args:
      loss_fn: as :func:`overlapped_step`.
      tx: as :func:`overlapped_step`.
      mesh: as :func:`overlapped_step`.
      axis_name: as :func:`overlapped_step`.
      pmean: as :func:`overlapped_step`.
    """

    def __init__(self, loss_fn, tx, mesh, axis_name, pmean):
        self.loss_fn, self.tx, self.mesh, self.axis_name = loss_fn, tx, mesh, axis_name
        self.pmean = pmean
        self.delayed = delayed(tx, axis_name=axis_name if pmean else None)
        self._programs: dict[tuple, tuple] = {}  # _compiled's cache
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxcomp-exchange")
        self._closed = False

    def close(self) -> None:
        """Stop the worker thread (after the running exchange, if any); the step is unusable
        after. Without it the thread ends when the step is garbage-collected or Python exits."""
        self._closed = True
        self._pool.shutdown(wait=True)

    def init(self, params: Any) -> DelayedState:
        """The state of ``jc.delayed(tx)`` on every device of ``mesh`` (``jc.sharded_init``)."""
        return sharding.sharded_init(self.delayed, params, self.mesh, self.axis_name)

    def _grads_body(self, p, count, *batch):
        """Per device: ``(gradients [1, ...], count + 1)``; no collective."""
        g = jax.grad(self.loss_fn)(jax.lax.pcast(p, self.axis_name, to="varying"), *batch)
        return jax.tree.map(lambda a, q: a.astype(q.dtype)[None], g, p), count + 1

    def _grads_fn(self, args: tuple) -> Callable:
        """``(params, count, *batch) -> (per-device gradients [1, ...], count + 1)`` for
        ``args`` like those, called on ``sharding.drop_empty`` of them
        (``sharding.without_empty``: XLA:CPU in jaxlib 0.11.2 segfaults on a zero-element
        operand of a ``shard_map``, docs/errors.md)."""
        fill, _ = sharding.without_empty(self._grads_body, args)
        fn = jax.shard_map(
            fill,
            mesh=self.mesh,
            in_specs=(P(), P(), *[P(self.axis_name)] * (len(args) - 2)),
            out_specs=(P(self.axis_name), P()),
        )
        return jax.jit(fn)

    def _exchange_body(self, p, inner, pending):
        """``tx`` on the mean of the previous step's gradients, applied to ``p``."""
        previous = jax.tree.map(lambda a: a[0], pending)
        if self.pmean:
            previous = skeleton.tree_pmean(previous, self.axis_name)  # empty leaves skip it
        u, inner = self.tx.update(previous, inner, p)
        return optax.apply_updates(p, u), inner

    def _exchange_fn(self, args: tuple, state: DelayedState) -> Callable:
        """``(params, inner, pending) -> (params + tx(mean of pending), inner)`` for ``args``
        like those, called on ``sharding.drop_empty`` of them (as :meth:`_grads_fn`);
        ``inner`` donated."""
        specs = sharding.state_specs(state, self.axis_name)
        fill, _ = sharding.without_empty(self._exchange_body, args)
        fn = jax.shard_map(
            fill,
            mesh=self.mesh,
            in_specs=(P(), specs.inner, specs.pending),
            out_specs=(P(), specs.inner),
        )
        return jax.jit(fn, donate_argnums=(1,))

    def _compiled(self, params: Any, state: DelayedState, batch: tuple) -> tuple:
        """Both programs for these inputs, compiled on the caller's thread the first time
        (:meth:`_compile`) and looked up after: the key is the inputs' tree structure, each
        leaf's type (shape, dtype, weak type, sharding) and the caller's jax settings, and
        whether this is step 0 (which runs no exchange). A lookup costs a dict access instead
        of jax's trace, lower and compile stages (cached by jax, but rebuilt as objects on
        every call)."""
        first = int(jax.device_get(state.count)) == 0  # step 0 applies nothing (jc.delayed)
        key = (_signature((params, state, batch)), first)
        if key not in self._programs:
            self._programs[key] = self._compile(params, state, batch, first)
        return self._programs[key]

    def _compile(self, params: Any, state: DelayedState, batch: tuple, first: bool) -> tuple:
        """Both programs traced, lowered and compiled: a trace or compile error raises here,
        before ``state.inner`` is donated, and the caller's thread-local jax settings
        (``jax.default_matmul_precision``, ``jax.numpy_rank_promotion``, ...) apply to both;
        the worker thread only runs the compiled exchange."""
        args = (params, state.count, *batch)
        grads = self._grads_fn(args).trace(*sharding.drop_empty(args)).lower().compile()
        if first:
            return grads, None
        args = (params, state.inner, state.pending)
        exchange = self._exchange_fn(args, state).trace(*sharding.drop_empty(args))
        return grads, exchange.lower().compile()

    def __call__(self, params: Any, state: DelayedState, *batch: Any) -> tuple[Any, DelayedState]:
        if self._closed:
            raise RuntimeError("the step was closed (step.close()): its worker thread is shut down")
        if any(a.is_deleted() for a in jax.tree.leaves(state.inner) if isinstance(a, jax.Array)):
            raise ValueError(
                "`state` was donated to an earlier step (its arrays are deleted): pass each "
                "step the state the previous one returned"
            )
        grads, exchange = self._compiled(params, state, batch)
        drop = sharding.drop_empty
        future = None
        if exchange is not None:
            args = drop((params, state.inner, state.pending))
            future = self._pool.submit(lambda: jax.block_until_ready(exchange(*args)))
        try:
            pending, count = jax.block_until_ready(grads(*drop((params, state.count, *batch))))
        finally:  # never leave the exchange running: its collectives pair with the peers'
            out = None if future is None else future.result()
        params, inner = (params, state.inner) if out is None else out
        return params, DelayedState(pending=pending, inner=inner, count=count)


def overlapped_step(
    loss_fn: Callable[..., jax.Array],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    pmean: bool = False,
) -> OverlappedStep:
    r"""A data-parallel step whose gradient exchange overlaps the next forward and backward.

    The step of :func:`jaxcomp.delayed` (params replicated, the batch split over
    ``axis_name``), run as two programs at once on two host threads::

        worker thread:   params_{t+1} = params_t + tx(mean_devices g_{t-1})      (exchange)
        caller thread:   g_t = grad loss_fn(params_t, batch_t)  on each device   (compute)

    so a step takes ``max(compute, exchange)`` where the runtime and the cores allow, not
    their sum; step 0 applies nothing. ``params`` and ``state`` after every step are those of
    ``jc.delayed(tx)`` in one program, bit for bit, and the state is a
    :class:`jaxcomp.DelayedState` (checkpoints move between the two). XLA:CPU runs a program's
    collectives synchronously, in order with its other work, so one program cannot overlap
    them; two programs dispatched back to back from one thread run one after the other too.
    The exchange program's collectives are issued from one worker thread, in step order, so
    every process pairs them the same way. Where XLA runs collectives asynchronously (GPU,
    TPU) ``jc.delayed(tx)`` can overlap them in one program; this step is measured on XLA:CPU
    only. A non-finite gradient reaches ``tx`` one step later, as in ``jc.delayed``.

    Both programs are traced and compiled on the caller's thread before either runs, once per
    input structure, shapes, dtypes, shardings and jax settings (the step keeps them, so later
    steps of the same inputs only look them up in a dict): jax settings made by
    a context manager in the caller's thread (they are thread-local, e.g.
    ``jax.default_matmul_precision``, ``jax.numpy_rank_promotion``) apply to both, and a
    trace or compile error (a batch of the wrong shape, an error in ``tx``) raises before
    anything runs, with ``state`` intact: the step can be called again with it. The exchange
    donates ``state.inner``: pass each step the state the previous one returned; after an
    error while the programs ran, restart from a checkpoint (the state passed in may have
    been consumed). An exception in either program is raised to the caller once both have
    finished; ``step.close()`` stops the worker thread.

    Args:
      loss_fn: ``loss_fn(params, *batch) -> scalar``, the loss of one device's batch.
      tx: the transform that averages and applies the gradients, as for ``jc.delayed``
        (``optax.chain(jc.compressed_allreduce(codec, axis_name), optax.sgd(lr))``), or a
        plain optax optimizer with ``pmean=True``.
      mesh: the mesh; ``axis_name`` is its data axis.
      axis_name: the data-parallel axis (each ``batch`` array's leading dimension is split
        over it).
      pmean: average the gradients with ``jax.lax.pmean`` (in the params' dtypes) before
        ``tx``.

    Returns:
      An :class:`OverlappedStep` ``step``: ``state = step.init(params)``, then
      ``params, state = step(params, state, *batch)`` (blocks until both programs are done).

    Raises:
      ValueError: at construction, ``axis_name`` outside its rule (the message names the argument;
        the rules: docs/errors.md).
      TypeError: at construction, ``loss_fn``, ``tx``, ``axis_name`` or ``pmean`` of the wrong kind.

    Example::

      step = jc.overlapped_step(loss_fn, optax.chain(
          jc.compressed_allreduce(jc.int_quant(8), "data", error_feedback=None),
          optax.sgd(0.1)), mesh, "data")
      state = step.init(params)
      for x, y in batches:
          params, state = step(params, state, x, y)

    References:
      Zhang et al., "Poseidon: An Efficient Communication Architecture for Distributed Deep
      Learning on GPU Clusters" (wait-free backpropagation), USENIX ATC 2017; Zhu et al.,
      "Delayed Gradient Averaging: Tolerate the Communication Latency for Federated
      Learning", NeurIPS 2021.
    """
    _check_loss(loss_fn)
    periodic.check_transform("tx", tx)
    if not isinstance(axis_name, str):
        raise TypeError(f"`axis_name` must be the mesh's data axis (a str), got {axis_name!r}")
    sharding.check_mesh_axes(mesh, axis_name, "axis_name")
    if not isinstance(pmean, bool):
        raise TypeError(f"`pmean` must be a bool, got {pmean!r}")
    return OverlappedStep(loss_fn, tx, mesh, axis_name, pmean)
