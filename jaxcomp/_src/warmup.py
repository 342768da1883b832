"""Density warm-up of sparse codecs: send more of each leaf in the first steps of training.

DGC's remedy for early training (Lin et al., ICLR 2018, Section 3.3): the first steps change
the weights fastest, and a sparse exchange that sends 1% or 0.1% of each leaf per step leaves
most coordinates untouched for hundreds of steps. The density starts high and falls
exponentially (the paper: 25%, 6.25%, 1.5625%, 0.4%, 0.1%, a factor of 4 per stage) to the
codec's ratio. Payload shapes are static, so each stage is its own codec and its own branch of
a ``jax.lax.switch`` on the step count: compiled once, one branch runs per step.

One warm-up serves ``jc.compressed_allreduce(warmup_steps=...)`` (and so ``jc.sgd``) and
``jc.dgc``: :func:`densities` gives the stages (:func:`ramp` by default), :func:`stage` their
timing (``steps / stages`` steps each, the codec's own ratio from step ``steps`` on).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomp._src.codecs.base import Codec, check_int

#: Default steps of the density warm-up of ``jc.dgc``; ``jc.compressed_allreduce`` and
#: ``jc.sgd`` default to none.
DGC_WARMUP_STEPS = 200
#: Density of the first stage, and the factor it falls by per stage (DGC's schedule).
FIRST_DENSITY = 0.25
FACTOR = 4.0


def ramp(ratio: float, first: float = FIRST_DENSITY, factor: float = FACTOR) -> tuple[float, ...]:
    """The densities of the warm-up stages before ``ratio``: ``first, first / factor, ...``
    while above ``ratio`` (empty when ``ratio >= first``). ``ramp(0.01)`` is
    ``(0.25, 0.0625, 0.015625)``."""
    count = max(0, math.ceil(math.log(first / ratio, factor) - 1e-9))
    return tuple(first / factor**j for j in range(count))


def densities(ratio: float, sparsities: Any = None) -> tuple[float, ...]:
    """The densities of the warm-up stages before ``ratio``: :func:`ramp` for None, else
    ``max(1 - s, ratio)`` for each sparsity ``s`` in ``sparsities`` (DGC's way of writing a
    schedule, e.g. ``(0.75, 0.9375, 0.984375, 0.996, 0.999)``), the trailing stages at
    ``ratio`` dropped (the codec itself runs them). ``densities(0.001)`` is
    ``(0.25, 0.0625, 0.015625, 0.00390625)``; ``densities(0.001, (0.75, 0.99))`` is
    ``(0.25, 0.01)``."""
    if sparsities is None:
        return ramp(ratio)
    out = [max(1.0 - s, ratio) for s in sparsities]
    while out and out[-1] <= ratio * (1 + 1e-9):  # 1 - 0.999 is 0.001 + 1e-18
        out.pop()
    return tuple(out)


def stage(count: Any, steps: int, stages: int) -> Any:
    """The stage of step ``count`` (0-based): ``floor(min(count, steps) * stages / steps)``.

    Stage ``j < stages`` lasts ``steps / stages`` steps; from step ``steps`` on it is
    ``stages``, the codec's own ratio. Works on Python ints and traced int32 counts."""
    if isinstance(count, int):
        return (min(count, steps) * stages) // steps
    return (jnp.minimum(count, steps) * stages) // steps


def sparse_ratio(codec: Codec) -> float | None:
    """The density of a biased sparse codec (a ``ratio`` field, e.g. ``jc.top_k``), else None
    (unbiased sparse codecs such as ``jc.random_k`` rescale instead: no warm-up)."""
    ratio = getattr(codec, "ratio", None)
    if ratio is None or getattr(codec, "unbiased", True) or not dataclasses.is_dataclass(codec):
        return None
    return float(ratio)


def stage_codecs(codec: Codec, steps: int, sparsities: Any = None) -> tuple[Codec, ...]:
    """The codecs of the warm-up stages of ``codec`` (``codec`` at :func:`densities`); empty
    for ``steps == 0``. ``steps > 0`` needs a biased sparse codec (``sparse_ratio``)."""
    steps = check_int("warmup_steps", steps, 0)
    if not steps:
        return ()
    ratio = sparse_ratio(codec)
    if ratio is None:
        raise ValueError(
            f"`warmup_steps`={steps} ramps the density of a sparse codec (jc.top_k(...)); "
            f"{getattr(codec, 'name', codec)!r} has none: pass warmup_steps=0"
        )
    return tuple(dataclasses.replace(codec, ratio=r) for r in densities(ratio, sparsities))


def switch(count: jax.Array, steps: int, branches: list, *operands: Any) -> Any:
    """Run ``branches[stage(count, steps, len(branches) - 1)](*operands)``: the warm-up
    stages, then the last branch (the codec's own ratio) from step ``steps`` on."""
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(stage(count, steps, len(branches) - 1), branches, *operands)


def stage_steps(total: int, steps: int, stages: int) -> list[int]:
    """How many of the first ``total`` steps each branch (``stages`` warm-up stages, then the
    codec) runs: the branch weights of ``CommReport.mean_bytes_per_device``."""
    counts = [0] * (stages + 1)
    for t in range(total):
        counts[stage(t, steps, stages) if steps else stages] += 1
    return counts
