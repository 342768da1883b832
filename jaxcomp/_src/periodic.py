"""The core shared by ``jc.local_sgd`` and ``jc.diloco``: local steps, periodic averaging.

Each device runs an inner optax transform on its own gradients and its own params (replicas,
see :mod:`jaxcomp._src.replicas`). At scheduled steps a *fragment* of the leaves (all of
them unless streaming) is synchronized: the pseudo-gradient ``Delta_i = x - theta_i``
(``x``: the anchor, the params of the last sync) is averaged (``pmean``, or
``jc.compressed_allreduce`` with its error feedback on ``Delta``), an outer step moves the
anchor (DiLoCo: an optax transform; local SGD: ``x <- x - mean Delta``, the mean of the
params), and every device restarts from the new anchor, or with ``delay`` mixes it into
params that went on meanwhile.

The sync runs inside a ``jax.lax.cond`` on the step count (identical on every device), so
its collectives run only on sync steps. ``comm_report`` of a compiled step counts every
branch; :func:`at_count` fixes the count to a constant, the branch is chosen while tracing
and the report shows that one step's traffic.

State (a NamedTuple with ``PER_DEVICE_FIELDS``): ``inner`` (per device: the inner optax
state, each leaf with a leading slot of 1), ``anchor`` (replicated: float32 like the
params; None at non-float leaves, which keep the inner update and are never averaged),
``outer`` and ``exchange`` (replicated / nested: one per fragment), ``pending`` (per
device: each fragment's pseudo-gradient snapshot waiting for its delayed exchange), ``count``
and, with ``delay``, ``taken`` (replicated, one per fragment: the count at which the pending
snapshot was taken, -1 once it has landed). A snapshot lands once, ``delay`` steps after it
was taken by the transform's own ``delay`` (:func:`landing`), so a state restored into
another ``delay`` or ``sync_every`` neither lands a snapshot twice nor drops one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import (
    collectives,
    feedback,
    inner_replicas,
    inner_update_types,
    replicas,
    shards,
    skeleton,
    whole_leaf_in_step,
)
from jaxcomp._src.axes import manual_axes
from jaxcomp._src.codecs.base import check_int, is_number, kept_any
from jaxcomp._src.compressed_allreduce import compressed_allreduce
from jaxcomp._src.fragments import partition

F32 = jnp.float32


def check_transform(name: str, tx: Any) -> optax.GradientTransformation:
    """``tx`` if it is an optax transform (callable ``init`` and ``update``), else a TypeError."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            f"`{name}` must be an optax GradientTransformation (init and update), got {tx!r}"
        )
    return tx


