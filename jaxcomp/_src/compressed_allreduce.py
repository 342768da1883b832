"""Optax transforms: compressed all-reduce with error feedback, chained before any optimizer."""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import (
    buckets,
    collectives,
    feedback,
    fused_residual,
    server,
    shards,
    skeleton,
    warmup,
)
from jaxcomp._src import layout as layouts
from jaxcomp._src.adaptive import check_adaptive
from jaxcomp._src.codecs.base import Codec, after, check_fraction_array, check_int
from jaxcomp._src.older_states import FRESH


class CompressedAllreduceState(NamedTuple):
    """State of :func:`compressed_allreduce`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Per-device fields mirror the gradient tree, None at leaves that are not compressed
    (small, masked, integer); each array carries a leading axis of 1, this device's slot.

    Attributes:
      memory: per device, [1, *leaf.shape] (f32 or memory_dtype) per compressed leaf: e_i, h_i
      server_residual: per device, [1, c] (f32 or memory_dtype) per two-phase leaf: the owned
        chunk's re-encoding error (c = ceil(size / n)); None if unused
      estimate: identical on every device, f32[*leaf.shape] per compressed leaf: EF21's h
      key: uint32[2], identical on every device; split every step
      count: int32[]: number of updates applied
      momentum: per device, f32[1, *leaf.shape] per float leaf: worker momentum
      adaptive: replicated AccordionState (adaptive=jc.accordion(...)), else None
      server_grid: identical on every device, int8 zeros of shape (H, L), the sizes of
        ``axis_name`` and ``inner_axis_name``, where a hierarchical exchange keeps
        ``server_residual`` (else None): device ``(h, l)`` owns part ``h`` of inner chunk
        ``l``, so a row of ``server_residual`` means another chunk on a mesh of other
        sizes; the shape makes orbax (and the update) refuse such a restore
      server_chunk: per device, int32[1]: the index of the chunk whose residual this
        device's row of ``server_residual`` holds (``l H + h`` on ``(h, l)``; flat: the
        device's index along ``axis_name``; -1 built outside the mesh, not checked), where
        ``server_residual`` is kept (else None); a row stepped on another device (a state
        restored into another layout of as many devices, or stepped with its axes in
        another order) flags the step as a non-finite gradient does, whole state kept
    """

    memory: Any
    server_residual: Any
    estimate: Any
    key: chex.PRNGKey
    count: jax.Array
    momentum: Any = None
    adaptive: Any = None
    server_grid: Any = None
    server_chunk: Any = None

    PER_DEVICE_FIELDS = ("memory", "server_residual", "momentum", "server_chunk")
    #: Fields added since the first release, and what a state saved without them gets
    #: (:func:`jaxcomp.complete_state`), each the fresh state's: ``momentum`` (with
    #: ``worker_momentum``) and ``adaptive`` (with ``adaptive=``) came with their arguments,
    #: so the transform of that day is built without them and its fresh field is None, as
    #: it ran (zeros / a fresh Accordion where they are turned on at the restore); the grid
    #: and the stamps say that each row is where it was saved (restore only into the layout
    #: it was saved from).
    ADDED_FIELDS = {
        "momentum": FRESH,
        "adaptive": FRESH,
        "server_grid": FRESH,
        "server_chunk": FRESH,
    }


def _may_run_two_phase(codec: Codec, strategy: str) -> bool:
    """``two_phase``, or ``"auto"`` with a codec that is not summable (which may pick it)."""
    return strategy == "two_phase" or (strategy == "auto" and not codec.summable)


def _uses_server_residual(codec: Codec, strategy: str, error_feedback, server_feedback) -> bool:
    if error_feedback is None or not server_feedback:
        return False
    return _may_run_two_phase(codec, strategy)


def _check_ef21_server(error_feedback, codec: Codec, strategy: str, server_feedback: bool):
    """EF21 through ``two_phase`` needs the owner's residual: the devices add their own
    ``c_i`` to ``h_i`` while the global ``h`` adds the owner's re-encoding of ``mean_i c_i``,
    so ``h = mean_i h_i - s`` holds only with the residual ``s`` kept. Without it the
    difference grows by every re-encoding error and never returns (sign, 8 devices: ``h``
    at 1e-5 where ``mean_i h_i`` was 11, the params stalled at 0.87 of their starting
    distance to the optimum at any learning rate)."""
    if error_feedback == "ef21" and _may_run_two_phase(codec, strategy) and not server_feedback:
        raise ValueError(
            "`server_feedback`=False with error_feedback='ef21' through two_phase: the global "
            "estimate would lose every re-encoding error of the chunk owners for good and stop "
            "tracking the devices' estimates (a wrong fixed point). Keep server_feedback=True, "
            "or pass strategy='allgather'"
        )


def _check_ef21_memory(error_feedback, memory_dtype) -> Any:
    """``memory_dtype`` checked (:func:`~jaxcomp._src.feedback.check_memory_dtype`), as a
    jnp dtype; float32 with ``error_feedback="ef21"``.

    EF21 keeps ``h = mean_i h_i`` only if every device adds to its ``h_i`` exactly the
    ``c_i`` the global ``h`` adds (Richtarik et al., 2021). Stored in bfloat16 / float16,
    ``h_i + c_i`` is rounded (and float16 saturates at 65504) while ``h`` is not: the two
    part for good, and the output no longer tracks the mean gradient (measured: the
    ``memory_dtype`` row of docs/errors.md)."""
    memory_dtype = feedback.check_memory_dtype(memory_dtype)
    if error_feedback == "ef21" and memory_dtype != jnp.float32:
        raise ValueError(
            f"`memory_dtype`={memory_dtype.name} with error_feedback='ef21': the devices' "
            "estimates would be rounded (float16: saturated at 65504) while the global one is "
            "not, and the output would stop tracking the mean gradient for good. Keep float32 "
            "memories (memory_dtype=None) with EF21, or use error_feedback='residual'"
        )
    return memory_dtype


