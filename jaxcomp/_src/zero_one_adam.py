"""0/1 Adam (Lu et al., 2022): 1-bit Adam with an adaptive variance freeze and skipped
communication rounds."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import collectives, shards, skeleton
from jaxcomp._src.axes import varying_axes
from jaxcomp._src.codecs.base import F32_MAX, Codec, after
from jaxcomp._src.compressed_allreduce import CompressedAllreduceState
from jaxcomp._src.older_states import FRESH, NoDefault
from jaxcomp._src.onebit_adam import (
    BranchExchange,
    adam_direction,
    adam_moments,
    adam_step_bound,
    as_float32,
    bounded_step,
    check_flag,
    check_number,
    checking_decay_mask,
    decoupled_weight_decay,
    filled_variance,
    gradient_mean,
    memory_after,
    momentum_exchange,
    per_leaf,
    positive_mean,
    preconditioner,
    recipe_shard_axis,
    saturate,
    tracked_levels,
    unprecondition,
    variance_floor,
    zero_levels,
    zeros_f32,
)
from jaxcomp._src.sgd import exchange_options

FULL, COMPRESSED, SKIPPED, VARIANCE = 0, 1, 2, 3  # the kinds of round


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      count: int32[]: finite steps taken (the schedule's step: rounds, freeze)
      variance_updates: int32[]: rounds that moved the variance (FULL, VARIANCE)
      variance_step: int32[]: count + 1 at the last of them (nu's bias correction)
      mu: identical on every device, f32 like the params: the synchronized momentum
      nu: identical on every device, f32 like the params: the variance
      level: identical on every device, f32[] per leaf: EMA of the devices' mean g_i^2
      level_ref: identical on every device, f32[] per leaf: level_hat at the last FULL round
      pending: per device, f32[1, *shape] per leaf: (1 - b1) g_i of skipped rounds
      exchange: the momentum's exchange: per-device error feedback
    """

    count: jax.Array
    variance_updates: jax.Array
    variance_step: jax.Array
    mu: Any
    nu: Any
    level: Any
    level_ref: Any
    pending: Any
    exchange: CompressedAllreduceState

    PER_DEVICE_FIELDS = ("pending",)
    #: Added since the first release (:func:`jaxcomp.complete_state`). ``variance_step`` has
    #: no safe default: the variance was an average over variance rounds before it.
    ADDED_FIELDS = {
        "level": FRESH,
        "level_ref": FRESH,
        "variance_step": NoDefault(
            "the state was saved when the variance was an average over variance rounds, "
            "not over steps: no value of `variance_step` makes it run as it did; restart "
            "its variance from a fresh state, or finish the run on the version that wrote it"
        ),
    }


def doubling_gap(t: jax.Array, scaler: Any) -> jax.Array:
    """``2^floor(log2(t / scaler + 1))``: 1 for the first ``scaler`` steps, 2 for the next
    ``2 scaler``, 4 for the next ``4 scaler``, ... (int32)."""
    level = jnp.floor(jnp.log2(jnp.asarray(t, jnp.float32) / scaler + 1.0))
    return (2 ** level.astype(jnp.int32)).astype(jnp.int32)


def round_kind(
    count: jax.Array,
    freeze: Any,
    var_scaler: Any,
    local_scaler: Any,
    clip: Any,
    warmup: Any = 0,
    compressed_before: Any = False,
):
    """FULL (float32 exchange, Adam's m and v move), COMPRESSED, SKIPPED or VARIANCE for
    step ``count``.

    The first ``warmup`` steps are FULL (uncompressed Adam). Then, before
    ``var_freeze_step``, a variance round where ``count`` is a multiple of the variance gap
    (:func:`doubling_gap` with ``var_update_scaler``), COMPRESSED otherwise; a variance round
    is FULL while every earlier round was, VARIANCE (the momentum through the codec, the
    gradient in float32 for the variance alone) once a compressed round has run
    (``compressed_before``). After the freeze: a COMPRESSED round where the steps since the
    freeze are a multiple of the local-step gap (doubling every ``local_step_scaler`` steps,
    at most ``local_step_clipper``), SKIPPED otherwise.
    """
    count = jnp.asarray(count, jnp.int32)
    variance = count % doubling_gap(count, var_scaler) == 0
    full = (count < warmup) | (variance & ~jnp.asarray(compressed_before))
    since = jnp.maximum(count - freeze, 0)
    gap = jnp.minimum(doubling_gap(since, local_scaler), jnp.asarray(clip, jnp.int32))
    synced = since % gap == 0
    before = jnp.where(full, FULL, jnp.where(variance, VARIANCE, COMPRESSED))
    return jnp.where(count < freeze, before, jnp.where(synced, COMPRESSED, SKIPPED))


