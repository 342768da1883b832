"""DiLoCo and Streaming DiLoCo: inner steps on each device, an outer step on the averaged
pseudo-gradient, sent through any codec with error feedback."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from jaxcomp._src import collectives, periodic, shards
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.older_states import NONE

#: DiLoCo's default outer step: plain averaging up to this many replicas, Nesterov above.
FEW_REPLICAS = 2


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      inner: per device: the inner optax state, every leaf with a leading slot of 1
      anchor: identical on every device: f32 global params, like the params
      outer: identical on every device: the outer optax state of each fragment (a tuple)
      exchange: with a codec: CompressedAllreduceState of each fragment; else None
      pending: per device, with delay: f32[1, *shape] pseudo-gradient snapshots; else None
      count: int32[]: number of updates applied
      taken: identical on every device, with delay: int32[] per fragment (a tuple), the count
        at which its pending snapshot was taken, -1 once it has landed (so that a state
        restored into another ``delay`` lands each snapshot once); else None. A state saved
        before this field (built without it: None) lands on the schedule of the count, as
        it did (docs: checkpoints)
    """

    inner: Any
    anchor: Any
    outer: Any
    exchange: Any
    pending: Any
    count: jax.Array
    taken: Any = None

    PER_DEVICE_FIELDS = ("inner", "pending")
    #: Added since the first release (:func:`jaxcomp.complete_state`): a state saved without
    #: ``taken`` gets None and lands on the schedule of the count, as it did.
    ADDED_FIELDS = {"taken": NONE}
    FRAGMENT_FIELDS = ("outer", "exchange", "pending")  # one entry per fragment (a tuple)


def default_outer(axis_name: Any) -> optax.GradientTransformation:
    r"""DiLoCo's default outer step, chosen by the number of replicas ``M`` (the size of
    ``axis_name``, read while tracing):

    .. math::

        M \le 2:\; x \leftarrow x - \Delta \qquad
        M > 2:\; v \leftarrow 0.6\, v + \Delta,\;
        x \leftarrow x - 0.7\, (\Delta + 0.6\, v)

    Plain averaging of the params (lr 1, no momentum) where few replicas each see a large
    share of the batch; Nesterov SGD with lr 0.7 and momentum 0.6 (MuLoCo's: an effective
    step ``lr / (1 - momentum)`` = 1.75) where many replicas each see a small one, so that
    the mean of their pseudo-gradients is shorter than each (their noise averages out) and
    a longer step recovers what each replica's noisier AdamW denominator took from the
    signal. Both keep one float32 buffer like the params (Nesterov's velocity, zero and
    unused at ``M <= 2``), so a state checkpointed with one ``M`` restores with another.

    Args:
      axis_name: the replica axis of the transform (bound where the update runs).

    Returns:
      An ``optax.GradientTransformation`` fed the averaged pseudo-gradient.

    Example::

        tx = jc.diloco(optax.adamw(1e-3), "replica", 10, outer=None)   # this step

    References:
      Douillard et al., "DiLoCo", 2023 (Nesterov outer step); Therien et al., "MuLoCo",
      arXiv 2505.23725, 2025 (lr 0.7, momentum 0.6); Lin et al., "Don't Use Large
      Mini-Batches, Use Local SGD", 2020 (plain averaging of the params).
    """
    nesterov = optax.sgd(0.7, momentum=0.6, nesterov=True)

    def update_fn(updates, state, params=None):
        if collectives.axis_size(axis_name) <= FEW_REPLICAS:
            return jax.tree.map(lambda g: -g, updates), state
        return nesterov.update(updates, state, params)

    return optax.GradientTransformation(nesterov.init, update_fn)


