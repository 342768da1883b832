"""1-bit Adam (Tang et al., 2021): Adam whose momentum, once the variance is frozen, is
exchanged through a 1-bit codec with worker and server error feedback."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import collectives, shards, skeleton
from jaxcomp._src.axes import varying_axes
from jaxcomp._src.codecs.base import (
    F32_MAX,
    Codec,
    check_scalar_array,
    folded_sum,
    is_number,
    saturating_square,
)
from jaxcomp._src.codecs.sign import sign
from jaxcomp._src.compressed_allreduce import (
    CompressedAllreduceState,
    compressed_allreduce,
    late_residual_memory,
)
from jaxcomp._src.older_states import FRESH
from jaxcomp._src.sgd import exchange_options


class OneBitAdamState(NamedTuple):
    """State of :func:`onebit_adam`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      count: int32[]: finite steps taken (the schedule's step: warm-up, freeze)
      mu: identical on every device, f32 like the params: the (synchronized) momentum
      nu: identical on every device, f32 like the params: the variance, frozen later
      level: identical on every device, f32[] per leaf: EMA of the devices' mean g_i^2
      level_ref: identical on every device, f32[] per leaf: level_hat when nu last moved
      exchange: the momentum's exchange: per-device error feedback
    """

    count: jax.Array
    mu: Any
    nu: Any
    level: Any
    level_ref: Any
    exchange: CompressedAllreduceState

    PER_DEVICE_FIELDS = ()  # the per-device memories are the exchange's own fields
    #: Added since the first release (:func:`jaxcomp.complete_state`): a fresh state's zero
    #: levels; a zero ``level_ref`` is "no reference yet" (ratio 1: the variance unscaled).
    ADDED_FIELDS = {"level": FRESH, "level_ref": FRESH}


def check_number(name: str, value: Any, lo: float, hi: float, *, integer: bool = False) -> Any:
    """``value`` in ``[lo, hi)``, an int where ``integer``; arrays (injected hyperparameters)
    are checked where concrete."""
    if isinstance(value, jax.Array):
        check_scalar_array(name, value)
    if isinstance(value, jax.core.Tracer):
        return value
    if not (is_number(value) or isinstance(value, jax.Array)):
        raise TypeError(f"`{name}` must be a number, got {type(value).__name__} {value!r}")
    number = float(value)
    if integer and number != int(number):
        raise TypeError(f"`{name}` must be an integer, got {value!r}")
    if not lo <= number < hi:
        raise ValueError(f"`{name}` must be in [{lo}, {hi}), got {value!r}")
    return value


def filled_variance(nu: Any) -> Any:
    """The frozen variance with each zero coordinate given its leaf's mean nonzero variance.

    A coordinate whose gradient was zero through the whole warm-up (the embedding row of a
    token not yet seen, a feature that appears later) has ``v = 0`` when the variance
    freezes: left at zero it could never move again (a zero preconditioner), and ``eps``
    alone would scale its 1-bit momentum by ``1 / eps``. Its leaf's mean variance is the
    preconditioner of a typical coordinate of the same tensor: the coordinate then learns
    at Adam's usual step size. A leaf whose variance is zero everywhere stays zero (its
    update is zero). Identical on every device, like ``nu``.
    """

    def one(v):
        mean = positive_mean(v)
        return jnp.where(v > 0, v, mean)

    return jax.tree.map(one, nu)


def positive_mean(v: jax.Array) -> jax.Array:
    """The mean of the positive entries of ``v`` (0 if none), never above ``F32_MAX``.

    Summed pre-scaled (``v / size``) through :func:`~jaxcomp._src.codecs.base.folded_sum`:
    the sum and the count read ``v`` where it is produced, without writing a float32 and an
    int32 temporary as large as ``v``."""
    flat = v.reshape(1, -1)
    positive = flat > 0
    size = max(flat.shape[1], 1)
    total = folded_sum(jnp.where(positive, flat * (1.0 / size), 0.0))
    count = folded_sum(positive.astype(jnp.int32))
    scale = size / jnp.maximum(count, 1).astype(jnp.float32)
    return jnp.minimum(total * scale, F32_MAX)


def local_levels(grads: Any, every_axis: Any) -> Any:
    r"""Per leaf, the second moment of the devices' gradients, ``mean_i mean_j g_{i,j}^2``:
    one float32 per leaf on the wire (a ``pmean`` of a vector of them).

    Each term is saturated and pre-scaled (``min(g^2, F32_MAX) / size``, then ``/ n``
    before the sum), so a finite gradient gives a finite level; a non-finite one a
    non-finite level. Integer leaves give 0. Where the leaves are FSDP shards of one model
    (:func:`jaxcomp._src.shards.shard_axes`: typed, or ``shard_axis``) the mean is over
    their shards too (equal shards: the whole leaf's), the same level on every shard.
    """
    leaves, treedef = jax.tree.flatten(grads)
    if leaves:
        every_axis = (*collectives.axis_names(every_axis), *_shard_axes(leaves, every_axis))
    n = collectives.axis_size(every_axis)

    def one(g):
        if not jnp.issubdtype(g.dtype, jnp.floating) or g.size == 0:
            return jnp.zeros([], jnp.float32)
        return folded_sum(saturating_square(g.astype(jnp.float32)) / (g.size * n))

    if not leaves:  # an empty tree: no level, and no empty all-reduce
        return jax.tree.unflatten(treedef, [])
    local = jnp.stack([one(g) for g in leaves])
    return jax.tree.unflatten(treedef, list(jax.lax.psum(local, every_axis)))


def _shard_axes(leaves: list, every_axis: Any) -> tuple:
    """The axes beside ``every_axis`` over which the leaves are shards of one model."""
    axes = set().union(*(shards.shard_axes(g, every_axis) for g in leaves))
    return tuple(sorted(axes, key=str))


def tracked_levels(
    grads: Any, level: Any, level_ref: Any, moves: jax.Array, count: jax.Array, b2, every_axis
) -> tuple[Any, Any, Any, Any]:
    r"""The per-leaf levels after this step: ``(level, level_ref, ratio_before, ratio)``.

    ``level <- b2 level + (1 - b2) s_t`` (``s_t``: :func:`local_levels`, capped at
    ``F32_MAX``); where the variance ``moves`` this step, ``level_ref`` becomes the
    bias-corrected ``level_hat = level / (1 - b2^(count + 1))``, else it is kept. ``ratio``
    is ``level_hat / level_ref`` (1 where the variance moved, or where ``level_ref`` is
    zero or the quotient not finite), ``ratio_before`` the same against the old reference.
    """
    scale = 1.0 / (1.0 - b2 ** (count + 1).astype(jnp.float32))
    level = jax.tree.map(
        lambda a, x: jnp.minimum(b2 * a + (1.0 - b2) * x, F32_MAX),
        level,
        local_levels(grads, every_axis),
    )
    # Saturated: ``level`` near F32_MAX times the bias correction (1000 at the first step,
    # b2 = 0.999) was inf, and a frozen variance kept the inf reference for good.
    new_ref = jax.tree.map(
        lambda a, r: jnp.where(moves, jnp.minimum(scale * a, F32_MAX), r), level, level_ref
    )
    return level, new_ref, level_ratio(level, level_ref, scale), level_ratio(level, new_ref, scale)


def level_ratio(level: Any, level_ref: Any, level_scale) -> Any:
    r"""Per leaf ``level_hat / level_ref`` (``level_hat = level_scale * level``): how far the
    gradients' second moment moved since the variance last did; 1 where ``level_ref`` is
    zero (a leaf without a gradient yet) or where the quotient is not finite or zero."""

    def one(a, ref):
        ratio = level_scale * a / jnp.where(ref > 0, ref, 1.0)
        return jnp.where((ref > 0) & jnp.isfinite(ratio) & (ratio > 0), ratio, 1.0)

    return jax.tree.map(one, level, level_ref)


def adam_direction(
    mu: Any,
    nu: Any,
    like: Any,
    mu_scale,
    nu_scale,
    eps,
    bad,
    filled: bool = False,
    floor: Any = None,
) -> Any:
    """``mu_hat / (sqrt(nu_hat) + eps)`` per leaf in the dtype of ``like``, with ``nu`` the
    :func:`filled_variance` (``sqrt(nu_hat)`` at least ``floor``, per leaf, where given:
    :func:`variance_floor`); zero where ``nu`` is still zero (a leaf whose gradient was always
    zero: a 1-bit momentum gives it +-scale, which ``eps`` would blow up by 1e8), and NaN
    everywhere when ``bad``."""

    def one(m, v, g, k, f=None):
        d = mu_scale * (m / adam_denominator(v, k, eps, f))
        return collectives.poison(jnp.where(v > 0, d, 0.0), bad).astype(g.dtype)

    nu = nu if filled else filled_variance(nu)
    args = (mu, nu, like, per_leaf(nu_scale, like))
    return jax.tree.map(one, *args) if floor is None else jax.tree.map(one, *args, floor)


def adam_step_bound(count: jax.Array, b1, b2) -> jax.Array:
    r"""Adam's own bound on a coordinate's preconditioned momentum at step ``count``:
    ``|m_t| / sqrt(v_hat_t) <= C sqrt(1 - b2^t)``, ``t = count + 1``, with
    ``C = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))`` (7.27 at Adam's 0.9 / 0.999; infinite
    where ``b1^2 >= b2``).

    By Cauchy-Schwarz on ``m_t = (1 - b1) sum_s b1^(t-s) g_s`` against
    ``v_t = (1 - b2) sum_s b2^(t-s) g_s^2``: Adam's variance includes the gradient that moves
    its momentum, so no coordinate's step exceeds it, however small its earlier gradients.
    A variance frozen or sampled between rounds has no such guard (see
    :func:`bounded_step`)."""
    b1 = jnp.asarray(b1, jnp.float32)
    b2 = jnp.asarray(b2, jnp.float32)
    room = 1.0 - b1 * b1 / b2
    c = (1.0 - b1) / jnp.sqrt((1.0 - b2) * jnp.where(room > 0, room, 1.0))
    t = (jnp.asarray(count, jnp.int32) + 1).astype(jnp.float32)
    return jnp.where(room > 0, c * jnp.sqrt(1.0 - b2**t), jnp.inf)


def variance_floor(level: Any, count: jax.Array, b1, b2) -> Any:
    r"""Per leaf, the smallest ``sqrt(v_hat)`` of the compression stage:
    ``(1 - b1) sqrt(L_hat) / (C sqrt(1 - b2^t))``, ``t = count + 1``, ``L_hat = level /
    (1 - b2^t)`` the devices' mean squared gradient of the leaf (:func:`tracked_levels`),
    ``C`` :func:`adam_step_bound`'s (the floor 0 where ``b1^2 >= b2``, ``b1 = b2 = 0``
    included: no bound there, as :func:`adam_step_bound`'s inf). Computed as ``sqrt((1 - b2)
    (1 - b1^2 / b2)) sqrt(level) / (1 - b2^t)``: finite for every finite level.

    A coordinate whose variance is stale and tiny (the embedding row of a rare token, its
    gradient near zero where the variance last moved) and whose gradient then comes back at
    its usual size gets a preconditioned step thousands of times Adam's: one such value sets
    the root mean square of its whole chunk of 1-bit signs, and every coordinate of the chunk
    moves by it (docs, "Steps within Adam's bound"). Under this floor a gradient at the
    leaf's root-mean-square level moves the preconditioned momentum by at most Adam's own
    bound (``(1 - b1) |g| / floor = C sqrt(1 - b2^t) |g| / sqrt(L_hat)``), as Adam's variance,
    which takes that gradient in, would. The floor is identical on every device and the
    preconditioner stays linear: the mean of the devices' steps is the preconditioned mean
    gradient, zero where the mean loss is stationary, however much the devices' own
    gradients differ there (a clip of each device's step is not: its mean is biased where
    they differ beyond the bound)."""
    b1 = jnp.asarray(b1, jnp.float32)
    b2 = jnp.asarray(b2, jnp.float32)
    room = (1.0 - b2) * (1.0 - b1 * b1 / b2)  # NaN at b1 = b2 = 0 (0 / 0): no floor there
    room = jnp.where(room > 0, room, 0.0)
    t = (jnp.asarray(count, jnp.int32) + 1).astype(jnp.float32)
    scale = jnp.sqrt(room) / (1.0 - b2**t)
    return jax.tree.map(lambda a: scale * jnp.sqrt(a), level)


def bounded_step(u: jax.Array, bound) -> jax.Array:
    """``u`` (the devices' mean momentum step in preconditioned units, identical on every
    device) clipped to ``[-bound, bound]`` where finite: a non-finite value passes as it is
    (never hidden). Adam never steps beyond :func:`adam_step_bound`; neither does this. A
    clip of the mean, not of each device's step: where the mean loss is stationary the mean
    step is zero and passes unchanged."""
    return jnp.where(jnp.isfinite(u), jnp.clip(u, -bound, bound), u)


def per_leaf(scale: Any, like: Any) -> Any:
    """``scale`` as a tree like ``like``: a scalar repeated, or a tree of scalars as it is."""
    if jax.tree.structure(scale) == jax.tree.structure(like):
        return scale
    return jax.tree.map(lambda _: scale, like)


def unprecondition(u: jax.Array, v: jax.Array, k, eps, floor=None) -> jax.Array:
    """``u * (sqrt(k v) + eps)`` where ``v > 0`` (0 elsewhere): a momentum sent in Adam's
    preconditioned units back in its own (``v`` filled, ``k`` its bias correction),
    saturating at ``+-F32_MAX`` where ``u`` is finite (:func:`saturate`).

    A finite ``u`` (the step the devices agreed on) times a large ``sqrt(k v)`` (the variance
    of a coordinate that just took an outlier) can overflow: the momentum then held inf
    while the step was finite and its flag clear, and every later step read it, non-finite,
    and was skipped: the state frozen for good."""
    return jnp.where(v > 0, saturate(u * adam_denominator(v, k, eps, floor), u), 0.0)


def adam_denominator(v: jax.Array, k, eps, floor=None) -> jax.Array:
    """``sqrt(k v) + eps`` as ``min(sqrt(k) sqrt(v), F32_MAX) + eps``: finite for every
    ``v >= 0`` and ``k >= 0`` (``k v`` overflows where a saturated ``v``, ``F32_MAX``, meets
    a bias correction ``k > 1``: an inf square root makes the coordinate's step 0 and, turned
    back by :func:`unprecondition`, its momentum NaN). ``floor`` (None: none): the square
    root at least that (:func:`variance_floor`)."""
    root = jnp.sqrt(k) * jnp.sqrt(v)
    root = root if floor is None else jnp.maximum(root, floor)
    return jnp.minimum(root, F32_MAX) + eps


def preconditioner(v: jax.Array, k, eps, floor=None) -> jax.Array:
    """``1 / (sqrt(k v) + eps)`` where ``v > 0``, 0 elsewhere (:func:`adam_denominator`): a
    momentum times it is in Adam's preconditioned units ``u_i = m_i / (sqrt(nu_hat) + eps)``,
    the units both recipes send it in (turned back by :func:`unprecondition`).

    With the variance frozen (identical on every device) this is a fixed per-coordinate
    change of units, so the mean is the same; but the codec's error (and the error-feedback
    memory) then lives where the update does: a 1-bit momentum sent as it is gives every
    coordinate of a leaf the same magnitude, and coordinates of small variance turn that into
    huge steps. ``v`` is the :func:`filled_variance` (a coordinate unseen during the warm-up
    takes its leaf's mean); a leaf whose variance is zero everywhere sends and keeps nothing
    (its update is zero)."""
    return jnp.where(v > 0, 1.0 / adam_denominator(v, k, eps, floor), 0.0)


def momentum_step(m: jax.Array, x: jax.Array, b1) -> jax.Array:
    """Adam's ``b1 m + (1 - b1) x``, saturating where ``x`` is finite (:func:`saturate`)."""
    return saturate(b1 * m + (1.0 - b1) * x, x)


def saturate(x: jax.Array, source: jax.Array) -> jax.Array:
    """``x`` clipped to ``[-F32_MAX, F32_MAX]`` where ``source`` is finite, else ``x`` as it
    is: a sum or product of finite values that overflows saturates (finite state stays
    finite), while a non-finite input stays non-finite (never hidden)."""
    return jnp.where(jnp.isfinite(source), jnp.clip(x, -F32_MAX, F32_MAX), x)


def momentum_exchange(name: str, codec: Codec | None, axis_name: Any, exchange: dict):
    """The ``compressed_allreduce`` that carries a 1-bit Adam momentum (residual feedback,
    ``jc.sign(scale="rms", exact_zeros=True)`` by default) and the axes of its float32
    rounds."""
    options = {"error_feedback": "residual", **exchange_options(exchange)}
    for option in ("worker_momentum", "worker_nesterov"):
        if option in options:
            raise TypeError(f"jc.{name} keeps its own momentum: drop `{option}`")
    if options.get("shard_axis") is None:  # the recipe warns itself (recipe_shard_axis)
        options["shard_axis"] = ()
    codec = sign("rms", exact_zeros=True) if codec is None else codec
    inner = compressed_allreduce(codec, axis_name, **options)
    every_axis = collectives.axis_names(axis_name, options.get("inner_axis_name"))
    return inner, every_axis


def recipe_shard_axis(update: Any, name: str, every_axis: Any, exchange: dict) -> Any:
    """``update`` of a recipe traced with its ``shard_axis`` (an option of its exchange) in
    force (:func:`jaxcomp._src.shards.with_shard_axis`): its own non-finite flag, formed
    after the round, is or-ed over the shards by :func:`~jaxcomp._src.shards.any_shard`."""
    shard_axis = shards.check_shard_axis(exchange_options(exchange).get("shard_axis"))
    return shards.with_shard_axis(update, f"jc.{name}", every_axis, shard_axis)


def memory_after(codec: Codec | None, axis_name: Any, exchange: dict):
    """:func:`~jaxcomp._src.compressed_allreduce.late_residual_memory` of
    :func:`momentum_exchange`'s exchange: None where it forms its memory otherwise (other
    options; memories narrower than float32 stay in the round)."""
    options = {"error_feedback": "residual", **exchange_options(exchange)}
    codec = sign("rms", exact_zeros=True) if codec is None else codec
    return late_residual_memory(codec, axis_name, options)


class BranchExchange(NamedTuple):
    """The momentum's exchange as one branch of a ``lax.cond`` / ``lax.switch`` (the rounds
    of :func:`onebit_adam` and :func:`~jaxcomp.zero_one_adam`), its worker memory formed
    after the branch (:func:`memory_after`; where that is None, in the branch).

    Returned from the branch, the new memory left it in a buffer of its own beside the
    branch's operand and the exchanged mean (and the other branches copied the old one out).
    The sending branch returns this device's payloads instead (a thirty-second of the
    memory's bytes for signs; the other branches zeros), and ``e' = (y + e) -
    decode(payload)`` is written after it, in place in the donated memory, from the branch's
    own operand ``y``: the same bits as the round's (``Codec.encode_with_error``)."""

    inner: optax.GradientTransformation  # momentum_exchange's compressed_allreduce
    late: Any  # memory_after(...): (capture, memory), or None
    every_axis: Any  # the axes of the exchange
    traced: Any = None  # jax.jit(self.round) (:meth:`make`), or None: self.round

    @classmethod
    def make(cls, inner: Any, late: Any, every_axis: Any) -> BranchExchange:
        """The exchange whose round is one ``jax.jit``: traced once per step, however many
        branches call :meth:`send` or :meth:`idle` (each branch traced the whole exchange
        again: :meth:`idle` for the payloads' shapes; 0/1 Adam's step traced it three
        times). XLA inlines the call: the compiled step is the same."""
        rounds = cls(inner, late, every_axis)
        return rounds._replace(traced=jax.jit(rounds.round))

    def send(self, y: Any, exchange_state: Any, params: Any) -> tuple[Any, Any, list]:
        """``inner.update(y)``: ``(mean, exchange state, this device's payloads)``; the state
        without its memory where that is formed after the branch (:meth:`with_memory`)."""
        return (self.traced or self.round)(y, exchange_state, params)

    def round(self, y: Any, exchange_state: Any, params: Any) -> tuple[Any, Any, list]:
        """:meth:`send`, traced."""
        if self.late is None:
            return (*self.inner.update(y, exchange_state, params), [])
        (x, new_state), payloads = self.late[0](self.inner.update, y, exchange_state, params)
        return x, self.without_memory(new_state), payloads

    def idle(self, y: Any, exchange_state: Any, params: Any) -> tuple[Any, list]:
        """What a branch that sends no momentum returns in place of :meth:`send`'s state and
        payloads: the state as it was (without its memory, as :meth:`send`'s) and zero
        payloads (varying over the axes, as the sending branch's)."""
        shapes = jax.eval_shape(lambda *a: self.send(*a)[2], y, exchange_state, params)
        # typed as the sending branch's: varying over the exchange's axes and over those
        # the payload varies on besides (FSDP shards under check_vma=True)
        zeros = jax.tree.map(
            lambda a: skeleton.varying_over(
                jnp.zeros(a.shape, a.dtype),
                {*collectives.axis_names(self.every_axis), *varying_axes(a)},
            ),
            shapes,
        )
        return self.without_memory(exchange_state), zeros

    def without_memory(self, exchange_state: Any) -> Any:
        return exchange_state if self.late is None else exchange_state._replace(memory=None)

    def with_memory(self, exchange_state: Any, y: Any, old: Any, keep, payloads: list) -> Any:
        """``exchange_state`` (the branch's) with its worker memory formed from ``y`` (the
        branch's operand), ``old`` (the exchange state before the round) and the payloads;
        ``old``'s memory where ``keep`` (a round that sent nothing, a non-finite step)."""
        if self.late is None:
            return exchange_state
        new = self.late[1](y, old, payloads)
        memory = jax.tree.map(lambda o, m: jnp.where(keep, o, m), old.memory, new)
        return exchange_state._replace(memory=memory)


def gradient_mean(grads: Any, every_axis: Any) -> Any:
    r"""The float32 mean of the devices' gradients, pre-scaled: ``sum_i (g_i / n)``, one
    ``psum`` per leaf, which XLA combines into a few all-reduces of tuples (no concatenated
    bucket: packing the leaves into buckets and slicing them out again cost two
    params-sized temporaries).

    Divided before the sum, a mean that fits float32 never overflows: ``jax.lax.pmean``'s
    ``sum / n`` made n finite gradients near ``F32_MAX / n`` an inf mean, and the step was
    skipped as non-finite. For ``n`` a power of two the same bits as ``jax.lax.pmean`` (a
    division by ``n`` is exact, above the subnormals). An empty leaf takes no part in the
    all-reduce (:func:`skeleton.tree_psum`)."""
    n = collectives.axis_size(every_axis)
    return skeleton.tree_psum(jax.tree.map(lambda g: g / n, as_float32(grads)), every_axis)


def adam_moments(mu: Any, nu: Any, g: Any, b1, b2) -> tuple[Any, Any]:
    """Adam's ``m <- b1 m + (1 - b1) g`` and ``v <- b2 v + (1 - b2) g^2``, both saturating
    (:func:`saturate`, the square too): a finite outlier never leaves ``m`` or ``v`` inf,
    frozen for ever."""
    mu = jax.tree.map(lambda m, x: momentum_step(m, x, b1), mu, g)
    nu = jax.tree.map(
        lambda v, x: jnp.minimum(b2 * v + (1.0 - b2) * saturating_square(x), F32_MAX), nu, g
    )
    return mu, nu


def zeros_f32(tree: Any) -> Any:
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), tree)


