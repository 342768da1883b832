"""SparseLoCo's exchange through a coordinate mask that every device derives on its own.

Per-replica top-k (:func:`jaxcomp.chunked_top_k`) sends indices, and no two devices keep the
same coordinates, so the payloads cannot be added: they travel in an all-gather, ``(n - 1) P``
bytes per device. When every device keeps the *same* ``k`` coordinates of a leaf, chosen from
something all of them already hold, no index travels and the kept values can be summed: any
dense codec and strategy of :func:`jaxcomp._src.collectives.reduce_segments` carries them
(e.g. ``jc.int_quant(4)`` two-phase, about ``2 (n - 1) / n P``). The masks:

* ``"random"``: ``k`` coordinates drawn without replacement from a key shared by every device,
  folded with the sync count and the leaf's index (as ``jc.random_k``'s shared indices);
* ``"previous"``: the ``k`` largest magnitudes of the previous sync's merged update (held by
  every device), a share ``explore`` of ``k`` drawn at random from the rest; random at the
  first sync. That update is zero outside the last mask, so the mask moves only by
  ``explore`` and by the kept values the codec rounded to 0 (:func:`select`).

What the mask (and the value codec) does not take stays in the decayed error feedback.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp._src import collectives, skeleton
from jaxcomp._src.buckets import BUCKET_BYTES
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.older_states import FRESH

F32 = jnp.float32

#: The coordinate masks of :func:`jaxcomp.sparseloco`: per-device top-k (its own indices
#: sent), or one mask shared by every device (no indices, summable values).
MASKS = ("topk", "random", "previous")


class SharedMaskState(NamedTuple):
    """State of the shared-mask exchange of one fragment (nested in ``SparseLoCoState``)."""

    memory: Any  # per device: f32[1, *shape] error feedback per masked leaf, None if pmean'd
    previous: Any  # identical on every device: f32[*shape] per masked leaf, the last merged
    #                update (mask="previous"), else None
    count: jax.Array  # int32[]: syncs done (the random mask's key folds it in)
    key: jax.Array  # uint32[2], identical on every device: jax.random.PRNGKey(seed), kept as is

    PER_DEVICE_FIELDS = ("memory",)
    #: Added since the first release (:func:`jaxcomp.complete_state`): a fresh state's key,
    #: PRNGKey(seed), the key the old program used as a constant (built with the same seed).
    ADDED_FIELDS = {"key": FRESH}


FIELDS = ("memory", "previous", "key")  # SharedMaskState's fields checked against the init's

#: ``explore``'s default with ``mask="previous"``: half of the kept coordinates drawn at random.
#: The previous merged update is zero outside the last mask, so at ``explore=0`` the mask
#: hardly moves: it keeps its first random draw, and the other coordinates are sent only in
#: place of kept values the codec rounded to 0 (measured: ``python -m
#: benchmarks.mask_coverage``, docs/lm-byte-budgets.md).
PREVIOUS_EXPLORE = 0.5


def default_explore(mask: str, explore: Any) -> Any:
    """``explore``, or where None its default for ``mask``: :data:`PREVIOUS_EXPLORE` for
    ``"previous"``, 0 for the others (which do not use it)."""
    if explore is not None:
        return explore
    return PREVIOUS_EXPLORE if mask == "previous" else 0.0


def check_mask(mask: Any) -> str:
    if mask not in MASKS:
        raise ValueError(f"`mask` must be one of {MASKS}, got {mask!r}")
    return mask


def kept(size: int, density: float) -> int:
    """Coordinates a leaf of ``size`` values keeps: ``ceil(density * size)``, at least 1."""
    return min(size, max(1, math.ceil(density * size - 1e-9)))


def select(
    mask: str, k: int, key: jax.Array, previous: jax.Array | None, explore: float
) -> jax.Array:
    """``int32[k]`` distinct indices of a flat leaf, the same on every device: the top ``k`` of
    a shared uniform draw (``"random"``), or of ``|previous|`` for ``k - round(explore k)``
    of them and the rest drawn at random from the others (``"previous"``; all random while
    ``previous`` is zero, before the first merged update).

    The merged update is zero outside the last mask (and where the value codec rounded a
    kept value to 0), so ``|previous|`` has at most ``k`` nonzero entries: ``"previous"``
    keeps the last mask's nonzero coordinates and only ``explore`` (and the zeros) bring
    others in. Zeros rank below every nonzero entry in a shared random order, not by index
    (``jax.lax.top_k`` breaks ties toward the lowest index: every new coordinate would come
    from the start of the leaf)."""
    size = previous.size if previous is not None else None
    if mask == "random":
        return jax.lax.top_k(jax.random.uniform(key, (size,)), k)[1]
    u = jax.random.uniform(key, (size,))
    score = jnp.abs(previous.reshape(-1))
    score = jnp.where(jnp.any(score > 0), jnp.where(score > 0, score, -u), u)
    k_top = k - round(explore * k)
    if k_top == k:
        return jax.lax.top_k(score, k)[1]
    top = jax.lax.top_k(score, k_top)[1]
    rest = jax.lax.top_k(u.at[top].set(-1.0), k - k_top)[1]
    return jnp.concatenate([top, rest])


def _flagged(values: jax.Array, target: jax.Array) -> jax.Array:
    """``values`` with NaN added to its first entry where ``target`` (the whole leaf, not
    only its kept values) is not finite: the value codec's payload carries the flag."""
    bad = jnp.logical_not(jnp.all(jnp.isfinite(target)))
    return values.at[0].add(jnp.where(bad, jnp.nan, 0.0))