def diloco(
    inner: optax.GradientTransformation,
    axis_name: Any,
    sync_every: int | tuple[int, ...],
    *,
    outer: optax.GradientTransformation | None = None,
    codec: Codec | None = None,
    error_feedback: str | None = "auto",
    fragments: int = 1,
    delay: int = 0,
    mix: float | None = None,
    shard_axis: Any = None,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo: ``H`` inner steps per device, then an outer step on the averaged
    pseudo-gradient; optionally compressed, streamed in fragments and overlapped.

    Params are per-device replicas (:func:`jaxcomp.replica_params`); ``update(grads, state,
    params)`` takes this device's gradients and params and returns the updates that move
    them. The state keeps the global params ``x`` (the anchor). With ``H = sync_every``::

        theta_i <- theta_i + inner(g_i)                       # every step, on each device
        every H steps:
          Delta = mean_i C(x - theta_i + e_i)                  # the pseudo-gradient
          e_i  <- x - theta_i + e_i - C(x - theta_i + e_i)     # error feedback (codec)
          x    <- x + outer(Delta)                             # e.g. Nesterov SGD
          theta_i <- x                                         # every device restarts

    Without ``codec`` the mean is a float32 ``pmean``. The inner optimizer's state stays on
    each device across syncs. Streaming (``fragments=F``): the float leaves are split in
    ``F`` groups (in order, balanced by size); fragment ``f`` syncs at the steps where
    ``(t + 1 + f H // F) % H == 0``, so one sync sends about ``1/F`` of the bytes. With
    ``delay=tau`` a fragment's pseudo-gradient is taken at its sync step and exchanged
    ``tau`` steps later, in the program of a later step (its collectives depend on nothing
    that step computes, so XLA can overlap them with its forward and backward); the new
    global params are then mixed into the params that went on meanwhile::

        theta_i <- (1 - mix) theta_i + mix x

    The sync runs inside a ``jax.lax.cond`` on the step count: other steps send nothing. A
    non-finite update on one device freezes that device's inner state and gives it a
    non-finite output (with ``delay``, a snapshot taken then is non-finite and reaches the
    exchange where it lands); a sync whose mean is not finite gives non-finite outputs
    everywhere and leaves the whole state as it was (the sync is retried next step). Wrap the inner
    optimizer, not this transform, in ``optax.apply_if_finite``.

    Args:
      inner: the optax transform each device runs on its own gradients (e.g.
        ``optax.adamw(1e-3)``). Hold its lr at the peak after a warm-up rather than decay
        it: at ``H = 30`` on a language model a cosine decay cost loss, and Muon inside
        (``optax.contrib.muon``, MuLoCo) did better still, on 8 replicas of one device and
        on 2 of several: the recommended inner optimizer at ``H = 30`` (figures in the docs,
        "Language models over slow links: the measurements": MuLoCo). The learning rate
        goes inside: nothing may follow this transform in an ``optax.chain``
        (``jc.sharded_init`` refuses it, as for :func:`jaxcomp.local_sgd`).
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      sync_every: ``H``, inner steps between outer steps; or a sequence of intervals
        ``(h_1, ..., h_k)``: syncs after ``h_1``, ``h_1 + h_2``, ... steps, then every
        ``h_k`` (a growing ``H``, e.g. ``(5, 5, 10, 10, 30)``: short intervals while the
        loss falls fast; with ``fragments=1`` and ``delay=0`` only). On a language model a
        constant shorter ``H`` did as well for fewer bytes (docs, "Language models over slow
        links: the measurements": AdamW inside at ``H = 30``). ``H`` trades bytes (``1 / H``) for
        loss: fewer replicas hold a longer ``H`` (the same docs page gives the rule for ``H``
        with the measured losses and bytes).
      outer: the optax transform of the anchor, fed the averaged pseudo-gradient. Default
        (None): :func:`default_outer`, by the number of replicas ``M``: plain averaging
        (``x <- x - Delta``) at ``M <= 2``, ``optax.sgd(0.7, momentum=0.6, nesterov=True)``
        (MuLoCo's: an effective step ``lr / (1 - momentum)`` = 1.75) above. The paper's
        0.7 / 0.9 takes an effective step of 7 and overshoots on runs of tens of outer steps
        (docs, "Language models over slow links: the measurements": the rule for ``H`` and
        the outer step).
      codec: None (float32 ``pmean``) or a jaxcomp codec for the pseudo-gradient (e.g.
        ``jc.int_quant(4)``, ``jc.cast("fp8_e4m3")``, ``jc.sign()``, ``jc.top_k(0.01)``),
        sent by :func:`jaxcomp.compressed_allreduce`.
      error_feedback: the codec's feedback on the pseudo-gradient, as for
        :func:`jaxcomp.compressed_allreduce` (``"auto"``: residual for biased codecs);
        ``"residual"`` / ``"ef21"`` only with ``codec``.
      fragments: ``F``, fragments synced at staggered steps (Streaming DiLoCo); at most
        ``sync_every`` and the number of float leaves.
      delay: ``tau`` in ``[0, H)``, steps between a fragment's snapshot and its exchange.
      mix: the weight of the new global params when a delayed exchange lands, in [0, 1]
        (default 0.5 with ``delay``, else 1: restart from them). Only with ``delay``:
        without it every device restarts from the new global params, so a ``mix`` other
        than 1 is refused.
      shard_axis: the mesh axis (or tuple) over which the params are FSDP shards inside each
        replica (params ``P(axis_name, "data")``, gradients from ``jc.fsdp_gather``), as
        :func:`jaxcomp.clip_by_global_norm`'s: the non-finite flags are or-ed over it (one
        scalar ``psum`` per flag), so a non-finite shard skips the sync of every shard.
        Under ``check_vma=True`` jax's types tell the shards anyway (None works); under
        ``check_vma=False`` they do not, and with another manual axis bound beside
        ``axis_name`` the update warns where this is None. ``()``: the params are whole
        (data parallel inside), no warning.
      **exchange: options of the codec's exchange (``jc.compressed_allreduce``):
        ``strategy``, ``min_size`` (default 1024: smaller leaves are averaged in plain
        float32, so on a small model ``codec=jc.int_quant(4)`` compresses nothing unless
        ``min_size`` is lowered; ``init`` warns then), ``granularity``, ``bucket_bytes``,
        ``seed``, ``server_feedback``. Only with ``codec``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`DiLoCoState`.
      Updates of bf16/fp16 leaves come back in float32, so that after a sync
      ``optax.apply_updates`` gives every replica the anchor bit for bit (float32 params:
      to the rounding of ``p + (anchor - p)``, at most an ulp of the leaf's largest value).

    Raises:
      ValueError: at construction, ``sync_every``, ``fragments``, ``delay``, ``mix``,
        ``error_feedback`` or ``axis_name`` outside its rule (the message names the argument; the
        rules: docs/errors.md); when traced, ``shard_axis`` not bound there or holding
        ``axis_name``, or ``inner`` returning an update that differs per device where its
        param is typed the same (a whole leaf beside FSDP shards).
      TypeError: at construction, ``inner``, ``outer``, ``sync_every``, ``fragments``, ``delay``,
        ``mix``, ``codec``, ``min_size``, ``mask``, ``shard_axis`` or ``axis_name`` of the wrong
        kind; ``error_feedback`` ``"residual"`` / ``"ef21"`` without ``codec``.

    Example::

        tx = jc.diloco(optax.adamw(1e-3), "data", sync_every=50, codec=jc.int_quant(4))
        replicas = jc.replica_params(params, mesh, "data")
        opt_state = jc.sharded_init(tx, params, mesh, "data")

        def step(replicas, opt_state, batch):
            p = jc.own(replicas)
            g = jax.grad(loss)(p, batch)
            u, opt_state = tx.update(g, opt_state, p)
            return jc.slot(optax.apply_updates(p, u)), opt_state

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", 2023; Douillard et al., "Streaming DiLoCo with overlapping communication:
      Towards a Distributed Free Lunch", 2025; Jaghouar et al., "INTELLECT-1 Technical
      Report", 2024 (int8 outer all-reduce).
    """
    if outer is None:
        outer = default_outer(axis_name)
    outer = periodic.check_transform("outer", outer)
    sync_every, fragments, delay, _ = periodic.check_common(sync_every, fragments, delay)
    mix = periodic.check_mix(mix)
    if mix is not None and mix != 1.0 and not delay:
        raise ValueError(
            f"`mix`={mix} weighs the global params where a delayed exchange lands, but "
            "`delay`=0: every device restarts from them at the sync (mix 1) and `mix` would "
            "be ignored. Pass `delay`=tau >= 1, or leave `mix` out"
        )
    return periodic.build(
        "diloco",
        DiLoCoState,
        inner,
        axis_name,
        sync_every,
        codec=codec,
        error_feedback=error_feedback,
        exchange=exchange,
        outer=outer,
        fragments=fragments,
        delay=delay,
        mix=(0.5 if delay else 1.0) if mix is None else mix,
        shard_axis=shards.check_shard_axis(shard_axis),
    )