def moves_variance(kind: jax.Array) -> jax.Array:
    """Whether a round of ``kind`` moves Adam's variance (FULL and VARIANCE rounds)."""
    return (kind == FULL) | (kind == VARIANCE)


def sends_momentum(kind: jax.Array) -> jax.Array:
    """Whether a round of ``kind`` sends the momentum through the codec (COMPRESSED and
    VARIANCE rounds)."""
    return (kind == COMPRESSED) | (kind == VARIANCE)


def round_kinds(
    steps: int, freeze: int, var_scaler: int, local_scaler: int, clip, warmup=0, coded=False
) -> list[int]:
    """The kind of each of the first ``steps`` rounds (static settings; ``coded``:
    ``variance_rounds="coded"``)."""
    kinds, compressed_before = [], False
    for t in range(steps):
        kind = int(round_kind(t, freeze, var_scaler, local_scaler, clip, warmup, compressed_before))
        compressed_before |= coded and kind != FULL
        kinds.append(kind)
    return kinds


def default_warmup(var_freeze_step: Any, warmup_steps: Any) -> Any:
    """``warmup_steps``, checked (an int in ``[0, var_freeze_step]``); None gives
    ``var_freeze_step // 2``: the first half of the variance phase."""
    if warmup_steps is None:
        return var_freeze_step // 2
    check_number("warmup_steps", warmup_steps, 0, float("inf"), integer=True)
    if isinstance(var_freeze_step, int | np.integer) and warmup_steps > var_freeze_step:
        raise ValueError(
            f"`warmup_steps` must be at most `var_freeze_step` ({var_freeze_step}): the "
            f"warm-up's rounds are variance rounds, which end at the freeze; got {warmup_steps}"
        )
    return warmup_steps


def unfilled_ratio(nu_old: Any, nu_new: Any, fill_new: Any, old_scale, new_scale, eps) -> Any:
    r"""Per leaf, ``min(1, (sqrt(new_scale F(nu_new)) + eps) / (sqrt(old_scale F(nu_old)) +
    eps))`` where ``nu_old`` is zero, 1 elsewhere (``F``: :func:`filled_variance`;
    ``fill_new``, per leaf, is ``nu_new``'s fill: its mean positive entry).

    A coordinate whose variance is still zero (its gradient was zero in every variance
    round) is preconditioned by its leaf's mean variance in the compressed rounds, and a
    1-bit momentum gives it a momentum of the leaf's typical size (a sign has no zero). When
    a variance round then gives it a variance of its own, often far smaller (a rare token's
    embedding row), Adam's division would turn that momentum into a step thousands of times
    Adam's (the embedding of the LM benchmark). Multiplying the old momentum by this ratio keeps
    ``m / (sqrt(v_hat) + eps)``, what the compressed rounds sent, across the variance update.
    At most 1: a variance of its own above the leaf's mean only shrinks the step, and the
    momentum is never scaled up (no overflow; square roots taken before the products).
    """

    def one(v0, f0, f1, old_scale, new_scale):
        num = jnp.sqrt(new_scale) * jnp.sqrt(f1) + eps
        den = jnp.sqrt(old_scale) * jnp.sqrt(f0) + eps
        ratio = jnp.where(den > num, num / jnp.where(den > 0, den, 1.0), 1.0)
        return jnp.where(v0 > 0, 1.0, ratio)

    return jax.tree.map(
        lambda v0, f0, f1, k0, k1: one(v0, f0, f1, k0, k1),
        nu_old,
        filled_variance(nu_old),
        jax.tree.map(lambda v, f: jnp.where(v > 0, v, f), nu_new, fill_new),
        per_leaf(old_scale, nu_old),
        per_leaf(new_scale, nu_old),
    )


