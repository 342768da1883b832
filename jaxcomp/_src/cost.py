"""The bytes model: ring-model bytes per device of each strategy, and what ``auto`` picks.

Pure Python over codec shapes (no devices needed): ``strategy_bytes``, ``choose_strategy``,
``hierarchical_bytes``. The compiled programs are checked against it row by row
(``benchmarks/wire_bytes.py``, ``tests/test_accounting.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp._src.codecs import packing
from jaxcomp._src.codecs.base import Codec, ceil_div

STRATEGIES = ("auto", "allreduce", "allgather", "two_phase", "majority_vote")
"""Values of ``strategy=``. Ring-model bytes per device for ``n`` devices and a payload of
``P(m)`` bytes for ``m`` floats: ``allreduce`` ``2(n-1)/n P(d)`` (summable codecs),
``allgather`` ``(n-1) P(d)``, ``two_phase`` ``2(n-1) P(d/n) ~ 2 P(d)``, ``majority_vote``
(sign codecs: packed bits out and back, signSGD with majority vote, Bernstein et al. 2019),
``auto`` the cheapest of the first three (:func:`choose_strategy`). Plain ``pmean`` sends
``2(n-1)/n 4d``."""


def check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def check_codec(codec: Any) -> Codec:
    if not isinstance(codec, Codec):
        raise TypeError(
            f"`codec` must be a jaxcomp codec (e.g. jc.int_quant(8)), got "
            f"{type(codec).__name__}{_codec_hint(codec)}"
        )
    return codec


def _codec_hint(codec: Any) -> str:
    """What a user who passed ``codec`` most likely meant: a codec's name from
    ``jc.CODECS`` (``"sign"``), a codec factory not called (``jc.sign``), or the arguments
    swapped (a learning rate in the codec's place)."""
    from jaxcomp._src.codecs.registry import CODECS  # the registry imports the codecs

    if isinstance(codec, str):
        known = f"jc.CODECS[{codec!r}]()" if codec in CODECS else "jc.CODECS: the named presets"
        return f" {codec!r}: pass a codec object, not its name ({known})"
    if isinstance(codec, int | float) and not isinstance(codec, bool):
        return (
            f" {codec!r}: a number where the codec goes (jc.sgd(learning_rate, codec, axis_name))"
        )
    module = getattr(codec, "__module__", None) or ""
    if callable(codec) and module.startswith("jaxcomp._src.codecs"):
        return f" {codec.__name__}: a codec factory, call it (jc.{codec.__name__}(...))"
    return ""


def check_pair(codec: Codec, strategy: str) -> None:
    """Construction-time check that ``strategy`` can carry ``codec``'s payloads."""
    check_strategy(strategy)
    if strategy == "allreduce" and not codec.summable:
        raise ValueError(
            f"`strategy`='allreduce' needs a summable codec; {codec.name} is not "
            f"(use 'allgather', 'two_phase' or 'auto')"
        )
    if strategy == "majority_vote" and not codec.votes:
        raise ValueError(
            f"`strategy`='majority_vote' needs a sign codec (jc.sign(None) or jc.sign('mean'), "
            f"without exact_zeros): the devices vote with their signs; got {codec.name}"
        )


def check_sizes(d: Any, **axes: Any) -> None:
    """``d`` (a vector's length) ``>= 0`` and each device count in ``axes`` ``>= 1``, else a
    ValueError naming it: a negative size gave negative bytes and 0 devices a
    ZeroDivisionError."""
    if not d >= 0:
        raise ValueError(f"`d` must be >= 0 (the length of the vector), got {d!r}")
    for name, n in axes.items():
        if not n >= 1:
            raise ValueError(f"`{name}` must be >= 1 (the devices on the axis), got {n!r}")


def majority_vote_bytes(codec: Codec, d: int, n: int) -> float:
    """Ring bytes per device of the two-phase vote: packed bits out, packed bits back, scales."""
    if not d:
        return 0.0
    words = ceil_div(packing.packed_words(d, 1), n)  # uint32 words of sign bits per chunk
    scales = (codec.payload_bytes(d) - 4 * packing.packed_words(d, 1)) / 4  # f32 block scales
    return 2 * (n - 1) * 4 * words + 2 * (n - 1) / n * 4 * scales


def strategy_bytes(codec: Codec, d: int, n: int) -> dict[str, float]:
    """Ring-model bytes per device of each strategy that ``codec`` supports (the auto model).

    With ``P(m) = codec.payload_bytes(m)``::

        allreduce      2 (n-1)/n * P_float(d)    (summable codecs only: their float leaves)
        allgather      (n-1) * P(d)
        two_phase      2 (n-1) * P(ceil(d/n))
        majority_vote  packed bits out and back, plus scales (sign codecs only)

    against ``2 (n-1)/n * 4d`` for plain float32 ``pmean``. The ring model is the
    bandwidth-optimal all-reduce of Patarasuk and Yuan, "Bandwidth Optimal All-reduce
    Algorithms for Clusters of Workstations", JPDC 2009.

    For the hierarchical case pass the outer axis size as ``n`` and the chunk each inner device
    holds, ``ceil(d / n_inner)``, as ``d`` (see :func:`hierarchical_bytes`).

    Args:
      codec: a jaxcomp codec.
      d: the length of the vector.
      n: the number of devices on the axis.

    Returns:
      ``{strategy: bytes per device}`` for the strategies ``codec`` supports, and ``"plain"``.

    Raises:
      ValueError: ``d`` below 0 or ``n`` below 1, naming it.
    """
    check_sizes(d, n=n)
    out = {}
    if codec.summable:
        out["allreduce"] = 2 * (n - 1) / n * _summed_bytes(codec, d)
    out["allgather"] = (n - 1) * codec.payload_bytes(d)
    out["two_phase"] = 2 * (n - 1) * codec.payload_bytes(ceil_div(d, n)) if d else 0.0
    if codec.votes:
        out["majority_vote"] = majority_vote_bytes(codec, d, n)
    out["plain"] = plain_bytes(d, n)
    return out


def plain_bytes(d: int, n: int) -> float:
    """Ring bytes per device of plain float32 ``pmean`` of ``d`` floats: ``2 (n-1)/n * 4d``."""
    return 2 * (n - 1) / n * 4 * d


#: Devices up to which a ring all-reduce that adds a summable payload in its own narrow type
#: stays accurate: its relative error within 2x that of ``two_phase`` (which adds in float32
#: and rounds the mean once more, at the same bytes). Simulated by ``benchmarks/narrow_sum.py``
#: (``benchmarks/results/narrow_sum.json``): fp16's ring error grows from 2.9e-4 at n = 2 to
#: 5.2e-4 at 16 and 3.9e-3 at 1024 against two-phase's 2.1e-4; bf16's from 2.3e-3 to 4.2e-3
#: at 16 and 0.34 at 1024 (a partial sum stops growing once the parts fall under half its
#: ulp) against 1.7e-3. Past it ``auto`` sends such codecs ``two_phase``.
RING_SUM_MAX_DEVICES = {"float16": 8, "bfloat16": 8}


@functools.lru_cache(maxsize=256)
def _summed_dtype(codec: Codec) -> str | None:
    """The narrowest floating dtype among the payload leaves ``allreduce`` psums."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    payload = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((8,), jnp.float32), key)
    floats = [a.dtype for a in jax.tree.leaves(payload) if jnp.issubdtype(a.dtype, jnp.floating)]
    return min(floats, key=lambda t: t.itemsize).name if floats else None


def ring_sum_accurate(codec: Codec, n: int) -> bool:
    """Whether ``n`` devices may add ``codec``'s payloads in their own type (a psum) and stay
    accurate: always for float32, up to :data:`RING_SUM_MAX_DEVICES` for fp16 and bf16."""
    return n <= RING_SUM_MAX_DEVICES.get(_summed_dtype(codec), n)


@functools.lru_cache(maxsize=1024)
def _summed_bytes(codec: Codec, d: int) -> int:
    """Bytes of the payload leaves that ``allreduce`` psums: the floating ones. Integer leaves
    (random-k's indices, the same on every device) never travel."""
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    payload = jax.eval_shape(codec.encode, jax.ShapeDtypeStruct((d,), jnp.float32), key)
    return sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(payload)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    )


def hierarchical_bytes(
    codec: Codec, d: int, n_outer: int, n_inner: int, strategy: str = "auto"
) -> dict[str, float]:
    """Ring bytes per device of the hierarchical reduction, per axis.

    ``inner``: float32 reduce-scatter + all-gather over the fast axis, ``2 (L-1)/L * 4d``;
    ``outer``: ``strategy`` over the slow axis for the ``ceil(d/L)`` chunk each device holds.

    Args:
      codec: a jaxcomp codec (the slow axis).
      d: the length of the vector.
      n_outer: the number of devices on the slow axis (``axis_name``).
      n_inner: ``L``, the number of devices on the fast axis (``inner_axis_name``).
      strategy: the slow axis' strategy, ``"auto"`` as :func:`choose_strategy`.

    Returns:
      ``{"inner": bytes, "outer": bytes}`` per device.

    Raises:
      ValueError: ``d`` below 0, ``n_outer`` or ``n_inner`` below 1, naming it.
    """
    check_sizes(d, n_outer=n_outer, n_inner=n_inner)
    chunk = ceil_div(d, n_inner) if d else 0
    chosen = choose_strategy(codec, chunk, n_outer, strategy)
    return {
        "inner": 2 * (n_inner - 1) * 4 * chunk,
        "outer": strategy_bytes(codec, chunk, n_outer)[chosen],
        "strategy": chosen,
    }


def choose_strategy(codec: Codec, d: int, n: int, strategy: str = "auto") -> str:
    """Resolve ``"auto"`` (and validate an explicit choice) for a vector of size ``d``.

    ``auto = argmin_s strategy_bytes(codec, d, n)[s]`` over the strategies below.
    ``auto`` takes the fewest bytes among ``allreduce`` (summable codecs: one psum, the same
    bytes as two-phase, so taken for them while the sum in their type stays accurate:
    :func:`ring_sum_accurate`; past it, fp16/bf16 go ``two_phase``, which adds in float32),
    ``allgather`` and ``two_phase`` (a tie goes to ``allgather``: one encode, no second
    compression error). A ``rounding_only`` codec (the scaled fp16 cast) goes ``two_phase``
    at any ``n``: at 2 devices it sends one float32 scale more per leaf than ``allgather``
    (``2d + 8`` against ``2d + 4`` bytes), its second encoding only rounds again (``2^-11``),
    and its owners decode ``d`` values where the all-gather decodes ``n d`` (measured:
    docs/network.md, "fp16 at 1 Gbit/s"). Where plain float32 ``pmean``
    sends fewer bytes still (a leaf of a
    few floats: a payload's scales, words and per-chunk padding cost more than the floats
    themselves; ``strategy_bytes(...)["plain"]``), it returns ``"plain"``: the leaf is
    averaged uncompressed and exactly. It never picks ``majority_vote``: the sign of a vote
    is not the mean the other strategies estimate.

    Args:
      codec: a jaxcomp codec.
      d: the length of the vector (one leaf, or one device's chunk in the hierarchical case).
      n: the number of devices on the axis.
      strategy: ``"auto"`` or one of :data:`STRATEGIES` the codec supports.

    Returns:
      The strategy's name, or ``"plain"`` (above).

    Raises:
      ValueError: ``strategy`` outside its rule, ``d`` below 0 or ``n`` below 1 (the message
        names the argument; the rules: docs/errors.md).
    """
    check_pair(codec, strategy)
    check_sizes(d, n=n)
    if strategy != "auto":
        return strategy
    costs = strategy_bytes(codec, d, n)
    if codec.summable:
        exact = ring_sum_accurate(codec, n) or costs["two_phase"] > costs["allreduce"]
        best = "allreduce" if exact else "two_phase"
    elif codec.rounding_only:
        best = "two_phase"
    else:
        best = min(("allgather", "two_phase"), key=lambda s: (costs[s], s != "allgather"))
    return "plain" if costs["plain"] < costs[best] else best
