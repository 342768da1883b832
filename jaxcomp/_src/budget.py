"""Byte budgets: SparseLoCo's density and DeMo's ``topk`` sized for a ratio on a given model.

A ratio of bytes ("3000x fewer than per-step ``pmean``") is a property of a setting AND of the
model: a chunked top-k pays per chunk of every leaf (the last chunk of a leaf is zero-padded
but keeps its ``k``), per index bit and per float32 scale, and the leaves sent plain (under
``min_size``) cost their full size. These functions compute the ratio that
:func:`jaxcomp.comm_report` reads off a step (ring model, per device) from the leaves' sizes,
and invert it: the largest integer ``k`` per chunk whose ratio is still at least the one asked.
Pure Python on shapes: no devices, nothing traced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp._src import demo as demo_lib
from jaxcomp._src import sparse_exchange
from jaxcomp._src.codecs.base import Codec, check_int, check_positive_float, is_number
from jaxcomp._src.codecs.chunked import check_sub_chunk, chunked_top_k
from jaxcomp._src.cost import plain_bytes
from jaxcomp._src.sparseloco import check_small_codec, check_small_for_size, density_codec


def float_sizes(params: Any) -> list[int]:
    """The number of values of every floating leaf of ``params`` (arrays or
    ``jax.ShapeDtypeStruct``; integer leaves travel nowhere), or an error naming ``params``."""
    sizes = [
        math.prod(jnp.shape(x))
        for x in jax.tree.leaves(params)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    if not sizes or not sum(sizes):
        raise ValueError("`params` holds no floating values: there are no bytes to budget")
    return sizes


def ratio_of(baseline: float, exchange: float, other_bytes: float) -> float:
    """``(baseline + other) / (exchange + other)``, bytes per step; inf where nothing is sent."""
    sent = exchange + other_bytes
    return math.inf if sent <= 0 else (baseline + other_bytes) / sent


def largest_fitting(fits: Callable[[int], bool], hi: int) -> int:
    """The largest ``k`` in ``[1, hi]`` with ``fits(k)`` (bytes grow with ``k``, so ``fits``
    turns False once and stays so), or 0 where ``fits(1)`` is False: a bisection."""
    if not fits(1):
        return 0
    lo = 1  # fits(lo) holds
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check_counts(sync_every: Any, replicas: Any, devices: Any) -> tuple[int, int, int]:
    """``sync_every`` >= 1, ``replicas`` >= 2 and ``devices`` (None: ``replicas``) >= 2,
    each an int, else an error naming it."""
    if not isinstance(sync_every, int | bool) and hasattr(sync_every, "__len__"):
        raise TypeError(
            f"`sync_every` must be one int here, got {sync_every!r}: with intervals that "
            "change, the bytes per step depend on the run's length (size for the last one)"
        )
    h = check_int("sync_every", sync_every, 1)
    m = check_int("replicas", replicas, 2)
    return h, m, m if devices is None else check_int("devices", devices, 2)


def check_other_bytes(other_bytes: Any) -> float:
    """``other_bytes`` as a finite float >= 0, else an error naming it."""
    if not is_number(other_bytes):
        raise TypeError(f"`other_bytes` must be a number >= 0, got {other_bytes!r}")
    if not (math.isfinite(other_bytes) and other_bytes >= 0):
        raise ValueError(f"`other_bytes` must be >= 0 and finite, got {other_bytes}")
    return float(other_bytes)


def sync_bytes(
    sizes: list[int],
    replicas: int,
    codec: Codec,
    min_size: int,
    small_codec: Codec | None,
) -> tuple[float, float]:
    """``(coded, small)``: ring-model bytes per device of one SparseLoCo sync (the all-gather
    of ``mask="topk"``) for the leaves of ``sizes``: the chunked top-k payloads of the leaves
    of ``min_size`` values or more, and the rest (a float32 ``pmean``, or ``small_codec``'s
    payloads in the same all-gather)."""
    big = [d for d in sizes if d >= min_size]
    small = [d for d in sizes if d < min_size]
    coded = sparse_exchange.wire_bytes(big, [codec] * len(big), replicas)
    return coded, sparse_exchange.wire_bytes(small, [small_codec] * len(small), replicas)


def _sparse_setting(chunk, bits, min_size, small_codec):
    """``chunk``, ``bits``, ``min_size`` and ``small_codec`` checked as
    :func:`jaxcomp.sparseloco` checks them (errors naming each)."""
    chunk = check_int("chunk", chunk, 1, 2**30)
    if bits is not None:
        bits = check_int("bits", bits, 1, 8)
    min_size = check_int("min_size", min_size, 0)
    return chunk, bits, min_size, check_small_for_size(check_small_codec(small_codec), min_size)


def unit_codec(chunk: int, bits: int | None, sub_chunk: int | None) -> Callable[[int], Codec]:
    """``k -> `` the chunked top-k keeping ``k`` per chunk, or with ``sub_chunk`` ``k`` per
    sub-chunk (``chunk / sub_chunk`` times that per chunk): the codec of a density ``k /
    unit``, ``unit`` = ``sub_chunk`` or ``chunk``."""
    group = 1 if sub_chunk is None else chunk // sub_chunk
    return lambda k: chunked_top_k(k * group, chunk, bits, sub_chunk=sub_chunk)


def sparseloco_ratio(
    params: Any,
    sync_every: int,
    replicas: int,
    *,
    devices: int | None = None,
    density: float = 64 / 4096,
    chunk: int = 4096,
    bits: int | None = 2,
    min_size: int = 1024,
    small_codec: Codec | None = None,
    other_bytes: float = 0.0,
    sub_chunk: int | None = None,
) -> float:
    r"""How many times fewer bytes :func:`jaxcomp.sparseloco` sends on ``params`` than a
    float32 ``pmean`` of the gradients every step, as :func:`jaxcomp.comm_report` reads the
    two steps (ring model, bytes per device, averaged over the ``H`` steps of a sync)::

        ratio = (B + o) / (S / H + o),   B = 2 (n - 1) / n x 4 sum_l d_l
        S = (M - 1) sum_{d_l >= min_size} P(d_l)  +  sum_{d_l < min_size} s(d_l)
        P(d) = 4 ceil(k_d R b_i / 32) + 4 ceil(k_d R bits / 32) + 4 R

    over the floating leaves ``l`` of ``d_l`` values: ``n`` devices in the data-parallel
    baseline, ``M`` replicas, ``H = sync_every``, ``o = other_bytes``. ``P(d)`` is the
    chunked top-k payload of a leaf (:func:`jaxcomp.chunked_top_k`): ``R = ceil(d / c)``
    chunks of ``c = min(chunk, d)`` values, the last zero-padded, ``k_d = k`` per chunk (a
    leaf shorter than ``chunk`` keeps ``ceil(k d / chunk)``), ``k = ceil(density chunk)``,
    indices in ``b_i = ceil(log2 c)`` bits, ``bits`` per value and a float32 scale per chunk;
    ``s(d)`` a small leaf's float32 ``pmean``, ``2 (M - 1) / M x 4 d``, or with
    ``small_codec`` ``(M - 1)`` times its payload. This is the all-gather exchange of
    ``mask="topk"`` (the default). With ``sub_chunk`` the top-k runs in sub-chunks
    (``ceil(density sub_chunk)`` kept in each, indices in ``ceil(log2 min(sub_chunk, d))``
    bits) and the float32 scales stay one per chunk (:func:`jaxcomp.chunked_top_k`).

    Args:
      params: the params (a pytree of arrays or ``jax.ShapeDtypeStruct``; floating leaves
        count, integer leaves travel nowhere).
      sync_every: ``H``, inner steps between syncs (an int).
      replicas: ``M``, the replicas the exchange crosses (the size of its axis), >= 2.
      devices: ``n``, the devices of the per-step ``pmean`` it is compared with (None:
        ``replicas``; for ``M`` replicas of data-parallel groups, all ``M x G`` devices).
      density: as :func:`jaxcomp.sparseloco`'s.
      chunk: as :func:`jaxcomp.sparseloco`'s.
      bits: as :func:`jaxcomp.sparseloco`'s.
      min_size: as :func:`jaxcomp.sparseloco`'s.
      small_codec: as :func:`jaxcomp.sparseloco`'s.
      other_bytes: bytes per step the step sends besides the exchange, counted on both sides
        (e.g. 7 for a float32 loss ``pmean``'d over 8 devices for logging), >= 0.
      sub_chunk: as :func:`jaxcomp.sparseloco`'s.

    Returns:
      The ratio, a float (``inf`` where nothing is sent).

    Raises:
      ValueError: ``params`` without floating values; ``sync_every``, ``replicas``,
        ``devices``, ``density``, ``chunk``, ``bits``, ``min_size``, ``small_codec``,
        ``other_bytes`` or ``sub_chunk`` outside its rule (the message names it; the rules:
        docs/errors.md).
      TypeError: ``sync_every`` (a sequence of intervals), ``replicas``, ``devices``,
        ``density``, ``chunk``, ``bits``, ``min_size``, ``small_codec``, ``other_bytes`` or
        ``sub_chunk`` of the wrong kind.

    Example::

        jc.sparseloco_ratio(params, 30, 8, density=21 / 4096, bits=1, min_size=0)

    References:
      Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
      SparseLoCo", arXiv 2508.15706, 2025.
    """
    sizes = float_sizes(params)
    h, m, n = check_counts(sync_every, replicas, devices)
    chunk, bits, min_size, small_codec = _sparse_setting(chunk, bits, min_size, small_codec)
    codec = density_codec(density, chunk, bits, sub_chunk=sub_chunk)
    coded, small = sync_bytes(sizes, m, codec, min_size, small_codec)
    return ratio_of(plain_bytes(sum(sizes), n), (coded + small) / h, check_other_bytes(other_bytes))


def sparseloco_density(
    params: Any,
    ratio: float,
    sync_every: int,
    replicas: int,
    *,
    devices: int | None = None,
    chunk: int = 4096,
    bits: int | None = 2,
    min_size: int = 1024,
    small_codec: Codec | None = None,
    other_bytes: float = 0.0,
    sub_chunk: int | None = None,
) -> float:
    r"""The ``density`` of :func:`jaxcomp.sparseloco` that sends at least ``ratio`` times
    fewer bytes than a float32 ``pmean`` every step, on these ``params``, as close to
    ``ratio`` as one integer ``k`` per chunk allows.

    Returns ``k / chunk`` for the largest ``k`` in ``[1, chunk]`` whose
    :func:`sparseloco_ratio` is ``>= ratio``: the sync may cost at most ``S_max = H ((B + o) /
    ratio - o)`` bytes (the formula of :func:`sparseloco_ratio`), of which the small leaves
    (under ``min_size``) take their fixed share and every leaf's payload ``(M - 1) P(d_l)``
    grows with ``k``. Each leaf is costed as the codec sends it: its last chunk zero-padded
    but keeping ``k``, its index bits, a leaf shorter than ``chunk`` keeping ``ceil(k d /
    chunk)``. One more ``k`` adds about ``1 / k`` of the payload, so the ratio lands within
    that of the one asked (at ``k`` = 20, 5%). The same ``density``, ``chunk``, ``bits``,
    ``min_size`` and ``small_codec`` passed to :func:`jaxcomp.sparseloco` give that ratio
    (``value_scale`` costs nothing). With ``sub_chunk`` it is ``k / sub_chunk`` for the
    largest ``k`` per sub-chunk, to pass with the same ``sub_chunk``.

    Args:
      params: as :func:`sparseloco_ratio`'s.
      ratio: the fewest times fewer bytes than per-step float32 ``pmean`` (e.g. 3000), > 0.
      sync_every: as :func:`sparseloco_ratio`'s.
      replicas: as :func:`sparseloco_ratio`'s.
      devices: as :func:`sparseloco_ratio`'s.
      chunk: as :func:`jaxcomp.sparseloco`'s.
      bits: as :func:`jaxcomp.sparseloco`'s.
      min_size: as :func:`jaxcomp.sparseloco`'s.
      small_codec: as :func:`jaxcomp.sparseloco`'s.
      other_bytes: as :func:`sparseloco_ratio`'s.
      sub_chunk: as :func:`jaxcomp.sparseloco`'s.

    Returns:
      The density ``k / chunk`` (``k / sub_chunk``), a float in ``(0, 1]``.

    Raises:
      ValueError: where no ``k`` reaches ``ratio``: the small leaves alone (or
        ``other_bytes``) exceed the budget (the message names ``min_size`` and
        ``small_codec``), or one value per chunk does (it names ``chunk``, ``bits`` and
        ``sync_every``); ``params`` without floating values; ``ratio``, ``sync_every``,
        ``replicas``, ``devices``, ``chunk``, ``bits``, ``min_size``, ``small_codec``,
        ``other_bytes`` or ``sub_chunk`` outside its rule (the rules: docs/errors.md).
      TypeError: ``ratio``, ``sync_every`` (a sequence of intervals), ``replicas``,
        ``devices``, ``chunk``, ``bits``, ``min_size``, ``small_codec``, ``other_bytes`` or
        ``sub_chunk`` of the wrong kind.

    Example::

        density = jc.sparseloco_density(params, 3000, 30, 8, bits=1, min_size=0)
        tx = jc.sparseloco(inner, "data", 30, density=density, bits=1,
                           value_scale="mean", min_size=0, outer=optax.sgd(1.5))

    References:
      Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
      SparseLoCo", arXiv 2508.15706, 2025.
    """
    sizes = float_sizes(params)
    ratio = check_positive_float("ratio", ratio)
    h, m, n = check_counts(sync_every, replicas, devices)
    chunk, bits, min_size, small_codec = _sparse_setting(chunk, bits, min_size, small_codec)
    other = check_other_bytes(other_bytes)
    sub_chunk = check_sub_chunk(sub_chunk, chunk)
    unit, codec = sub_chunk or chunk, unit_codec(chunk, bits, sub_chunk)
    base = plain_bytes(sum(sizes), n)
    fixed = sync_bytes(sizes, m, codec(1), min_size, small_codec)[1]

    def fits(k: int) -> bool:
        coded = sync_bytes(sizes, m, codec(k), min_size, small_codec)[0]
        return ratio_of(base, (coded + fixed) / h, other) >= ratio

    k = largest_fitting(fits, unit)
    if k == 0:
        best = ratio_of(base, fixed / h, other)
        if best < ratio:
            small = sum(d < min_size for d in sizes)
            how = "a float32 pmean" if small_codec is None else f"`small_codec` {small_codec.name}"
            raise ValueError(
                f"`ratio`={ratio:g} is out of reach: the {small} leaves under "
                f"`min_size`={min_size} (sent by {how}) and `other_bytes`={other:g} alone give "
                f"{best:.4g}x; pass `min_size`=0 (compress every leaf) or "
                "`small_codec`=jc.sign(), or a larger `sync_every`"
            )
        one = sync_bytes(sizes, m, codec(1), min_size, small_codec)[0]
        top = ratio_of(base, (one + fixed) / h, other)
        raise ValueError(
            f"`ratio`={ratio:g} is out of reach: one value per chunk (k=1) gives {top:.4g}x; "
            "pass a larger `chunk`, fewer `bits` or a larger `sync_every`"
        )
    return k / unit


def demo_ratio(
    params: Any,
    devices: int,
    *,
    chunk: int = 64,
    topk: int = 16,
    bits: int | None = 8,
    min_size: int = 0,
    other_bytes: float = 0.0,
) -> float:
    r"""How many times fewer bytes :func:`jaxcomp.demo` sends on ``params`` than a float32
    ``pmean`` of the gradients, both every step, as :func:`jaxcomp.comm_report` reads them::

        ratio = (B + o) / (S + o),   B = 2 (n - 1) / n x 4 sum_l d_l
        S = (n - 1) sum_{d_l >= min_size} sum_{blocks of l} P_block
            + 2 (n - 1) / n x 4 sum_{d_l < min_size} d_l

    each leaf viewed as a matrix cut into blocks (:func:`jaxcomp._src.demo.block_side`), a
    block of ``b1 x b2`` sending ``topk`` DCT components per ``chunk x chunk`` (``ceil(topk b1
    b2 / chunk^2)``, at least one) as a chunked top-k payload: indices in ``ceil(log2 b1
    b2)`` bits, ``bits`` per value, a float32 scale per block.

    Args:
      params: as :func:`sparseloco_ratio`'s.
      devices: ``n``, the devices of the data-parallel axis, >= 2.
      chunk: as :func:`jaxcomp.demo`'s.
      topk: as :func:`jaxcomp.demo`'s.
      bits: as :func:`jaxcomp.demo`'s.
      min_size: as :func:`jaxcomp.demo`'s.
      other_bytes: as :func:`sparseloco_ratio`'s.

    Returns:
      The ratio, a float.

    Raises:
      ValueError: ``params`` without floating values; ``devices``, ``chunk``, ``topk``,
        ``bits``, ``min_size`` or ``other_bytes`` outside its rule (the rules:
        docs/errors.md).
      TypeError: ``devices``, ``chunk``, ``topk``, ``bits``, ``min_size`` or ``other_bytes``
        of the wrong kind.

    Example::

        jc.demo_ratio(params, 8, topk=20, bits=3)

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870,
      2024.
    """
    sizes = float_sizes(params)
    n = check_int("devices", devices, 2)
    chunk, topk, _, bits, min_size = demo_lib.check_demo(chunk, topk, 0.0, bits, min_size)
    base = plain_bytes(sum(sizes), n)
    sent = demo_lib.wire_bytes(params, n, chunk=chunk, topk=topk, bits=bits, min_size=min_size)
    return ratio_of(base, sent, check_other_bytes(other_bytes))


def demo_topk(
    params: Any,
    ratio: float,
    devices: int,
    *,
    chunk: int = 64,
    bits: int | None = 8,
    min_size: int = 0,
    other_bytes: float = 0.0,
) -> int:
    r"""The ``topk`` of :func:`jaxcomp.demo` that sends at least ``ratio`` times fewer bytes
    than a float32 ``pmean`` every step, on these ``params``: the largest ``topk`` in ``[1,
    chunk^2]`` whose :func:`demo_ratio` is ``>= ratio`` (every block's components grow with
    it: a full ``chunk x chunk`` block sends ``topk``, a smaller one ``ceil(topk b1 b2 /
    chunk^2)``, at least one).

    Args:
      params: as :func:`sparseloco_ratio`'s.
      ratio: the fewest times fewer bytes than per-step float32 ``pmean`` (e.g. 80), > 0.
      devices: as :func:`demo_ratio`'s.
      chunk: as :func:`jaxcomp.demo`'s.
      bits: as :func:`jaxcomp.demo`'s.
      min_size: as :func:`jaxcomp.demo`'s.
      other_bytes: as :func:`sparseloco_ratio`'s.

    Returns:
      ``topk``, an int.

    Raises:
      ValueError: where no ``topk`` reaches ``ratio``: the leaves under ``min_size`` (sent by
        a float32 ``pmean``) or ``other_bytes`` alone exceed the budget (the message names
        ``min_size``), or one component per block does (it names ``chunk`` and ``bits``);
        ``params`` without floating values; ``ratio``, ``devices``, ``chunk``, ``bits``,
        ``min_size`` or ``other_bytes`` outside its rule (the rules: docs/errors.md).
      TypeError: ``ratio``, ``devices``, ``chunk``, ``bits``, ``min_size`` or
        ``other_bytes`` of the wrong kind.

    Example::

        topk = jc.demo_topk(params, 80, 8, bits=3)
        tx = jc.demo(lr, "data", decay=0.95, topk=topk, bits=3, weight_decay=0.1)

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870,
      2024.
    """
    sizes = float_sizes(params)
    ratio = check_positive_float("ratio", ratio)
    n = check_int("devices", devices, 2)
    chunk, _, _, bits, min_size = demo_lib.check_demo(chunk, 1, 0.0, bits, min_size)
    other = check_other_bytes(other_bytes)
    base = plain_bytes(sum(sizes), n)

    def sent(topk: int) -> float:
        return demo_lib.wire_bytes(params, n, chunk=chunk, topk=topk, bits=bits, min_size=min_size)

    topk = largest_fitting(lambda k: ratio_of(base, sent(k), other) >= ratio, chunk * chunk)
    if topk == 0:
        dense = sum(d for d in sizes if d < max(min_size, 1))
        best = ratio_of(base, plain_bytes(dense, n), other)
        if best < ratio:
            raise ValueError(
                f"`ratio`={ratio:g} is out of reach: the leaves under `min_size`={min_size} "
                f"(a float32 pmean) and `other_bytes`={other:g} alone give {best:.4g}x; pass "
                "a smaller `min_size` (0: every leaf through the DCT)"
            )
        raise ValueError(
            f"`ratio`={ratio:g} is out of reach: one component per block (topk=1) gives "
            f"{ratio_of(base, sent(1), other):.4g}x; pass a larger `chunk` or fewer `bits`"
        )
    return topk


__all__ = ["demo_ratio", "demo_topk", "sparseloco_density", "sparseloco_ratio"]