def shared_mask_feedback(
    value_codec: Codec,
    axis_name: Any,
    *,
    mask: str,
    density: float,
    ef_decay: float,
    min_size: int,
    strategy: str = "two_phase",
    explore: float = 0.0,
    seed: int = 0,
    bucket_bytes: int = BUCKET_BYTES,
) -> optax.GradientTransformation:
    r"""The mean over devices of a list of arrays ``D_i`` through a shared mask ``S`` (``k =
    ceil(density d)`` coordinates of each leaf, the same on every device) and ``value_codec``,
    with decayed error feedback::

        e_i <- beta e_i + D_i;   v_i = Q(e_i[S]);   out[S] = mean_i v_i, 0 elsewhere;
        e_i <- e_i - scatter_S(v_i)

    ``Q``: what this device's payload of the kept values decodes to (``strategy``'s first
    phase; two-phase's re-encoding error of the sum is dropped, as ``jc.pmean``'s). Leaves
    under ``min_size`` values go through a float32 ``pmean`` and keep no memory. A
    non-finite ``D`` on any device, inside the mask or not, gives NaN outputs everywhere and
    keeps every memory (the caller freezes the state on it). Every device draws the masks
    from the state's ``key`` (``jax.random.PRNGKey(seed)``, made by the init and replicated
    like the count) folded with the sync count and the leaf's index. The key is state, not a
    constant of the program, so :func:`jaxcomp.sharded_init` compares it across processes:
    a per-process ``seed`` is refused there instead of desynchronising the replicas.
    """

    def masked(x) -> bool:  # an empty leaf keeps nothing: its own mean, no collective
        return jnp.size(x) >= max(min_size, 1)

    def init_fn(leaves):
        memory = [jnp.zeros((1, *jnp.shape(x)), F32) if masked(x) else None for x in leaves]
        previous = [
            jnp.zeros(jnp.shape(x), F32) if masked(x) and mask == "previous" else None
            for x in leaves
        ]
        return SharedMaskState(memory, previous, jnp.zeros([], jnp.int32), jax.random.PRNGKey(seed))

    def update_fn(deltas, state, params=None):
        del params  # a state of other params or devices: refused (memory[0] reads one row)
        want = jax.eval_shape(init_fn, deltas)
        skeleton.check_fields("sparseloco", state, {k: getattr(want, k) for k in FIELDS}, axis_name)
        key = jax.random.fold_in(state.key, state.count)
        coded = [i for i, m in enumerate(state.memory) if m is not None]
        plain = [i for i, m in enumerate(state.memory) if m is None]
        targets = {i: ef_decay * state.memory[i][0] + deltas[i].astype(F32) for i in coded}
        index = {}
        for i in coded:
            prev = state.previous[i]
            ref = prev if prev is not None else jnp.zeros(deltas[i].shape, F32)
            k = kept(int(jnp.size(ref)), density)
            index[i] = select(mask, k, jax.random.fold_in(key, i), ref, explore)
        values = [_flagged(targets[i].reshape(-1)[index[i]], targets[i]) for i in coded]
        means_plain, held = collectives.plain_mean(
            [deltas[i].astype(F32) for i in plain], axis_name, bucket_bytes, True
        )
        extra = collectives.local_nonfinite(held) if plain else None
        r = collectives.reduce_segments(
            [jnp.concatenate(values)] if values else [],
            axis_name,
            value_codec,
            strategy,
            extra_bad=extra,
            bucket_bytes=bucket_bytes,
        )
        fill = jnp.where(r.bad, jnp.nan, 0.0)
        offsets = [0, *itertools.accumulate(v.shape[0] for v in values)]
        means: list[Any] = [None] * len(deltas)
        memory, previous = list(state.memory), list(state.previous)
        for j, i in enumerate(coded):
            t, idx, lo, hi = targets[i], index[i], offsets[j], offsets[j + 1]
            flat = jnp.zeros(t.size, F32)
            mean = flat.at[idx].set(r.mean[0][lo:hi]) + fill
            sent = flat.at[idx].set(r.sent[0][lo:hi])
            means[i] = mean.reshape(t.shape)
            memory[i] = jnp.where(r.bad, state.memory[i], (t - sent.reshape(t.shape))[None])
            if previous[i] is not None:
                previous[i] = jnp.where(r.bad, previous[i], means[i])
        for i, m in zip(plain, means_plain, strict=True):
            means[i] = collectives.poison(m, r.bad).reshape(deltas[i].shape)
        return means, SharedMaskState(memory, previous, state.count + 1, state.key)

    return optax.GradientTransformation(init_fn, update_fn)


def wire_bytes(sizes: list[int], value_codec: Codec, n: int, density: float, min_size: int):
    """Ring-model bytes per device of one exchange over ``n`` devices with the two-phase
    strategy: ``(n - 1) / n`` of the rows' payloads twice (all-to-all, then all-gather of the
    re-encoded chunks) for the kept values of every masked leaf (one segment), a float32
    ``pmean`` (``2 (n - 1) / n x 4 d``) for each leaf under ``min_size``."""
    k = sum(kept(d, density) for d in sizes if d >= min_size)
    c = -(-k // n)
    first, second = value_codec.phase_codecs(c, n)
    coded = (n - 1) * (first.payload_bytes(c) + second.payload_bytes(c)) if k else 0.0
    plain = sum(2 * (n - 1) / n * 4 * d for d in sizes if d < min_size)
    return coded + plain
