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
device: each fragment's pseudo-gradient snapshot waiting for its delayed exchange) and
``count``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import collectives, skeleton
from jaxcomp._src.codecs.base import check_int
from jaxcomp._src.compressed_allreduce import compressed_allreduce

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
    if isinstance(mix, bool) or not isinstance(mix, int | float):
        raise TypeError(f"`mix` must be None or a number in [0, 1], got {mix!r}")
    if not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"`mix` must be in [0, 1], got {mix}")
    return float(mix)


def is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def partition(sizes: list[int], fragments: int) -> list[list[int]]:
    """Leaf indices in ``fragments`` groups, in order, balanced by size (none empty)."""
    total, groups, acc, g = float(sum(sizes)), [[] for _ in range(fragments)], 0.0, 0
    for j, s in enumerate(sizes):
        left = len(sizes) - j  # leaves still to place, this one included
        if groups[g] and g < fragments - 1:
            if acc + s / 2 > (g + 1) * total / fragments or left <= fragments - 1 - g:
                g += 1
        groups[g].append(j)
        acc += s
    return groups


def _varying(x: jax.Array, axes: tuple) -> jax.Array:
    """``x`` typed as varying over ``axes`` (a no-op where it already is, or outside vma)."""
    vma = getattr(jax.typeof(x), "vma", None)
    if vma is None:
        return x
    missing = tuple(a for a in axes if a not in vma)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _nonfinite(leaves: list[jax.Array]) -> jax.Array:
    flags = [jnp.logical_not(jnp.all(jnp.isfinite(x))) for x in leaves]
    return jnp.any(jnp.stack(flags)) if flags else jnp.zeros([], bool)


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

    @property
    def axes(self) -> tuple:
        return collectives.axis_names(self.axis_name)

    def exchange(self) -> optax.GradientTransformation | None:
        if self.codec is None:
            return None
        return compressed_allreduce(self.codec, self.axis_name, error_feedback=self.error_feedback)

    def offset(self, f: int) -> int:
        return f * self.sync_every // self.fragments

    def due(self, count: Any, f: int) -> Any:
        """Whether fragment ``f`` syncs at the step whose count (before it) is ``count``: a
        Python bool where the count is a constant (:func:`at_count`), else traced."""
        s, h = self.start_step, self.sync_every
        if not isinstance(count, jax.core.Tracer):
            c = int(count)
            return c >= 0 and (c < s or (c + 1 - s + self.offset(f)) % h == 0)
        periodic = jnp.mod(count + 1 - s + self.offset(f), h) == 0
        return (count >= 0) & ((count < s) | periodic)

    def lands(self, count: Any, f: int) -> Any:
        """Whether fragment ``f``'s exchange (``delay`` steps after its sync) runs at ``count``."""
        if not isinstance(count, jax.core.Tracer):
            return int(count) >= self.delay and self.due(int(count) - self.delay, f)
        return (count >= self.delay) & self.due(count - self.delay, f)


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


