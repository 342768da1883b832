"""1-bit Adam (Tang et al., 2021): Adam whose momentum, once the variance is frozen, is
exchanged through a 1-bit codec with worker and server error feedback."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import collectives, skeleton
from jaxcomp._src.codecs import sign
from jaxcomp._src.codecs.base import F32_MAX, Codec, saturating_square
from jaxcomp._src.compressed_allreduce import CompressedAllreduceState, compressed_allreduce
from jaxcomp._src.sgd import exchange_options


class OneBitAdamState(NamedTuple):
    """State of :func:`onebit_adam`. Under ``shard_map`` use :func:`jaxcomp.state_specs`."""

    count: jax.Array  # int32[]: steps taken
    mu: Any  # identical on every device, f32 like the params: the (synchronized) momentum
    nu: Any  # identical on every device, f32 like the params: the variance, frozen later
    exchange: CompressedAllreduceState  # the momentum's exchange: per-device error feedback

    PER_DEVICE_FIELDS = ()  # the per-device memories are the exchange's own fields


def check_number(name: str, value: Any, lo: float, hi: float, *, integer: bool = False) -> Any:
    """``value`` in ``[lo, hi)``, an int where ``integer``; arrays (injected hyperparameters)
    are checked where concrete."""
    if isinstance(value, jax.core.Tracer):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float | jax.Array):
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
        positive = v > 0
        count = jnp.sum(positive)
        mean = jnp.sum(jnp.where(positive, v, 0.0)) / jnp.maximum(count, 1)
        return jnp.where(positive, v, mean)

    return jax.tree.map(one, nu)


def adam_direction(mu: Any, nu: Any, like: Any, mu_scale, nu_scale, eps, bad) -> Any:
    """``mu_hat / (sqrt(nu_hat) + eps)`` per leaf in the dtype of ``like``, with ``nu`` the
    :func:`filled_variance`; zero where that is still zero (a leaf whose gradient was always
    zero: a 1-bit momentum gives it +-scale, which ``eps`` would blow up by 1e8), and NaN
    everywhere when ``bad``."""

    def one(m, v, g):
        d = mu_scale * m / (jnp.sqrt(nu_scale * v) + eps)
        return collectives.poison(jnp.where(v > 0, d, 0.0), bad).astype(g.dtype)

    return jax.tree.map(one, mu, filled_variance(nu), like)


def preconditioned_mean(inner, local: Any, nu: Any, nu_scale, eps, exchange_state, params):
    """``mean_i m_i`` through ``inner`` (a ``compressed_allreduce``), exchanged in Adam's
    preconditioned coordinates ``u_i = m_i / (sqrt(nu_hat) + eps)``.

    With the variance frozen (identical on every device) this is a fixed per-coordinate
    change of units, so the mean is the same; but the codec's error (and the error-feedback
    memory) then lives where the update does: a 1-bit momentum sent as it is gives every
    coordinate of a leaf the same magnitude, and coordinates of small variance turn that into
    huge steps. The variance is :func:`filled_variance` (a coordinate unseen during the
    warm-up takes its leaf's mean); a leaf whose variance is zero everywhere sends and keeps
    nothing (its update is zero). Returns ``(mean momentum, new exchange state)``.
    """
    scale = jax.tree.map(
        lambda v: jnp.where(v > 0, 1.0 / (jnp.sqrt(nu_scale * v) + eps), 0.0), filled_variance(nu)
    )
    sent, exchange_state = inner.update(
        jax.tree.map(jnp.multiply, local, scale), exchange_state, params
    )
    mean = jax.tree.map(
        lambda u, k: jnp.where(k > 0, u / jnp.where(k > 0, k, 1.0), 0.0), sent, scale
    )
    return mean, exchange_state


def momentum_exchange(name: str, codec: Codec | None, axis_name: Any, exchange: dict):
    """The ``compressed_allreduce`` that carries a 1-bit Adam momentum (residual feedback,
    ``jc.sign()`` by default), the axes of its float32 rounds and their bucket size."""
    options = {"error_feedback": "residual", **exchange_options(exchange)}
    if "worker_momentum" in options:
        raise TypeError(f"jc.{name} keeps its own momentum: drop `worker_momentum`")
    inner = compressed_allreduce(sign() if codec is None else codec, axis_name, **options)
    every_axis = collectives.axis_names(axis_name, options.get("inner_axis_name"))
    return inner, every_axis, options.get("bucket_bytes", 2**25)


def mean_gradient(grads: Any, every_axis: Any, bucket_bytes: int) -> tuple[Any, jax.Array]:
    """The float32 mean gradient (bucketed ``pmean``) and its non-finite flag."""
    leaves, treedef = jax.tree.flatten(as_float32(grads))
    means, held = collectives.plain_mean(leaves, every_axis, bucket_bytes, with_buckets=True)
    return jax.tree.unflatten(treedef, means), collectives.local_nonfinite(held)


def adam_moments(mu: Any, nu: Any, g: Any, b1, b2) -> tuple[Any, Any]:
    """Adam's ``m <- b1 m + (1 - b1) g`` and ``v <- b2 v + (1 - b2) g^2`` (the square
    saturating: a finite outlier never leaves ``v`` inf, frozen for ever)."""
    mu = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, mu, g)
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
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    """The direction of :func:`onebit_adam` (before the learning rate); see there."""
    freeze_step = check_number("freeze_step", freeze_step, 1, float("inf"), integer=True)
    b1 = check_number("b1", b1, 0.0, 1.0)
    b2 = check_number("b2", b2, 0.0, 1.0)
    eps = check_number("eps", eps, 0.0, float("inf"))
    inner, every_axis, bucket_bytes = momentum_exchange("onebit_adam", codec, axis_name, exchange)
    inner_axis = exchange_options(exchange).get("inner_axis_name")

    def init_fn(params):
        zeros = zeros_f32(params)
        return OneBitAdamState(
            count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros, exchange=inner.init(params)
        )

    # The lax.cond returns one params-sized tree (the warm-up's mean gradient or the
    # compression stage's mean momentum) and the exchange state; Adam's moments are moved
    # outside it, in place. Returning mu and nu from the branches made XLA copy both out of
    # the cond's buffers (5.9 copies of temporaries against AdamW's 2.0).

    def warmup(grads, state, params):
        """The float32 mean gradient (uncompressed): Adam with the variance still learning."""
        g, bad = mean_gradient(grads, every_axis, bucket_bytes)
        return g, state.exchange, bad

    def compressed(grads, state, params):
        """Each device's momentum step, averaged through the codec; the variance frozen."""
        local = jax.tree.map(lambda m, x: b1 * m + (1.0 - b1) * x, state.mu, as_float32(grads))
        mu, exchange_state = preconditioned_mean(
            inner, local, state.nu, frozen_scale(state.count), eps, state.exchange, params
        )
        return mu, exchange_state, collectives.local_nonfinite(mu)

    def moments(state, warm, x):
        """Warm-up: Adam's moments moved by the mean gradient ``x``; after: ``mu = x``."""
        mu, nu = adam_moments(state.mu, state.nu, x, b1, b2)
        pick = functools.partial(jax.tree.map, lambda a, b: jnp.where(warm, a, b))
        return pick(mu, x), pick(nu, state.nu)

    def frozen_scale(count):
        """Adam's bias correction of the variance, frozen at ``freeze_step``."""
        frozen_t = jnp.minimum(count + 1, freeze_step).astype(jnp.float32)
        return 1.0 / (1.0 - b2**frozen_t)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        skeleton.begin("onebit_adam", updates, params, axis_name, inner_axis)
        like = jax.eval_shape(lambda: zeros_f32(updates))
        skeleton.check_fields("onebit_adam", state, {"mu": like, "nu": like})
        warm = state.count < freeze_step
        x, exchange_state, bad = jax.lax.cond(warm, warmup, compressed, updates, state, params)
        mu, nu = moments(state, warm, x)
        t = (state.count + 1).astype(jnp.float32)
        mu_scale = 1.0 / (1.0 - b1**t)
        nu_scale = frozen_scale(state.count)
        new_state = OneBitAdamState(count=state.count + 1, mu=mu, nu=nu, exchange=exchange_state)
        new_state = skeleton.freeze(bad, state, new_state)
        # A non-finite step: NaN everywhere (not just where the mean was), state kept. The
        # direction reads the frozen state (the same where the step is finite): the new
        # mu and nu then have one reader each, written once into the state's own buffers
        # (read before the freeze, each was a params-sized temporary).
        direction = adam_direction(
            new_state.mu, new_state.nu, updates, mu_scale, nu_scale, eps, bad
        )
        return direction, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""1-bit Adam: Adam for ``freeze_step`` steps, then the variance frozen and the momentum
    exchanged through ``codec`` (1-bit signs by default) with error feedback.

    Adam's variance ``v`` is what makes its momentum hard to compress; 1-bit Adam observes
    that ``v`` becomes stable early, freezes it, and from then on Adam is momentum SGD with a
    fixed per-coordinate preconditioner, whose momentum compresses like EF-SGDM's::

        warm-up (t < freeze_step), uncompressed:
            g  = mean_i g_i                         # float32 all-reduce
            m <- b1 m + (1 - b1) g
            v <- b2 v + (1 - b2) g^2
        compression stage (t >= freeze_step), v frozen:
            m_i = b1 m + (1 - b1) g_i               # each device's momentum step
            m  <- mean_i C(m_i + e_i)               # worker error e_i; two_phase adds the
                                                    # chunk owners' server error; sent in
                                                    # units of m / (sqrt(v_hat) + eps)
        x <- x - lr * (m_hat / (sqrt(v_hat) + eps) + wd * x)   # bias-corrected as Adam (v's
                                                    # correction frozen with v); wd: AdamW's
                                                    # decoupled weight decay (optax.adamw)

    The momentum travels in Adam's preconditioned units, ``m_i / (sqrt(v_hat) + eps)`` (``v``
    is frozen and the same on every device, so the mean is unchanged): sent as it is, a
    1-bit momentum gives every coordinate of a leaf the same magnitude, and coordinates of
    small variance turn that into steps that diverge (measured: docs, "Choosing a codec").
    A coordinate whose variance is exactly zero at the freeze (its gradient was zero through
    the warm-up: the embedding row of a token not seen yet) is preconditioned by its leaf's
    mean variance, so it still learns at Adam's step size once its gradient appears (frozen
    at zero it would never move; ``eps`` alone would multiply its 1-bit momentum by
    ``1 / eps``). A leaf whose variance is zero everywhere gets a zero update.

    Every device restarts its momentum step from the synchronized ``m``, as in the paper's
    Algorithm 1. The warm-up runs inside a ``jax.lax.cond`` on the step count, so a compiled
    step holds both exchanges (``jc.comm_report`` counts both) and sends one.

    ``**exchange`` goes to :func:`jaxcomp.compressed_allreduce` (``strategy``: ``"auto"``
    picks ``two_phase`` for signs, whose owned-chunk re-encoding keeps the server error as
    the paper does; ``min_size``, ``mask``, ``bucket_bytes``, ``param_specs``, ...). Leaves
    below ``min_size`` are averaged uncompressed. A non-finite gradient leaves the whole
    state as it was and gives a NaN update (``optax.apply_if_finite`` can skip it).

    Args:
      learning_rate: a float or an optax schedule.
      axis_name: the data-parallel mesh axis.
      freeze_step: steps of uncompressed Adam before the variance is frozen (>= 1). The
        rule: a quarter to a third of the run (the paper uses 15-25% of training for BERT;
        on a 300-step byte-level LM a sixth ended 3.7% above AdamW, a third 2.4%; with the
        momentum exchanged exactly a sixth still costs 1.6%: the frozen variance itself).
      codec: the momentum's codec (default ``jc.sign()``: 1 bit per coordinate and a scale).
      b1: the momentum's decay.
      b2: the variance's decay.
      eps: added to the square root of the variance.
      weight_decay: AdamW's decoupled weight decay ``wd`` (>= 0; 0: Adam), scaled by the
        learning rate as ``optax.adamw``; computed from the params, so nothing is sent.
      weight_decay_mask: None (decay every param) or, as ``optax.adamw``'s ``mask``, a tree
        of bools like the params (or a callable of the params giving one): True where decayed.
      **exchange: options of :func:`jaxcomp.compressed_allreduce`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``: the update to add to the params.

    Example::

        tx = jc.onebit_adam(3e-3, "data", freeze_step=100, weight_decay=0.1)
        opt_state = jc.sharded_init(tx, params, mesh, "data")

    References:
      Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam: Communication
      Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021.
    """
    return optax.chain(
        scale_by_onebit_adam(
            axis_name, freeze_step=freeze_step, codec=codec, b1=b1, b2=b2, eps=eps, **exchange
        ),
        *decoupled_weight_decay(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def decoupled_weight_decay(weight_decay: Any, mask: Any) -> tuple:
    """``(optax.add_decayed_weights(weight_decay, mask),)``, or ``()`` for a zero decay (Adam:
    the chain stays as it was). Checks ``weight_decay`` >= 0, naming it."""
    weight_decay = check_number("weight_decay", weight_decay, 0.0, float("inf"))
    if not isinstance(weight_decay, jax.core.Tracer) and float(weight_decay) == 0.0:
        return ()
    return (optax.add_decayed_weights(weight_decay, mask),)