def _resolve_feedback(error_feedback, codec: Codec, strategy: str):
    """``"auto"`` feedback; majority vote defaults to none (signSGD with majority vote / Signum)."""
    if strategy == "majority_vote":
        feedback.check_kind(error_feedback)
        if error_feedback == "ef21":
            raise ValueError(
                "`error_feedback`='ef21' does not apply to strategy='majority_vote' (the vote is "
                "not a mean of compressed differences); use None (default) or 'residual'"
            )
        return None if error_feedback == "auto" else error_feedback
    return feedback.resolve(error_feedback, codec)


def check_momentum(name: str, value: Any) -> Any:
    """None, a momentum in [0, 1) (a Python 0 is None: no state), or an array (a
    hyperparameter injected by ``optax.inject_hyperparams``; checked where concrete)."""
    if value is None:
        return None
    value = check_fraction_array(name, value)
    return value if isinstance(value, jax.Array | np.ndarray) else value or None


def _check_same_servers(
    plan, codec: Codec, gentle: Codec, strategy: str, sizes, option: str = "adaptive"
) -> None:
    """Accordion's two codecs (or the warm-up's stages) share the two-phase server residuals:
    they must use two_phase on the same segments (``sizes``: the bound ``(n, n_inner)``, None
    without residuals)."""
    if sizes is None:
        return
    if server.chunk_sizes(plan, codec, strategy, *sizes) != server.chunk_sizes(
        plan, gentle, strategy, *sizes
    ):
        raise ValueError(
            f"`{option}`: with `strategy`={strategy!r}, {gentle.name} and {codec.name} choose "
            "different strategies for some leaves; name one (`strategy`='two_phase' or "
            "'allgather') so both share the server residual"
        )


def _like_momentum(layout: layouts.Layout, compressed: list, plain: list) -> Any:
    """Per-device momentum vectors as a field like the params, ``(1, *shape)`` per leaf."""

    def shaped(vectors: list, group: str) -> list:
        shapes = [s for s, g in zip(layout.shapes, layout.groups, strict=True) if g == group]
        return [v.reshape(1, *s) for v, s in zip(vectors, shapes, strict=True)]

    return layouts.like_floats(
        layout, shaped(compressed, layouts.COMPRESSED), shaped(plain, layouts.PLAIN)
    )


def _shaped_residuals(codec, strategy, axis_name, updates, layout, state, errors) -> list:
    """Residual memories ``e' = (g + e) - C(g + e)`` of an ``elementwise`` codec, formed in
    each memory's shape ``[1, *leaf]`` (the same values as ``errors``, bit for bit).

    The flat ``errors`` read the old memory through a reshape; XLA:CPU writes a fusion over
    an operand in place only where the fusion reads it elementwise in its output's shape, so
    the new memory went to a fresh buffer and was then copied over the donated one (two
    passes and a gradient-sized temporary per step). Leaves the strategy sends otherwise
    keep their entry of ``errors``.
    """
    n = collectives.axis_size(axis_name)
    leaves = layouts.leaves_of(updates, layout, layouts.COMPRESSED)
    out = []
    for g, m, error in zip(leaves, layouts.field_leaves(state.memory), errors, strict=True):
        target = g.astype(jnp.float32).reshape(m.shape) + m.astype(jnp.float32)
        shaped = collectives.elementwise_error(codec, strategy, n, target)
        out.append(error if shaped is None else shaped)
    return out


def _residuals(kind, how, step, plan, reduced, fused=None) -> list:
    """Residual feedback's new memories ``e' = (g + e) - C(g + e)`` (None each for another
    ``kind``): an elementwise codec's in each memory's shape (:func:`_shaped_residuals`),
    another codec's sent whole from what it sent (:func:`_residuals_again`), else as the
    encoding step formed them. ``how``: ``(codec, strategy, axis_name, inner_axis_name,
    shaped)``; ``step``: ``(updates, grads, layout, state)``."""
    updates, grads, layout, state = step
    if kind != "residual":
        return [None] * len(grads)
    codec, strategy, axis_name, inner_axis_name, shaped = how
    errors = plan.join(reduced.error)
    if shaped:
        return _shaped_residuals(codec, strategy, axis_name, updates, layout, state, errors)
    if inner_axis_name is None and _sent_whole(codec, strategy, axis_name, grads):
        fused = fused or [None] * len(grads)
        return _residuals_again(grads, state.memory, plan.join(reduced.sent), fused)
    return errors


def _sent_whole(codec: Codec, strategy: str, axis_name: Any, targets: list) -> bool:
    """Whether every compressed vector is sent whole by ``allgather`` or ``allreduce`` (what
    it sent then decodes to ``Reduced.sent``, and ``x - sent`` is ``Reduced.error``)."""
    n = collectives.axis_size(axis_name)
    return all(
        t.shape[0] <= collectives.MAX_SEGMENT
        and collectives.choose_strategy(codec, t.shape[0], n, strategy)
        in ("allgather", "allreduce")
        for t in targets
    )


