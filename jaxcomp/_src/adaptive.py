"""Adaptive compression (Accordion, Agarwal et al., MLSys 2021): compress less in critical
regimes of training, detected from how fast the gradient norm changes, and more elsewhere.

Training has critical regimes (the first steps, the steps after a learning-rate drop) where
compression errors cost final accuracy, and long stretches where they cost nothing. Accordion
switches between a gentle and an aggressive codec at interval boundaries: with ``G_k`` the mean
squared norm of the averaged gradient over interval ``k``::

    critical_{k+1} = |G_k - G_{k-1}| / G_{k-1} >= threshold      (interval 0: critical)

so the next interval runs the gentle codec where the norm moves fast. The paper measures the
norm of the gradient accumulated over an epoch; here ``G_k`` is the mean of the per-step
squared norms of the output (the averaged gradient every device already holds): no extra
collective and no params-sized buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp._src.codecs.base import (
    F32_MAX,
    Codec,
    check_int,
    check_positive_float,
    saturating_square,
)


class AccordionState(NamedTuple):
    """Replicated scalars of :func:`accordion` (identical on every device).

    Attributes:
      critical: bool[]: this interval runs the gentle codec
      norm: f32[]: sum of the squared output norms of this interval so far
      previous: f32[]: the previous interval's mean squared norm (0: none yet)
    """

    critical: jax.Array
    norm: jax.Array
    previous: jax.Array


@dataclasses.dataclass(frozen=True)
class Accordion:
    """Configuration of :func:`accordion` (hashable: static under jit).

    Attributes:
      gentle: the codec of the critical intervals (less compression).
      interval: steps per interval: the regime is judged once per interval.
      threshold: the relative change of the mean squared norm from one interval to the next
        at or above which the next interval is critical.
    """

    gentle: Codec
    interval: int
    threshold: float

    def init(self) -> AccordionState:
        return AccordionState(
            critical=jnp.bool_(True),
            norm=jnp.zeros([], jnp.float32),
            previous=jnp.zeros([], jnp.float32),
        )

    def update(self, state: AccordionState, count: jax.Array, outs: list) -> AccordionState:
        """Add this step's squared output norm; at an interval's end decide the next regime."""
        # Squares saturate at float32's largest (a finite outlier never leaves it inf).
        step = sum((jnp.sum(saturating_square(o)) for o in outs), jnp.zeros([], jnp.float32))
        norm = jnp.minimum(state.norm + jnp.minimum(step, F32_MAX), F32_MAX)
        ends = (count + 1) % self.interval == 0
        mean = norm / self.interval
        change = jnp.abs(mean - state.previous) / jnp.maximum(state.previous, 1e-30)
        critical = jnp.where(state.previous > 0, change >= self.threshold, True)
        return AccordionState(
            critical=jnp.where(ends, critical, state.critical),
            norm=jnp.where(ends, 0.0, norm),
            previous=jnp.where(ends, mean, state.previous),
        )


def accordion(gentle: Codec, *, interval: int = 100, threshold: float = 0.5) -> Accordion:
    r"""Adaptive compression: ``gentle`` in critical regimes, the transform's codec elsewhere.

    Pass it as ``adaptive=`` to :func:`jaxcomp.compressed_allreduce` or :func:`jaxcomp.sgd`::

        tx = jc.sgd(0.05, jc.top_k(0.01), "data", adaptive=jc.accordion(jc.top_k(0.1)))

    Every ``interval`` steps the mean squared norm of the averaged gradient over the interval,
    ``G_k``, is compared with the previous interval's; a relative change of at least
    ``threshold`` marks the next interval critical, and it sends through ``gentle``. The
    first interval is critical. Both codecs share the error-feedback memory (what one drops,
    the other sends later), and the switch is a ``jax.lax.cond``: both exchanges are compiled,
    one runs (``jc.comm_report`` counts both).

    Args:
      gentle: the codec of critical regimes (less compression, e.g. ``jc.top_k(0.1)`` beside
        ``jc.top_k(0.01)``, or ``jc.int_quant(8)`` beside ``jc.sign()``).
      interval: steps per detection interval (the paper's epoch).
      threshold: the relative change of the gradient norm that marks a critical regime
        (the paper's ``eta``, 0.5).

    Returns:
      An :class:`Accordion` configuration.

    Raises:
      ValueError: at construction, ``interval`` or ``threshold`` outside its rule (the message names
        the argument; the rules: docs/errors.md).
      TypeError: at construction, ``gentle`` of the wrong kind.

    References:
      Agarwal, Wang, Lee, Venkataraman, Papailiopoulos, "Adaptive Gradient Communication via
      Critical Learning Regime Identification", MLSys 2021.
    """
    if not isinstance(gentle, Codec):
        raise TypeError(
            f"`gentle` must be a jaxcomp codec (e.g. jc.top_k(0.1)), got {type(gentle).__name__}"
        )
    interval = check_int("interval", interval, 1)
    threshold = check_positive_float("threshold", threshold)
    return Accordion(gentle, interval, threshold)


def check_adaptive(adaptive: Any) -> Accordion | None:
    if adaptive is None or isinstance(adaptive, Accordion):
        return adaptive
    raise TypeError(
        f"`adaptive` must be None or jc.accordion(...), got {type(adaptive).__name__} {adaptive!r}"
    )
