"""Error feedback: what compression drops is kept in memory and sent later, not lost.

Pure functions on ``(grad, memory)``; the transform holds the memory in its state.

``"residual"`` (EF-SGD; Seide et al. 2014, Karimireddy et al. 2019, Stich et al. 2018)::

    p_i   = g_i + e_i                 # what device i wants to send
    e_i' = p_i - C(p_i)               # what it could not send, kept for next step
    out   = mean_i C(p_i)

so after T steps ``sum_t out_t + mean_i e_i = sum_t mean_i g_i``: nothing is lost. ``out``
is the value returned, in the leaf's dtype: for a bfloat16 or float16 leaf its rounding
``mean - cast(mean)`` (identical on every device) is added to every memory
(:func:`with_rounding`), so the identity holds for what is applied, to float32 rounding.

With ``two_phase`` the owner of chunk ``j`` re-encodes the chunk's average, and keeps that
second error in a server residual ``s_j`` (1-bit Adam's server error, Tang et al. 2021;
DoubleSqueeze, Tang et al. 2019)::

    y_j   = mean_i C(p_i)[chunk j] + s_j
    s_j' = y_j - C(y_j)
    out[chunk j] = C(y_j)

so ``sum_t out_t + mean_i e_i + s = sum_t mean_i g_i``. Hierarchically (an inner axis of
``L`` devices reduced first) device ``(h, l)`` compresses chunk ``l`` of its host's mean and
keeps ``L`` times that chunk's error: the next reduce-scatter hands it back exactly.

``"ef21"`` (Richtarik, Sokolov, Fatkhullin, 2021)::

    c_i   = C(g_i - h_i)              # compress the change of the device's estimate
    h_i' = h_i + c_i                  # device estimate of its own gradient
    h'    = h + mean_i c_i            # global estimate, identical on every device
    out   = h'

EF21 works with any contractive codec and needs no step-size tricks; its output is the
running estimate ``h``, which tracks ``mean_i g_i``.

``None``: no memory, ``out = mean_i C(g_i)`` (right for unbiased codecs).

``"auto"``: ``"residual"`` for biased codecs, ``None`` for unbiased ones and for codecs that
drop only a rounding of every value (``rounding_only``: the scaled fp16 cast, relative error
``2^-11``, as torch's fp16 hook sends without feedback). The scaled fp8 casts (the default
``jc.cast("fp8_e4m3")``, relative error ``2^-4``) are not ``rounding_only``: they keep a
residual (:func:`jaxcomp.cast`).

Memories may be kept in bfloat16 (``memory_dtype=jnp.bfloat16``, as optax's ``mu_dtype``):
read widened to float32, updated in float32, stored rounded to nearest (saturating at the
type's largest finite value). Each step then loses the rounding of ``e_i`` (relative
``2^-9``), a fraction of what the codec drops, for half the memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp._src import layout as layouts

KINDS = ("auto", "residual", "ef21", None)


def check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"`error_feedback` must be one of {KINDS}, got {kind!r}")
    return kind


def resolve(kind, codec):
    """``"auto"``: residual feedback for biased codecs, none for unbiased ones and for
    ``rounding_only`` codecs (a scaled 16-bit cast: ``|C(x)_i - x_i| <= 2^-11 |x_i|`` for
    fp16 over the vector's whole range, nothing a memory would need to carry; a memory
    costs a gradient-sized read and write per step).

    Residual feedback needs a contractive codec (``||C(x) - x|| < ||x||``). Unbiased codecs
    with large variance (TernGrad, QSGD, stochastic rounding) are not contractive, and
    feeding their error back makes the memory grow without bound (measured:
    docs/when-not-to-compress.md); they need none.
    """
    check_kind(kind)
    if kind == "auto":
        return None if codec.unbiased or codec.rounding_only else "residual"
    return kind


def to_send(grad: jax.Array, memory: jax.Array, kind) -> jax.Array:
    """The vector handed to the codec."""
    if kind == "residual":
        return grad + memory
    if kind == "ef21":
        return grad - memory
    return grad


def next_memory(
    memory: jax.Array, sent_target: jax.Array, sent: jax.Array, kind, error: Any = None
) -> jax.Array:
    """Memory after a step; ``sent`` is what the codec's payload decodes to.

    ``error``: ``sent_target - sent`` as the encoding step formed it
    (:meth:`jaxcomp.Codec.encode_with_error`; ``collectives.Reduced.error``), the same values:
    residual feedback then stores it, and ``g + e`` and ``sent`` are not formed again.
    """
    if kind == "residual":
        return sent_target - sent if error is None else error
    if kind == "ef21":
        return memory + sent
    return memory


def output(mean: jax.Array, estimate: jax.Array, kind) -> jax.Array:
    """What the transform returns: the mean of what was sent, or EF21's global estimate."""
    return estimate + mean if kind == "ef21" else mean