def _residuals_again(grads: list, memory: Any, sent: list, fused: list) -> list:
    """Residual memories ``e' = (g + e) - sent`` in each memory's shape ``[1, *leaf]``: the
    values of ``Reduced.error`` (``x - decode(payload)``), bit for bit.

    ``g + e`` is added again here from the gradient behind an optimization barrier, so
    XLA:CPU does not take it for the sum the encoding read: each pass that reads ``g + e``
    (the scales, the encoding, this one) adds it again, and none is written out (a
    gradient-sized temporary, read three times, was the costliest pass of int8's and
    sign's updates). Formed in the memory's shape, the pass writes the donated memory in
    place (:func:`_shaped_residuals`). Leaves whose memory the encoding already wrote
    (``fused`` not None: :mod:`~jaxcomp._src.fused_residual`) get None, and their gradients
    stay out of the barrier (which would keep them alive past the encoding's loop).
    """
    idx = [i for i, f in enumerate(fused) if f is None]
    held = dict(zip(idx, _barrier([grads[i] for i in idx]), strict=True))
    memories = layouts.field_leaves(memory)
    return [
        None if f is not None else _residual(held[i], m, s)
        for i, (f, m, s) in enumerate(zip(fused, memories, sent, strict=True))
    ]


def _barrier(arrays: list) -> list:
    """``jax.lax.optimization_barrier`` of ``arrays``, one barrier per varying type: one
    barrier types every output as varying over the union of its operands' axes, so a
    gradient whole over ``"data"`` beside FSDP shards came out varying over ``"data"``
    (and so did its memory). One barrier where the types agree (or are not tracked)."""
    kinds: dict = {}
    for i, a in enumerate(arrays):
        kinds.setdefault(skeleton.varying_axes(a), []).append(i)
    out: list = [None] * len(arrays)
    for members in kinds.values():
        held = jax.lax.optimization_barrier([arrays[i] for i in members])
        for i, b in zip(members, held, strict=True):
            out[i] = b
    return out


def _residual(g: jax.Array, e: jax.Array, sent: jax.Array) -> jax.Array:
    """``(g + e) - sent`` in the memory ``e``'s own shape ``[1, *leaf]`` (float32), so that
    XLA writes it in place in the donated memory (through a reshape it copies the result)."""
    return (g.reshape(e.shape) + e.astype(jnp.float32)) - sent.reshape(e.shape)


def _after_memory(outs: list, memory: Any, axes: Any, residual: bool = True) -> list:
    """The means ``outs``, computed once the new memories are written (``residual`` feedback;
    else ``outs`` as they are).

    The mean is written into the donated gradient, which the memory's pass reads; with no
    data edge between them XLA keeps a copy of the gradient (or of ``g + e``) for that pass.
    Under ``shard_map`` a per-device value reaches a replicated one only through a
    collective: one scalar psum of the memories' first values, and each mean waits on it
    (:func:`~jaxcomp._src.codecs.base.after`: the same bits). Not where the caller captures
    the payloads (:func:`late_residual_memory`): it drops this memory and forms its own after
    its ``lax.cond``, so there is nothing to order (and no psum to pay)."""
    if not residual or _PAYLOADS.get() is not None:
        return outs
    firsts = [m.reshape(-1)[0].astype(jnp.float32) for m in layouts.field_leaves(memory) if m.size]
    if not firsts or not outs:
        return outs
    total = sum(firsts[1:], firsts[0])
    # Summed over every axis it varies over too (FSDP shards beside a leaf whole there): a
    # dependence typed as varying over them made every mean so (docs/sharded.md).
    dep = jax.lax.psum(total, (*collectives.axis_names(axes), *_beyond(total, axes)))
    return [after(o, dep) for o in outs]


def _beyond(x: jax.Array, axes: Any) -> tuple:
    """The manual axes ``x`` is typed as varying over besides ``axes`` (none where jax does
    not track them)."""
    return tuple(sorted(skeleton.varying_axes(x) - set(collectives.axis_names(axes)), key=str))


def _outputs(kind: Any, means: list, estimate: Any) -> list:
    """The transform's output per compressed leaf from the exchanged means: the mean itself,
    or EF21's new estimate ``h + mean`` (``estimate``: the state field ``h``)."""
    estimate = skeleton.vectors(estimate) if kind == "ef21" else [None] * len(means)
    return [feedback.output(m, h, kind) for m, h in zip(means, estimate, strict=True)]


def _worker_momentum(beta, nesterov: bool, layout: layouts.Layout, field, grads, plain):
    """Per device, on every floating leaf: ``m_i <- beta m_i + (1 - beta) g_i``.

    Returns the new momenta (``[compressed, plain]`` vectors) and what is sent in place of
    the gradients: the momentum, or Nesterov's look-ahead ``beta m_i + (1 - beta) g_i``
    with the new ``m_i`` (compressed vectors, plain leaves in their shapes). Without worker
    momentum (``beta`` None): None and the gradients as they are.
    """
    if beta is None:
        return None, grads, plain
    flat_plain = [jnp.ravel(g).astype(jnp.float32) for g in plain]
    old = layouts.split_floats(layout, skeleton.vectors(field))
    momentum = [
        [beta * m + (1.0 - beta) * g for m, g in zip(ms, gs, strict=True)]
        for ms, gs in zip(old, (grads, flat_plain), strict=True)
    ]
    sends = momentum
    if nesterov:
        sends = [
            [beta * m + (1.0 - beta) * g for m, g in zip(ms, gs, strict=True)]
            for ms, gs in zip(momentum, (grads, flat_plain), strict=True)
        ]
    plain = [v.reshape(jnp.shape(g)) for v, g in zip(sends[1], plain, strict=True)]
    return momentum, sends[0], plain