def as_float32(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def scale_by_onebit_adam(
    axis_name: Any,
    *,
    freeze_step: int,
    codec: Codec | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    rescale_variance: bool = True,
    adam_bound: bool = True,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    """The direction of :func:`onebit_adam` (before the learning rate); see there."""
    freeze_step = check_number("freeze_step", freeze_step, 1, float("inf"), integer=True)
    b1 = check_number("b1", b1, 0.0, 1.0)
    b2 = check_number("b2", b2, 0.0, 1.0)
    eps = check_number("eps", eps, 0.0, float("inf"))
    rescale = check_flag("rescale_variance", rescale_variance)
    bounded = check_flag("adam_bound", adam_bound)
    inner, every_axis = momentum_exchange("onebit_adam", codec, axis_name, exchange)
    inner_axis = exchange_options(exchange).get("inner_axis_name")

    def init_fn(params):
        zeros = zeros_f32(params)
        return OneBitAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=zeros,
            nu=zeros,
            level=zero_levels(params),
            level_ref=zero_levels(params),
            exchange=inner.init(params),
        )

    # The lax.cond returns one params-sized tree (the warm-up's mean gradient or the
    # compression stage's mean momentum) and the exchange state; Adam's moments are moved
    # outside it, in place. Returning mu and nu from the branches made XLA copy both out of
    # the cond's buffers (5.9 copies of temporaries against AdamW's 2.0).

    # The worker memory is formed after the cond (BranchExchange), in place in its donated
    # buffer, from this device's payloads, which the compressed branch returns.
    rounds = BranchExchange.make(inner, memory_after(codec, axis_name, exchange), every_axis)

    def warmup(y, state, params):
        """The float32 mean gradient over the devices (uncompressed; ``y`` holds each
        device's ``g_i / n``: the sum is the mean and never overflows where it fits, see
        :func:`gradient_mean`): Adam with the variance still learning."""
        return skeleton.tree_psum(y, every_axis), *rounds.idle(y, state.exchange, params)

    def compressed(y, state, params):
        """Each device's momentum step, averaged through the codec; the variance frozen.
        Returned in preconditioned units: turned back where mu is written (one pass)."""
        return rounds.send(y, state.exchange, params)

    def branch_input(grads, state, warm, nu_scale, floor):
        """What the round sends: the float32 gradient over ``n`` (warm-up: its sum is the
        mean, pre-scaled as :func:`gradient_mean`), or the momentum step
        ``b1 m + (1 - b1) g`` in preconditioned units (:func:`preconditioner`, the
        variance filled as it froze; ``adam_bound``: its square root at least the
        :func:`variance_floor`). Formed before the cond, it takes the gradient's buffer
        (the codec's input was a params-sized temporary of its own)."""

        def one(m, x, v, k, f=None):
            u = momentum_step(m, x, b1) * preconditioner(v, k, eps, f)
            return jnp.where(warm, x / n, u)

        n = collectives.axis_size(every_axis)
        args = (state.mu, as_float32(grads), state.nu, per_leaf(nu_scale, state.nu))
        return jax.tree.map(one, *args) if floor is None else jax.tree.map(one, *args, floor)

    def variance(state, warm, x, bad):
        """Warm-up: Adam's variance moved by the mean gradient ``x``; after: frozen. A
        non-finite step keeps it. The variance is filled as it freezes (a coordinate never
        seen takes its leaf's mean): after that it is a constant of the state, which the
        frozen steps return filled again (the same bits: no zero is left but in a leaf zero
        everywhere), so that a state restored past a ``freeze_step`` it never reached (saved
        with a larger one) is filled too; left at zero its unseen coordinates never moved."""
        nu = jax.tree.map(
            lambda v, g: jnp.minimum(b2 * v + (1.0 - b2) * saturating_square(g), F32_MAX),
            state.nu,
            x,
        )
        last = state.count == freeze_step - 1
        nu = jax.tree.map(lambda v, f: jnp.where(last, f, v), nu, filled_variance(nu))
        frozen = filled_variance(state.nu)
        return jax.tree.map(
            lambda a, f, v: jnp.where(bad, v, jnp.where(warm, a, f)), nu, frozen, state.nu
        )

    def momentum(state, warm, x, nu, nu_scale, bad, floor):
        """Warm-up: Adam's momentum moved by the mean gradient ``x``; after: ``mu = x``, sent
        in preconditioned units (``adam_bound``: clipped at :func:`adam_step_bound`, the
        mean, identical on every device) and turned back with the new ``nu`` (the frozen
        one, equal to the old: the old variance has no reader once the new one is written,
        so it is updated in place). A non-finite step keeps it."""

        def one(m, u, v, k, f=None):
            sent = bounded_step(u, bound) if bounded else u
            new = jnp.where(warm, momentum_step(m, u, b1), unprecondition(sent, v, k, eps, f))
            return jnp.where(bad, m, new)

        bound = adam_step_bound(state.count, b1, b2)
        args = (state.mu, x, nu, per_leaf(nu_scale, x))
        return jax.tree.map(one, *args) if floor is None else jax.tree.map(one, *args, floor)

    def frozen_scale(count):
        """Adam's bias correction of the variance, frozen at ``freeze_step``."""
        frozen_t = jnp.minimum(count + 1, freeze_step).astype(jnp.float32)
        return 1.0 / (1.0 - b2**frozen_t)

    def levels(grads, state, warm):
        """``(level, level_ref, nu_scale)``: the per-leaf levels moved by this step's
        gradients (:func:`tracked_levels`; the reference follows while the variance moves)
        and the variance's bias correction, times ``level_hat / level_ref`` per leaf where
        ``rescale_variance``. Neither ``rescale_variance`` nor ``adam_bound``: the state's
        levels as they were (nothing on the wire)."""
        if not (rescale or bounded):
            return state.level, state.level_ref, frozen_scale(state.count)
        level, ref, _, ratio = tracked_levels(
            as_float32(grads), state.level, state.level_ref, warm, state.count, b2, every_axis
        )
        if not rescale:
            return level, ref, frozen_scale(state.count)
        k = jax.tree.map(lambda r: jnp.minimum(frozen_scale(state.count) * r, F32_MAX), ratio)
        return level, ref, k

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        skeleton.begin("onebit_adam", updates, params, axis_name, inner_axis)
        skeleton.check_floating("onebit_adam", updates)
        like = jax.eval_shape(lambda: zeros_f32(updates))
        skeleton.check_fields("onebit_adam", state, {"mu": like, "nu": like}, updates=updates)
        warm = state.count < freeze_step
        level, level_ref, nu_scale = levels(updates, state, warm)
        floor = None
        if bounded:  # no floor in the warm-up (a floor of 0): Adam's own steps
            floor = variance_floor(level, state.count, b1, b2)
            floor = jax.tree.map(lambda f: jnp.where(warm, 0.0, f), floor)
        y = branch_input(updates, state, warm, nu_scale, floor)
        x, exchange_state, payloads = jax.lax.cond(warm, warmup, compressed, y, state, params)
        # The flag of what the round gave (identical on every device), read after the cond:
        # in the warm-up branch its partial sums added to the branch operand and its output.
        # Or-ed over the shards of one model (FSDP inside, shard_axis): every shard skips.
        bad = shards.any_shard(collectives.local_nonfinite(x))
        nu = variance(state, warm, x, bad)
        mu = momentum(state, warm, x, nu, nu_scale, bad, floor)
        # The worker memory: kept in the warm-up and on a non-finite step.
        exchange_state = rounds.with_memory(exchange_state, y, state.exchange, warm | bad, payloads)
        t = (state.count + 1).astype(jnp.float32)
        mu_scale = 1.0 / (1.0 - b1**t)
        new_state = OneBitAdamState(
            count=state.count + 1,
            mu=mu,
            nu=nu,
            level=level,
            level_ref=level_ref,
            exchange=exchange_state,
        )
        # mu and nu keep their old values on a non-finite step already (above).
        new_state = skeleton.freeze(bad, state, new_state._replace(mu=state.mu, nu=state.nu))
        new_state = new_state._replace(mu=mu, nu=nu)
        # A non-finite step: NaN everywhere (not just where the mean was), state kept. The
        # direction reads the frozen state (the same where the step is finite): the new
        # mu and nu then have one reader each, written once into the state's own buffers
        # (read before the freeze, each was a params-sized temporary).
        direction = adam_direction(
            new_state.mu,
            new_state.nu,
            updates,
            mu_scale,
            nu_scale,
            eps,
            bad,
            filled=True,
            floor=floor,
        )
        return direction, new_state

    update_fn = recipe_shard_axis(update_fn, "onebit_adam", every_axis, exchange)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def zero_levels(params: Any) -> Any:
    """One float32 zero per leaf (the per-leaf levels' initial state)."""
    return jax.tree.map(lambda _: jnp.zeros([], jnp.float32), params)


def check_flag(name: str, value: Any) -> bool:
    """``value`` must be a Python bool (it picks what is compiled), naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be True or False (a Python bool: it decides what is compiled), "
            f"got {type(value).__name__} {value!r}; under optax.inject_hyperparams pass it "
            f"as a bool (kept static) or name it in static_args"
        )
    return value


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: Any,
    *,
    freeze_step: int,
    codec: Codec | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    rescale_variance: bool = True,
    adam_bound: bool = True,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""1-bit Adam: Adam for ``freeze_step`` steps, then the variance frozen (rescaled per
    leaf) and the momentum exchanged through ``codec`` (1-bit signs) with error feedback.

    Adam's variance ``v`` is what makes its momentum hard to compress; 1-bit Adam observes
    that ``v`` becomes stable early, freezes it, and from then on Adam is momentum SGD with a
    fixed per-coordinate preconditioner, whose momentum compresses like EF-SGDM's::

        every step: L <- b2 L + (1 - b2) mean_i mean_j g_{i,j}^2   # per leaf: one float32
                                                    # per leaf on the wire (a pmean)
        warm-up (t < freeze_step), uncompressed:
            g  = mean_i g_i                         # float32 all-reduce
            m <- b1 m + (1 - b1) g
            v <- b2 v + (1 - b2) g^2;  L_f = L_hat  # the level when v last moved
        compression stage (t >= freeze_step), v frozen:
            m_i = b1 m + (1 - b1) g_i               # each device's momentum step
            s   = max(sqrt(v_hat), f) + eps         # f: per leaf, Adam's bound as a floor
            u_i = m_i / s                           # in preconditioned units
            m  <- s clip(mean_i C(u_i + e_i), +-C sqrt(1 - b2^t))   # Adam's bound on the
                                                    # mean; worker error e_i; two_phase
                                                    # adds the chunk owners' server error
            v_hat = v / (1 - b2^freeze_step) * L_hat / L_f    # per leaf (rescale_variance)
        x <- x - lr * (m_hat / s + wd * x)          # bias-corrected as Adam (warm-up:
                                                    # s = sqrt(v_hat) + eps); wd: AdamW's
                                                    # decoupled weight decay

    with ``L_hat = L / (1 - b2^t)``, ``f = (1 - b1) sqrt(L_hat) / (C sqrt(1 - b2^t))``
    (``adam_bound``, below; ``f = 0`` without it) and ``C(x) = (||x||_2 / sqrt(d))
    sign(x)`` by default (``jc.sign(scale="rms", exact_zeros=True)``, DeepSpeed's
    compressed momentum: 1 bit per coordinate, one float32 per chunk, and one bit per word
    of 32 that marks an all-zero word, which decodes to 0: the embedding rows of tokens
    never seen stay still, as under Adam, where a sign would move them by ``+-scale`` every
    round).

    **The variance's level follows the gradients.** A frozen ``v`` keeps the size of the
    early, large gradients: where the gradients keep shrinking after the freeze (a language
    model's do), the frozen preconditioner makes every later step too small. Each leaf's
    frozen ``v`` is therefore multiplied by ``L_hat / L_f``: the devices' mean squared
    gradient of that leaf (an EMA with Adam's ``b2`` and bias correction), now against its
    value at the freeze. The shape of ``v`` within a leaf stays frozen; only its level
    moves, from one float per leaf per step. ``rescale_variance=False`` freezes ``v`` as the
    paper does.

    **Steps within Adam's bound** (``adam_bound``, on by default). Adam's variance takes in
    the gradient that moves its momentum: by Cauchy-Schwarz on ``m_t = (1 - b1) sum_s
    b1^(t-s) g_s`` against ``v_t = (1 - b2) sum_s b2^(t-s) g_s^2``, every coordinate's
    ``|m_t| / sqrt(v_hat_t) <= C sqrt(1 - b2^t)``, ``C = (1 - b1) / sqrt((1 - b2)(1 - b1^2 /
    b2))`` (7.27 at the defaults), however small its earlier gradients. A frozen variance has
    no such guard: a coordinate whose gradient was near zero while ``v`` moved (a rare
    token's embedding row) and then comes back at its usual size is preconditioned into a
    step thousands of times Adam's, and that one value sets the root mean square of its
    whole chunk of 1-bit signs: every coordinate of the chunk moves by it. Two guards, both
    identical on every device, neither a clip of a device's own step: each leaf's
    ``sqrt(v_hat)`` is at least ``f`` (above), so that a gradient at the leaf's level
    (``|g_i| = sqrt(L_hat)``, ``L`` the devices' mean squared gradient) moves a device's
    preconditioned momentum by at most Adam's bound, as Adam's own variance would; and the
    decoded mean step is clipped at that bound (a non-finite value passes as it is: never
    hidden). Both keep the mean exact where the mean loss is stationary: the floor is a
    preconditioner like ``v``, linear, and the mean step there is zero, within the bound, so
    1-bit Adam still converges to the optimum of the mean loss when the devices' own
    gradients differ there (data that differ by device). Clipping each device's own step
    instead (this recipe's bound from 2026-11-26 to 2026-11-27) stopped short of it
    (docs/choosing-a-codec.md, "What each exchange converges to"). No byte more on the wire
    (the levels travel with ``rescale_variance``; without it, one float32 per leaf per
    step). ``adam_bound=False`` sends the step as it is (the paper's, and this recipe's
    default before 2026-11-26; docs: "1-bit Adam and 0/1 Adam for language models").

    **The scale of the signs.** ``jc.sign()``'s mean ``||x||_1 / d`` minimizes the error of
    one step but shrinks every step below the momentum's norm (far below it for a momentum
    whose coordinates differ widely in size), and the error feedback pays the rest late;
    the root mean square keeps the step's norm. Both send the same bytes.

    The momentum travels in Adam's preconditioned units, ``m_i / (sqrt(v_hat) + eps)`` (``v``
    is the same on every device, so the mean is unchanged): sent as it is, a
    1-bit momentum gives every coordinate of a leaf the same magnitude, and coordinates of
    small variance turn that into steps that diverge (measured: docs, "Choosing a codec").
    A coordinate whose variance is exactly zero at the freeze (its gradient was zero through
    the warm-up: the embedding row of a token not seen yet) is preconditioned by its leaf's
    mean variance (filled once, as ``v`` freezes), so it still learns at Adam's step size
    once its gradient appears (frozen at zero it would never move; ``eps`` alone would
    multiply its 1-bit momentum by ``1 / eps``). A leaf whose variance is zero everywhere
    gets a zero update.

    Every device restarts its momentum step from the synchronized ``m``, as in the paper's
    Algorithm 1. The warm-up runs inside a ``jax.lax.cond`` on the step count, so a compiled
    step holds both exchanges (``jc.comm_report`` counts both) and sends one.

    ``**exchange`` goes to :func:`jaxcomp.compressed_allreduce` (``strategy``: ``"auto"``
    picks ``two_phase`` for signs, whose owned-chunk re-encoding keeps the server error as
    the paper does; ``min_size``, ``mask``, ``bucket_bytes``, ``param_specs``, ...). Leaves
    below ``min_size`` are averaged uncompressed.

    **Non-finite steps and outliers.** A NaN or inf on any device gives a NaN update on every
    device and leaves the whole state as it was, its step count included: the schedule
    (warm-up, freeze, bias corrections) counts finite steps, so the next finite step is the
    one a run without the bad step takes, bit for bit. ``jc.apply_if_finite(tx, axis_name,
    k)`` skips such a step (a zero update) and counts them (``total_notfinite``);
    ``optax.apply_if_finite`` around this recipe is refused (it decides per device). A
    finite gradient is never taken for a non-finite one: the warm-up's mean is summed
    pre-scaled (``sum_i g_i / n``: a mean that fits float32 never overflows, while ``n``
    gradients near ``F32_MAX / n`` summed first give inf), and the moments saturate at
    ``+-F32_MAX`` (the momentum turned back from preconditioned units, ``u (sqrt(v_hat) +
    eps)``, can overflow after an outlier: a state holding inf flags every later step).

    Args:
      learning_rate: a float or an optax schedule.
      axis_name: the data-parallel mesh axis.
      freeze_step: steps of uncompressed Adam before the variance is frozen (>= 1). The
        rule: a sixth of the run, past the learning-rate warm-up and the first fast fall
        of the loss (the paper uses 15-25% of training for BERT); the bytes over the run
        are about ``f + (1 - f) / 25`` of ``pmean``'s, ``f`` the warm-up's share
        (docs: "1-bit Adam and 0/1 Adam for language models").
      codec: the momentum's codec (None: ``jc.sign(scale="rms", exact_zeros=True)``, 1 bit
        per coordinate, one float32 root mean square per chunk and 1/32 bit per coordinate
        for the all-zero words; ``jc.sign()`` scales by the mean ``|x|``).
      b1: the momentum's decay.
      b2: the variance's decay.
      eps: added to the square root of the variance.
      weight_decay: AdamW's decoupled weight decay ``wd`` (>= 0; 0: Adam), scaled by the
        learning rate as ``optax.adamw``; computed from the params, so nothing is sent.
      weight_decay_mask: None (decay every param) or, as ``optax.adamw``'s ``mask``, a tree
        of bools like the params or a prefix of them (or a callable of the params giving one):
        True where decayed. With a weight decay, ``init`` refuses one of another tree, naming
        both structures.
      rescale_variance: True (default): the frozen variance follows each leaf's gradient
        level ``L_hat / L_f`` (one float32 per leaf per step on the wire); False: frozen as
        in the paper (with ``adam_bound`` the levels still travel: its floor reads them). A
        Python bool: ``optax.inject_hyperparams`` keeps bools static (an
        array is refused with a TypeError).
      adam_bound: True (default): Adam's own bound ``C sqrt(1 - b2^t)`` (``C = (1 - b1) /
        sqrt((1 - b2)(1 - b1^2 / b2))``, 7.27 at the defaults; above) as a per-leaf floor on
        the frozen ``sqrt(v_hat)`` and as a clip of the decoded mean step, both identical on
        every device, so the optimum of the mean loss stays a fixed point when the devices'
        data differ (docs/choosing-a-codec.md, "What each exchange converges to"); False:
        the step sent as it is (the paper's 1-bit Adam). A Python bool (docs: "1-bit Adam
        and 0/1 Adam for language models"). Until 2026-11-27 True clipped each device's own
        step before the codec, which stopped short of that optimum.
      **exchange: options of :func:`jaxcomp.compressed_allreduce`. Among them
        ``shard_axis``: the mesh axis (or tuple) over which the gradients are shards of one
        model (HSDP: FSDP over ``"data"`` inside each group averaged over ``axis_name``):
        every non-finite flag of the step (the round's and this transform's own, after it)
        is or-ed over it (one scalar ``psum``), so a non-finite shard poisons every shard's
        update and keeps every shard's state. Under ``check_vma=True`` jax's types tell
        (None works); under ``check_vma=False`` they do not, and with another manual axis
        bound beside ``axis_name`` the update warns where it is None. ``()``: the leaves are
        whole, no warning.

    Returns:
      An ``optax.GradientTransformationExtraArgs``: the update to add to the params.
      Its update refuses gradient leaves that are not floating (integer, bool, ``float0``)
      with a TypeError naming them (the exchange transforms pass them through): keep
      integer params out of the tree it optimizes (docs/errors.md).

    Raises:
      ValueError: at construction, ``freeze_step``, ``b1``, ``b2``, ``eps``, ``weight_decay`` or
        ``axis_name`` outside its rule (the message names the argument; the rules: docs/errors.md);
        at ``init``, a ``weight_decay_mask`` that is no prefix of the params' tree.
      TypeError: at construction, ``freeze_step``, ``b1``, ``weight_decay``, ``weight_decay_mask``,
        ``worker_momentum``, ``rescale_variance``, ``adam_bound``, ``shard_axis`` or ``axis_name``
        of the wrong kind; ``worker_momentum`` or ``worker_nesterov`` given (it keeps its own
        momentum).

    Example::

        tx = jc.onebit_adam(3e-3, "data", freeze_step=50, weight_decay=0.1)
        opt_state = jc.sharded_init(tx, params, mesh, "data")
        # hyperparameters in the state (learning rate, b1, b2, eps, weight decay, freeze step)
        tx = optax.inject_hyperparams(jc.onebit_adam)(3e-3, "data", freeze_step=50)

    References:
      Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication
      Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021.
      Li, Awan, Tang, Rajbhandari, Wang, He, "1-bit LAMB: Communication Efficient
      Large-Scale Large-Batch Training with LAMB's Convergence Speed", HiPC 2022 (a frozen
      variance corrected by a scaling from fresh statistics).
    """
    chain = optax.chain(
        scale_by_onebit_adam(
            axis_name,
            freeze_step=freeze_step,
            codec=codec,
            b1=b1,
            b2=b2,
            eps=eps,
            rescale_variance=rescale_variance,
            adam_bound=adam_bound,
            **exchange,
        ),
        *decoupled_weight_decay(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    return checking_decay_mask(chain, weight_decay_mask)


def checking_decay_mask(tx: optax.GradientTransformationExtraArgs, mask: Any):
    """``tx`` (a recipe's chain) whose ``init``, where it fails, says so when
    ``weight_decay_mask`` is no prefix of the params' tree (:func:`check_decay_mask_tree`;
    jax's own pytree error named neither). An init that succeeds is ``tx``'s own (and so is
    ``optax.tree_map_params``' call with its placeholder for the params), and so is the
    update."""
    if mask is None:
        return tx

    def init_fn(params):
        try:
            return tx.init(params)
        except ValueError:
            check_decay_mask_tree(mask, params)
            raise

    return tx._replace(init=init_fn)


def check_decay_mask_tree(mask: Any, params: Any) -> None:
    """``weight_decay_mask`` (a callable: what it gives for ``params``) must be a prefix of
    the params' tree, as ``optax.masked`` maps it over them; otherwise a ValueError naming it
    and both structures (jax's own error named neither)."""
    tree = mask(params) if callable(mask) else mask
    structure = jax.tree.structure(tree)
    try:
        structure.flatten_up_to(params)
    except ValueError as e:
        given = "`weight_decay_mask` gives" if callable(mask) else "`weight_decay_mask` has"
        raise ValueError(
            f"{given} the tree structure {structure}, which is not a prefix of the params' "
            f"{jax.tree.structure(params)} ({str(e).splitlines()[0][:120]}): the mask must be a "
            "tree of bools like the params, or a prefix of them (one bool for a whole subtree), "
            "as optax.adamw's `mask`"
        ) from None


def decoupled_weight_decay(weight_decay: Any, mask: Any) -> tuple:
    """``(optax.add_decayed_weights(weight_decay, mask),)``, or ``()`` for a Python zero
    (Adam: the chain stays as it was). Checks ``weight_decay`` >= 0, naming it.

    An array (``optax.inject_hyperparams`` passes a concrete one to ``init`` and a traced one
    to ``update``) always gets the decay, even a zero: both then build the same chain, whose
    states must match."""
    weight_decay = check_number("weight_decay", weight_decay, 0.0, float("inf"))
    mask = check_decay_mask(mask)
    if is_number(weight_decay) and weight_decay == 0.0:
        return ()
    return (optax.add_decayed_weights(weight_decay, mask),)


def check_decay_mask(mask: Any) -> Any:
    """``weight_decay_mask`` as ``optax.masked`` reads it: None, a callable, a bool, or a tree
    (of bools, like the params or a prefix of them). A single leaf that is no bool (``"w"``,
    ``3``) would be read as one truthy mask over every param: refused, naming it."""
    if mask is None or callable(mask) or isinstance(mask, bool | np.bool_):
        return mask
    if jax.tree_util.all_leaves([mask]) and not (hasattr(mask, "dtype") and mask.dtype == bool):
        raise TypeError(
            "`weight_decay_mask` must be None, a bool, a tree of bools like the params or a "
            f"callable of the params giving one, got {mask!r}"
        )
    return mask