#: The types an error-feedback memory may be kept in (``memory_dtype=``).
MEMORY_DTYPES = ("float32", "bfloat16", "float16")


def check_memory_dtype(memory_dtype: Any) -> Any:
    """``memory_dtype`` as a jnp dtype: None is float32; bfloat16 and float16 halve the memory.

    Raises a ValueError naming the argument for any other type (an integer memory would
    truncate what compression drops; float64 is not used by jaxcomp's float32 work).
    """
    if memory_dtype is None:
        return jnp.dtype(jnp.float32)
    try:
        dtype = jnp.dtype(memory_dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in MEMORY_DTYPES:
        raise ValueError(
            f"`memory_dtype` must be None (float32), jnp.float32, jnp.bfloat16 or jnp.float16, "
            f"got {memory_dtype!r}"
        )
    return dtype


def widened(memories: list) -> list:
    """Memories as float32 for the step's work (None entries stay None)."""
    return [None if m is None else m.astype(jnp.float32) for m in memories]


def to_memory(x: jax.Array, dtype: Any) -> jax.Array:
    """A float32 memory ``x`` stored as ``dtype``, rounded to nearest and saturating.

    Finite values beyond the type's largest finite value are clipped to it (float32's
    3.4e38 would round to bfloat16's inf, float16 overflows at 65504), so a finite memory
    never becomes inf by being stored; NaN and inf stay what they are (a non-finite step is
    frozen before it is stored, ``skeleton.freeze``). None (a codec that keeps no memory,
    ``error_feedback=None`` or an unbiased codec's ``"auto"``) stays None.
    """
    if x is None or dtype == jnp.float32:
        return x
    big = float(jnp.finfo(dtype).max)
    return jnp.where(jnp.isfinite(x), jnp.clip(x, -big, big), x).astype(dtype)


def output_rounding(mean: jax.Array, dtype: Any) -> jax.Array | None:
    """``mean - cast(mean)``: what casting the float32 ``mean`` to the output's ``dtype``
    drops (the saturating cast of :func:`~jaxcomp._src.layout.assemble`, so the same bits);
    None for float32 and wider, which drop nothing."""
    if jnp.dtype(dtype).itemsize >= 4:
        return None
    return mean - layouts.saturating_cast(mean, dtype).astype(jnp.float32)


def with_rounding(memories: list, means: list, dtypes: list, ok: Any = True) -> list:
    r"""Each memory plus the rounding of its leaf's output to the leaf's ``dtype``
    (:func:`output_rounding`), where ``ok`` (a finite step); float32 leaves as they are.

    Residual feedback keeps ``sum_i e_i' = sum_i (g_i + e_i) - n * out``, with ``out`` the
    value applied. A bfloat16 or float16 leaf's output is ``cast(mean)``, not the float32
    ``mean`` the memories were formed against: without this, each step's ``n (mean -
    cast(mean))`` was lost (measured: docs/errors.md, tests/test_conservation.py). The
    rounding is the same on every device, so each memory takes it once and their mean holds
    it exactly::

        e_i' <- e_i' + (mean - cast(mean))      # sum_i e_i' + n cast(mean) = sum_i (g_i + e_i)

    The sum is stored as every memory is (:func:`to_memory`: saturating), so a finite memory
    never becomes inf here either. Until 2026-11-27 it was a plain cast: a float16 memory
    near 65504 plus the rounding of a saturated float16 output rounded to inf, and every
    later step was non-finite for good (the next ``g + e`` inf, the frozen memory inf).

    Args:
      memories: the new memories, one array per compressed leaf (any shape, its dtype kept).
      means: the float32 means (the outputs before the cast), one per memory.
      dtypes: the output dtype of each leaf.
      ok: where False (a non-finite step), the memories as they are.

    Returns:
      The memories with the roundings added.
    """
    out = []
    for e, mean, dtype in zip(memories, means, dtypes, strict=True):
        r = output_rounding(mean, dtype)
        if r is None:
            out.append(e)
            continue
        r = jnp.where(ok, r, 0.0).reshape(e.shape)
        out.append(to_memory(e.astype(jnp.float32) + r, e.dtype))
    return out


def compressed_dtypes(layout: layouts.Layout) -> list:
    """The dtype of each compressed leaf of ``layout``, in order."""
    return [d for d, g in zip(layout.dtypes, layout.groups, strict=True) if g == layouts.COMPRESSED]