def scale_by_zero_one_adam(
    axis_name: Any,
    *,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    local_step_scaler: int = 1000,
    local_step_clipper: int = 16,
    warmup_steps: int | None = None,
    codec: Codec | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    rescale_variance: bool = True,
    variance_rounds: str = "exact",
    adam_bound: bool = True,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    """The direction of :func:`zero_one_adam` (before the learning rate); see there."""
    inf = float("inf")
    freeze = check_number("var_freeze_step", var_freeze_step, 1, inf, integer=True)
    var_scaler = check_number("var_update_scaler", var_update_scaler, 1, inf, integer=True)
    local_scaler = check_number("local_step_scaler", local_step_scaler, 1, inf, integer=True)
    clip = check_number("local_step_clipper", local_step_clipper, 1, inf, integer=True)
    warmup = default_warmup(freeze, warmup_steps)
    b1 = check_number("b1", b1, 0.0, 1.0)
    b2 = check_number("b2", b2, 0.0, 1.0)
    eps = check_number("eps", eps, 0.0, inf)
    rescale = check_flag("rescale_variance", rescale_variance)
    bounded = check_flag("adam_bound", adam_bound)
    if variance_rounds not in ("exact", "coded"):
        raise ValueError(
            f"`variance_rounds` must be 'exact' (the paper's: the momentum moved by the float32 "
            f"mean gradient) or 'coded' (the momentum through the codec, the float32 "
            f"gradient for the variance only), got {variance_rounds!r}"
        )
    coded = variance_rounds == "coded"
    inner, every_axis = momentum_exchange("zero_one_adam", codec, axis_name, exchange)
    inner_axis = exchange_options(exchange).get("inner_axis_name")

    def init_fn(params):
        zeros = zeros_f32(params)
        return ZeroOneAdamState(
            count=jnp.zeros([], jnp.int32),
            variance_updates=jnp.zeros([], jnp.int32),
            variance_step=jnp.zeros([], jnp.int32),
            mu=zeros,
            nu=zeros,
            level=zero_levels(params),
            level_ref=zero_levels(params),
            pending=jax.tree.map(lambda z: z[None], zeros),
            exchange=inner.init(params),
        )

    # The lax.switch returns one params-sized tree (the FULL round's mean gradient, the mean
    # momentum of a compressed or variance round, zeros in a skipped round), the exchange
    # state and this device's payloads. Adam's moments, the pending sums and the worker
    # memory (BranchExchange, from the payloads) move outside it, in place: returned from
    # the branches, XLA copied each out of the switch's buffers.
    rounds = BranchExchange.make(inner, memory_after(codec, axis_name, exchange), every_axis)

    def full(y, state, params):
        """The float32 mean gradient over the devices (``y`` holds each device's ``g_i / n``,
        :func:`round_input`: the sum is the mean, finite wherever it fits): momentum and
        variance both move (outside)."""
        g = skeleton.tree_psum(y, every_axis)
        return g, *rounds.idle(y, state.exchange, params), collectives.local_nonfinite(g)

    def compressed(y, state, params):
        """Each device's momentum step plus what its skipped rounds held (``y``, in Adam's
        preconditioned units: :func:`round_input`), through the codec (a VARIANCE round's
        too). Returned in those units: turned back where mu is written (moved)."""
        sent, exchange_state, payloads = rounds.send(y, state.exchange, params)
        return sent, exchange_state, payloads, collectives.local_nonfinite(sent)

    def skipped(y, state, params):
        """No gradient on the wire (``y`` is ``g_i``): the synchronized momentum decays
        (``b1 m``: the moment update with a zero mean) and moves the params on every device
        alike."""
        # One scalar all-reduce: a non-finite gradient on any device poisons every device's
        # update and keeps every state as it was (nothing gradient-sized on the wire).
        flag = collectives.local_nonfinite(y).astype(jnp.float32)
        bad = jax.lax.psum(flag, every_axis) > 0
        # typed as the FULL round's mean (psum over the axes): varying over the shards only
        zeros = jax.tree.map(
            lambda m, x: skeleton.varying_over(
                jnp.zeros(m.shape, m.dtype), varying_axes(x) - set(every_axis)
            ),
            state.mu,
            y,
        )
        return zeros, *rounds.idle(y, state.exchange, params), bad

    def variance_gradient(grads, kind):
        """``variance_rounds="coded"``: a VARIANCE round's float32 mean gradient, for the
        variance alone (zeros in the other rounds), in a ``lax.cond`` of its own before the
        round's switch, which then sends the momentum as a COMPRESSED round does (in the
        switch, the gradient, its mean and a tree of zeros were each a buffer beside the
        codec's input and the decoded mean)."""
        return jax.lax.cond(
            kind == VARIANCE, lambda a: gradient_mean(a, every_axis), zeros_f32, grads
        )

    def moved(state, kind, x, g, grads, old_scale, floor):
        """``(mu, pending)`` after a round of ``kind`` whose exchanged tree is ``x`` (and
        ``g``, a variance round's mean gradient): a skipped round keeps ``(1 - b1) g_i``
        pending for the next exchange, which empties it. The variance: :func:`new_variance`,
        read here through its reductions only and written after the momentum (update_fn)."""
        mu, _ = adam_moments(state.mu, state.nu, round_mean(kind, x, g), b1, 0.0)
        nu = new_variance(state, state.nu, kind, x, g)
        # A round that moves the variance keeps the preconditioned momentum of a coordinate
        # that had no variance yet (unfilled_ratio); a compressed round takes the exchanged
        # momentum (a variance round: times that ratio too).
        new = variance_scale(state.count + 1)
        ratio = unfilled_ratio(state.nu, nu, new_fill(state, kind, x, g), old_scale, new, eps)
        sent = sends_momentum(kind)
        keep = lambda u, r: u * jnp.where(kind == VARIANCE, r, 1.0) if coded else u  # noqa: E731
        bound = step_bound(state.count)

        def one(a, m0, r, u, v, k, f=None):
            u = bounded_step(u, bound) if bounded else u
            return jnp.where(
                sent,
                keep(unprecondition(u, v, k, eps, f), r),
                jnp.where(kind == FULL, a + b1 * m0 * (r - 1.0), a),
            )

        args = (mu, state.mu, ratio, x, filled_variance(state.nu), per_leaf(old_scale, x))
        mu = jax.tree.map(one, *args) if floor is None else jax.tree.map(one, *args, floor)
        pending = jax.tree.map(
            lambda p, g: jnp.where(
                sent, 0.0, jnp.where(kind == SKIPPED, saturate(p + (1.0 - b1) * g[None], g), p)
            ),
            state.pending,
            as_float32(grads),
        )
        return mu, pending

    def new_fill(state, kind, x, g):
        """Per leaf, the new variance's mean positive entry (its fill), reduced from a copy
        of the new variance's expression of its own (the old variance read through
        `after`: the same bits). Reduced from the one the momentum reads elementwise, XLA
        wrote the new variance out, a params-sized temporary beside the switch's operand
        (alive until the worker memory is formed) and its output."""
        again = jax.tree.map(lambda v: after(v, state.count), state.nu)
        return jax.tree.map(positive_mean, new_variance(state, again, kind, x, g))

    def round_mean(kind, x, g):
        """The mean gradient that moves Adam's moments: ``x`` (a variance round's ``g``;
        None with ``variance_rounds="exact"``)."""
        return jax.tree.map(lambda a, b: jnp.where(kind == VARIANCE, b, a), x, g) if coded else x

    def new_variance(state, nu, kind, x, g):
        """``nu`` (the state's variance) moved by the round's mean gradient where the round
        moves the variance. The variance is an EMA in time: a round after ``gap`` steps
        weighs as ``gap`` steps."""
        gap = (state.count + 1 - state.variance_step).astype(jnp.float32)
        _, moved_nu = adam_moments(state.mu, nu, round_mean(kind, x, g), b1, b2**gap)
        moves = moves_variance(kind)
        return jax.tree.map(lambda a, b: jnp.where(moves, a, b), moved_nu, nu)

    def variance_scale(variance_step):
        """Adam's bias correction of a variance last moved at step ``variance_step - 1``."""
        return 1.0 / (1.0 - b2 ** jnp.maximum(variance_step, 1).astype(jnp.float32))

    def levels(grads, state, kind):
        """``(level, level_ref, scale_before, nu_scale)``: the per-leaf levels after this
        step (the reference follows the FULL rounds), and the variance's bias correction
        times ``level_hat / level_ref`` against the old and the new reference."""
        moves = moves_variance(kind)
        before = variance_scale(state.variance_step)
        after = variance_scale(jnp.where(moves, state.count + 1, state.variance_step))
        if not (rescale or bounded):
            return state.level, state.level_ref, before, after
        level, ref, r0, r1 = tracked_levels(
            as_float32(grads),
            state.level,
            state.level_ref,
            moves,
            state.count,
            b2,
            every_axis,
        )
        if not rescale:  # the levels tracked for adam_bound's floor only
            return level, ref, before, after
        # saturating: a level risen far above its reference never makes the scale inf
        scale = functools.partial(jax.tree.map, lambda k, r: jnp.minimum(k * r, F32_MAX))
        return level, ref, scale(per_leaf(before, r0), r0), scale(per_leaf(after, r1), r1)

    def step_bound(count):
        """Adam's bound (:func:`~jaxcomp._src.onebit_adam.adam_step_bound`) times the rounds
        a synced round sends after skipped ones."""
        since = jnp.maximum(count - freeze, 0)
        gap = jnp.minimum(doubling_gap(since, local_scaler), clip).astype(jnp.float32)
        return gap * adam_step_bound(count, b1, b2)

    def floor_at(level, count):
        """``adam_bound``'s :func:`~jaxcomp._src.onebit_adam.variance_floor` per leaf from
        the end of the warm-up (before it, 0: Adam's own steps); None without the bound."""
        if not bounded:
            return None
        return jax.tree.map(
            lambda f: jnp.where(count < warmup, 0.0, f), variance_floor(level, count, b1, b2)
        )

    def round_input(grads, state, kind, nu_scale, floor):
        """The switch's operand ``y``, per leaf: in a FULL round each device's float32
        gradient over ``n`` (pre-scaled as :func:`~jaxcomp._src.onebit_adam.gradient_mean`:
        its sum is the mean, which never overflows where it fits); in a COMPRESSED or
        VARIANCE round the codec's input, this device's momentum step plus what its skipped
        rounds held, ``b1 m + (1 - b1) g_i + p_i``, in Adam's preconditioned units
        (:func:`~jaxcomp._src.onebit_adam.preconditioner`; ``adam_bound``: its square root
        at least ``floor``, :func:`~jaxcomp._src.onebit_adam.variance_floor`); in a SKIPPED
        round ``g_i``. One pass that writes into the gradient's buffer: every later reader
        takes it, the worker memory formed after the switch included (formed in a branch,
        the codec's input was a params-sized temporary of its own)."""
        n = collectives.axis_size(every_axis)
        sends = sends_momentum(kind)

        def one(x, m, p, v, k, f=None):
            u = saturate(b1 * m + (1.0 - b1) * x + p[0], x) * preconditioner(v, k, eps, f)
            return jnp.where(kind == FULL, x / n, jnp.where(sends, u, x))

        # The filled variance read through `after` (the same bits): the preconditioner's
        # square root, the same expression as the momentum's after the switch, was shared
        # with it and held through the switch (a params-sized temporary).
        nu = jax.tree.map(lambda v: after(v, kind), filled_variance(state.nu))
        args = (as_float32(grads), state.mu, state.pending, nu, per_leaf(nu_scale, nu))
        return jax.tree.map(one, *args) if floor is None else jax.tree.map(one, *args, floor)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        skeleton.begin("zero_one_adam", updates, params, axis_name, inner_axis)
        skeleton.check_floating("zero_one_adam", updates)
        like = jax.eval_shape(lambda: zeros_f32(updates))
        skeleton.check_fields("zero_one_adam", state, {"mu": like, "nu": like}, updates=updates)
        compressed_before = coded & (state.variance_updates < state.count)
        kind = round_kind(
            state.count, freeze, var_scaler, local_scaler, clip, warmup, compressed_before
        )
        level, level_ref, old_scale, nu_scale = levels(updates, state, kind)
        floor = floor_at(level, state.count)
        g = variance_gradient(as_float32(updates), kind) if coded else None
        y = round_input(updates, state, kind, old_scale, floor)
        branches = (full, compressed, skipped, compressed)[: 4 if coded else 3]
        x, exchange_state, payloads, bad = jax.lax.switch(kind, branches, y, state, params)
        if coded:
            bad = bad | collectives.local_nonfinite(g)
        # Or-ed over the shards of one model (FSDP inside, shard_axis): every shard skips.
        bad = shards.any_shard(bad)
        mu, pending = moved(state, kind, x, g, y, old_scale, floor)
        keep = ~sends_momentum(kind) | bad
        exchange_state = rounds.with_memory(exchange_state, y, state.exchange, keep, payloads)
        t = (state.count + 1).astype(jnp.float32)
        moves = moves_variance(kind)
        new_state = ZeroOneAdamState(
            count=state.count + 1,
            variance_updates=state.variance_updates + moves.astype(jnp.int32),
            variance_step=jnp.where(moves, state.count + 1, state.variance_step),
            mu=mu,
            nu=state.nu,
            level=level,
            level_ref=level_ref,
            pending=pending,
            exchange=exchange_state,
        )
        new_state = skeleton.freeze(bad, state, new_state)
        # The variance is written into its own buffer once the momentum, which reads the old
        # variance, is written (a data dependence on the new momentum through `after`): XLA
        # orders the two only by data, and the momentum read the old variance after the new
        # one was written, so the old one was copied at the start and held to the end (one
        # params-sized temporary). The same values: `after` adds zero bits.
        old_nu = jax.tree.map(
            lambda v, m: after(v, m.reshape(-1)[0]) if m.size else v, state.nu, new_state.mu
        )
        nu = new_variance(state, old_nu, kind, x, g)
        new_state = new_state._replace(nu=skeleton.freeze(bad, old_nu, nu))
        # Read from the frozen state (as onebit_adam): no params-sized temporary per moment.
        direction = adam_direction(
            new_state.mu,
            new_state.nu,
            updates,
            1.0 / (1.0 - b1**t),
            nu_scale,
            eps,
            bad,
            floor=floor,
        )
        return direction, new_state

    update_fn = recipe_shard_axis(update_fn, "zero_one_adam", every_axis, exchange)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def zero_one_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: Any,
    *,
    var_freeze_step: int,
    var_update_scaler: int = 16,
    local_step_scaler: int = 1000,
    local_step_clipper: int = 16,
    warmup_steps: int | None = None,
    codec: Codec | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    rescale_variance: bool = True,
    variance_rounds: str = "exact",
    adam_bound: bool = True,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""0/1 Adam: 1-bit Adam whose variance is updated on ever sparser rounds and frozen at
    ``var_freeze_step``, after which whole communication rounds are skipped.

    Three kinds of round (a ``jax.lax.switch`` on the step count, identical on every device)::

        FULL (the first warmup_steps steps, then variance rounds before the freeze):
            float32 all-reduce, Adam's m and v move
            g = mean_i g_i;  m <- b1 m + (1 - b1) g
            v <- b2^k v + (1 - b2^k) g^2;  L_f = L_hat   # k: steps since the last FULL round
        VARIANCE (variance_rounds="coded": variance rounds after a compressed one):
            m as a COMPRESSED round, v and L_f as a FULL round (g: a float32 all-reduce)
        COMPRESSED (the other rounds, and synced rounds after the freeze): as 1-bit Adam
            m <- mean_i C(b1 m + (1 - b1) g_i + p_i + e_i);  p_i <- 0
            (sent in units of m / (max(sqrt(v_hat), f) + eps) and the mean clipped at
            Adam's bound, as jc.onebit_adam does; f = 0 in the warm-up)
        SKIPPED (after the freeze, between synced rounds): no gradient on the wire
            m <- b1 m;  p_i <- p_i + (1 - b1) g_i        # sent at the next synced round
        v_hat = v / (1 - b2^s) * L_hat / L_f             # s: step + 1 of the last FULL round;
                                                     # L: as jc.onebit_adam (per leaf)
        x <- x - lr * (m_hat / (sqrt(v_hat) + eps) + wd * x)   # a zero coordinate of v
                                                     # takes its leaf's mean

    ``C`` is ``jc.sign(scale="rms", exact_zeros=True)`` by default (1-bit signs scaled by
    their chunk's root mean square; an all-zero word of 32 decodes to 0). **The variance is
    an EMA in time**: a variance round ``k`` steps after the last one weighs as the ``k``
    steps it stands for (``b2^k``), and the bias correction counts steps, so ``v_hat``
    weighs every step of the run alike, as Adam's does. Moved by ``b2`` per round as in the
    paper, the first rounds (every step at the start, when gradients are largest) outweigh
    the later, sparser ones many times over and ``v_hat`` stays too large: every later step
    too small. Between variance rounds (and after the freeze) each leaf's ``v_hat`` follows
    the gradients' level ``L_hat / L_f``, as in :func:`jaxcomp.onebit_adam`
    (``rescale_variance``).

    A coordinate whose variance is still zero (no gradient in any variance round yet: a token
    not seen so far) is preconditioned by its leaf's mean variance in the compressed rounds,
    and the 1-bit momentum gives it a momentum of the leaf's typical size. The variance round
    that first gives it a variance of its own multiplies that momentum by
    ``(sqrt(v_hat_new) + eps) / (sqrt(v_hat_mean) + eps)`` (at most 1), so
    ``m / (sqrt(v_hat) + eps)``, what the compressed rounds sent, carries over; divided by a
    rare token's small variance as it was, it made steps thousands of times Adam's (the
    embedding of the LM benchmark).

    **Steps within Adam's bound** (``adam_bound``). Adam's variance takes in the gradient
    that moves its momentum, so ``|m_t| / sqrt(v_hat_t) <= C sqrt(1 - b2^t)``, ``C = (1 -
    b1) / sqrt((1 - b2)(1 - b1^2 / b2))`` (7.27 at the defaults). A variance sampled at
    sparse rounds has no such guard: a coordinate whose gradient was near zero where the
    variance last moved (a rare token's embedding row) and then comes back at its usual
    size is preconditioned into a step thousands of times Adam's, which sets the root mean
    square of its whole chunk of 1-bit signs: every coordinate of the chunk moves by it.
    After the warm-up, as in :func:`jaxcomp.onebit_adam`, each leaf's ``sqrt(v_hat)`` is
    therefore at least ``f = (1 - b1) sqrt(L_hat) / (C sqrt(1 - b2^t))`` (a gradient at the
    leaf's level moves a device's preconditioned momentum by at most Adam's bound) and the
    decoded mean step is clipped at the bound (times the rounds a synced round sends after
    skipped ones; a non-finite value passes as it is). Both are identical on every device:
    the optimum of the mean loss stays a fixed point when the devices' data differ (each
    device's own step clipped, the bound until 2026-11-27, stopped short of it). The LM
    benchmark's losses with and without it: docs, "Steps within Adam's bound".

    **A full-precision warm-up: the first half of the variance phase.** The first
    ``warmup_steps`` steps (by default ``var_freeze_step // 2``) are all FULL rounds
    (uncompressed Adam, as 1-bit Adam's warm-up); the variance rounds of the second half
    refine a variance estimated from every step of the first. A momentum compressed to 1 bit
    while it is young (its bias correction ``1 / (1 - b1^t)`` far from 1), during the
    learning rate's warm-up and the loss's fastest fall, loses progress that the error
    feedback, repaying it steps later, does not win back: on the LM benchmark the paper's
    schedule (compressed rounds from step ``var_update_scaler + 1``) cost several percent of
    loss that the same rounds with the momentum exchanged exactly did not. And 1-bit rounds
    interleaved with variance rounds cost loss that neither costs alone: with the momentum
    exchanged exactly the same variance rounds keep Adam's loss, and 1-bit rounds under a
    variance frozen where they start keep it too, while 0/1 Adam's variance rounds between
    its 1-bit rounds fell behind (with a quarter of ``var_freeze_step`` as the warm-up, the
    default until 2026-11-26, on the benchmark's held-out pair). The longer
    warm-up halves those interleaved rounds and starts them after the fast fall, for more
    float32 rounds than the paper's schedule (docs, "The per-step recipes against the best
    AdamW, three seeds": the losses, the bytes and the diagnosis).

    **Variance rounds after 1-bit rounds** (``variance_rounds``). A compressed round's
    decoded momentum carries the codec's error ``n`` (``m = mean_i m_i + n``) and each
    device keeps ``-n`` (its share) as error feedback, added to its next momentum step
    ``b1 m + (1 - b1) g_i + e_i``: the next round takes back ``n`` against the ``b1 n`` that
    ``b1 m`` carries, so the params feel ``n`` once, decaying by ``b1`` per step. A float32
    round in between (``"exact"``, the paper's: ``m <- b1 m + (1 - b1) g``) applies ``b1 n``
    with no feedback, and the feedback that follows takes back ``n`` against ``b1^2 n``:
    the last 1-bit error moves the params ``1 + b1`` times as far, for as long (summed over
    the run, nothing is lost either way). ``"coded"`` exchanges the momentum through the
    codec at those rounds too (error feedback in step) and the float32 gradient sum for the
    variance alone (``v <- b2^k v + (1 - b2^k) g^2``): the momentum's path is 1-bit Adam's,
    the variance the paper's, for ``1/32`` more bytes per variance round. Variance rounds
    before the first compressed one (the warm-up) stay FULL.

    Variance rounds are the steps that are multiples of a gap that doubles every
    ``var_update_scaler`` rounds (1, 2, 4, ...: the paper's variance-update policy T_v);
    after the freeze, synced rounds are the multiples of a gap that doubles every
    ``local_step_scaler`` steps up to ``local_step_clipper`` (its local-step policy T_u, with
    DeepSpeed's argument names).

    Difference from the paper: there each device takes local steps with its own momentum on
    skipped rounds, so the params differ between syncs. Here the params stay replicated (any
    data-parallel loop works unchanged): a skipped round applies the synchronized momentum,
    decayed, and each device keeps its gradients' share ``p_i`` for its next exchange, so no
    gradient is dropped, only delayed. The momentum a skipped round applies is the last
    exchanged one, 1-bit error included, which the error feedback returns only at the next
    synced round: skipped rounds trade loss for bytes where that error matters (measured on
    the LM benchmark: docs, "Language models over slow links: the measurements"), so they
    start late by default (``local_step_scaler=1000``). Gaps past 2 set off loss spikes at a
    constant learning rate, codec or none: a gradient waits up to ``gap - 1`` steps, and the
    synced round puts the gap's gradients into the momentum at once. Gaps of at most 2
    (``local_step_clipper=2``), or the default ``local_step_scaler``, did not spike where
    ``local_step_scaler=100`` did (docs, "Choosing a codec", "0/1 Adam's skipped rounds",
    with the measured accuracies). A skipped round sends one 4-byte
    non-finite flag (a scalar ``psum``), so a NaN or inf on any device still gives a NaN
    update everywhere and leaves every state as it was.

    **Non-finite steps and outliers.** A non-finite step keeps the whole state, its step
    count included: the rounds (warm-up, variance, synced and skipped ones) and the bias
    corrections count finite steps, so the next finite step is the one a run without the bad
    step takes, bit for bit (``jc.apply_if_finite`` skips it with a zero update and counts
    it). A finite gradient is never taken for a non-finite one: FULL and VARIANCE rounds
    sum ``g_i / n`` (a mean that fits float32 never overflows), and the momentum, the
    pending sums and each device's momentum step saturate at ``+-F32_MAX``. Unsaturated, a
    gradient of 1e30 at a coded variance round leaves a 1-bit momentum of ~1e28 in
    preconditioned units, which the next round multiplies by that coordinate's
    ``sqrt(v_hat)`` (~1e19): the momentum holds inf, every later step reads it, is flagged
    and skipped, and the count never moves again (docs, "Non-finite steps and outliers").

    Args:
      learning_rate: a float or an optax schedule.
      axis_name: the data-parallel mesh axis.
      var_freeze_step: the last step that may update the variance (>= 1).
      var_update_scaler: rounds per doubling of the variance-update gap.
      local_step_scaler: steps after the freeze per doubling of the gap between synced
        rounds (the first skipped round comes ``local_step_scaler`` steps after the freeze).
      local_step_clipper: the largest gap between synced rounds.
      warmup_steps: steps of uncompressed Adam at the start, every one a variance round (an
        int in ``[0, var_freeze_step]``; None: ``var_freeze_step // 2``, the first half of
        the variance phase, past the learning-rate warm-up and the first fast fall of the
        loss (``var_freeze_step // 4`` until 2026-11-26); 0: the paper's schedule, compressed
        rounds from step ``var_update_scaler + 1``). Each is a float32 all-reduce (its cost
        in bytes: docs, "1-bit Adam and 0/1 Adam for language models").
      codec: the momentum's codec (default: 1-bit signs scaled by their root mean square).
      b1: the momentum's decay.
      b2: the variance's decay.
      eps: added to the square root of the variance.
      weight_decay: AdamW's decoupled weight decay (>= 0; 0: Adam), as ``optax.adamw``.
      weight_decay_mask: None (decay every param) or ``optax.adamw``'s ``mask`` (a tree of
        bools like the params or a prefix of them, or a callable giving one; with a weight decay,
        ``init`` refuses one of another tree).
      rescale_variance: True (default): between variance rounds each leaf's variance follows
        the gradients' level (one float32 per leaf per step on the wire); False: it stays
        as the last variance round left it (with ``adam_bound`` the levels still travel: its
        floor reads them). A Python bool (``optax.inject_hyperparams``
        keeps bools static).
      variance_rounds: ``"exact"`` (default, the paper's): a variance round moves the
        momentum by the float32 mean gradient; ``"coded"``: once a compressed round has
        run, a variance round also sends the momentum through the codec (its error
        feedback kept in step) and takes the float32 gradient for the variance only.
      adam_bound: True (default): Adam's own bound ``C sqrt(1 - b2^t)`` (above; times the
        rounds a synced round sends after skipped ones) as a per-leaf floor on
        ``sqrt(v_hat)`` and a clip of the decoded mean step, identical on every device (the
        optimum of the mean loss stays a fixed point with data that differ by device:
        docs/choosing-a-codec.md, "What each exchange converges to"); False: sent as it is.
        A Python bool. Until 2026-11-27 True clipped each device's own step, which stopped
        short of that optimum.
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
      ValueError: at construction, ``var_freeze_step``, ``warmup_steps``, ``var_update_scaler``,
        ``local_step_scaler``, ``local_step_clipper``, ``b1``, ``b2``, ``eps``, ``weight_decay``,
        ``variance_rounds`` or ``axis_name`` outside its rule (the message names the argument; the
        rules: docs/errors.md); at ``init``, a ``weight_decay_mask`` that is no prefix of the
        params' tree.
      TypeError: at construction, ``var_freeze_step``, ``warmup_steps``, ``worker_momentum``,
        ``weight_decay``, ``weight_decay_mask``, ``rescale_variance``, ``adam_bound``,
        ``shard_axis`` or ``axis_name`` of the wrong kind; ``worker_momentum`` or
        ``worker_nesterov`` given (it keeps its own momentum).

    Example::

        tx = jc.zero_one_adam(3e-3, "data", var_freeze_step=200, local_step_clipper=4)

    References:
      Lu, Li, Zhang, De Sa, He, "Maximizing Communication Efficiency for Large-scale Training
      via 0/1 Adam", ICLR 2023 (arXiv 2202.06009, 2022).
    """
    chain = optax.chain(
        scale_by_zero_one_adam(
            axis_name,
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
            warmup_steps=warmup_steps,
            codec=codec,
            b1=b1,
            b2=b2,
            eps=eps,
            rescale_variance=rescale_variance,
            variance_rounds=variance_rounds,
            adam_bound=adam_bound,
            **exchange,
        ),
        *decoupled_weight_decay(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    return checking_decay_mask(chain, weight_decay_mask)