def make(cfg: Config) -> optax.GradientTransformationExtraArgs:
    """The optax transform of ``cfg``."""
    collectives.check_axis_name(cfg.axis_name)
    inner, exchange = cfg.inner, cfg.exchange()
    axes = cfg.axes
    fields = cfg.state_type._fields

    def init_fn(params):
        leaves, treedef, _ = float_leaves(params)
        groups = groups_of(cfg, params)
        values: dict[str, Any] = {
            "inner": jax.tree.map(lambda a: jnp.asarray(a)[None], inner.init(params)),
            "count": jnp.zeros([], jnp.int32),
            "outer": None,
            "exchange": None,
            "pending": None,
        }
        anchor = [jnp.asarray(x, F32) if is_float(x) else None for x in leaves]
        values["anchor"] = jax.tree.unflatten(treedef, anchor)
        parts = [[anchor[i] for i in g] for g in groups]
        if cfg.outer is not None:
            values["outer"] = tuple(cfg.outer.init(p) for p in parts)
        if exchange is not None:
            values["exchange"] = tuple(exchange.init(p) for p in parts)
        if cfg.delay:
            values["pending"] = tuple([jnp.zeros((1, *x.shape), F32) for x in p] for p in parts)
        return cfg.state_type(**{k: v for k, v in values.items() if k in fields})

    def average(delta, ex_state):
        """The mean over devices (through the codec with its feedback, or pmean)."""
        if exchange is None:
            return jax.lax.pmean(delta, cfg.axis_name), ex_state
        return exchange.update(delta, ex_state, None)

    def outer_step(mean, outer_state, anchor):
        if cfg.outer is None:
            return [a - m for a, m in zip(anchor, mean, strict=True)], outer_state
        u, outer_state = cfg.outer.update(mean, outer_state, anchor)
        return [a + v.astype(F32) for a, v in zip(anchor, u, strict=True)], outer_state

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                f"{cfg.name} needs `params` in update(grads, state, params): it moves each "
                "device's own params to the synchronized ones"
            )
        skeleton.begin(cfg.name, updates, params, cfg.axis_name)
        expected = jax.eval_shape(init_fn, params)
        skeleton.check_fields(
            cfg.name,
            state,
            {
                k: getattr(expected, k)
                for k in ("inner", "anchor", "outer", "pending")
                if k in fields
            },
            cfg.axis_name,
        )
        groups = groups_of(cfg, params)
        inner_old = jax.tree.map(lambda a: a[0], state.inner)
        u, inner_new = inner.update(updates, inner_old, params, **extra_args)
        p_leaves, treedef = jax.tree.flatten(params)
        u_leaves = treedef.flatten_up_to(u)
        local_bad = _nonfinite([x for x, p in zip(u_leaves, p_leaves, strict=True) if is_float(p)])
        count = state.count
        out = list(u_leaves)
        anchor = treedef.flatten_up_to(state.anchor)
        new_anchor = list(anchor)
        new_outer = list(state.outer) if "outer" in fields and state.outer is not None else None
        new_ex = list(state.exchange) if state.exchange is not None else None
        new_pending = list(state.pending) if "pending" in fields and state.pending else None
        bad = jnp.zeros([], bool)

        def local_of(p, v):
            return optax.apply_updates(p, v).astype(F32)

        for f, idx in enumerate(groups):
            p_f, u_f = [p_leaves[i] for i in idx], [u_leaves[i] for i in idx]
            a_f = [anchor[i] for i in idx]
            o_f = None if new_outer is None else new_outer[f]
            e_f = None if new_ex is None else new_ex[f]

            def restart(target, p_f, u_f, bad):
                """The updates moving each param to its target; NaN everywhere if ``bad``
                (a mean that is not finite: the state keeps its old anchor)."""
                return [
                    _varying(jnp.where(bad, jnp.nan, t - p.astype(F32)).astype(v.dtype), axes)
                    for t, p, v in zip(target, p_f, u_f, strict=True)
                ]

            if not cfg.delay:

                def sync(ops):
                    p_f, u_f, a_f, o_f, e_f = ops
                    delta = [a - local_of(p, v) for a, p, v in zip(a_f, p_f, u_f, strict=True)]
                    mean, e_f = average(delta, e_f)
                    a_f, o_f = outer_step(mean, o_f, a_f)
                    bad = _nonfinite(mean)
                    return restart(a_f, p_f, u_f, bad), a_f, o_f, e_f, bad

                def keep(ops):
                    p_f, u_f, a_f, o_f, e_f = ops
                    return [_varying(v, axes) for v in u_f], a_f, o_f, e_f, jnp.zeros([], bool)

                ops = (p_f, u_f, a_f, o_f, e_f)
                outs, a_f, o_f, e_f, b = cond(cfg.due(count, f), sync, keep, ops)
            else:
                w_f = new_pending[f]

                def snapshot(ops):
                    p_f, u_f, a_f, w_f = ops
                    return [
                        _varying((a - local_of(p, v))[None], axes)
                        for a, p, v in zip(a_f, p_f, u_f, strict=True)
                    ]

                def hold(ops):
                    return [_varying(w, axes) for w in ops[3]]

                w_new = cond(cfg.due(count, f), snapshot, hold, (p_f, u_f, a_f, w_f))

                def land(ops):
                    p_f, u_f, a_f, o_f, e_f, w_f = ops
                    mean, e_f = average([w[0] for w in w_f], e_f)
                    a_f, o_f = outer_step(mean, o_f, a_f)
                    target = [
                        (1.0 - cfg.mix) * local_of(p, v) + cfg.mix * a
                        for p, v, a in zip(p_f, u_f, a_f, strict=True)
                    ]
                    bad = _nonfinite(mean)
                    return restart(target, p_f, u_f, bad), a_f, o_f, e_f, bad

                def wait(ops):
                    p_f, u_f, a_f, o_f, e_f, _ = ops
                    return [_varying(v, axes) for v in u_f], a_f, o_f, e_f, jnp.zeros([], bool)

                ops = (p_f, u_f, a_f, o_f, e_f, w_f)
                outs, a_f, o_f, e_f, b = cond(cfg.lands(count, f), land, wait, ops)
                new_pending[f] = w_new
            for i, o in zip(idx, outs, strict=True):
                out[i] = o
            for i, a in zip(idx, a_f, strict=True):
                new_anchor[i] = a
            if new_outer is not None:
                new_outer[f] = o_f
            if new_ex is not None:
                new_ex[f] = e_f
            bad = bad | b

        values = {
            "inner": _where(local_bad, state.inner, jax.tree.map(lambda a: a[None], inner_new)),
            "count": count + 1,
            "anchor": jax.tree.unflatten(treedef, new_anchor),
            "outer": None if new_outer is None else tuple(new_outer),
            "exchange": None if new_ex is None else tuple(new_ex),
            "pending": None
            if new_pending is None
            else _where(local_bad, state.pending, tuple(new_pending)),
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


def check_common(
    sync_every: Any, fragments: Any = 1, delay: Any = 0, start_step: Any = 0
) -> tuple[int, int, int, int]:
    sync_every = check_int("sync_every", sync_every, 1)
    fragments = check_int("fragments", fragments, 1)
    if fragments > sync_every:
        raise ValueError(
            f"`fragments` must be at most `sync_every` ({sync_every}): fragments sync at "
            f"distinct steps of each period, got {fragments}"
        )
    delay = check_int("delay", delay, 0)
    if delay >= sync_every:
        raise ValueError(
            f"`delay` must be less than `sync_every` ({sync_every}): an exchange lands before "
            f"the fragment's next sync, got {delay}"
        )
    start_step = check_int("start_step", start_step, 0)
    return sync_every, fragments, delay, start_step


def schedule(
    count: int, *, sync_every: int, fragments: int = 1, delay: int = 0, start_step: int = 0
) -> tuple[bool, ...]:
    """Which fragments exchange (with ``delay``: land) at the step of count ``count``."""
    cfg = Config("", tuple, optax.identity(), None, sync_every, None, None, None, fragments)
    cfg = dataclasses.replace(cfg, delay=delay, start_step=start_step)
    return tuple(bool(cfg.lands(count, f)) for f in range(fragments))