def check_mix(mix: Any) -> float | None:
    if mix is None:
        return None
    if not is_number(mix):
        raise TypeError(f"`mix` must be None or a number in [0, 1], got {mix!r}")
    if not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"`mix` must be in [0, 1], got {mix}")
    return float(mix)


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _varying(x: jax.Array, axes: tuple) -> jax.Array:
    """``x`` typed as varying over ``axes`` (a no-op where it already is, or where the
    context does not track variance: pmap, ``check_vma=False``)."""
    if not skeleton.tracks_variance(axes):
        return x
    manual = manual_axes()
    missing = tuple(a for a in axes if a in manual and a not in skeleton.varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _nonfinite(leaves: list[jax.Array]) -> jax.Array:
    flags = [jnp.logical_not(jnp.all(jnp.isfinite(x))) for x in leaves]
    return kept_any(flags) if flags else jnp.zeros([], bool)


def _where(flag: jax.Array, old: Any, new: Any) -> Any:
    return jax.tree.map(lambda o, n: jnp.where(flag, o, n), old, new)


@dataclasses.dataclass(frozen=True)
class Config:
    """What a periodic transform does (static)."""

    name: str
    state_type: type
    inner: optax.GradientTransformation
    axis_name: Any
    sync_every: int
    outer: optax.GradientTransformation | None  # None: the anchor becomes the mean params
    codec: Any
    error_feedback: Any
    fragments: int = 1
    delay: int = 0
    mix: float = 1.0
    start_step: int = 0
    options: tuple = ()  # (name, value) pairs: the codec exchange's options (EXCHANGE_OPTIONS)
    early: tuple = ()  # steps (from 1, after start_step) of the syncs before every sync_every
    shard_axis: Any = None  # the axes the params are FSDP shards over, for untyped programs

    @property
    def axes(self) -> tuple:
        return collectives.axis_names(self.axis_name)

    def exchange(self) -> optax.GradientTransformation | None:
        if self.codec is None:
            return None
        return compressed_allreduce(
            self.codec,
            self.axis_name,
            error_feedback=self.error_feedback,
            # the transform warns itself where it is missing
            shard_axis=() if self.shard_axis is None else self.shard_axis,
            **dict(self.options),
        )

    def offset(self, f: int) -> int:
        return f * self.sync_every // self.fragments

    def due(self, count: Any, f: int) -> Any:
        """Whether fragment ``f`` syncs at the step whose count (before it) is ``count``: a
        Python bool where the count is a constant (:func:`at_count`), else traced."""
        s, h, early = self.start_step, self.sync_every, self.early
        base = early[-1] if early else 0  # the steady period starts after the early syncs
        if not isinstance(count, jax.core.Tracer):
            c = int(count)
            k = c + 1 - s
            if k <= base:
                return c >= 0 and (c < s or k in early)
            return c >= 0 and (k - base + self.offset(f)) % h == 0
        k = count + 1 - s
        hit = (k > base) & (jnp.mod(k - base + self.offset(f), h) == 0)
        for e in early:
            hit = hit | (k == e)
        return (count >= 0) & ((count < s) | hit)

    def lands(self, count: Any, f: int) -> Any:
        """Whether fragment ``f``'s exchange (``delay`` steps after its sync) runs at ``count``."""
        if not isinstance(count, jax.core.Tracer):
            return int(count) >= self.delay and self.due(int(count) - self.delay, f)
        return (count >= self.delay) & self.due(count - self.delay, f)


#: The options of the codec's exchange (``jc.compressed_allreduce``) that ``jc.local_sgd`` and
#: ``jc.diloco`` pass on (``**exchange``). ``min_size``: leaves with fewer elements go through
#: plain float32 ``pmean`` (default 1024, as ``jc.compressed_allreduce``).
EXCHANGE_OPTIONS = (
    "strategy",
    "min_size",
    "granularity",
    "bucket_bytes",
    "seed",
    "server_feedback",
)
MIN_SIZE = inspect.signature(compressed_allreduce).parameters["min_size"].default


def check_exchange(name: str, codec: Any, exchange: dict) -> tuple:
    """``exchange`` (the ``**exchange`` keywords) as sorted ``(name, value)`` pairs; an error
    naming a keyword that is no exchange option, or options given without a codec."""
    unknown = sorted(set(exchange) - set(EXCHANGE_OPTIONS))
    if unknown:
        raise TypeError(
            f"jc.{name}: unexpected keyword {unknown[0]!r}; the codec exchange takes "
            f"{', '.join(EXCHANGE_OPTIONS)}"
        )
    if exchange and codec is None:
        raise TypeError(
            f"jc.{name}: `{sorted(exchange)[0]}` sets the codec's exchange, but `codec` is None "
            "(the sync is a plain float32 pmean): pass codec= or drop it"
        )
    return tuple(sorted(exchange.items()))


def check_feedback_needs_codec(name: str, codec: Any, error_feedback: Any) -> None:
    """``error_feedback`` ``"residual"`` / ``"ef21"`` only with a codec: without one the sync
    is a plain float32 pmean, which has no error to feed back (it was ignored silently)."""
    if codec is None and error_feedback in ("residual", "ef21"):
        raise TypeError(
            f"jc.{name}: `error_feedback`={error_feedback!r} is the codec's feedback, but "
            "`codec` is None (the sync is a plain float32 pmean, nothing to feed back): pass "
            "codec= or leave `error_feedback` out"
        )


def warn_if_nothing_compressed(cfg: Config, parts: list[list[Any]]) -> None:
    """A codec that compresses no leaf (every float leaf under ``min_size``) is a silent no-op:
    the bytes equal ``codec=None``. Say so once, at init, with the fix."""
    min_size = dict(cfg.options).get("min_size", MIN_SIZE)
    sizes = [int(jnp.size(x)) for p in parts for x in p]
    if sizes and max(sizes) < max(min_size, 1):
        warnings.warn(
            f"jc.{cfg.name}: codec {cfg.codec} compresses none of the params: every float "
            f"leaf has fewer than min_size={min_size} elements (largest: {max(sizes)}) and is "
            f"sent as plain float32; pass min_size=0 (or a smaller value) to compress them",
            stacklevel=2,
        )


def build(
    name: str,
    state_type: type,
    inner: Any,
    axis_name: Any,
    sync_every: Any,
    *,
    codec: Any,
    error_feedback: Any,
    exchange: dict,
    **schedule: Any,
) -> optax.GradientTransformationExtraArgs:
    """The checks ``jc.local_sgd`` and ``jc.diloco`` share, then :func:`make`. ``schedule``:
    ``outer``, ``fragments``, ``delay``, ``mix``, ``start_step`` (already checked)."""
    inner = check_transform("inner", inner)
    collectives.check_axis_name(axis_name)
    sync_every, early = split_sync_every(sync_every)
    feedback.check_kind(error_feedback)
    options = check_exchange(name, codec, exchange)
    check_feedback_needs_codec(name, codec, error_feedback)
    outer = schedule.pop("outer", None)
    cfg = Config(name, state_type, inner, axis_name, sync_every, outer, codec, error_feedback)
    cfg = dataclasses.replace(cfg, options=options, early=early, **schedule)
    if codec is not None:  # its own checks (codec, options), naming the argument
        cfg.exchange()
    return make(cfg)


def cond(pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    """``jax.lax.cond``, or the branch itself where ``pred`` is a Python bool."""
    if isinstance(pred, bool):
        return (true_fn if pred else false_fn)(operands)
    return jax.lax.cond(pred, true_fn, false_fn, operands)


def float_leaves(params: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, treedef = jax.tree.flatten(params)
    return leaves, treedef, [i for i, x in enumerate(leaves) if is_float(x)]


def groups_of(cfg: Config, params: Any) -> list[list[int]]:
    """The leaf indices of each fragment (float leaves only)."""
    leaves, _, floats = float_leaves(params)
    if cfg.fragments > len(floats):
        raise ValueError(
            f"{cfg.name}: `fragments`={cfg.fragments} is more than the params' "
            f"{len(floats)} float leaves: every fragment needs at least one"
        )
    sizes = [int(jnp.size(leaves[i])) for i in floats]
    return [[floats[j] for j in g] for g in partition(sizes, cfg.fragments)]


class _Exchange(NamedTuple):
    """How a sync averages pseudo-gradients and moves the anchor (one per transform)."""

    cfg: Config
    exchange: optax.GradientTransformation | None  # the codec's compressed_allreduce, or None

    def average(self, delta: list, ex_state: Any) -> tuple[list, Any]:
        """The mean over devices (through the codec with its feedback, or pmean)."""
        if self.exchange is None:
            return skeleton.tree_pmean(delta, self.cfg.axis_name), ex_state
        return self.exchange.update(delta, ex_state, None)

    def outer_step(self, mean: list, outer_state: Any, anchor: list) -> tuple[list, Any]:
        """The new anchor: minus the mean (local SGD), or the outer optimizer's step."""
        if self.cfg.outer is None:
            return [a - m for a, m in zip(anchor, mean, strict=True)], outer_state
        u, outer_state = self.cfg.outer.update(mean, outer_state, anchor)
        return [a + v.astype(F32) for a, v in zip(anchor, u, strict=True)], outer_state


def _local(p: jax.Array, v: jax.Array) -> jax.Array:
    """This device's params after the inner step, in float32."""
    return optax.apply_updates(p, v).astype(F32)


def wide(dtype: Any) -> Any:
    """The dtype of the updates returned for a float leaf of ``dtype``: float32 at least.

    A bf16/fp16 param's target (the anchor, rounded to the param's dtype) differs from the
    param by a float32-exact amount, and ``optax.apply_updates`` adds a float32 update in
    float32 before casting back: every replica lands on the same bf16/fp16 value, bit for
    bit. An update in the narrow type would round ``target - p`` per device first.
    """
    return jnp.promote_types(dtype, F32)


def _restart(target: list, p_f: list, u_f: list, bad: jax.Array, axes: tuple) -> list:
    """The updates moving each param to its target, NaN everywhere if ``bad`` (a mean that
    is not finite: the state keeps its old anchor). The target is rounded to the param's
    dtype first and the update is float32 for narrow params (:func:`wide`): ``p + u`` then
    gives every replica the same value (float32 params: up to the rounding of ``p + u``).
    For float64 params (``jax_enable_x64``) ``t - p`` is formed in float64, so ``p + u`` is
    the float32 target (a float32 ``t - p`` kept ``p``'s digits below float32's resolution)."""
    return [
        _varying(jnp.where(bad, jnp.nan, _to(t, p, wide(v.dtype))), axes)
        for t, p, v in zip(target, p_f, u_f, strict=True)
    ]


def _to(target: jax.Array, p: jax.Array, dtype: Any) -> jax.Array:
    """``target - p`` in ``dtype``, the target rounded to ``p``'s dtype first."""
    return target.astype(p.dtype).astype(dtype) - p.astype(dtype)


def _keep(ops: tuple, axes: tuple) -> tuple:
    """No exchange this step: the inner updates (float32 for narrow params, as
    :func:`_restart`'s), the fragment's state as it was."""
    _, u_f, a_f, o_f, e_f = ops[:5]
    outs = [_varying(v.astype(wide(v.dtype)), axes) for v in u_f]
    return outs, a_f, o_f, e_f, jnp.zeros([], bool)


def _sync_now(ex: _Exchange, ops: tuple, axes: tuple) -> tuple:
    """Average the pseudo-gradients, step the anchor, restart every device from it."""
    p_f, u_f, a_f, o_f, e_f = ops
    delta = [a - _local(p, v) for a, p, v in zip(a_f, p_f, u_f, strict=True)]
    mean, e_f = ex.average(delta, e_f)
    a_f, o_f = ex.outer_step(mean, o_f, a_f)
    bad = shards.any_shard(_nonfinite(mean), shard_axis=ex.cfg.shard_axis)
    return _restart(a_f, p_f, u_f, bad, axes), a_f, o_f, e_f, bad


def _snapshot(ops: tuple, axes: tuple) -> list:
    """Delayed sync, at the fragment's sync step: keep this device's pseudo-gradient, from
    ``ops = (params, this step's updates, anchor)`` after any landing of the same step (one
    lands at a sync step only after a restore into another ``delay`` or ``sync_every``), so
    that it holds what the landed one did not."""
    p_f, u_f, a_f = ops[:3]
    return [_varying((a - _local(p, v))[None], axes) for a, p, v in zip(a_f, p_f, u_f, strict=True)]


def _land(ex: _Exchange, ops: tuple, axes: tuple) -> tuple:
    """Delayed sync, ``delay`` steps later: average the snapshots, step the anchor, and mix
    it into the params that went on meanwhile (weight ``mix``)."""
    p_f, u_f, a_f, o_f, e_f, w_f = ops
    mean, e_f = ex.average([w[0] for w in w_f], e_f)
    a_f, o_f = ex.outer_step(mean, o_f, a_f)
    mix = ex.cfg.mix
    target = [(1.0 - mix) * _local(p, v) + mix * a for p, v, a in zip(p_f, u_f, a_f, strict=True)]
    bad = shards.any_shard(_nonfinite(mean), shard_axis=ex.cfg.shard_axis)
    return _restart(target, p_f, u_f, bad, axes), a_f, o_f, e_f, bad


def landing(cfg: Config, count: Any, f: int, taken: Any, due: Any) -> Any:
    """Whether fragment ``f``'s pending snapshot lands at the step of count ``count``.

    With ``taken`` (the count at which the snapshot was taken, -1 once it has landed): a
    snapshot not landed yet lands ``delay`` steps after it was taken, or at once where that is
    past (a state restored into a smaller ``delay``), or where a new snapshot is due first (a
    smaller ``sync_every``): ``taken >= 0 and (count - taken >= delay or due)``. A snapshot
    landed before a save (``taken = -1``) never lands again, whatever the new ``delay``. On
    one schedule this is :meth:`Config.lands` at every step (``delay < H``: a snapshot lands
    before the next is due). ``taken`` None (a state saved before the field existed) or a
    constant count (:func:`at_count`): the schedule of the count, as before.
    """
    if taken is None or not isinstance(count, jax.core.Tracer):
        return cfg.lands(count, f)
    return (taken >= 0) & ((count - taken >= cfg.delay) | due)


def _taken_after(count: Any, taken: Any, due: Any, landed: Any) -> Any:
    """``taken`` after the step: the count where a snapshot is taken, -1 where one landed."""
    if taken is None:
        return None
    return jnp.where(due, count, jnp.where(landed, -1, taken)).astype(jnp.int32)


def _fragment_step(ex: _Exchange, ops: tuple, delayed: tuple, count: Any, f: int) -> tuple:
    """Fragment ``f``'s step: ``(outs, anchor, outer, exchange, bad, pending, taken)``;
    ``delayed`` is its ``(pending, taken)`` (None, None without ``delay``)."""
    cfg, axes = ex.cfg, ex.cfg.axes
    keep = functools.partial(_keep, axes=axes)
    due = cfg.due(count, f)
    if not cfg.delay:
        now = functools.partial(_sync_now, ex, axes=axes)
        return (*cond(due, now, keep, ops), None, None)
    pending, taken = delayed
    landed = landing(cfg, count, f, taken, due)
    land = functools.partial(_land, ex, axes=axes)
    outs, a_f, o_f, e_f, bad = cond(landed, land, keep, (*ops, pending))
    hold = lambda o: [_varying(w, axes) for w in o[3]]  # noqa: E731
    snapshot = functools.partial(_snapshot, axes=axes)
    w_new = cond(due, snapshot, hold, (ops[0], outs, a_f, pending))
    return outs, a_f, o_f, e_f, bad, w_new, _taken_after(count, taken, due, landed)


def _check_update(cfg: Config, updates: Any, state: Any, params: Any, init_fn: Any) -> None:
    """Trace-time checks: ``params`` given, the gradient tree and the state match them
    (``init_fn(params)`` traced abstractly once ``params`` is known to be there)."""
    if params is None:
        raise ValueError(
            f"{cfg.name} needs `params` in update(grads, state, params): it moves each "
            "device's own params to the synchronized ones"
        )
    skeleton.begin(cfg.name, updates, params, cfg.axis_name)
    shards.check_traced(cfg.name, cfg.axis_name, cfg.shard_axis)
    replicas.check_within_replica(cfg.name, updates, params, cfg.axis_name)
    expected = jax.eval_shape(init_fn, params)
    names = [k for k in ("inner", "anchor", "outer", "pending") if k in cfg.state_type._fields]
    if getattr(state, "taken", None) is not None:  # None: saved before the field existed
        names.append("taken")
    want = {k: getattr(expected, k) for k in names}
    skeleton.check_fields(cfg.name, state, want, cfg.axis_name, updates)


def check_params_are_replicas(name: str, params: Any, axis_name: Any) -> None:
    """Refuse ``params`` typed the same on every device of ``axis_name`` (``check_vma=True``).

    A periodic transform keeps one model per device between syncs: its updates differ per
    device, so params that entered the step replicated (``P()``, the per-step recipes'
    step) would leave it differing per device, and jax refuses that step later ("out_specs
    ... can't be statically inferred"), naming neither the params nor the fix.
    """
    if not skeleton.tracks_variance(axis_name):
        return
    bad = skeleton.invariant_leaves(params, collectives.axis_names(axis_name))
    if bad:
        raise ValueError(
            f"{name}: `params` at {bad[:4]} entered the step replicated over {axis_name!r}: "
            f"{name} keeps one model per device between syncs, so they would leave it "
            "differing per device. Place them with "
            f"jc.replica_params(params, mesh, {axis_name!r}) and jc.replica_specs(params, "
            f"{axis_name!r}) as their specs, and in the step take this device's copy with "
            "jc.own and give it back with jc.slot (docs/local-sgd-diloco.md, Params per "
            "device)"
        )


def _fields_of(state: Any) -> dict[str, Any]:
    """The per-fragment fields of ``state`` as mutable lists (None where absent)."""
    get = lambda k: getattr(state, k, None)  # noqa: E731
    return {
        "outer": None if get("outer") is None else list(state.outer),
        "exchange": None if state.exchange is None else list(state.exchange),
        "pending": list(state.pending) if get("pending") else None,
        "taken": None if get("taken") is None else list(state.taken),
    }


def _sync_fragments(ex: _Exchange, state: Any, treedef: Any, p_leaves: list, u_leaves: list):
    """Every fragment's step; returns ``(outs, anchor, per-fragment fields, bad)``."""
    groups = groups_of(ex.cfg, jax.tree.unflatten(treedef, p_leaves))
    out, anchor = list(u_leaves), treedef.flatten_up_to(state.anchor)
    new_anchor, parts, bad = list(anchor), _fields_of(state), jnp.zeros([], bool)
    for f, idx in enumerate(groups):
        at = lambda k: None if parts[k] is None else parts[k][f]  # noqa: E731, B023
        ops = (
            [p_leaves[i] for i in idx],
            [u_leaves[i] for i in idx],
            [anchor[i] for i in idx],
            at("outer"),
            at("exchange"),
        )
        delayed = (at("pending"), at("taken"))
        outs, a_f, o_f, e_f, b, w_f, t_f = _fragment_step(ex, ops, delayed, state.count, f)
        for i, o, a in zip(idx, outs, a_f, strict=True):
            out[i], new_anchor[i] = o, a
        for k, v in (("outer", o_f), ("exchange", e_f), ("pending", w_f), ("taken", t_f)):
            if parts[k] is not None:
                parts[k][f] = v
        bad = bad | b
    return out, new_anchor, parts, bad


def make(cfg: Config) -> optax.GradientTransformationExtraArgs:
    """The optax transform of ``cfg``."""
    collectives.check_axis_name(cfg.axis_name)
    inner, ex = cfg.inner, _Exchange(cfg, cfg.exchange())
    fields = cfg.state_type._fields

    def build(params):
        leaves, treedef, _ = float_leaves(params)
        groups = groups_of(cfg, params)
        values: dict[str, Any] = {
            "inner": jax.tree.map(lambda a: jnp.asarray(a)[None], inner.init(params)),
            "count": jnp.zeros([], jnp.int32),
            "outer": None,
            "exchange": None,
            "pending": None,
            "taken": None,
        }
        anchor = [jnp.asarray(x, F32) if is_float(x) else None for x in leaves]
        values["anchor"] = jax.tree.unflatten(treedef, anchor)
        parts = [[anchor[i] for i in g] for g in groups]
        if cfg.outer is not None:
            values["outer"] = tuple(cfg.outer.init(p) for p in parts)
        if ex.exchange is not None:
            values["exchange"] = tuple(ex.exchange.init(p) for p in parts)
            warn_if_nothing_compressed(cfg, parts)
        if cfg.delay:
            values["pending"] = tuple([jnp.zeros((1, *x.shape), F32) for x in p] for p in parts)
            values["taken"] = tuple(jnp.full([], -1, jnp.int32) for _ in parts)
        return cfg.state_type(**{k: v for k, v in values.items() if k in fields})

    def init_fn(params):
        state = build(params)
        whole_leaf_in_step.warn_inner_blocks(f"jc.{cfg.name}", state.inner, params, cfg.axes)
        return state

    def update_fn(updates, state, params=None, **extra_args):
        _check_update(cfg, updates, state, params, build)
        inner_old = jax.tree.map(lambda a: a[0], state.inner)
        with inner_replicas.stepping_inner(cfg.axes):  # each device's params: its replica
            u, inner_new = inner.update(updates, inner_old, params, **extra_args)
        inner_update_types.check_inner_update(f"jc.{cfg.name}", u, params, cfg.axes)
        p_leaves, treedef = jax.tree.flatten(params)
        u_leaves = treedef.flatten_up_to(u)
        floats = [x for x, p in zip(u_leaves, p_leaves, strict=True) if is_float(p)]
        local_bad = shards.any_shard(_nonfinite(floats), keep=cfg.axes, shard_axis=cfg.shard_axis)
        out, anchor, parts, bad = _sync_fragments(ex, state, treedef, p_leaves, u_leaves)
        check_params_are_replicas(cfg.name, params, cfg.axis_name)  # after the state's checks
        # A device's non-finite inner update freezes its inner state only. Its delayed
        # pseudo-gradient snapshot (``pending``) is the message the next landing exchanges:
        # taken as it is, non-finite, so that the landing's mean is flagged on every device.
        # Kept from the previous period instead, it hid the bad device from every later sync.
        values = {
            "inner": _where(local_bad, state.inner, jax.tree.map(lambda a: a[None], inner_new)),
            "count": state.count + 1,
            "anchor": jax.tree.unflatten(treedef, anchor),
            "outer": None if parts["outer"] is None else tuple(parts["outer"]),
            "exchange": None if parts["exchange"] is None else tuple(parts["exchange"]),
            "pending": None if parts["pending"] is None else tuple(parts["pending"]),
            "taken": None if parts["taken"] is None else tuple(parts["taken"]),
        }
        new_state = cfg.state_type(**{k: v for k, v in values.items() if k in fields})
        # A sync whose mean is not finite (the flag is identical on every device) leaves the
        # whole state as it was, the count too: the next step retries the same sync.
        new_state = skeleton.freeze(bad, state, new_state)
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def at_count(state: Any, count: int) -> Any:
    """``state`` (a chain's state holding one periodic state) with its step count replaced by
    the constant ``count``: lowered inside a step, XLA folds the sync condition and drops the
    branches not taken, so ``comm_report`` shows the traffic of that one step."""

    def fix(node):
        if isinstance(node, tuple) and hasattr(type(node), "PER_DEVICE_FIELDS"):
            if "anchor" in type(node)._fields and "inner" in type(node)._fields:
                return node._replace(count=np.int32(count))
        return node

    return jax.tree.map(fix, state, is_leaf=lambda n: hasattr(type(n), "PER_DEVICE_FIELDS"))


def period_counts(sync_every: int, start_step: int = 0) -> range:
    """The counts of one period of the schedule after ``start_step`` (for bytes per step)."""
    return range(start_step, start_step + sync_every)


def split_sync_every(sync_every: Any) -> tuple[int, tuple[int, ...]]:
    """``(H, early)`` of a checked ``sync_every``: an int ``H`` (``early`` empty), or a
    sequence of intervals ``(h_1, ..., h_k)``: ``H = h_k`` and ``early`` the steps of the
    syncs before it, ``(h_1, h_1 + h_2, ..., h_1 + ... + h_{k-1})``; the syncs after them
    come every ``H`` steps. A ValueError or TypeError naming ``sync_every`` otherwise."""
    if not isinstance(sync_every, list | tuple):
        return check_int("sync_every", sync_every, 1), ()
    if not sync_every:
        raise ValueError(
            "`sync_every` must be an int or a non-empty sequence of ints (the intervals "
            "between syncs, the last one repeated), got an empty sequence"
        )
    hs = [check_int(f"sync_every[{i}]", h, 1) for i, h in enumerate(sync_every)]
    return hs[-1], tuple(itertools.accumulate(hs[:-1]))


def check_common(
    sync_every: Any, fragments: Any = 1, delay: Any = 0, start_step: Any = 0
) -> tuple[Any, int, int, int]:
    """The checked schedule: ``sync_every`` (an int, or a tuple of intervals: see
    :func:`split_sync_every`), ``fragments``, ``delay`` and ``start_step``."""
    h, early = split_sync_every(sync_every)
    fragments = check_int("fragments", fragments, 1)
    if fragments > h:
        raise ValueError(
            f"`fragments` must be at most `sync_every` ({h}): fragments sync at "
            f"distinct steps of each period, got {fragments}"
        )
    delay = check_int("delay", delay, 0)
    if delay >= h:
        raise ValueError(
            f"`delay` must be less than `sync_every` ({h}): an exchange lands before "
            f"the fragment's next sync, got {delay}"
        )
    if early and (fragments > 1 or delay):
        raise ValueError(
            f"`sync_every` as a sequence of intervals ({tuple(sync_every)}) takes "
            f"`fragments`=1 and `delay`=0, got fragments={fragments}, delay={delay}: pass an "
            "int `sync_every` to stream fragments or delay the exchange"
        )
    start_step = check_int("start_step", start_step, 0)
    steps = tuple(int(x) for x in sync_every) if early else h
    return steps, fragments, delay, start_step


def schedule(
    count: int, *, sync_every: Any, fragments: int = 1, delay: int = 0, start_step: int = 0
) -> tuple[bool, ...]:
    """Which fragments exchange (with ``delay``: land) at the step of count ``count``."""
    h, early = split_sync_every(sync_every)
    cfg = Config("", tuple, optax.identity(), None, h, None, None, None, fragments)
    cfg = dataclasses.replace(cfg, delay=delay, start_step=start_step, early=early)
    return tuple(bool(cfg.lands(count, f)) for f in range(fragments))
