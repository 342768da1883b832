"""SparseLoCo: DiLoCo's pseudo-gradient with decayed error feedback, top-k per chunk, 2 bits.

Built on the periodic core (:mod:`jaxcomp._src.periodic`) that runs ``jc.local_sgd`` and
``jc.diloco``: inner steps on each device, a sync in a ``lax.cond`` every ``H`` steps. Only
the exchange differs: :func:`sparse_feedback`, an optax transform of the pseudo-gradients
that keeps the decayed error feedback and sends chunked top-k payloads.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import periodic, shards, shared_mask, skeleton, sparse_exchange
from jaxcomp._src.codecs.base import (
    Codec,
    check_decay,
    check_fraction,
    check_int,
    check_positive_float,
    is_array,
    is_number,
    scaled_global_norm_parts,
)
from jaxcomp._src.codecs.chunked import SCALES, ChunkedTopK, check_sub_chunk, chunked_top_k
from jaxcomp._src.codecs.quantize import int_quant
from jaxcomp._src.compressed_allreduce import compressed_allreduce

F32 = jnp.float32


class SparseFeedbackState(NamedTuple):
    """State of the SparseLoCo exchange of one fragment (nested in :class:`SparseLoCoState`).

    Attributes:
      memory: per device: f32[1, *shape] error feedback per coded leaf, None if pmean'd
    """

    memory: Any

    PER_DEVICE_FIELDS = ("memory",)


class SparseLoCoState(NamedTuple):
    """State of :func:`sparseloco`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      inner: per device: the inner optax state, every leaf with a leading slot of 1
      anchor: identical on every device: f32 global params, like the params
      outer: identical on every device: the outer optax state (a 1-tuple), or None
      exchange: (SparseFeedbackState,) or, two-phase, (CompressedAllreduceState,); with a
        shared ``mask``, the shared-mask state (``memory`` per device; ``previous``,
        ``count`` and the masks' PRNG ``key`` identical on every device)
      count: int32[]: number of updates applied
    """

    inner: Any
    anchor: Any
    outer: Any
    exchange: Any
    count: jax.Array

    PER_DEVICE_FIELDS = ("inner",)
    FRAGMENT_FIELDS = ("outer", "exchange")  # one entry per fragment (a tuple)


def sparse_feedback(
    codec: ChunkedTopK,
    axis_name: Any,
    *,
    ef_decay: float,
    min_size: int,
    averaging: str = "all",
    clip: bool = False,
    small_codec: Codec | None = None,
) -> optax.GradientTransformation:
    r"""The mean over devices of a list of vectors-shaped arrays ``D_i``, through ``codec``
    with decayed error feedback (SparseLoCo)::

        e_i <- beta e_i + D_i;   s_i = c_i C(e_i);   out = mean_i s_i;   e_i <- e_i - s_i

    ``c_i = 1``, or with ``clip`` :func:`clip_factor` (``min(1, |D_i| / |C(e_i)|)`` per leaf).

    Leaves under ``min_size`` values are averaged exactly (``pmean``) and keep no memory, or
    with ``small_codec`` go through it (a dense codec, the mean over all devices) with the
    same decayed error feedback. A non-finite ``D`` on any device gives NaN outputs
    everywhere and keeps every memory.
    """

    def leaf_codec(x):
        return codec if jnp.size(x) >= min_size else small_codec

    def init_fn(leaves):
        return SparseFeedbackState(
            [None if leaf_codec(x) is None else jnp.zeros((1, *jnp.shape(x)), F32) for x in leaves]
        )

    def update_fn(deltas, state, params=None):
        del params  # a state of other params or devices: refused (m[0] would read one row)
        want = jax.eval_shape(init_fn, deltas)._asdict()
        skeleton.check_fields("sparseloco", state, want, axis_name)
        targets = [
            d.astype(F32) if m is None else ef_decay * m[0] + d.astype(F32)
            for d, m in zip(deltas, state.memory, strict=True)
        ]
        sends = [  # an empty leaf sends nothing: nothing to clip (its norm has no max)
            t * clip_factor(leaf_codec(t), t, d) if clip and m is not None and t.size else t
            for t, d, m in zip(targets, deltas, state.memory, strict=True)
        ]
        out = sparse_exchange.exchange(
            [t.reshape(-1) for t in sends],
            [
                None if m is None else leaf_codec(t)
                for m, t in zip(state.memory, sends, strict=True)
            ],
            axis_name,
            averaging=averaging,
        )
        memory = [
            None if m is None else jnp.where(out.bad, m, (t - s.reshape(t.shape))[None])
            for m, t, s in zip(state.memory, targets, out.sent, strict=True)
        ]
        means = [m.reshape(t.shape) for m, t in zip(out.means, targets, strict=True)]
        return means, SparseFeedbackState(memory)

    return optax.GradientTransformation(init_fn, update_fn)


def clip_factor(codec: Codec, target: jax.Array, delta: jax.Array) -> jax.Array:
    r"""The factor ``c = min(1, |D| / |C(e)|)`` that scales one leaf's payload so that it is
    no longer than this sync's pseudo-gradient ``D`` (``e``: the error-feedback target).

    A device never sends more than it moved since the last sync: memory built up over earlier
    syncs (whose pseudo-gradients were larger, early in a run) is sent at the pace of the
    current ones, the rest waits in the memory. 1 where nothing is sent; NaN where ``D`` or
    ``e`` is not finite (the exchange then flags the sync as bad). Norms are taken as
    ``max |x| * |x / max |x||`` and their ratio as a product of ratios, so values near
    float32's range neither overflow nor leave the factor at 0 for a finite, nonzero ``D``.
    """
    t = target.reshape(-1)
    sent = codec.decode(codec.encode(t), t.shape[0])
    a_d, b_d = scaled_global_norm_parts([delta.astype(F32).reshape(-1)])
    a_s, b_s = scaled_global_norm_parts([sent])
    ratio = (a_d / jnp.where(a_s > 0, a_s, 1.0)) * (b_d / jnp.where(b_s > 0, b_s, 1.0))
    bad = jnp.logical_not(jnp.all(jnp.isfinite(t)) & jnp.all(jnp.isfinite(delta)))
    return jnp.where(bad, jnp.nan, jnp.where(a_s > 0, jnp.minimum(ratio, 1.0), 1.0))


def decayed(
    exchange: optax.GradientTransformation, ef_decay: float
) -> optax.GradientTransformation:
    r"""``jc.compressed_allreduce`` (residual feedback) with its memory decayed: it is fed
    ``D + (beta - 1) e``, so it sends ``C(beta e + D)`` and keeps ``beta e + D - C(...)``."""

    def update_fn(deltas, state, params=None):
        if is_array(ef_decay) or ef_decay != 1.0:  # an array of 1: ``D + 0 e``, bit for bit
            deltas = [
                d if isinstance(m, optax.MaskedNode) or m is None else d + (ef_decay - 1.0) * m[0]
                for d, m in zip(deltas, state.memory, strict=True)
            ]
        return exchange.update(deltas, state, params)

    return optax.GradientTransformation(exchange.init, update_fn)


@dataclasses.dataclass(frozen=True)
class _Config(periodic.Config):
    """The periodic core's config with SparseLoCo's exchange in place of a codec's."""

    feedback: Any = None

    def exchange(self) -> optax.GradientTransformation:
        return self.feedback


def _brief(value: Any) -> str:
    """``repr(value)`` in one short line (an array's shape and dtype, not its values)."""
    if hasattr(value, "shape") and hasattr(value, "dtype") and not is_number(value):
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def check_density(density: Any, chunk: int) -> int:
    """``k = ceil(density * chunk)`` values kept per chunk, or an error naming ``density``."""
    density = check_positive_float("density", density, upper=1.0)
    return max(1, math.ceil(density * chunk - 1e-9))


def density_codec(
    density: Any, chunk: int, bits: int | None, scale: str = "max", sub_chunk: Any = None
) -> ChunkedTopK:
    """The chunked top-k codec of ``density``: ``k = ceil(density * chunk)`` per chunk, or with
    ``sub_chunk`` ``ceil(density * sub_chunk)`` per sub-chunk (``chunk / sub_chunk`` times
    that per chunk); errors name ``density`` and ``sub_chunk``."""
    if sub_chunk is None:
        return chunked_top_k(check_density(density, chunk), chunk, bits, scale)
    sub_chunk = check_sub_chunk(sub_chunk, chunk)
    k = check_density(density, sub_chunk) * (chunk // sub_chunk)
    return chunked_top_k(k, chunk, bits, scale, sub_chunk)


def check_small_for_size(small_codec: Codec | None, min_size: int) -> Codec | None:
    """``small_codec`` codes the leaves under ``min_size`` values: refused (ValueError
    naming it) with ``min_size`` 0, where no leaf is under it and it would be ignored."""
    if small_codec is not None and min_size == 0:
        raise ValueError(
            "`small_codec` codes the leaves under `min_size` values, and with `min_size`=0 no "
            "leaf is under it (every leaf goes through the chunked top-k): pass a `min_size` "
            "> 0 (e.g. 1024) or leave `small_codec` out"
        )
    return small_codec


def check_small_codec(small_codec: Any) -> Codec | None:
    """None, or a deterministic dense codec that flags a non-finite input in its payload
    (e.g. ``jc.sign()``); an error naming ``small_codec`` otherwise."""
    if small_codec is None:
        return None
    if not isinstance(small_codec, Codec):
        raise TypeError(f"`small_codec` must be a jaxcomp codec or None, got {small_codec!r}")
    if not small_codec.dense or small_codec.stochastic or not small_codec.flags_nonfinite:
        raise ValueError(
            "`small_codec` must send every coordinate (dense), need no random key and flag a "
            f"non-finite input in its payload (e.g. jc.sign()), got {small_codec.name}"
        )
    return small_codec


def resolve_averaging(averaging: Any, strategy: Any) -> str:
    """The merge of :func:`sparseloco`: ``averaging``, or where it is None ``"senders"``
    (Templar's) with the all-gather and ``"all"`` with two-phase (which sums payloads and
    cannot count who sent a coordinate); an error naming ``averaging`` otherwise."""
    if averaging is None:
        averaging = "all" if strategy == "two_phase" else "senders"
    averaging = sparse_exchange.check_averaging(averaging)
    if strategy == "two_phase" and averaging != "all":
        raise ValueError(
            "`averaging`='senders' needs every device's payload: use `strategy`='allgather'"
        )
    return averaging


def exchange_feedback(
    codec: ChunkedTopK,
    axis_name: Any,
    strategy: Any,
    *,
    ef_decay: float,
    min_size: int,
    averaging: str,
    clip: bool,
    small_codec: Codec | None,
) -> optax.GradientTransformation:
    """:func:`sparseloco`'s exchange of the pseudo-gradients with decayed error feedback:
    :func:`sparse_feedback` (``strategy="allgather"``) or the two-phase
    ``jc.compressed_allreduce`` with its memory :func:`decayed`, which neither clips nor
    sends small leaves through ``small_codec`` (errors naming them)."""
    if strategy == "allgather":
        return sparse_feedback(
            codec,
            axis_name,
            ef_decay=ef_decay,
            min_size=min_size,
            averaging=averaging,
            clip=clip,
            small_codec=small_codec,
        )
    if strategy != "two_phase":
        raise ValueError(f"`strategy` must be 'allgather' or 'two_phase', got {strategy!r}")
    if small_codec is not None:
        raise ValueError(
            "`small_codec` travels in SparseLoCo's all-gather: use `strategy`='allgather'"
        )
    if clip:
        raise ValueError(
            "`clip`=True scales each device's own payload before the all-gather: use "
            "`strategy`='allgather' (two-phase re-encodes sums it cannot clip per device)"
        )
    ex = compressed_allreduce(
        codec, axis_name, error_feedback="residual", strategy="two_phase", min_size=min_size
    )
    return decayed(ex, ef_decay)


def topk_feedback(
    axis_name: Any,
    *,
    density: Any,
    chunk: Any,
    bits: Any,
    ef_decay: Any,
    averaging: Any,
    strategy: Any,
    min_size: Any,
    clip: Any,
    value_scale: Any,
    small_codec: Any,
    value_codec: Any,
    explore: Any,
    seed: Any,
    sub_chunk: Any = None,
) -> tuple[optax.GradientTransformation, Codec]:
    """:func:`sparseloco`'s exchange of each device's own chunked top-k
    (:func:`exchange_feedback`) and its codec, after checking the arguments (errors naming
    each; ``value_codec``, ``explore`` and ``seed`` belong to a shared mask and are refused)."""
    # explore: any value but None or a zero number (an array too: its truth value was
    # ambiguous, a bare ValueError of numpy's) is refused naming `explore` and `mask`.
    explore_set = explore is not None and not (is_number(explore) and explore == 0)
    given = {"value_codec": value_codec is not None, "explore": explore_set}
    given["seed"] = check_int("seed", seed, 0) != 0
    for name, set_ in given.items():
        if set_:
            value = {"value_codec": value_codec, "explore": explore, "seed": seed}[name]
            raise ValueError(
                f"`{name}` applies to a shared mask, not to `mask`='topk' (got `{name}`="
                f"{_brief(value)}): pass `mask`='random' or 'previous', or leave `{name}` out"
            )
    chunk = check_int("chunk", chunk, 1, 2**30)
    if value_scale not in SCALES:
        raise ValueError(f"`value_scale` must be one of {SCALES}, got {value_scale!r}")
    if value_scale == "mean" and bits != 1:
        raise ValueError(f"`value_scale`='mean' needs `bits`=1, got {bits!r}")
    codec = density_codec(density, chunk, bits, value_scale, sub_chunk)
    ef_decay = check_decay("ef_decay", ef_decay)  # 1: plain residual feedback
    averaging = resolve_averaging(averaging, strategy)
    min_size = check_int("min_size", min_size, 0)
    if not isinstance(clip, bool):
        raise TypeError(f"`clip` must be True or False, got {clip!r}")
    small_codec = check_small_for_size(check_small_codec(small_codec), min_size)
    feedback = exchange_feedback(
        codec,
        axis_name,
        strategy,
        ef_decay=ef_decay,
        min_size=min_size,
        averaging=averaging,
        clip=clip,
        small_codec=small_codec,
    )
    return feedback, codec


#: :func:`sparseloco`'s arguments of the per-device chunked top-k codec, at their defaults.
TOPK_DEFAULTS = (("chunk", 4096), ("bits", 2), ("value_scale", "max"), ("sub_chunk", None))


def refuse_topk_options(**given: Any) -> None:
    """With a shared mask the chunked top-k codec's arguments have no use: refuse one set
    away from its default, which would otherwise be ignored (``bits=1`` sending int4
    values), naming the argument and the fix (``value_codec``)."""
    for name, default in TOPK_DEFAULTS:
        if given[name] != default:
            raise ValueError(
                f"`{name}` applies to `mask`='topk' (the chunked top-k codec), got "
                f"`{name}`={given[name]!r} with a shared `mask`: the kept values go through "
                "`value_codec` (e.g. jc.int_quant(1) for one bit per value)"
            )


def masked_feedback(
    axis_name: Any,
    *,
    mask: str,
    density: Any,
    ef_decay: Any,
    min_size: Any,
    strategy: Any,
    averaging: Any,
    clip: Any,
    small_codec: Any,
    value_codec: Any,
    explore: Any,
    seed: Any,
) -> tuple[optax.GradientTransformation, Codec]:
    """:func:`sparseloco`'s exchange through a shared ``mask``
    (:func:`jaxcomp._src.shared_mask.shared_mask_feedback`) and its value codec, after
    checking the arguments (errors naming each)."""
    density = check_positive_float("density", density, upper=1.0)
    ef_decay = check_decay("ef_decay", ef_decay)  # 1: plain residual feedback
    min_size = check_int("min_size", min_size, 0)
    if averaging not in (None, "all"):
        raise ValueError(
            f"`averaging` must be None or 'all' with a shared `mask` (the kept values are "
            f"summed over every device), got {averaging!r}"
        )
    if clip is not False:
        raise ValueError("`clip` needs `mask`='topk' (each device's own payload, all-gathered)")
    if small_codec is not None:
        raise ValueError("`small_codec` needs `mask`='topk': with a shared mask pass `min_size`=0")
    value_codec = int_quant(4) if value_codec is None else value_codec
    if not isinstance(value_codec, Codec) or not value_codec.dense:
        raise ValueError(
            "`value_codec` must be a dense jaxcomp codec (e.g. jc.int_quant(4)), got "
            f"{value_codec!r}"
        )
    if strategy not in ("allreduce", "allgather", "two_phase", "auto"):
        raise ValueError(
            "`strategy` must be 'two_phase', 'allgather', 'allreduce' or 'auto' with a shared "
            f"`mask`, got {strategy!r}"
        )
    explore = check_fraction("explore", shared_mask.default_explore(mask, explore))
    if explore and mask != "previous":
        raise ValueError(f"`explore` applies to `mask`='previous', got `mask`={mask!r}")
    feedback = shared_mask.shared_mask_feedback(
        value_codec,
        axis_name,
        mask=mask,
        density=density,
        ef_decay=ef_decay,
        min_size=min_size,
        strategy=strategy,
        explore=explore,
        seed=check_int("seed", seed, 0),
    )
    return feedback, value_codec


def exchange_of(axis_name: Any, mask: str, strategy: Any, topk: dict, common: dict) -> tuple:
    """``(feedback, codec)`` of the pseudo-gradient's exchange: :func:`topk_feedback` (each
    replica's own top-k, ``strategy`` default ``"allgather"``) for ``mask="topk"``, else
    :func:`masked_feedback` (a mask every replica shares, default ``"two_phase"``), which
    refuses the top-k codec's options (``topk``: ``chunk``, ``bits``, ``value_scale``,
    ``sub_chunk``)."""
    if shared_mask.check_mask(mask) != "topk":
        refuse_topk_options(**topk)
        strategy = "two_phase" if strategy is None else strategy
        return masked_feedback(axis_name, mask=mask, strategy=strategy, **common)
    strategy = "allgather" if strategy is None else strategy
    return topk_feedback(axis_name, strategy=strategy, **topk, **common)


def sparseloco(
    inner: optax.GradientTransformation,
    axis_name: Any,
    sync_every: int | tuple[int, ...],
    *,
    density: float = 64 / 4096,
    chunk: int = 4096,
    bits: int | None = 2,
    ef_decay: float = 0.5,
    outer: optax.GradientTransformation | None = None,
    averaging: str | None = None,
    strategy: str | None = None,
    min_size: int = 1024,
    clip: bool = False,
    value_scale: str = "max",
    small_codec: Codec | None = None,
    mask: str = "topk",
    value_codec: Codec | None = None,
    explore: float | None = None,
    seed: int = 0,
    shard_axis: Any = None,
    sub_chunk: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""SparseLoCo: ``H`` inner steps per device, then the pseudo-gradient with decayed error
    feedback, top-k inside fixed chunks and 2-bit values, averaged and applied to the anchor.

    Params are per-device replicas (:func:`jaxcomp.replica_params`), as for
    :func:`jaxcomp.diloco`. With ``H = sync_every``, ``beta = ef_decay`` and ``C`` the
    chunked top-k codec (:func:`jaxcomp.chunked_top_k`: ``k = ceil(density * chunk)`` per
    chunk, ``bits``-bit values)::

        theta_i <- theta_i + inner(g_i)                       # every step, on each device
        every H steps:
          D_i  = x - theta_i                                   # the pseudo-gradient
          e_i <- beta e_i + D_i                                # decayed error feedback
          Delta = merge_i C(e_i);  e_i <- e_i - C(e_i)         # mean over the senders
          x    <- x - Delta            (or x + outer(Delta))   # no outer momentum by default
          theta_i <- x                                         # every device restarts

    The payloads travel in one all-gather (indices in ``ceil(log2 chunk)`` bits, values in
    ``bits`` bits, a float32 scale per chunk): at the defaults 116 bytes per 4096 values.
    By default each coordinate's mean is over the devices that sent it (Templar's merge),
    not over all of them (``averaging="all"``). Leaves under ``min_size`` values are
    averaged exactly by ``pmean``. The decayed error feedback takes the place of DiLoCo's
    outer Nesterov momentum. Non-finite values behave as in :func:`jaxcomp.diloco`: a sync
    whose mean is not finite leaves the whole state (error feedback too) as it was.

    Args:
      inner: the optax transform each device runs on its own gradients (e.g.
        ``optax.adamw(1e-3)``), its lr held at the peak after a warm-up rather than decayed
        (as for :func:`jaxcomp.diloco`), learning rate included: nothing may follow this
        transform in an ``optax.chain`` (``jc.sharded_init`` refuses it).
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      sync_every: ``H``, inner steps between outer steps (Covenant-72B: 30); or a
        sequence of intervals, the last one repeated (as :func:`jaxcomp.diloco`'s).
      density: fraction of each chunk sent, in (0, 1] (default 64 / 4096 = 1.56%). Its
        ratio of bytes depends on the model's leaves: :func:`jaxcomp.sparseloco_density`
        sizes it for a ratio on given params, :func:`jaxcomp.sparseloco_ratio` gives it.
      chunk: values per chunk (default 4096 = 64 x 64; indices take ``ceil(log2 chunk)`` bits).
      bits: bits per sent value, in [1, 8] (default 2), or None for float32 values.
      ef_decay: ``beta`` in [0, 1], the error feedback's decay (default 0.5; 1: plain
        residual error feedback, nothing lost; SparseLoCo's paper and Templar: 0.95); a
        number, or a 0-d float array (``optax.inject_hyperparams``; checked where concrete). What a
        device does not send stays in its memory for about ``1 / (1 - beta)`` syncs: 2 at
        0.5, 20 at 0.95. On runs of tens of outer steps the pseudo-gradients shrink several
        times over the run, and a long memory makes the largest entries it sends stale
        (the applied step grows far beyond the current pseudo-gradients); 0.95 suits runs of
        thousands of outer steps, and replicas that are data-parallel groups: on the LM
        benchmark 0.95 ends closer to AdamW than 0.5 on 2 replicas of 4 devices and far
        behind it on 8 one-device replicas (docs, "Language models over slow links:
        the measurements", SparseLoCo).
      outer: None (``x <- x - Delta``, an outer lr of 1) or an optax transform fed ``Delta``
        (e.g. ``optax.sgd(0.7)`` for a smaller outer lr).
      averaging: ``"senders"`` (per coordinate, the mean over the devices that sent it:
        Templar's merge), ``"all"`` (the mean over every device: a coordinate one device
        sent counts ``1 / n``), or None (the default: ``"senders"`` with the all-gather,
        ``"all"`` with two-phase, which sums the payloads and cannot count senders).
      strategy: None (the default: ``"allgather"`` with ``mask="topk"``, ``"two_phase"``
        with a shared mask), ``"allgather"`` (every device's payload to every device,
        SparseLoCo's) or
        ``"two_phase"`` (:func:`jaxcomp.compressed_allreduce`'s reduce-scatter style: each
        device owns ``1/n`` of every leaf, sums what the others sent of it, sends that sum
        again through the codec; its second error stays in a server residual, not decayed;
        ``averaging`` must be ``"all"``). All-gather costs each device ``(n - 1) P`` bytes,
        two-phase about ``2 (n - 1) / n P``.
      min_size: leaves with fewer values go through a float32 ``pmean`` (or
        ``small_codec``), >= 0.
      clip: scale each device's payload of each leaf down to the norm of its pseudo-gradient
        of this sync, ``|C(e_i)| <= |D_i|`` (:func:`clip_factor`; what is not sent stays in
        the memory). Only with ``strategy="allgather"``.
      value_scale: the per-chunk scale of the sent values (:func:`jaxcomp.chunked_top_k`'s
        ``scale``): ``"max"`` (their largest magnitude), or with ``bits=1`` ``"mean"`` (each
        sent as ``mean |v| sign(v)``).
      small_codec: None (leaves under ``min_size`` in float32, exact) or a dense codec
        for them, e.g. ``jc.sign()`` (every value's sign at their mean magnitude, ``d / 8 +
        4`` bytes for ``d`` values: little more than a top-k payload of a few values, whose
        indices and values are rounded up to whole uint32 words), with the same decayed
        error feedback, averaged over all devices. Only with ``strategy="allgather"`` and a
        ``min_size`` > 0 (with 0 no leaf is small: refused, not ignored).
      mask: which coordinates each device sends. ``"topk"`` (the default, SparseLoCo's):
        its own chunked top-k, indices on the wire. Or a mask every device derives alone,
        the same ``ceil(density d)`` coordinates of every leaf on every device, so no index
        travels and the kept values are summed through ``value_codec`` and ``strategy``
        (two-phase: about ``2 (n - 1) / n`` of the payload, not ``(n - 1)`` payloads):
        ``"random"`` (drawn from a key shared by every device, folded with the sync count,
        as ``jc.random_k``'s indices) or ``"previous"`` (the largest magnitudes of the
        previous sync's merged update, a share ``explore`` of them drawn at random; random
        at the first sync; that update is zero outside the last mask, so without
        ``explore`` the mask keeps its coordinates sync after sync and the others,
        rarely sent, decay in the memory: ``explore`` defaults to 0.5 there). With a shared
        mask the mean is over all devices
        (``averaging`` None or ``"all"``), and ``clip``, ``small_codec`` and ``chunk``,
        ``bits``, ``value_scale``, ``sub_chunk`` away from their defaults are refused (module
        :mod:`jaxcomp._src.shared_mask`).
      value_codec: with a shared mask, the dense codec of the kept values (default
        ``jc.int_quant(4)``: 4 bits and a float32 scale per 256 values).
      explore: with ``mask="previous"``, the share of the kept coordinates drawn at random
        instead of from the previous update, in [0, 1). None (the default): 0.5 with
        ``mask="previous"`` (:data:`jaxcomp._src.shared_mask.PREVIOUS_EXPLORE`), 0 with the
        others. At 0 the mask hardly moves (the previous update is zero outside the last
        mask); the measurements: docs, "a mask shared by every replica".
      seed: with a shared mask, seeds the key every device draws the mask from (the same on
        every device of a run; two runs or jobs with different seeds draw different masks).
        The key, ``jax.random.PRNGKey(seed)``, is state (the shared-mask state's ``key``,
        replicated like its count), so in a multi-process run :func:`jaxcomp.sharded_init`
        compares it across the processes and refuses a per-process seed (e.g.
        ``seed=jax.process_index()``), naming the leaf ``exchange[0].key``.
        Default 0, the key of ``jax.random.PRNGKey(0)`` used before the argument existed
        (the same masks, bit for bit). Only 0 with ``mask="topk"``, which draws nothing.
      shard_axis: the mesh axis (or tuple) over which the params are FSDP shards inside each
        replica, as :func:`jaxcomp.diloco`'s: the non-finite flags are or-ed over it, so a
        non-finite shard skips the sync of every shard (needed under ``check_vma=False``,
        where the update warns without it; ``()``: the params are whole). The top-k, its
        scales and ``clip`` stay per shard.
      sub_chunk: None (the default: the top-k over each chunk) or the values of each
        sub-chunk the top-k runs in, a divisor of ``chunk``: ``ceil(density * sub_chunk)``
        kept in each, indices in ``ceil(log2 sub_chunk)`` bits, one scale per chunk still
        (:func:`jaxcomp.chunked_top_k`'s ``sub_chunk``). With 1-bit values a sent value
        costs ``ceil(log2 sub_chunk) + 1 + 32 / k`` bits: ``chunk=1536, sub_chunk=24,
        density=2 / 24`` (``k = 128``) 5 + 1 + 0.25 = 6.25, where ``chunk=1024`` without
        costs 10 + 1 + 32 / 47 = 11.7 at ``k = 47``, so about the same bytes send 85 of each
        1024 values instead of 47 (size ``density`` with :func:`jaxcomp.sparseloco_density`
        given the same ``chunk`` and ``sub_chunk``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`SparseLoCoState`.

    Raises:
      ValueError: at construction, ``sync_every``, ``density``, ``chunk``, ``bits``, ``ef_decay``,
        ``averaging``, ``strategy``, ``min_size``, ``value_scale``, ``small_codec``, ``clip``,
        ``mask``, ``value_codec``, ``explore``, ``seed`` or ``sub_chunk`` outside its rule (the
        message names the argument; the rules: docs/errors.md), e.g. ``small_codec`` with
        ``min_size=0``; when traced, ``shard_axis`` not bound there or holding ``axis_name``,
        or ``inner`` returning an update that differs per device where its param is typed the
        same.
      TypeError: at construction, ``inner``, ``outer``, ``sync_every``, ``density``, ``chunk``,
        ``bits``, ``ef_decay``, ``min_size``, ``clip``, ``small_codec``, ``explore``, ``seed``,
        ``shard_axis`` or ``sub_chunk`` of the wrong kind.

    Example::

        tx = jc.sparseloco(optax.adamw(1e-3), "data", sync_every=30)
        replicas = jc.replica_params(params, mesh, "data")
        opt_state = jc.sharded_init(tx, params, mesh, "data")
        # the step is DiLoCo's: jc.own(replicas), grad, tx.update(g, opt_state, p), jc.slot

    References:
      Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
      SparseLoCo", arXiv 2508.15706, 2025; Templar, "Covenant-72B", arXiv 2603.08163, 2026;
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
      Models", 2023.
    """
    inner = periodic.check_transform("inner", inner)
    if outer is not None:
        outer = periodic.check_transform("outer", outer)
    sync_every, early = periodic.split_sync_every(periodic.check_common(sync_every)[0])
    common = dict(
        density=density,
        ef_decay=ef_decay,
        min_size=min_size,
        averaging=averaging,
        clip=clip,
        small_codec=small_codec,
        value_codec=value_codec,
        explore=explore,
        seed=seed,
    )
    topk = dict(chunk=chunk, bits=bits, value_scale=value_scale, sub_chunk=sub_chunk)
    feedback, codec = exchange_of(axis_name, mask, strategy, topk, common)
    cfg = _Config(
        name="sparseloco",
        state_type=SparseLoCoState,
        inner=inner,
        axis_name=axis_name,
        sync_every=sync_every,
        outer=outer,
        codec=codec,
        error_feedback=None,
        feedback=feedback,
        early=early,
        shard_axis=shards.check_shard_axis(shard_axis),
        # read by init's nothing-compressed warning: with a small_codec every leaf is coded
        options=(("min_size", min_size if small_codec is None else 0),),
    )
    return periodic.make(cfg)
