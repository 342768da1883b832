"""Compressed collectives: ``psum`` / ``pmean`` with a codec, and the strategies behind them.

A strategy decides how payloads travel over the ``n`` devices of ``axis_name``. With a
payload of ``P(m)`` bytes for ``m`` floats, the ring-model bytes each device sends are:

=================  =================================  =========================================
strategy           bytes per device                   when
=================  =================================  =========================================
``allreduce``      ``2 (n-1)/n * P(d)``               summable (identity, bf16, fp16 unscaled)
``allgather``      ``(n-1) * P(d)``                   any codec; grows linearly with n
``two_phase``      ``2 (n-1) * P(ceil(d/n))``         any codec; ~ ``2 P(d)`` while ``d/n``
                   ``~= 2 (n-1)/n * P(d)``            spans many blocks (see below)
``majority_vote``  ``2 (n-1) * 4 ceil(W/n)``          sign codecs; ``W = ceil(d/32)`` words of
                   ``+ 2 (n-1)/n * 4 * blocks``       bits each way, plus one psum of the scales
=================  =================================  =========================================

Plain ``pmean`` of float32 sends ``2 (n-1)/n * 4d``. So all-gather saves ``8d / (n P)`` —
at n = 8 int8 saves nothing and 1-bit only 8x — while two-phase keeps ``4d / P`` (1-bit:
~32x) at any n *for large vectors*: each of the ``2 (n-1)`` chunks a device sends carries its
own scales and padding to whole words, ``P(ceil(d/n)) = ceil(d/n) * b + c``, so two-phase
sends ``~2 P(d) + 2 (n-1) c``. The second term grows with n and dominates once ``d/n`` is
a few blocks: on a 4,079-float tree sign's bytes per device grow 1.77x from 8 to 32
devices. For a leaf of a few floats every payload costs more than the floats themselves (a
7-float leaf at 32 devices: sign 248 B, plain ``pmean`` 54 B); ``auto`` then sends it
through plain float32 ``pmean``.

``two_phase`` (reduce-scatter style): split the vector into n chunks, encode each,
``all_to_all`` so device i receives everybody's chunk i, decode and average it, re-encode the
average, ``all_gather`` the re-encoded chunks, decode. The second encode adds a second
compression error; the optax transform keeps it in a server-side residual (as 1-bit Adam's
server error), the stateless :func:`psum` cannot. Sparse codecs work the same way, as gTop-k
does (Shi et al., ICDCS 2019): top-k of each chunk, ``all_to_all``, the owner adds the ``n``
sparse chunks (one scatter-add) and re-sparsifies the sum, ``all_gather``; what the
re-sparsification drops stays in the owner's residual. Traffic: ``~2 P(d)``, not ``(n-1) P(d)``.
A codec may split its slots between the two encodings (:meth:`Codec.phase_codecs`, the same
bytes): top-k sends ``k1 = floor(2k / (n + 1))`` per device and chunk (at least 1, at least
``2k - c``) and ``k2 = 2k - k1`` from the owner; once ``2k >= n + 1``, ``k2 >= min(n k1, c)``
and the owner re-sends the whole sum it received (an even split, ``k`` and ``k``, would
re-select ``k`` of up to ``n k`` coordinates and hold the rest back).

``majority_vote`` (signSGD with majority vote, Bernstein et al., ICLR 2019), two-phase with
bits both ways: each device packs its signs (32 per uint32), ``all_to_all``s chunks of words,
the owner of a chunk counts the votes in int32, packs the sign of the vote and
``all_gather``s it. The result is ``sign(sum_i sign(x_i))`` times the devices' mean scale
(one ``psum`` of the codec's block scales: mean ``|x|`` for ``sign("mean")``, 1 for
``sign(None)``); a tie (even n) goes to the chunk owner's own sign. It is not a mean: only
for sign codecs, never chosen by ``auto``.

Hierarchical (``inner_axis_name=``): with ``L`` devices on the fast inner axis (a host's
NVLink/ICI) and ``H`` on the slow outer one (between hosts), the vector is reduce-scattered
in float32 over the inner axis (``(L-1)/L * 4d`` bytes), each device reduces its ``d/L``
chunk over the outer axis with the codec and strategy (the bytes above with ``n = H`` and
``d/L``), and the result is all-gathered in float32 over the inner axis (``(L-1)/L * 4d``).
Only compressed payloads cross the slow axis. See :func:`hierarchical_bytes`.

With ``allreduce`` the payload is also *added* in its own type (fp16 sums round at
~2^-11 of the running sum): error feedback cannot see that rounding, it happens in the
network. So that a mean that fits the type never overflows in that sum (8 devices of fp16
10000: the sum, 80000, is past fp16's 65504), each device encodes ``x / n`` and the psum
*is* the mean (as torch's fp16 hook divides by the world size first); the price is
``log2 n`` bits of range at the small end (fp16 values below ``6e-5 n`` lose precision).
The rounding of a ring sum grows with n (``benchmarks/narrow_sum.py``: fp16's relative
error 2.9e-4 at n = 2, 5.2e-4 at 16, 3.9e-3 at 1024; bf16's 2.3e-3, 4.2e-3 and 0.34),
so ``auto`` psums fp16/bf16 payloads only up to n = 8, where it stays within 2x of
``two_phase``'s (2.1e-4 / 1.7e-3 at any n), and above sends them ``two_phase``: the owner adds
the decoded chunks in float32, at the same bytes. ``allgather`` and ``two_phase`` always
add in float32. Integer payloads are never summed in their narrow type (int8 sums overflow).

``auto`` picks, per vector, the strategy with the fewest bytes in the table above; a
summable codec uses ``allreduce`` (same bytes as two-phase, one psum) while its sum in its
own type stays accurate (float32 always, fp16/bf16 up to 8 devices); a tie goes to
``allgather`` (one encode, one compression error); plain float32 ``pmean`` where it is
cheaper than all of them. What it picks for a vector of
``d = 2^20`` floats, and the saving against plain ``pmean`` (``jc.choose_strategy``,
``jc.strategy_bytes``; the same on the outer axis of a hierarchical mesh of n hosts)::

    codec             n=2              n=4 .. 16           n=64
    fp16 (scaled)     two_phase 2.0x   two_phase 2.0x      two_phase 2.0x
    fp16 unscaled     allreduce 2.0x   allreduce 2.0x      two_phase 2.0x
    int8              allgather 3.9x   two_phase 3.9x      two_phase 3.9x
    int4              allgather 7.8x   two_phase 7.8x      two_phase 7.8x
    qsgd(16)          allgather 5.0x   two_phase 5.0x      two_phase 5.0x
    sign, sign(None)  allgather 32x    two_phase 32x       two_phase 31.9x
    top_k(0.01)       allgather 50x    two_phase 50x       two_phase 50x
    top_k(0.001)      allgather 500x   two_phase 496-498x  two_phase 482x
    random_k bf16     allreduce 67x    allreduce 67x       allreduce 67x

(unscaled fp16: ``allreduce`` up to n = 8, ``two_phase`` from 16: the same bytes, float32
sums. The default ``jc.cast("fp16")`` is scaled, one scale per device, so not summable:
``two_phase`` at every n, ``rounding_only``, see :func:`choose_strategy`.)
At n = 2 all-gather and two-phase send the same bytes. ``majority_vote`` (explicit) saves
32x at every n. All-gather alone would give int8 0.98x and sign 8x at n = 8, 0.5x / 4x at 16.

Non-finite input anywhere makes the output non-finite everywhere: one scalar flag is
all-reduced per call (8 bytes) so a NaN is never hidden behind a codec that would drop it.
Codecs that ``flags_nonfinite`` (their scales carry NaN/inf) raise the flag from the
payloads every device received (:meth:`Codec.flag_arrays`: the scaled cast's scales alone);
the others from one read of the input.

Every strategy works on a *list* of segments (a leaf each, or one flat vector): each segment
is encoded on its own, and the payloads of all segments travel together in a few buckets
(:mod:`jaxcomp._src.buckets`), one collective per bucket per phase, so the program grows
with neither the number of leaves nor the number of devices.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp._src import buckets, shards
from jaxcomp._src import layout as layouts
from jaxcomp._src.axes import (  # noqa: F401  (re-exported)
    axis_names,
    check_axes,
    check_axis_name,
    check_mesh_axis,
    check_not_mixed,
    gather_to,
    manual_axes,
    tracks_variance,
    varying_axes,
)
from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import (
    Codec,
    after,
    all_finite,
    ceil_div,
    check_int,
    folded_sum,
    kept_sum,
    scaled,
)
from jaxcomp._src.cost import (  # noqa: F401  (re-exported: the public bytes model)
    STRATEGIES,
    check_codec,
    check_pair,
    check_strategy,
    choose_strategy,
    hierarchical_bytes,
    majority_vote_bytes,
    strategy_bytes,
)


class Reduced(NamedTuple):
    """What one compressed reduction of a list of segments gives back, per segment."""

    mean: list  # f32[d_s]: the mean over the axis, identical on every device (NaN if bad)
    sent: list  # f32[d_s]: what this device's contribution decodes to (for error feedback)
    server: list  # f32[c_s]: the owned chunk's new re-encoding error (two_phase), else None
    bad: jax.Array  # bool[]: some input on some device was non-finite (same on every device)
    error: list | None = None  # f32[d_s]: segment - sent, what this device's contribution
    #                            dropped (residual error feedback), formed in the encoding pass
    payload: list | None = None  # per segment, this device's payload ("allgather",
    #                              "majority_vote": of the segment; "two_phase": of its rows)


def axis_size(axis_name: Any) -> int:
    """Size of a bound mesh axis (or tuple of axes), with a clear error when it is not bound."""
    check_axis_name(axis_name)
    names = axis_names(axis_name)
    try:
        size = int(jax.lax.axis_size(names if len(names) != 1 else names[0]))
    except NameError as e:
        raise ValueError(
            f"`axis_name` {axis_name!r} is not bound here: call jaxcomp collectives inside "
            f"jax.shard_map (or jax.pmap) over a mesh that has axis {axis_name!r} ({e})"
            f"{_bound_hint()}"
        ) from None
    check_not_mixed(axis_name)
    return size


def _bound_hint() -> str:
    """What is bound where an axis name was not: no axis at all (``tx.update`` called
    eagerly or under ``jax.jit`` alone), or the names that are (a misspelt axis)."""
    try:  # private: the named axes of the trace (shard_map's manual axes, pmap's, vmap's)
        from jax._src import core as jax_core

        bound = tuple(jax_core.get_axis_env().axis_sizes)
    except (ImportError, AttributeError):  # a jax that moved it: the message without a hint
        return ""
    if not bound:
        return (
            "; no axis is bound here at all: this runs outside jax.shard_map / jax.pmap "
            "(called eagerly, or under jax.jit without a shard_map): put it inside the "
            "shard_map'ed step, as the README's quickstart does"
        )
    return f"; the axes bound here are {bound}: build the transform with one of them"


def bound_axis_size(axis_name: Any) -> int | None:
    """Size of ``axis_name`` where it is bound (inside shard_map/pmap), else None."""
    try:
        return axis_size(axis_name)
    except ValueError:
        return None


def check_inner_axis(axis_name: Any, inner_axis_name: Any) -> None:
    """``inner_axis_name`` must be bound and distinct from ``axis_name`` (trace time)."""
    if inner_axis_name is None:
        return
    check_axis_name(inner_axis_name, "inner_axis_name")
    shared = set(axis_names(axis_name)) & set(axis_names(inner_axis_name))
    if shared:
        raise ValueError(
            f"`inner_axis_name` {inner_axis_name!r} must differ from `axis_name` {axis_name!r} "
            f"(shared: {sorted(shared)})"
        )
    try:
        jax.lax.axis_size(axis_names(inner_axis_name))
    except NameError as e:
        raise ValueError(
            f"`inner_axis_name` {inner_axis_name!r} is not bound here: it must be an axis of the "
            f"mesh under jax.shard_map ({e})"
        ) from None


# --------------------------------------------------------------------------- non-finite input


def local_nonfinite(arrays: Any) -> jax.Array:
    """True when any entry of the floating arrays in ``arrays`` (a pytree) is NaN or inf.

    float32: ``sum(x * 0)`` is NaN exactly when ``x`` holds a NaN or an inf, and a sum of
    zeros never overflows: one reduction, about half the time of ``all(isfinite(x))`` on
    XLA:CPU, summed through :func:`~jaxcomp._src.codecs.base.folded_sum` so the zeros are
    never written out as large as ``x``. Narrower floats (an fp16 payload):
    :func:`all_finite`, which reads them as they are (the sum would first write them out
    widened to float32) and writes 1/8 of a byte per value before its reduce, not the byte
    per value of ``all(isfinite(x))``.
    """
    # One NaN-or-zero scalar per array, summed by ONE reduction (kept_sum): a chain of adds
    # or ors is copied by XLA into every fusion that reads the flag (quadratic in the leaves).
    zeros = [
        folded_sum(a * jnp.zeros([], a.dtype))
        if a.dtype == jnp.float32
        else jnp.where(all_finite(a), 0.0, jnp.nan)
        for a in jax.tree.leaves(arrays)
        if jnp.issubdtype(a.dtype, jnp.floating) and a.size
    ]
    if not zeros:
        return jnp.bool_(False)
    return jnp.isnan(kept_sum(jnp.stack([z.astype(jnp.float32) for z in zeros])))


def poison(x: jax.Array, bad: jax.Array) -> jax.Array:
    """``x``, or NaN everywhere when ``bad``: a non-finite input is never hidden."""
    return jnp.where(bad, jnp.nan, x)


# --------------------------------------------------------------------------- keys


def device_key(key: jax.Array | None, codec: Codec, axis_name: Any) -> jax.Array | None:
    """Independent noise per device, or the same key everywhere for shared randomness."""
    if key is None:
        if codec.stochastic or codec.shared_randomness:
            raise ValueError(f"{codec.name} is stochastic: pass `key=` (a PRNG key)")
        return None
    if codec.shared_randomness:
        check_shared_key(key, codec, axis_name)
        return key
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def check_shared_key(key: jax.Array, codec: Codec, axis_name: Any) -> None:
    """Refuse a key that differs between the devices of ``axis_name`` where the codec needs
    the same one everywhere (random-k: every device must pick the same indices, or the summed
    payloads add values of different coordinates and each device decodes its own indices: a
    different wrong mean on each). Read from jax's varying-axes type, so under
    ``check_vma=True`` only (``pmap`` and ``check_vma=False`` carry no such type)."""
    varying = sorted(varying_axes(key) & set(axis_names(axis_name)), key=str)
    if varying:
        raise ValueError(
            f"`key` differs between the devices of axis {varying} (it varies over them: "
            f"e.g. folded with jax.lax.axis_index), but {codec.name} needs the same key on "
            "every device, so that all pick the same coordinates. Pass the key as it is: "
            "jaxcomp folds in the device index itself where a codec wants independent noise."
        )


def shared_key(key: jax.Array | None, codec: Codec, axis_name: Any) -> jax.Array | None:
    """The caller's ``key``, made the same on every device of ``axis_name`` where ``codec``
    needs one key everywhere (random-k) and the key's type cannot say it already is.

    Under ``jax.shard_map(..., check_vma=True)`` a key that varies over the axis is refused
    (:func:`check_shared_key`) and an invariant one is used as it is. ``pmap``, ``vmap`` and
    ``check_vma=False`` type every key invariant, so a per-device key (``jax.random.split``
    into ``pmap``) passed there would give every device its own indices: the summed payloads
    would add values of different coordinates and each device decode its own, a different
    wrong mean on each. There the key's words are replaced by their maximum over the devices
    (one ``pmax`` of 8 bytes for a threefry key): one key, so one draw of ``k`` coordinates
    ``S`` and the mean ``(d/k) P_S(mean_i x_i)`` on every device, as with a shared key.

    With several processes (``jax.distributed``) an invariant type is only a promise: a key
    passed in replicated (``P()``) holds whatever each process put on its own devices, and
    a per-process seed (``PRNGKey(seed + jax.process_index())``) gave the devices of each
    process their own indices, a different wrong mean on each process (docs/multihost.md).
    There the words are made one the same way, whatever their type (:func:`process_count`
    > 1 only: within one process a replicated array is one value).
    """
    if key is None or not codec.shared_randomness:
        return key
    tracked = tracks_variance(axis_name)
    if tracked:
        check_shared_key(key, codec, axis_name)  # typed varying: refused, with the fix
        if process_count() == 1:
            return key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    words = jax.random.key_data(key) if typed else key
    names = axis_names(axis_name)
    if tracked:  # jax reduces an invariant value without moving it: make it varying first
        words = jax.lax.pcast(words, names, to="varying")
    words = jax.lax.pmax(words, names)
    return jax.random.wrap_key_data(words, impl=jax.random.key_impl(key)) if typed else words


def process_count() -> int:
    """``jax.process_count()``: the processes whose devices a replicated array spans."""
    return jax.process_count()


# --------------------------------------------------------------------------- strategies


def _psum_floats(payloads: list, axis_name: Any, bucket_bytes: int) -> tuple[list, list]:
    """psum the floating leaves of summable payloads (bucketed); shared integer leaves
    (random-k's indices, the same on every device) pass through unsent. Also the summed
    buckets."""
    flat, treedef = jax.tree.flatten(payloads)
    floats = [i for i, a in enumerate(flat) if jnp.issubdtype(a.dtype, jnp.floating)]
    summed, held = buckets.exchange(
        [flat[i] for i in floats],
        lambda b: jax.lax.psum(b, axis_name),
        bucket_bytes=bucket_bytes,
        with_buckets=True,
    )
    for i, a in zip(floats, summed, strict=True):
        flat[i] = a
    return jax.tree.unflatten(treedef, flat), held


def _gather(payloads: list, axis_name: Any, bucket_bytes: int) -> tuple[list, list]:
    """Every device's payloads, stacked on a new leading device axis (bucketed all_gather),
    and the gathered buckets."""
    return buckets.exchange(
        payloads,
        lambda b: all_gather_rows(b, axis_name),
        bucket_bytes=bucket_bytes,
        with_buckets=True,
    )


def all_gather_rows(b: jax.Array, axis_name: Any) -> jax.Array:
    """``jax.lax.all_gather(b, axis_name)``: ``[n, *b.shape]``, row ``i`` device ``i``'s ``b``
    (over a tuple of axes ``(a, c)``: device ``(i_a, i_c)`` is row ``i_a n_c + i_c``).

    A tuple with a ``jax.vmap`` axis in it (``jax.vmap(jax.pmap(step, axis_name="j"),
    axis_name="i")`` or two nested vmaps, reducing over ``("i", "j")``) is gathered one axis
    at a time, the last first, which gives the same rows: jax's own all_gather over such a
    tuple fails while batching ("axis size doesn't match"), where ``jax.lax.psum`` / ``pmean``
    over it work."""
    names = axis_names(axis_name)
    if len(names) < 2 or set(names) <= manual_axes():
        return jax.lax.all_gather(b, axis_name, to=gather_to(axis_name))
    out = b
    for a in reversed(names):
        out = jax.lax.all_gather(out, a, to=gather_to(a))
    return out.reshape(-1, *b.shape)


def all_to_all_rows(b: jax.Array, axis_name: Any) -> jax.Array:
    """``jax.lax.all_to_all(b, axis_name, 0, 0, tiled=False)``: row ``j`` of the result is
    device ``j``'s row ``i`` on device ``i``.

    Where ``jax.vmap(..., axis_name=...)`` binds an axis, jax batches an operand that does
    not vary over it (random-k's indices, drawn from the one key every device shares) into
    the wrong shape (an ``[8, 3]`` operand on 8 emulated devices came back ``[8, 3, 8, 3]``
    each): the operand is made to vary over the axis first (a select on ``axis_index``, no
    data moved). Manual axes (``shard_map``, ``pmap``) take the operand as it is."""
    if not set(axis_names(axis_name)) <= manual_axes():
        b = jnp.where(jax.lax.axis_index(axis_name) >= 0, b, b)
    return jax.lax.all_to_all(b, axis_name, 0, 0, tiled=False)


def _floats(arrays: list) -> list[jax.Array]:
    return [a for a in arrays if jnp.issubdtype(a.dtype, jnp.floating)]


def _flag_arrays(codec: Codec, received: list, held: list) -> list[jax.Array]:
    """What a ``flags_nonfinite`` codec's step flag reads of the payloads every device
    received: the arrays :meth:`Codec.flag_arrays` names (the scaled cast: its scales),
    else every floating bucket ``held``."""
    named = codec.flag_arrays(received)
    return _floats(held) if named is None else named


def _encode(xs, keys, ctx):
    """One payload per segment and what it drops, ``x - decode(payload)`` (allgather,
    majority_vote): :meth:`Codec.encode_with_error`, so the error comes from the encoding
    pass, not from a second pass that decodes the payload."""
    pairs = [ctx.codec.encode_with_error(x, k) for x, k in zip(xs, keys, strict=True)]
    return [p for p, _ in pairs], [e for _, e in pairs]


def _sent(payloads, xs, codec):
    """What each segment's payload decodes to: this device's contribution."""
    return [codec.decode(p, x.shape[0]) for p, x in zip(payloads, xs, strict=True)]


# Each strategy is three steps: encode (per segment: the payloads and what they drop, the
# residual ``x - sent``), exchange (the collectives; returns what decoding needs and the
# floating arrays that every device now holds, from which a ``flags_nonfinite`` codec's
# non-finite flag is read at no extra pass), decode (into the mean, with ``fill`` NaN when
# the step is not finite).


def _allreduce_encode(xs, keys, ctx):
    """Summable payloads of ``x / n``: their psum is the mean, and a mean that fits the
    payload's type (fp16: 65504) never overflows in the sum, as ``x``'s sum could."""
    scale = 1.0 / ctx.n
    payloads = [ctx.codec.encode(x * scale, k) for x, k in zip(xs, keys, strict=True)]
    # This device's contribution, in units of x, is n decode(payload): elementwise beside the
    # cast (one fused pass for cast payloads).
    errors = [
        x - _times(ctx.codec.decode(p, x.shape[0]), ctx.n)
        for p, x in zip(payloads, xs, strict=True)
    ]
    return payloads, errors


def _times(x: jax.Array, n: int) -> jax.Array:
    return x if n == 1 else x * float(n)


def whole_payload(codec: Codec, strategy: str, n: int, x: jax.Array) -> tuple[Any, jax.Array]:
    """``(payload, sent)`` of a vector sent whole by a deterministic codec, ``sent`` in units
    of ``x``: ``"allreduce"`` encodes ``x / n`` (:func:`_allreduce_encode`: its psum is the
    mean) and sends ``n decode``; ``"allgather"`` encodes ``x`` itself."""
    if strategy == "allreduce":
        payload = codec.encode(x * (1.0 / n))
        return payload, _times(codec.decode(payload, x.shape[0]), n)
    payload = codec.encode(x)
    return payload, codec.decode(payload, x.shape[0])


def _allreduce_exchange(payloads, ctx, servers):
    summed, held = _psum_floats(payloads, ctx.axis_name, ctx.bucket_bytes)
    return summed, held


def _allreduce_decode(xs, payloads, summed, ctx, fill):
    mean = [
        scaled(ctx.codec.decode(s, x.shape[0]), 1.0, fill) for s, x in zip(summed, xs, strict=True)
    ]
    sent = [_times(s, ctx.n) for s in _sent(payloads, xs, ctx.codec)]  # back in units of x
    return mean, sent, [None] * len(xs)


def elementwise_error(codec: Codec, strategy: str, n: int, x: jax.Array) -> jax.Array | None:
    """What a whole segment's encoding drops, ``x - sent``, formed from ``x`` of any shape.

    For an ``elementwise`` codec the residual of :func:`_allreduce_encode`
    (``x - n C(x / n)``) and of ``allgather`` (``x - C(x)``) is a function of each coordinate
    alone, so it can be formed where ``x`` lies (a parameter-shaped ``g + e``), bit for bit
    the values of ``Reduced.error``. None where the segment is not sent so (``two_phase``
    chunks, ``plain``, a codec that is not elementwise, a leaf cut into pieces).

    Args:
      codec: the codec of the reduction.
      strategy: the strategy asked for (``"auto"`` resolved as :func:`choose_strategy`).
      n: devices on the axis.
      x: the vector sent, in any shape (``x.size`` floats, one segment).

    Returns:
      ``x - sent`` shaped like ``x``, or None.
    """
    if not codec.elementwise or x.size > MAX_SEGMENT:
        return None
    chosen = choose_strategy(codec, x.size, n, strategy)
    if chosen == "allreduce":
        return x - _times(codec.roundtrip(x * (1.0 / n)), n)
    if chosen == "allgather":
        return x - codec.roundtrip(x)
    return None


def _plain_encode(xs, keys, ctx):
    """``x / n`` in float32, for a segment where plain ``pmean`` is the cheapest (``auto``)."""
    return [x * (1.0 / ctx.n) for x in xs], [jnp.zeros_like(x) for x in xs]


def _plain_exchange(payloads, ctx, servers):
    return buckets.exchange(
        payloads,
        lambda b: jax.lax.psum(b, ctx.axis_name),
        bucket_bytes=ctx.bucket_bytes,
        with_buckets=True,
    )


def _plain_decode(xs, payloads, summed, ctx, fill):
    """The exact float32 mean; this device sent ``x`` itself (nothing held back)."""
    return [scaled(s, 1.0, fill) for s in summed], list(xs), [None] * len(xs)


def _allgather_exchange(payloads, ctx, servers):
    pieces = _gather_pieces(payloads, ctx)
    if pieces is not None:
        return _gather_in_pieces(payloads, pieces, ctx)
    gathered, held = _gather(payloads, ctx.axis_name, ctx.bucket_bytes)
    return gathered, _flag_arrays(ctx.codec, gathered, held)


def _allgather_decode(xs, payloads, gathered, ctx, fill):
    if _gather_pieces(payloads, ctx) is not None:  # already summed, piece by piece
        mean = [s + fill for s in gathered]
    else:
        mean = [
            ctx.codec.decode_sum(g, x.shape[0], scale=1.0 / ctx.n, fill=fill)
            for g, x in zip(gathered, xs, strict=True)
        ]
    return mean, _sent(payloads, xs, ctx.codec), [None] * len(xs)


def _gather_pieces(payloads, ctx) -> list[int] | None:
    """Per segment, how many pieces its payload is all-gathered in (``ctx.gather_pieces``),
    or None for one bucketed all-gather of every payload.

    Gathered, the payloads of ``n`` devices can outgrow the gradient (top-k at 25%, 8 bytes
    a value, 8 devices: 4 copies of it). In pieces, each at most a quarter of a float32
    copy of the segments, decoded into the sum before the next is gathered, they hold a
    quarter copy at once (half a copy: 0.24 more copies of temporaries for DGC's step on a
    small MLP). Only for payloads of equal-length 1-D slots (top-k's values and indices), whose
    sum decodes slot by slot; when every payload fits one piece, nothing changes.
    """
    if not ctx.gather_pieces:
        return None
    shapes = [{a.shape for a in jax.tree.leaves(p)} for p in payloads]
    if any(len(s) != 1 or len(next(iter(s))) != 1 for s in shapes):
        return None
    limit = sum(ctx.sizes)  # bytes: a quarter of a float32 copy of the segments
    gathered = [
        ctx.n * sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(p)) for p in payloads
    ]
    if sum(gathered) <= limit:
        return None
    slots = [next(iter(s))[0] for s in shapes]
    return [min(k, ceil_div(g, limit)) for k, g in zip(slots, gathered, strict=True)]


def _gather_in_pieces(payloads, pieces, ctx) -> tuple[list, list]:
    """Each segment's sum ``sum_i decode(payload_i) / n`` (no fill), its payloads all-gathered
    a piece of slots at a time. Each gather's input depends on the sum so far
    (:func:`~jaxcomp._src.codecs.base.after`), so it waits until the previous piece is added
    in: one piece is live at a time. Also, for ``flags_nonfinite`` codecs, a NaN-or-zero
    scalar per piece (the gathered floats' flag)."""
    sums, flags, last = [], [], None
    for p, count, d in zip(payloads, pieces, ctx.sizes, strict=True):
        k = jax.tree.leaves(p)[0].shape[0]
        total = None
        for j in range(count):
            a, b = k * j // count, k * (j + 1) // count
            piece = jax.tree.map(lambda x, a=a, b=b, c=last: after(x[a:b], c), p)
            (g,), held = _gather([piece], ctx.axis_name, ctx.bucket_bytes)
            if total is None:  # zeros made here, not copied from a constant at the start
                total = after(jnp.zeros((d,), jnp.float32), jax.tree.leaves(g)[0][0, 0])
            if ctx.codec.flags_nonfinite:
                flags.extend(folded_sum(h * jnp.zeros([], h.dtype)) for h in _floats(held))
            total = ctx.codec.decode_sum(g, d, scale=1.0 / ctx.n, fill=total)
            last = total[0] if not flags else total[0] + flags[-1]
        sums.append(total)
    return sums, flags


def _place(chunk: jax.Array, index: jax.Array, size: int, d: int) -> jax.Array:
    """``f32[d]``: zeros with ``chunk`` at chunk position ``index`` of a padded ``size`` buffer."""
    c = chunk.shape[0]
    return jax.lax.dynamic_update_slice(jnp.zeros((size,), chunk.dtype), chunk, (index * c,))[:d]


def _rows(x: jax.Array, n: int) -> jax.Array:
    """``x`` zero-padded to ``n`` equal chunks: ``[n, ceil(d/n)]``."""
    c = ceil_div(x.shape[0], n)
    return jnp.pad(x, (0, n * c - x.shape[0])).reshape(n, c)


def _phases(ctx, d: int) -> tuple[Codec, Codec]:
    """The codecs of a segment of ``d`` floats' two phases (:meth:`Codec.phase_codecs`)."""
    return ctx.codec.phase_codecs(ceil_div(d, ctx.n), ctx.n)


def _encode_two_phase(xs, keys, ctx):
    """Worker payloads: each segment cut in ``n`` chunks, encoded row by row (batched), and
    what they drop (the rows' errors, end to end)."""
    payloads, errors = [], []
    for x, k in zip(xs, keys, strict=True):
        worker_key = None if k is None else jax.random.split(jax.random.split(k)[0], ctx.n)
        first, _ = _phases(ctx, x.shape[0])
        payload, error = first.encode_rows_with_error(_rows(x, ctx.n), worker_key)
        payloads.append(payload)
        errors.append(error.reshape(-1)[: x.shape[0]])
    return payloads, errors


def _owner_key(key: jax.Array | None) -> jax.Array | None:
    """The key of a chunk owner's re-encoding (the second half of the segment's key)."""
    return None if key is None else jax.random.split(key)[1]


def _two_phase_exchange(payloads, ctx, servers):
    """all_to_all the rows, decode+sum the owned chunk, re-encode it, all_gather.

    Device ``i`` owns chunk ``i`` of every segment; it adds the chunk's server residual
    (``f32[c]``, what it could not send last time) before re-encoding with the second
    phase's codec (:meth:`Codec.phase_codecs`), and keeps the new re-encoding error. A
    non-finite row anywhere makes the owner's re-encoding non-finite, so the gathered
    payloads carry the flag to every device.
    """
    n, axis = ctx.n, ctx.axis_name
    cs = [ceil_div(d, n) for d in ctx.sizes]
    phases = [_phases(ctx, d) for d in ctx.sizes]
    # Row j of a received payload is device j's encoding of the chunk this device owns.
    received = buckets.exchange(
        payloads,
        lambda b: all_to_all_rows(b, axis),
        lead=1,
        bucket_bytes=ctx.bucket_bytes,
    )
    # The owner sums the n decoded chunks (sparse: one scatter-add of n*k slots), adds what it
    # could not send last time, and re-encodes (top-k: keeps k2 >= n k1 of the sum).
    own = [
        first.decode_sum(r, c, scale=1.0 / n) + (0.0 if s is None else s)
        for r, c, s, (first, _) in zip(received, cs, servers, phases, strict=True)
    ]
    # Without a server residual, a codec of both phases encodes the mean from the rows
    # (Codec.encode_sum: the scaled cast takes its scale from theirs, the mean not written out).
    own_payloads = [
        first.encode_sum(r, c, 1.0 / n, _owner_key(k))
        if s is None and first == second
        else second.encode(o, _owner_key(k))
        for o, r, c, s, k, (first, second) in zip(
            own, received, cs, servers, ctx.keys, phases, strict=True
        )
    ]
    own_error = [
        o - second.decode(p, c)
        for o, p, c, (_, second) in zip(own, own_payloads, cs, phases, strict=True)
    ]
    gathered, held = _gather(own_payloads, axis, ctx.bucket_bytes)
    return (gathered, own_error, cs), _flag_arrays(ctx.codec, gathered, held)


def _two_phase_decode(xs, payloads, exchanged, ctx, fill):
    gathered, own_error, cs = exchanged
    phases = [_phases(ctx, x.shape[0]) for x in xs]
    mean = [
        scaled(second.decode_rows(g, c)[: x.shape[0]], 1.0, fill)
        for g, c, x, (_, second) in zip(gathered, cs, xs, phases, strict=True)
    ]
    sent = [
        first.decode_rows(p, c)[: x.shape[0]]
        for p, c, x, (first, _) in zip(payloads, cs, xs, phases, strict=True)
    ]
    return mean, sent, own_error


def _vote_counts(received: jax.Array) -> jax.Array:
    """``int32[words, 32]``: per bit, how many rows of ``received[n, words]`` have it set."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (received[:, :, None] >> shifts) & jnp.uint32(1)
    return jnp.sum(bits.astype(jnp.int32), axis=0)


def _vote_exchange(payloads, ctx, servers):
    """signSGD with majority vote, two-phase: bits travel both ways, the vote is an integer count.

    Device ``i`` packs the signs of ``x_i`` (32 per uint32 word), splits the words in ``n``
    chunks and ``all_to_all``s them; the owner of a chunk counts the negative votes ``m`` per
    coordinate in int32 and keeps the sign of the vote ``sum_i sign(x_i) = n - 2m`` (a tie,
    possible for even ``n``, goes to the owner's own sign), packs it, and ``all_gather``s the
    words. The result is scaled by the mean over devices of the codec's scale (one ``psum``
    of the scales over ``n``: ``scale="mean"``, mean ``|x|``; ``scale=None``, 1, or 0 when
    every device has a zero block, so a zero gradient gives zero).
    """
    n, axis = ctx.n, ctx.axis_name
    received = buckets.exchange(
        [_rows(w, n) for w, _ in payloads],
        lambda b: all_to_all_rows(b, axis),
        lead=1,
        bucket_bytes=ctx.bucket_bytes,
    )
    me = jax.lax.axis_index(axis)
    results = []
    for r in received:
        negatives = _vote_counts(r)
        own = _vote_counts(jax.lax.dynamic_slice_in_dim(r, me, 1, 0))
        negative = (2 * negatives > n) | ((2 * negatives == n) & (own == 1))
        results.append(packing.pack(negative.reshape(-1), 1))
    voted, _ = _gather(results, axis, ctx.bucket_bytes)
    scales, held = buckets.exchange(  # the mean scale, divided before the sum (no overflow)
        [s / n for _, s in payloads],
        lambda b: jax.lax.psum(b, axis),
        bucket_bytes=ctx.bucket_bytes,
        with_buckets=True,
    )
    return (voted, scales), held


def _vote_decode(xs, payloads, exchanged, ctx, fill):
    voted, scales = exchanged
    mean = [
        scaled(ctx.codec.decode((v.reshape(-1)[: w.shape[0]], s), x.shape[0]), 1.0, fill)
        for v, (w, _), s, x in zip(voted, payloads, scales, xs, strict=True)
    ]
    return mean, _sent(payloads, xs, ctx.codec), [None] * len(xs)


class _Context(NamedTuple):
    """What every strategy of one reduction shares."""

    codec: Codec
    axis_name: Any
    n: int
    bucket_bytes: int
    keys: list  # per segment of the group: the segment's step key (per device)
    sizes: list  # per segment of the group: its number of floats
    gather_pieces: bool = False  # allgather: gather large payloads in pieces (_gather_pieces)


#: strategy -> (encode, exchange, decode)
_STRATEGIES = {
    "allreduce": (_allreduce_encode, _allreduce_exchange, _allreduce_decode),
    "plain": (_plain_encode, _plain_exchange, _plain_decode),
    "allgather": (_encode, _allgather_exchange, _allgather_decode),
    "two_phase": (_encode_two_phase, _two_phase_exchange, _two_phase_decode),
    "majority_vote": (_encode, _vote_exchange, _vote_decode),
}
_ORDER = tuple(_STRATEGIES)


def _step_flag(segments, groups, codec, extra_bad, axis_name) -> jax.Array:
    """The step's non-finite flag, identical on every device: from the payloads every device
    received (``flags_nonfinite`` codecs) or from the segments (:func:`inputs_nonfinite`) and
    the values a sparse ``allreduce`` payload sent (:func:`_rescaled_overflow`), or-ed with
    ``extra_bad`` and over the blocks of :func:`~jaxcomp._src.shards.over_shards`."""
    if not codec.flags_nonfinite:
        return inputs_nonfinite(segments, extra_bad, axis_name, _rescaled_overflow(groups))
    local = local_nonfinite([g[6] for g in groups])
    return shards.any_block(local if extra_bad is None else local | extra_bad)


def _rescaled_overflow(groups) -> jax.Array | None:
    """Whether a sparse payload sent by ``allreduce`` holds a value that times ``n`` passes
    float32's range (None where no such payload is sent). Its values times ``n`` are the
    nonzeros of what this device sent in units of ``x``, ``n decode(C(x / n))`` (a summable
    payload's floating leaves are its values): random-k sends ``s_j x_i``, inf for a finite
    ``|x_i| > F32_MAX / s_j``, so an inf residual memory, and an inf sum wherever the mean
    ``s_j mean(x_i)`` passes the range too. Or-ed into the one scalar ``psum`` that flags a
    non-finite input (``k`` values a segment read), such a step is NaN on every device with
    every memory kept. Dense payloads (casts of ``x / n``) are not read: their ``n decode``
    fits wherever ``x`` does, but for the rounding of values within ``2^-8`` of ``F32_MAX``."""
    over = None
    for decode, _, ctx, _, payloads, *_ in groups:
        if decode is _allreduce_decode and not ctx.codec.dense:
            for v in _floats(jax.tree.leaves(payloads)):
                o = ~all_finite(_times(v.astype(jnp.float32), ctx.n))
                over = o if over is None else over | o
    return over


def inputs_nonfinite(
    arrays: list, extra_bad: Any, axis_name: Any, local_bad: jax.Array | None = None
) -> jax.Array:
    """True on every device when some device's ``arrays`` hold a NaN or inf, or its
    ``local_bad`` (a flag of this device alone) is set (one scalar ``psum`` of
    :func:`local_nonfinite`; no collective when ``arrays`` is empty), or ``extra_bad`` (a
    flag already identical on every device) is set, or-ed over the blocks of
    :func:`~jaxcomp._src.shards.over_shards`."""
    bad = jnp.bool_(False) if extra_bad is None else extra_bad
    if arrays:
        local = local_nonfinite(arrays)
        local = local if local_bad is None else local | local_bad
        bad = bad | (jax.lax.psum(local.astype(jnp.int32), axis_name) > 0)
    return shards.any_block(bad)


def _reduce_flat(
    segments,
    axis_name,
    codec,
    strategy,
    key,
    servers,
    extra_bad,
    bb,
    gather_pieces=False,
    with_payload=False,
    checked=False,
    encoded=None,
):
    """Each segment through the strategy ``auto`` picks for its size (or ``strategy``).

    Returns the :class:`Reduced` and whether its non-finite flag still needs a psum over
    the devices (``flags_nonfinite`` codecs read it from what every device received).
    """
    n = axis_size(axis_name)
    chosen = [choose_strategy(codec, s.shape[0], n, strategy) for s in segments]
    keys = [
        device_key(None if key is None else jax.random.fold_in(key, i), codec, axis_name)
        for i in range(len(segments))
    ]
    groups = []
    for name in sorted(set(chosen), key=_ORDER.index):
        encode, exchange, decode = _STRATEGIES[name]
        idx = [i for i, c in enumerate(chosen) if c == name]
        xs = [segments[i] for i in idx]
        sizes = [x.shape[0] for x in xs]
        ctx = _Context(codec, axis_name, n, bb, [keys[i] for i in idx], sizes, gather_pieces)
        payloads, errors = encode(xs, ctx.keys, ctx)
        if encoded is not None:  # payloads the caller encoded (their errors are its own)
            mine = [encoded[i] for i in idx]
            payloads = [p if m is None else m for p, m in zip(payloads, mine, strict=True)]
        srv = [None if servers is None else servers[i] for i in idx]
        exchanged, held = exchange(payloads, ctx, srv)
        groups.append((decode, idx, ctx, xs, payloads, exchanged, held, errors))
    if checked:
        fill_bad = extra_bad
    else:
        fill_bad = _step_flag(segments, groups, codec, extra_bad, axis_name)
    fill = jnp.where(fill_bad, jnp.nan, 0.0)
    mean: list = [None] * len(segments)
    sent: list = [None] * len(segments)
    server: list = [None] * len(segments)
    error: list = [None] * len(segments)
    payload: list = [None] * len(segments)
    for decode, idx, ctx, xs, payloads, exchanged, _, errors in groups:
        m, s, r = decode(xs, payloads, exchanged, ctx, fill)
        for j, i in enumerate(idx):
            mean[i], sent[i], server[i], error[i] = m[j], s[j], r[j], errors[j]
            payload[i] = payloads[j]
    return Reduced(mean, sent, server, fill_bad, error, payload if with_payload else None)


def own_sent(sizes: list[int], payloads: list, axis_name: Any, codec: Codec, strategy: str):
    """What this device's payload of each segment (``Reduced.payload`` of
    :func:`reduce_segments` with ``with_payload=True``, no inner axis) decodes to, in the
    segment's units, as each strategy encodes it: ``x - own_sent`` is ``Reduced.error`` bit
    for bit (``Codec.encode_with_error`` returns ``x - decode(payload)``), with no
    collective and no second encoding; None where the error is zero (plain ``pmean``).

    Residual error feedback forms its new memory with it after a ``lax.cond`` whose branch
    ran the exchange, in place in the donated memory (returned from the branch, the memory
    left it in a buffer of its own): the decode is elementwise and XLA fuses it into that
    write."""
    n = axis_size(axis_name)
    sent = []
    for d, p in zip(sizes, payloads, strict=True):
        name = choose_strategy(codec, d, n, strategy)
        if name == "two_phase":
            first, _ = codec.phase_codecs(ceil_div(d, n), n)
            sent.append(first.decode_rows(p, ceil_div(d, n))[:d])
        elif name == "allreduce":
            sent.append(_times(codec.decode(p, d), n))
        elif name == "plain":
            sent.append(None)
        else:  # allgather, majority_vote
            sent.append(codec.decode(p, d))
    return sent


def _hierarchical(
    segments, axis_name, inner_axis_name, codec, strategy, key, servers, extra, bb, scale_after
):
    """:func:`_hierarchical_pass` with the input pre-scaled by ``1/L`` before the sum (a
    host's mean that fits float32 never overflows), or, with ``scale_after``, summed first.

    Pre-scaling costs nothing where ``x`` comes out of a pass of the caller's
    (``compressed_allreduce``'s ``g + e``: ``x / L`` fuses into it) but one more read and
    write of the whole gradient where ``x`` is the gradient as given (stateless
    ``jc.pmean``). ``scale_after`` divides the reduce-scatter's ``1/L`` chunk after the sum
    instead; a host's sum that overflows float32 is then inf in the chunk, the outer
    reduction sets the step's flag (identical on every device), and only then a
    ``lax.cond`` redoes the step pre-scaled, whose mean fits float32 and comes out finite (a
    non-finite input stays flagged). The common path gets no collective and no pass more.
    """
    args = (segments, axis_name, inner_axis_name, codec, strategy, key, servers, extra, bb)
    if not scale_after:
        return _hierarchical_pass(*args, prescale=True)
    fast = _hierarchical_pass(*args, prescale=False)
    return jax.lax.cond(fast.bad, lambda: _hierarchical_pass(*args, prescale=True), lambda: fast)


def _hierarchical_pass(
    segments, axis_name, inner_axis_name, codec, strategy, key, servers, extra, bb, *, prescale
):
    """Reduce-scatter over the fast axis (f32), compress over the slow one, all-gather back.

    Device ``(h, l)`` holds, after the reduce-scatter, chunk ``l`` of its host's mean
    ``y_{h,l}``; only that chunk (``d / L`` floats) crosses the slow axis, through ``codec``.
    What the codec drops, ``e_{h,l} = y_{h,l} - C(y_{h,l})``, is returned as this device's
    residual: ``sent = x - L * e_{h,l}`` (placed at chunk ``l``), so residual error feedback
    adds ``L e_{h,l}`` to the device's next input and the next reduce-scatter hands exactly
    ``e_{h,l}`` back to the chunk it came from. The non-finite flag of the outer reduction
    covers chunk ``l`` only: one scalar psum over the inner axis shares it (made inside the
    outer reduction by :func:`~jaxcomp._src.shards.any_shard` where jax types the flag as
    varying over the inner axis, here where it does not track variance).
    """
    n_inner = axis_size(inner_axis_name)
    li = jax.lax.axis_index(inner_axis_name)
    # ``prescale``: by 1/L before the float32 sum (a host's mean that fits float32 never
    # overflows; summed first, L rows near float32's largest value make it inf); else the
    # 1/L chunk is divided after the sum, with no pass over the whole of x.
    parts = buckets.exchange(
        [_rows(x * (1.0 / n_inner) if prescale else x, n_inner) for x in segments],
        lambda b: jax.lax.psum_scatter(b, inner_axis_name, scatter_dimension=0, tiled=False),
        lead=1,
        bucket_bytes=bb,
    )
    parts = parts if prescale else [p / n_inner for p in parts]
    inner_key = None if key is None else jax.random.fold_in(key, li)
    r = _reduce_flat(parts, axis_name, codec, strategy, inner_key, servers, extra, bb)
    bad = r.bad
    if inner_axis_name in varying_axes(bad) or not tracks_variance(inner_axis_name):
        bad = jax.lax.psum(bad.astype(jnp.int32), inner_axis_name) > 0
    gathered = buckets.exchange(
        r.mean,
        lambda b: jax.lax.all_gather(b, inner_axis_name, to=gather_to(inner_axis_name)),
        bucket_bytes=bb,
    )
    fill = jnp.where(bad, jnp.nan, 0.0)
    mean = [g.reshape(-1)[: x.shape[0]] + fill for g, x in zip(gathered, segments, strict=True)]
    error = [
        n_inner * _place(e, li, n_inner * p.shape[0], x.shape[0])
        for x, p, e in zip(segments, parts, r.error, strict=True)
    ]
    sent = [x - e for x, e in zip(segments, error, strict=True)]
    return Reduced(mean, sent, r.server, bad, error)


def server_size(d: int, n: int, n_inner: int = 1) -> int:
    """Floats of the chunk a device owns (its server residual) for a segment of ``d``."""
    return ceil_div(ceil_div(d, n_inner), n)


def reduce_segments(
    segments: list[jax.Array],
    axis_name: Any,
    codec: Codec,
    strategy: str,
    key: jax.Array | None = None,
    servers: list | None = None,
    inner_axis_name: Any = None,
    extra_bad: jax.Array | None = None,
    bucket_bytes: int = buckets.BUCKET_BYTES,
    gather_pieces: bool = False,
    with_payload: bool = False,
    checked: bool = False,
    encoded: list | None = None,
    scale_after: bool = False,
) -> Reduced:
    """Mean over ``axis_name`` (and ``inner_axis_name``) of each float32 vector of ``segments``.

    Each segment is encoded on its own (its own scales, its own selection); the payloads of
    all segments travel in buckets of about ``bucket_bytes``, one collective per bucket per
    phase. ``key`` is the step's key, the same on every device; each segment folds in its
    index and per-device noise is derived here. ``servers`` (two_phase): per segment, the
    owned chunk's residual ``f32[c]`` added before re-encoding (None: zeros). ``extra_bad``:
    a non-finite flag of other inputs, identical on every device (read from the plain
    leaves' means). ``Reduced.bad`` is the step's flag, identical on every device; it
    poisons every mean (NaN). Codecs that ``flags_nonfinite`` read it from the payloads every
    device received (no pass over the input, no extra collective); the others from their
    input, with one scalar psum. ``Reduced.error`` is what each segment's payload drops on
    this device (``segment - sent``), from :meth:`Codec.encode_with_error` in the encoding
    step: residual error feedback stores it as the new memory. ``gather_pieces``
    (``"allgather"``): payloads whose gathered bytes pass a quarter of a float32 copy of the
    segments are gathered and summed a piece at a time (same bytes, more collectives; each
    coordinate's sum in another order, so equal up to float rounding), bounding the memory
    they hold.
    ``with_payload``: ``Reduced.payload`` holds this device's payloads (else None).
    ``checked``: ``extra_bad`` is already the whole step's flag, identical on every device
    (the caller checked the inputs of the segments, which are finite where it is clear): no
    pass over the segments, no psum (flat reduce only).
    ``encoded``: per segment, this device's payload as the caller already encoded it (as the
    segment's strategy would, e.g. :func:`jaxcomp._src.fused_residual.encode_in_place`), or
    None to encode it here; a segment's ``Reduced.error`` and ``sent`` then do not describe
    the given payload (flat reduce only).
    ``scale_after`` (hierarchical reduce only): the reduce-scatter sums first and divides
    after, redoing the step pre-scaled only when its flag is set, for segments that are the
    caller's input as given (see :func:`_hierarchical`); else they are pre-scaled by ``1/L``.
    """
    if not segments:
        bad = jnp.bool_(False) if extra_bad is None else extra_bad
        return Reduced([], [], [], shards.any_block(bad), [])
    if inner_axis_name is None:
        return _reduce_flat(
            segments,
            axis_name,
            codec,
            strategy,
            key,
            servers,
            extra_bad,
            bucket_bytes,
            gather_pieces,
            with_payload,
            checked,
            encoded,
        )
    if encoded is not None:
        raise ValueError("`encoded` payloads need a flat reduce (no `inner_axis_name`)")
    return _hierarchical(
        segments,
        axis_name,
        inner_axis_name,
        codec,
        strategy,
        key,
        servers,
        extra_bad,
        bucket_bytes,
        scale_after,
    )


def mean_divided_first(x: Any, axis_name: Any) -> Any:
    """``jax.lax.pmean`` of the array (or list of arrays) ``x``, each divided by ``n`` before
    the sum: ``jax.lax.pmean`` sums first, so ``n`` finite values near float32's largest
    gave an inf mean where the mean fits (until 2026-11-27). For ``n`` a power of two the
    division is exact and the bits are ``jax.lax.pmean``'s (docs/strategies.md)."""
    n = axis_size(axis_name)
    return jax.lax.psum(jax.tree.map(lambda a: a / n, x), axis_name)


def inner_mean(tree: Any, inner_axis_name: Any) -> Any:
    """Floating leaves averaged in float32 over the fast inner axis (``None``: ``tree`` as is).

    The hierarchical entry of transforms that work on whole leaves (DGC, PowerSGD): every
    device of a host then holds the host's mean gradient and the transform runs over the outer
    axis as if each host were one device. The price: each of the ``L`` devices of a host sends
    the whole payload over the outer axis, so a host puts ``L`` times the payload on the slow
    link (DGC at 0.1% and PowerSGD's factors are small enough that this rarely matters).
    ``jc.pmean`` and ``compressed_allreduce`` do better: a reduce-scatter, so each device
    compresses and sends only ``1/L`` of the vector, one payload per host in all.
    """
    if inner_axis_name is None:
        return tree

    def mean(a):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        return mean_divided_first(a.astype(jnp.float32), inner_axis_name).astype(a.dtype)

    return jax.tree.map(mean, tree)


def plain_mean(
    leaves: list[jax.Array], every_axis: Any, bucket_bytes: int, with_buckets: bool = False
) -> Any:
    """Float32 ``pmean`` of uncompressed leaves (biases, norms, masked), bucketed: each
    leaf back in its own dtype (and, ``with_buckets``, the averaged buckets).

    An empty leaf is its own mean and takes no part in a collective: XLA:CPU (jaxlib 0.11)
    crashes compiling a program whose all-reduces include a zero-element one."""
    full = [a for a in leaves if a.size]
    means, held = buckets.exchange(
        [a.astype(jnp.float32) for a in full],
        lambda b: mean_divided_first(b, every_axis),
        bucket_bytes=bucket_bytes,
        with_buckets=True,
    )
    it = iter(means)
    means = [next(it).astype(a.dtype) if a.size else jnp.zeros(a.shape, a.dtype) for a in leaves]
    return (means, held) if with_buckets else means


GRANULARITIES = ("leaf", "flat")


def check_granularity(granularity: str) -> str:
    if granularity not in GRANULARITIES:
        raise ValueError(f"`granularity` must be one of {GRANULARITIES}, got {granularity!r}")
    return granularity


#: Codecs index with int32: a segment longer than this is cut into near-equal pieces.
MAX_SEGMENT = 2**31 - 1


def _pieces(d: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of the near-equal int32-indexable pieces of a vector of ``d``."""
    num = ceil_div(d, MAX_SEGMENT)
    bounds = [d * i // num for i in range(num + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class Segments(NamedTuple):
    """How per-leaf vectors map to the segments a codec sees (static).

    ``granularity="leaf"``: one segment per leaf (scales and selections per layer);
    ``"flat"``: one segment for all leaves end to end. A segment longer than
    ``MAX_SEGMENT`` (2^31 - 1) is cut into pieces, so int32 indices never overflow.
    """

    sizes: tuple[int, ...]  # per leaf
    flat: bool

    def wholes(self) -> list[int]:
        """Sizes of the vectors before cutting: the leaves, or their total."""
        return [sum(self.sizes)] if self.flat and self.sizes else list(self.sizes)

    def pieces(self) -> list[list[int]]:
        """Per whole, the sizes of its segments."""
        return [[b - a for a, b in _pieces(d)] for d in self.wholes()]

    def split(self, vectors: list[jax.Array]) -> list[jax.Array]:
        """Per-leaf vectors -> segments."""
        wholes = [_concat(vectors)] if self.flat and vectors else vectors
        return [
            w if b - a == w.shape[0] else w[a:b] for w in wholes for a, b in _pieces(w.shape[0])
        ]

    def join(self, segments: list[jax.Array]) -> list[jax.Array]:
        """Inverse of :meth:`split`: per-leaf vectors from per-segment ones."""
        wholes, i = [], 0
        for pieces in self.pieces():
            wholes.append(_concat(segments[i : i + len(pieces)]))
            i += len(pieces)
        if not self.flat or not wholes:
            return wholes
        offsets = [sum(self.sizes[:j]) for j in range(len(self.sizes) + 1)]
        return [wholes[0][a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _concat(parts: list[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def segments_for(sizes: list[int], granularity: str) -> Segments:
    """The :class:`Segments` of compressed leaves of these sizes."""
    return Segments(tuple(sizes), granularity == "flat")


def pmean(
    tree: Any,
    axis_name: Any,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    strategy: str = "auto",
    min_size: int = 0,
    granularity: str = "leaf",
    inner_axis_name: Any = None,
    bucket_bytes: int = buckets.BUCKET_BYTES,
) -> Any:
    """Compressed ``jax.lax.pmean``: the mean of ``tree`` over ``axis_name``, through ``codec``.

    Stateless (no error feedback): use :func:`jaxcomp.compressed_allreduce` to keep what the
    codec drops. Floating leaves with at least ``min_size`` elements are compressed, smaller
    ones go through plain ``pmean``; each keeps its dtype, the work is in float32. Integer
    and bool leaves pass through untouched (a step counter riding along with the gradients;
    for a count's mean over the devices call ``jax.lax.pmean`` on it); complex leaves are
    reduced exactly by ``jax.lax.pmean``, uncompressed. Over axes of one device in all, every
    leaf comes back as it is (the mean of one value: no codec runs).

    ``pmean(x) = (1/n) sum_i decode(encode(x_i))`` over the ``n`` devices of ``axis_name``
    (``two_phase`` encodes each averaged chunk once more before the all-gather). The bytes of
    each strategy are in :data:`STRATEGIES` and :func:`strategy_bytes`. Under ``jax.grad``
    the derivative is ``jax.lax.pmean``'s (straight-through: the codec's rounding and
    selection are not differentiated, the backward pass is uncompressed).

    Raises:
      ValueError: when the call is traced, ``strategy``, ``granularity``, ``min_size``,
        ``bucket_bytes``, ``key``, ``axis_name`` or ``inner_axis_name`` outside its rule (the
        message names the argument; the rules: docs/errors.md).
      TypeError: when the call is traced, ``codec``, ``min_size``, ``bucket_bytes`` or ``axis_name``
        of the wrong kind.

    References: compressed reduce-scatter / all-gather as in ZeRO++ qgZ (Wang et al., 2023)
    and gTop-k (Shi et al., ICDCS 2019); ``majority_vote``: Bernstein, Zhao, Azizzadenesheli,
    Anandkumar, "signSGD with Majority Vote is Communication Efficient and Fault Tolerant",
    ICLR 2019.

    Args:
      tree: a pytree of arrays (the per-device value), inside ``shard_map``/``pmap``.
      axis_name: the mesh axis to reduce over (with ``inner_axis_name``: the slow one).
      codec: a jaxcomp codec.
      key: PRNG key, the same on every device (required by stochastic codecs; per-device
        noise is derived by folding in the device index).
      strategy: ``"auto"``, ``"allreduce"``, ``"allgather"``, ``"two_phase"`` or
        ``"majority_vote"`` (sign codecs: the sign of the devices' vote, scaled by the mean
        of their scales, instead of the mean).
      min_size: leaves smaller than this go through plain ``pmean``.
      granularity: ``"leaf"`` (compress each leaf on its own: per-layer scales) or ``"flat"``
        (all compressed leaves as one vector: one scale, one selection over the model).
      inner_axis_name: a second, fast mesh axis (devices of one host). The mean is then over
        both axes: float32 reduce-scatter over the inner axis, ``strategy`` with ``codec``
        over ``axis_name`` on the ``1/L`` chunk each device holds, float32 all-gather back.
      bucket_bytes: payloads travel in buckets of about this many bytes, one collective per
        bucket per phase (default 32 MiB).

    Returns:
      The mean, same structure and dtypes as ``tree``, identical on every device (integer
      and bool leaves: each device's own, untouched).
    """
    every_axis = axis_names(axis_name, inner_axis_name)

    def forward(t):
        mean = _mean_of_floats(
            t, axis_name, codec, key, strategy, min_size, granularity, inner_axis_name, bucket_bytes
        )
        return _reduce_complex(mean, jax.lax.pmean, every_axis)

    return straight_through(forward, jax.lax.pmean, every_axis, tree)


def straight_through(forward: Callable, reduce: Callable, every_axis: Any, tree: Any) -> Any:
    """``forward(tree)`` (the compressed reduction), differentiated as ``reduce``
    (``jax.lax.pmean`` / ``psum``) of the floating and complex leaves over ``every_axis``.

    A codec's rounding and selection have derivative zero almost everywhere (int8's
    ``round``) or keep only the coordinates it chose (top-k): ``jax.grad`` through the
    program as written gave zero, or a few coordinates, where the drop-in's reference
    ``jax.lax.pmean`` gives the mean of the cotangents. Here the tangents go through
    ``reduce`` itself (uncompressed; forward mode, ``jax.jvp``), and ``jax.grad`` through its
    transpose, with jax's rules for pmap and for ``shard_map``'s varying types: the
    straight-through estimator of quantization-aware training (Bengio, Leonard, Courville,
    2013). Integer and bool leaves pass through, as in the forward pass, with no cotangent.
    """

    def reference(t):
        return jax.tree.map(
            lambda x: (
                reduce(x, every_axis) if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else x
            ),
            t,
        )

    @jax.custom_jvp
    def reduced(t):
        return forward(t)

    @reduced.defjvp
    def _(primals, tangents):  # linear in the tangent: jax transposes it for jax.grad
        return forward(primals[0]), reference(tangents[0])

    return reduced(tree)


def _mean_of_floats(
    tree, axis_name, codec, key, strategy, min_size, granularity, inner_axis_name, bucket_bytes
) -> Any:
    """:func:`pmean` of the floating leaves; the other leaves of ``tree`` as they were."""
    check_codec(codec)
    check_pair(codec, strategy)
    check_granularity(granularity)
    min_size = check_int("min_size", min_size, 0)
    bucket_bytes = buckets.check_bucket_bytes(bucket_bytes)
    axis_size(axis_name)
    check_inner_axis(axis_name, inner_axis_name)
    every_axis = axis_names(axis_name, inner_axis_name)
    if axis_size(every_axis) == 1:
        return _over_one_device(tree, every_axis)
    if axis_size(axis_name) == 1:  # a slow axis of one host: the fast axis's float32 mean
        min_size = sys.maxsize  # every float leaf plain: no codec where nothing crosses it
    layout = layouts.layout_of(tree, min_size)
    xs = layouts.compressed_vectors(tree, layout)
    plan = segments_for([x.shape[0] for x in xs], granularity)
    plain, held = plain_mean(
        layouts.leaves_of(tree, layout, layouts.PLAIN), every_axis, bucket_bytes, True
    )
    reduced = reduce_segments(
        plan.split(xs),
        axis_name,
        codec,
        strategy,
        shared_key(key, codec, axis_name) if xs else key,
        None,
        inner_axis_name,
        local_nonfinite(held) if plain else None,  # means: the same on every device
        bucket_bytes,
        scale_after=True,  # the gradient as given: no pass of ours to fuse x / L into
    )
    means = plan.join(reduced.mean) if xs else []
    return layouts.assemble(tree, layout, means, plain)


def _over_one_device(tree: Any, every_axis: Any) -> Any:
    """The mean (and the sum) over axes of one device in all: each floating leaf as it is,
    typed as ``jax.lax.psum`` types it (one device: no data moves). A codec there only added
    its error where ``jax.lax.pmean`` gives the value exactly (figures: docs/index.md), and
    a float64 leaf kept float32's digits. Other leaves as :func:`pmean` leaves them."""

    def one(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        if not jnp.size(x):  # no zero-element collective (XLA:CPU, jaxlib 0.11)
            return jnp.zeros(jnp.shape(x), jnp.result_type(x))
        return jax.lax.psum(x, every_axis)

    return jax.tree.map(one, tree)


def _reduce_complex(tree: Any, reduce: Callable, every_axis: Any) -> Any:
    """``tree`` with its complex leaves reduced by ``reduce`` (``jax.lax.psum`` or ``pmean``)
    over ``every_axis``, exactly as jax.lax does: the codecs take real floats, and a complex
    leaf returned untouched would leave each device its own value. Integer and bool leaves
    pass through (DESIGN.md: a step counter rides along with the gradients, in its dtype)."""

    def one(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.complexfloating):
            return reduce(x, every_axis)
        return x

    return jax.tree.map(one, tree)


def psum(
    tree: Any,
    axis_name: Any,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    strategy: str = "auto",
    min_size: int = 0,
    granularity: str = "leaf",
    inner_axis_name: Any = None,
    bucket_bytes: int = buckets.BUCKET_BYTES,
) -> Any:
    """Compressed ``jax.lax.psum``: :func:`pmean` times the number of devices. Same arguments.

    ``psum(x) = n * pmean(x) ~ sum_i decode(encode(x_i))`` over the ``n`` devices of the
    axis (or axes); the strategies, bytes and references are those of :func:`pmean`. Under
    ``jax.grad`` the derivative is ``jax.lax.psum``'s (straight-through, as :func:`pmean`).

    The sum is that of ``jax.lax.psum``: in the leaf's own type. What travels is the mean
    (each device's ``x / n`` through the codec), so the wire never overflows where the mean
    fits; the product ``n * mean`` is formed in float32 and cast to the leaf's dtype, so a
    sum that leaves the leaf's range is inf there, as ``jax.lax.psum`` gives (8 devices of
    fp16 10000: inf in an fp16 leaf, 80000 in a float32 one). Integer and bool leaves pass
    through untouched, as in :func:`pmean` (sum a count of tokens with ``jax.lax.psum``);
    complex leaves are summed exactly by ``jax.lax.psum``, uncompressed.

    Args:
      tree: a pytree of arrays (the per-device value), inside ``shard_map``/``pmap``.
      axis_name: the mesh axis to reduce over (with ``inner_axis_name``: the slow one).
      codec: a jaxcomp codec.
      key: PRNG key, the same on every device (stochastic codecs), as :func:`pmean`.
      strategy: as :func:`pmean`.
      min_size: leaves smaller than this are summed exactly (plain ``pmean`` times ``n``).
      granularity: ``"leaf"`` or ``"flat"``, as :func:`pmean`.
      inner_axis_name: a second, fast mesh axis, as :func:`pmean`.
      bucket_bytes: payload bucket size, as :func:`pmean`.

    Returns:
      The tree of sums, each leaf in its own dtype.

    Raises:
      ValueError: when the call is traced, ``axis_name`` or ``strategy`` outside its rule (the
        message names the argument; the rules: docs/errors.md).
      TypeError: when the call is traced, ``axis_name`` of the wrong kind.

    Example::

        total = jc.psum(grads, "data", jc.cast("bf16"))  # inside jax.shard_map over "data"
    """
    every_axis = axis_names(axis_name, inner_axis_name)

    def forward(t):
        mean = _mean_of_floats(
            t,
            axis_name,
            codec,
            key,
            strategy,
            min_size,
            granularity,
            inner_axis_name,
            bucket_bytes,
        )
        n = axis_size(axis_name) * (1 if inner_axis_name is None else axis_size(inner_axis_name))
        scale = lambda m: (  # noqa: E731
            (m.astype(jnp.float32) * n).astype(m.dtype)
            if jnp.issubdtype(m.dtype, jnp.floating) and n > 1
            else m
        )
        total = jax.tree.map(scale, mean)
        return _reduce_complex(total, jax.lax.psum, every_axis)

    return straight_through(forward, jax.lax.psum, every_axis, tree)