def compressed_allreduce(
    codec: Codec,
    axis_name: Any,
    *,
    error_feedback: str | None = "auto",
    strategy: str = "auto",
    min_size: int = 1024,
    mask: Any = None,
    granularity: str = "leaf",
    seed: int = 0,
    inner_axis_name: Any = None,
    server_feedback: bool = True,
    worker_momentum: float | None = None,
    worker_nesterov: bool = False,
    adaptive: Any = None,
    bucket_bytes: int = buckets.BUCKET_BYTES,
    param_specs: Any = None,
    warmup_steps: int = 0,
    memory_dtype: Any = None,
    fuse_residuals: bool = False,
    shard_axis: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Average gradients over ``axis_name`` through ``codec``, keeping what it drops.

    Replaces the data-parallel ``pmean`` of the gradients: put it first in an optax chain,
    inside ``jax.shard_map`` (or ``jax.pmap``), and pass it the per-device gradients::

        tx = optax.chain(jc.compressed_allreduce(jc.sign(), "data"), optax.sgd(0.1, momentum=0.9))

    With ``error_feedback="residual"`` each device sends ``C(g_i + e_i)`` and keeps
    ``e_i <- g_i + e_i - C(g_i + e_i)``; the output is ``mean_i C(g_i + e_i)``, so
    ``sum_t out_t + mean_i e_i = sum_t mean_i g_i`` (Karimireddy et al., 2019, "Error Feedback
    Fixes SignSGD"). ``"ef21"`` keeps estimates instead (Richtarik et al., 2021); ``None`` keeps
    nothing (for unbiased codecs). With ``two_phase`` (also under ``"auto"`` for codecs that
    are not summable) the owner of each chunk keeps its own re-encoding error too
    (``server_feedback=True``, as 1-bit Adam's server error), so with both memories
    ``sum_t out_t + mean_i e_i + sum_i s_i = sum_t mean_i g_i`` (``s_i``: device ``i``'s
    server residual, non-zero only on the chunk it owns).

    ``strategy="majority_vote"`` (sign codecs) returns the sign of the devices' vote scaled by
    their mean scale (signSGD with majority vote, Bernstein et al. 2019); its feedback
    defaults to none.

    Worker momentum (``worker_momentum=beta``): each device keeps its own momentum of every
    floating leaf and sends that instead of its gradient::

        m_i <- beta * m_i + (1 - beta) * g_i          # per device, before feedback and encoding
        out  = mean_i C(m_i)                          # or the vote: sign(sum_i sign(m_i))

    (with ``worker_nesterov=True`` each device sends ``beta * m_i + (1 - beta) * g_i`` with
    the new ``m_i``, Nesterov's look-ahead in this averaged form). This is the momentum of
    :func:`jaxcomp.sgd`, which scales it by ``learning_rate / (1 - beta)``: the heavy-ball
    momentum ``m_i / (1 - beta)`` of SGD.

    With ``jc.sign(None)``, ``strategy="majority_vote"`` and a plain ``optax.sgd(lr)`` after
    it this is Signum with majority vote (Bernstein, Zhao, Azizzadenesheli, Anandkumar,
    ICLR 2019, "signSGD with Majority Vote is Communication Efficient and Fault Tolerant",
    Algorithm 1): ``x <- x - lr * sign(sum_i sign(m_i))``. Momentum after the vote
    (``optax.sgd(lr, momentum=0.9)``) is a different algorithm: it accumulates votes taken
    on the signs of each device's raw, noisy gradient; Signum's devices vote with the signs
    of their momenta. Error feedback, if any, acts on ``m_i`` (``C(m_i + e_i)``). Leaves
    sent by plain ``pmean`` (small or masked) send their momentum too (uncompressed: the
    mean of the devices' momenta is the momentum of the mean gradient). It works with every
    strategy.

    Hierarchical (``inner_axis_name``): the mean is over both axes; the fast inner axis is
    reduced in float32 (reduce-scatter), only the ``1/L`` chunk each device then holds goes
    through ``codec`` over ``axis_name``, and a float32 all-gather over the inner axis brings
    the result back. Memories stay per device: initialize with
    ``jc.sharded_init(tx, params, mesh, (axis_name, inner_axis_name))`` and use
    ``jc.state_specs(state, (axis_name, inner_axis_name))``.

    Leaves smaller than ``min_size`` or masked out go through plain ``pmean``; integer leaves
    pass through. The output keeps each leaf's dtype; the work is in float32. A non-finite
    gradient on any device makes the compressed output NaN on every device and leaves the
    whole state unchanged, so ``optax.apply_if_finite`` can skip the step and lose nothing.
    Put it around the optimizer that follows (``optax.chain(jc.compressed_allreduce(...),
    optax.apply_if_finite(optax.sgd(...), 3))``), or wrap the whole chain in
    ``jc.apply_if_finite(chain, axis_name, 3)``. ``optax.apply_if_finite`` around this
    transform decides per device (a device that skips would leave the others waiting in the
    exchange) and is refused at trace time.

    Args:
      codec: a jaxcomp codec, e.g. ``jc.int_quant(8)``, ``jc.sign()``.
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      error_feedback: ``"auto"`` (default: ``"residual"`` for biased codecs, ``None`` for
        unbiased ones, whose variance makes residual memory grow), ``"residual"``,
        ``"ef21"`` or ``None``.
      strategy: ``"auto"``, ``"allreduce"``, ``"allgather"``, ``"two_phase"`` or
        ``"majority_vote"`` (see :mod:`jaxcomp._src.collectives`).
      min_size: leaves with fewer elements go through plain ``pmean``.
      mask: None, a pytree of bools like the params, or a callable params -> such a tree;
        False leaves go through plain ``pmean``.
      granularity: ``"leaf"`` (default: one codec call per leaf, so scales and selections are
        per layer, as in the papers) or ``"flat"`` (all compressed leaves as one vector).
      seed: seeds the PRNG key kept in the state (stochastic codecs).
      inner_axis_name: a fast mesh axis reduced uncompressed first (hierarchical), or None.
      server_feedback: keep the chunk owner's re-encoding error (two_phase). False keeps the
        worker residual only (for comparison: it converges less close to uncompressed);
        refused with ``"ef21"``, whose global estimate needs it. With ``"ef21"`` two_phase
        compresses both ways (EF21 on the devices and on the owners): the stable learning
        rate is smaller than ``allgather``'s (docs/choosing-a-codec.md).
      worker_momentum: None (default) or ``beta`` in [0, 1): each device compresses its own
        momentum ``m_i <- beta m_i + (1 - beta) g_i`` (Signum with majority vote). A Python 0
        is None; an array (``optax.inject_hyperparams``) keeps the momentum state. The other
        numbers are static: ``optax.inject_hyperparams(jc.compressed_allreduce,
        static_args=("min_size", "seed", "bucket_bytes", "warmup_steps"))(codec, axis_name,
        worker_momentum=schedule)`` (without them ``warmup_steps`` arrives as an array and is
        refused; :func:`jaxcomp.sgd` needs none).
      worker_nesterov: send Nesterov's look-ahead ``beta m_i + (1 - beta) g_i`` (new ``m_i``).
        Only with ``worker_momentum`` given: with None there is no momentum to look ahead
        of, and True is refused rather than ignored. (A ``worker_momentum`` of 0 is accepted:
        the look-ahead of ``beta = 0`` is ``g_i``, the same step.)
      adaptive: None, or ``jc.accordion(gentle_codec, ...)``: send through ``gentle_codec``
        in critical regimes of training (Accordion), through ``codec`` elsewhere; both share
        the memories. With ``two_phase`` under ``strategy="auto"`` both codecs must choose
        the same strategy for every leaf (else name one).
      param_specs: where params are sharded over other mesh axes than ``axis_name`` (a data
        x model mesh, ``jax.shard_map(..., axis_names={axis_name})``): a tree like the params
        of ``PartitionSpec`` (or ``NamedSharding``). Each device then compresses its own block
        of every leaf (per-block scales and selections) and keeps its memories sharded like
        the params: no gradient-sized traffic over the other axes. Build the state with
        ``jc.sharded_init(tx, params, mesh, axis_name, param_specs)``. The model axis must
        be ``AxisType.Auto``: an Explicit one is refused (the data-manual ``shard_map``
        would gather every model-sharded operand in float32); None beside an Auto axis warns.
      bucket_bytes: encoded payloads of all leaves travel in buckets of about this many
        bytes, one collective per bucket per phase (default 32 MiB).
      warmup_steps: density warm-up of a sparse codec (``jc.top_k``): the first steps send
        ``codec`` at densities 25%, 6.25%, 1.5625%, ... (a factor of 4 per stage, while above
        its ratio), each for ``warmup_steps / stages`` steps, then ``codec`` itself (DGC's
        warm-up, :mod:`jaxcomp._src.warmup`). One ``jax.lax.switch`` on the step count
        (``jc.comm_report`` counts every stage: weigh them with ``mean_bytes_per_device``).
        0 (default): none (also in :func:`jaxcomp.sgd`; :func:`jaxcomp.dgc` runs the same
        stages, 200 steps by default).
      memory_dtype: the type the error-feedback memories (``memory``, ``server_residual``)
        are kept in, as optax's ``mu_dtype``: None (float32) or ``jnp.bfloat16`` (half the
        state; read as float32, stored rounded to nearest and saturating, so a finite memory
        never becomes inf). ``jnp.float16`` also works but saturates at 65504. Float32 only
        with ``error_feedback="ef21"``, whose device estimates must add exactly what the
        global one adds (refused otherwise: :func:`_check_ef21_memory`).
      fuse_residuals: False (default): the encoding, the new memory and the output in
        passes over whole leaves. True: with residual feedback, float32 memories and a codec
        whose payload is its chunks' payloads end to end (``Codec.chunk_unit``: int_quant,
        casts, sign with ``block_size``), each leaf sent whole (``allgather``,
        ``allreduce``) is encoded a cache-sized chunk at a time in one loop that also writes
        its new memory in place and the old one over the donated gradient (which a
        non-finite step copies back): ``g`` and ``e`` are read once. The same payloads,
        memories and outputs, bit for bit for ``int_quant`` of 2 bits or more and casts (a
        1-bit block scale can round a few ulp apart: ``Codec.chunk_unit``), and the same wire
        bytes. Measured on XLA:CPU
        (docs/hot-path-copies.md, "Chunked residuals"): fewer bytes moved, but not faster for
        int8 or fp16 there; hence off by default.
      shard_axis: the mesh axis (or tuple) over which the gradients are shards of one model
        (HSDP: FSDP over ``"data"`` inside each group averaged over ``axis_name``, leaves
        ``P("replica", "data")``): the non-finite flag is or-ed over it, so a non-finite
        shard poisons every shard's output and freezes every shard's memory. Under
        ``check_vma=True`` jax's types tell (None works); under ``check_vma=False`` they do
        not, and with another manual axis bound beside ``axis_name`` / ``inner_axis_name``
        the update warns where this is None. ``()``: the leaves are whole, no warning.

    Raises:
      ValueError: at construction, ``strategy``, ``error_feedback``, ``granularity``, ``min_size``,
        ``bucket_bytes``, ``seed``, ``server_feedback``, ``worker_momentum``, ``memory_dtype``,
        ``warmup_steps``, ``axis_name`` or ``inner_axis_name`` outside its rule (the message
        names the argument; the rules: docs/errors.md), or ``worker_nesterov`` True without
        ``worker_momentum``.
      TypeError: at construction, ``codec``, ``min_size``, ``bucket_bytes``, ``seed``,
        ``server_feedback``, ``worker_momentum``, ``worker_nesterov``, ``fuse_residuals``,
        ``adaptive``, ``warmup_steps``, ``axis_name``, ``inner_axis_name`` or ``shard_axis`` of
        the wrong kind.

    Example (Signum with majority vote; the state's per-device fields under ``shard_map``
    come from ``jc.sharded_init`` / ``jc.state_specs``)::

        tx = optax.chain(
            jc.compressed_allreduce(jc.sign(None), "data", strategy="majority_vote",
                                    worker_momentum=0.9),
            optax.sgd(optax.cosine_decay_schedule(0.01, 1000)),
        )

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update returns the mean gradient.
    """
    collectives.check_axes(axis_name, inner_axis_name)
    collectives.check_codec(codec)
    collectives.check_pair(codec, strategy)
    adaptive = check_adaptive(adaptive)
    if adaptive is not None:
        collectives.check_pair(adaptive.gentle, strategy)
    stages = warmup.stage_codecs(codec, warmup_steps)
    if stages and adaptive is not None:
        raise ValueError(
            "`warmup_steps` and `adaptive` both choose the codec of a step: pass "
            "warmup_steps=0 with adaptive=jc.accordion(...)"
        )
    collectives.check_granularity(granularity)
    error_feedback = _resolve_feedback(error_feedback, codec, strategy)
    min_size = check_int("min_size", min_size, 0)
    seed = check_int("seed", seed, 0)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    if not isinstance(server_feedback, bool):
        raise TypeError(f"`server_feedback` must be a bool, got {server_feedback!r}")
    use_server = _uses_server_residual(codec, strategy, error_feedback, server_feedback)
    _check_ef21_server(error_feedback, codec, strategy, server_feedback)
    beta = check_momentum("worker_momentum", worker_momentum)
    if not isinstance(worker_nesterov, bool):
        raise TypeError(f"`worker_nesterov` must be a bool, got {worker_nesterov!r}")
    if worker_nesterov and worker_momentum is None:
        raise ValueError(
            "`worker_nesterov=True` is the look-ahead of the devices' momentum and needs "
            "`worker_momentum` (a beta in [0, 1)); without it no momentum is kept and the "
            "flag would be ignored"
        )
    every_axis = collectives.axis_names(axis_name, inner_axis_name)
    # With inner_axis_name each device owns its own chunk: per-device over both axes.
    per_device = axis_name if inner_axis_name is None else every_axis
    memory_dtype = _check_ef21_memory(error_feedback, memory_dtype)

    flat = granularity == "flat"
    # Residuals formed in each memory's shape need the codec of every step fixed at trace
    # time and whole leaves sent from the gradient itself.
    shaped_residuals = (
        codec.elementwise
        and not flat
        and inner_axis_name is None
        and beta is None
        and adaptive is None
        and not stages
    )
    residual_how = (codec, strategy, axis_name, inner_axis_name, shaped_residuals)
    if not isinstance(fuse_residuals, bool):
        raise TypeError(f"`fuse_residuals` must be True or False, got {fuse_residuals!r}")
    shard_axis = shards.check_shard_axis(shard_axis)
    # The encoding and the new memory in one loop over chunks of each leaf: the codec of
    # every step fixed at trace time, whole leaves sent from g + e, float32 memories.
    fuse_residuals = (
        fuse_residuals
        and not flat
        and inner_axis_name is None
        and beta is None
        and adaptive is None
        and not stages
        and memory_dtype == jnp.float32
        and codec.flags_nonfinite
    )

    def chunks(layout: layouts.Layout):
        """Owned chunk sizes per whole and segment; None outside the mesh."""
        sizes = server.bound_sizes(axis_name, inner_axis_name)
        if sizes is None:
            return None
        plan = collectives.segments_for(list(layout.compressed_sizes), granularity)
        return server.chunk_sizes(plan, codec, strategy, *sizes)

    def fields(layout: layouts.Layout) -> dict[str, Any]:
        """Every per-leaf field, zeros (None where unused: orbax saves no zero-size array)."""
        some = bool(layout.compressed_size)
        return {
            "memory": skeleton.zeros_like_compressed(layout, dtype=memory_dtype)
            if some and error_feedback is not None
            else None,
            "server_residual": server.zeros(
                layout, chunks(layout), flat, use_server and some, memory_dtype
            ),
            "estimate": skeleton.zeros_like_compressed(layout, lambda s: s)
            if some and error_feedback == "ef21"
            else None,
            "momentum": skeleton.zeros_like_floats(layout) if beta is not None else None,
            "server_grid": server.grid(
                server.bound_sizes(axis_name, inner_axis_name),
                use_server and some and inner_axis_name is not None,
            ),
            "server_chunk": server.stamp(axis_name, inner_axis_name, use_server and some),
        }

    def init_fn(params):
        layout = layouts.layout_of(params, min_size, mask)
        return CompressedAllreduceState(
            key=jax.random.PRNGKey(seed),
            count=jnp.zeros([], jnp.int32),
            **fields(layout),
            adaptive=None if adaptive is None else adaptive.init(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        skeleton.begin("compressed_allreduce", updates, params, axis_name, inner_axis_name)
        layout = layouts.layout_of(updates, min_size, mask)
        server.check_grid(state, layout, flat, axis_name, inner_axis_name)
        skeleton.check_state(
            "compressed_allreduce", state, lambda: fields(layout), layout, flat, per_device, updates
        )
        server.check_whole(state, layout, flat, axis_name, inner_axis_name)
        grads = layouts.compressed_vectors(updates, layout)
        plain = layouts.leaves_of(updates, layout, layouts.PLAIN)
        momentum, grads, plain = _worker_momentum(
            beta, worker_nesterov, layout, state.momentum, grads, plain
        )
        plain_out, plain_bad = skeleton.plain_means(plain, every_axis, bucket_bytes)
        kind = error_feedback if grads else None
        key, step_key = jax.random.split(state.key)

        memory = feedback.widened(skeleton.vectors(state.memory) if kind else [None] * len(grads))
        targets = [feedback.to_send(g, m, kind) for g, m in zip(grads, memory, strict=True)]
        owner = server.Owner(axis_name, inner_axis_name)
        targets = server.poison_misplaced(targets, state, owner)

        plan = collectives.segments_for([t.shape[0] for t in targets], granularity)
        fused = [None] * len(grads)
        if fuse_residuals and kind == "residual" and _PAYLOADS.get() is None:
            fused, targets = _fused_encodings(codec, strategy, axis_name, grads, state, targets)
        owned = chunks(layout) if grads and use_server else None
        servers = _owned_servers(state, layout, owned, flat, owner)

        def reduce(through: Codec) -> collectives.Reduced:
            sink = _PAYLOADS.get()
            r = collectives.reduce_segments(
                plan.split(targets),
                axis_name,
                through,
                strategy,
                step_key,
                servers,
                inner_axis_name,
                plain_bad,
                bucket_bytes,
                with_payload=sink is not None,
                encoded=_given(plan, fused, through is codec),
            )
            if sink is not None:
                sink.append(r.payload)
            return r

        def reduce_in_regime() -> collectives.Reduced:
            """Through ``codec``; with Accordion, through the gentle codec when critical;
            during a density warm-up, through the stage's codec."""
            sizes = server.bound_sizes(axis_name, inner_axis_name) if use_server else None
            if stages and grads:
                for c in stages:
                    _check_same_servers(plan, codec, c, strategy, sizes, "warmup_steps")
                return warmup.switch(
                    state.count, warmup_steps, [lambda c=c: reduce(c) for c in (*stages, codec)]
                )
            if adaptive is None or not grads:
                return reduce(codec)
            _check_same_servers(plan, codec, adaptive.gentle, strategy, sizes)
            return jax.lax.cond(
                state.adaptive.critical, lambda: reduce(adaptive.gentle), lambda: reduce(codec)
            )

        reduced = reduce_in_regime()
        sent = plan.join(reduced.sent)
        outs = _outputs(kind, plan.join(reduced.mean), state.estimate)

        step = (updates, grads, layout, state)
        errors = _residuals(kind, residual_how, step, plan, reduced, fused)
        new_memory, restored = _new_memories(
            kind, memory_dtype, (memory, targets, sent, errors), fused, reduced.bad
        )
        new_state = state._replace(  # server_grid and server_chunk as they came
            memory=skeleton.like_state(layout, new_memory) if kind else state.memory,
            server_residual=state.server_residual
            if owned is None
            else server.write(reduced.server, state.server_residual, layout, owned, flat, owner),
            estimate=skeleton.like_state(layout, outs, per_device=False)
            if kind == "ef21"
            else state.estimate,
            key=key,
            count=state.count + 1,
            momentum=state.momentum if momentum is None else _like_momentum(layout, *momentum),
            adaptive=state.adaptive
            if adaptive is None
            else adaptive.update(state.adaptive, state.count, outs),
        )
        new_state = _freeze(reduced.bad, state, new_state, layout, restored)
        new_state = _with_rounding(kind, new_state, outs, layout, reduced.bad)
        outs = _after_memory(outs, new_state.memory, every_axis, kind == "residual")
        return layouts.assemble(updates, layout, outs, plain_out), new_state

    own_axes = (*collectives.axis_names(axis_name), *collectives.axis_names(inner_axis_name))
    update_fn = shards.with_shard_axis(update_fn, "jc.compressed_allreduce", own_axes, shard_axis)
    return optax.GradientTransformationExtraArgs(
        init_fn, shards.over_shards(update_fn, param_specs, every_axis)
    )


def _fused_encodings(codec, strategy, axis_name, grads, state, targets):
    """Per compressed leaf, ``(payload, new memory, old memory)`` from
    :func:`~jaxcomp._src.fused_residual.encode_in_place` where the leaf qualifies (a whole
    segment sent by ``allgather`` or ``allreduce``, a chunk size for it), else None; and the
    targets with each fused leaf's ``g + e`` replaced by ``g`` (the exchange reads only its
    size, and nothing may read the memory that the loop overwrites)."""
    n = collectives.axis_size(axis_name)
    chosen = [collectives.choose_strategy(codec, g.shape[0], n, strategy) for g in grads]
    chunks = [
        fused_residual.chunk_size(codec, g.shape[0])
        if g.shape[0] <= collectives.MAX_SEGMENT and s in ("allgather", "allreduce")
        else None
        for g, s in zip(grads, chosen, strict=True)
    ]
    if all(c is None for c in chunks):
        return [None] * len(grads), targets
    memories = layouts.field_leaves(state.memory)
    fused = [
        None if c is None else fused_residual.encode_in_place(codec, s, n, g, m, c)
        for g, m, c, s in zip(grads, memories, chunks, chosen, strict=True)
    ]
    targets = [t if f is None else g for t, g, f in zip(targets, grads, fused, strict=True)]
    return fused, targets


def _given(plan, fused: list, same_codec: bool) -> list | None:
    """Per segment of ``plan``, the payload a fused leaf's encoding made (None elsewhere);
    None where no leaf is fused (or for another codec than the one fused)."""
    if not same_codec or all(f is None for f in fused):
        return None
    given = []
    for f, pieces in zip(fused, plan.pieces(), strict=True):
        given += [None] * len(pieces) if f is None else [f[0]]
    return given


def _owned_servers(state, layout: layouts.Layout, owned, flat: bool, owner) -> Any:
    """The server residuals of the chunks this device owns (``two_phase``), as
    :func:`~jaxcomp._src.server.read` gives them; None where there are none (``owned``)."""
    if owned is None:
        return None
    return server.read(state.server_residual, layout, owned, flat, owner)


def _new_memories(kind, memory_dtype, step: tuple, fused: list, bad) -> tuple[list, list]:
    """``(new memories, restored)`` per compressed leaf: the feedback's next memory
    (``step`` is ``(memories, targets, sent, errors)``), stored in ``memory_dtype``; where a
    leaf's encoding was fused (:mod:`~jaxcomp._src.fused_residual`) the memory its loop wrote
    in place instead, or on a non-finite step (``bad``) the old one, copied back from the
    gradient's buffer (``restored``: those memories, None for every other leaf)."""
    new = [
        feedback.to_memory(feedback.next_memory(m, t, s, kind, r), memory_dtype)
        for m, t, s, r in zip(*step, strict=True)
    ]
    restored = [None if f is None else fused_residual.restore(bad, f[1], f[2]) for f in fused]
    return [n if r is None else r for n, r in zip(new, restored, strict=True)], restored


def _with_rounding(kind, state, outs: list, layout: layouts.Layout, bad):
    """``state`` whose residual ``memory`` holds each bfloat16 / float16 leaf's output
    rounding too (:func:`~jaxcomp._src.feedback.with_rounding`; float32 leaves and the other
    feedback kinds untouched), but not on a non-finite step (``bad``)."""
    dtypes = feedback.compressed_dtypes(layout)
    if kind != "residual" or all(jnp.dtype(d).itemsize >= 4 for d in dtypes):
        return state
    leaves = feedback.with_rounding(layouts.field_leaves(state.memory), outs, dtypes, ~bad)
    return state._replace(memory=layouts.like_compressed(layout, leaves))


def _freeze(bad, state, new_state, layout, restored: list):
    """:func:`~jaxcomp._src.skeleton.freeze`, but the fused leaves' memories as
    :func:`~jaxcomp._src.fused_residual.restore` gives them (``restored`` not None: the old
    memory was overwritten in place, and a non-finite step has it copied back)."""
    frozen = skeleton.freeze(bad, state, new_state)
    if all(r is None for r in restored):
        return frozen
    memories = layouts.field_leaves(frozen.memory)
    merged = [m if r is None else r for m, r in zip(memories, restored, strict=True)]
    return frozen._replace(memory=layouts.like_compressed(layout, merged))


#: Set by :func:`late_residual_memory`'s ``capture``: the update appends its exchange's
#: payloads (this device's, per segment) while it is traced.
_PAYLOADS: contextvars.ContextVar = contextvars.ContextVar("jaxcomp_payloads", default=None)


def late_residual_memory(codec: Codec, axis_name: Any, options: dict[str, Any]) -> Any:
    """For a recipe that runs :func:`compressed_allreduce` ``(codec, axis_name, **options)``
    (residual feedback, float32 memories) inside a ``lax.cond``: ``(capture, memory)``, or
    None where these options form the memory otherwise (another feedback or memory dtype,
    an elementwise codec, an inner axis, worker momentum, adaptive, a density warm-up,
    sharded params).

    ``capture(fn, *args)`` calls ``fn`` (the branch's ``update``) and returns ``(its result,
    payloads)``: this device's payload of every segment, which the branch returns (a
    fraction of the memory's bytes). ``memory(updates, state, payloads)`` is then the new
    ``memory`` field, ``e' = (g + e) - decode(payload)`` per segment
    (:func:`jaxcomp._src.collectives.own_errors`: the errors of the encoding, bit for bit,
    no collective, no second encoding), formed after the cond where XLA writes it in
    place in the donated memory: returned from the branch, the memory left the cond in a
    buffer of its own, beside the branch's operand and the exchanged mean.
    """
    o = options
    unsupported = (
        o.get("error_feedback") != "residual"
        or codec.elementwise
        or any(o.get(k) is not None for k in ("inner_axis_name", "worker_momentum", "adaptive"))
        or o.get("param_specs") is not None
        or o.get("warmup_steps", 0)
        or feedback.check_memory_dtype(o.get("memory_dtype")) != jnp.float32
    )
    if unsupported:
        return None
    min_size, mask = o.get("min_size", 1024), o.get("mask")
    granularity, strategy = o.get("granularity", "leaf"), o.get("strategy", "auto")

    def capture(fn, *args):
        sink = []
        token = _PAYLOADS.set(sink)
        try:
            out = fn(*args)
        finally:
            _PAYLOADS.reset(token)
        return out, (sink[0] if sink else [])

    def memory(updates: Any, state: CompressedAllreduceState, payloads: list) -> Any:
        layout = layouts.layout_of(updates, min_size, mask)
        grads = layouts.compressed_vectors(updates, layout)
        if not grads:
            return state.memory
        plan = collectives.segments_for([g.shape[0] for g in grads], granularity)
        sizes = [d for pieces in plan.pieces() for d in pieces]
        sent = collectives.own_sent(sizes, payloads, axis_name, codec, strategy)
        if any(s is None for s in sent):  # plain segments: zero error
            sent = [
                jnp.zeros((d,), jnp.float32) if s is None else s
                for d, s in zip(sizes, sent, strict=True)
            ]
        memories = layouts.field_leaves(state.memory)
        return layouts.like_compressed(
            layout,
            [_residual(g, e, s) for g, e, s in zip(grads, memories, plan.join(sent), strict=True)],
        )

    return capture, memory
