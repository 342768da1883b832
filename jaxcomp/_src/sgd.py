"""Data-parallel momentum SGD whose gradient exchange goes through a codec: ``jc.sgd``.

The recipe puts momentum where compression keeps quality: on each device, before the codec,
with error feedback on the momentum (not on the raw gradient), and nowhere else, so it cannot
be applied twice.
"""

from __future__ import annotations

from typing import Any

import optax

from jaxcomp._src import skeleton
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.compressed_allreduce import check_momentum, compressed_allreduce


def exchange_options(exchange: dict[str, Any]) -> dict[str, Any]:
    """The ``**exchange`` options of a recipe, also when ``optax.inject_hyperparams`` passes
    them back as one ``exchange={...}`` keyword (it binds ``**kwargs`` by name)."""
    nested = exchange.get("exchange")
    if isinstance(nested, dict) and len(exchange) == 1:
        return dict(nested)
    return dict(exchange)


def heavy_ball_rate(learning_rate: optax.ScalarOrSchedule, beta: Any) -> optax.ScalarOrSchedule:
    """``learning_rate / (1 - beta)``: the step of heavy-ball momentum ``m <- beta m + g``
    applied to the averaged momentum ``(1 - beta) m`` that the devices exchange."""
    if beta is None:
        return learning_rate
    if callable(learning_rate):
        return lambda count: learning_rate(count) / (1.0 - beta)
    return learning_rate / (1.0 - beta)


def look_ahead(nesterov: bool | None, codec: Codec) -> bool:
    """``nesterov`` of :func:`sgd`: None (default) is the look-ahead for a biased codec (one
    that error feedback corrects: sign, top-k, ...) and heavy-ball momentum otherwise."""
    if nesterov is None:
        return not getattr(codec, "unbiased", True)
    if not isinstance(nesterov, bool):
        raise TypeError(f"`nesterov` must be a bool or None, got {nesterov!r}")
    return nesterov


def sgd(
    learning_rate: optax.ScalarOrSchedule,
    codec: Codec,
    axis_name: Any,
    *,
    momentum: float | None = 0.9,
    nesterov: bool | None = None,
    **exchange: Any,
) -> optax.GradientTransformationExtraArgs:
    r"""Momentum SGD, data parallel, with each device's momentum sent through ``codec``.

    Every device ``i`` keeps its own momentum ``m_i`` of its gradient ``g_i`` and an
    error-feedback memory ``e_i``; only the codec's payload goes on the wire::

        m_i <- beta m_i + (1 - beta) g_i                 # per device, every floating leaf
        p_i  = m_i + e_i                                  # error feedback on the momentum
        e_i <- p_i - C(p_i)
        x   <- x - lr / (1 - beta) * mean_i C(p_i)

    Without compression this is ``optax.sgd(lr, momentum=beta)`` on the mean gradient, up
    to float32 rounding (the mean of the devices' momenta is the momentum of the mean
    gradient, summed in another order; ``m_i / (1 - beta)`` is the heavy-ball momentum).
    With compression it is EF-SGDM:
    momentum before the codec, error feedback after it (Zheng, Huang, Kwok, NeurIPS 2019,
    "Communication-Efficient Distributed Blockwise Momentum SGD with Error-Feedback";
    DGC's momentum correction, Lin et al. 2018, is the same placement for top-k). Applying
    momentum *after* the compressed mean instead (``compressed_allreduce`` followed by
    ``optax.sgd(lr, momentum=0.9)``, the plain chain) feeds the momentum with the codec's
    error-laden output, which costs accuracy at 1-bit and 1% top-k (docs: "Choosing a codec").

    ``nesterov=True`` sends Nesterov's look-ahead ``beta m_i + (1 - beta) g_i``
    ``= m_i + beta (m_i - m_i^prev)``. It is the default (``nesterov=None``) for biased
    codecs, the ones error feedback corrects (``jc.sign()``, ``jc.top_k``, ...); unbiased
    codecs (``jc.identity()``, stochastic ones) keep heavy-ball momentum, so without
    compression ``jc.sgd`` is ``optax.sgd(lr, momentum=beta)`` exactly. Why: error
    feedback delays what a codec drops, and the two-phase exchange (the default for sign
    and top-k on more than 2 devices) adds a second delay, the chunk owner's re-encoding of
    the mean and its server residual. Heavy-ball momentum then follows stale directions
    (measured on the teacher task of ``benchmarks/convergence.py`` with sign and 64-value
    sign blocks; with one compression, ``strategy="allgather"``, it did not). The
    look-ahead's extra ``beta (m_i - m_i^prev)`` leads by the momentum's last change and
    makes up for the delay (docs: "Choosing a codec", "Which default holds where"). Top-k
    avoids the second delay instead: its two phases split the slots so that the chunk's
    owner re-sends all it receives (``jc.top_k(r).phase_codecs(c, n)``, the same bytes).
    ``warmup_steps=N`` (an exchange option) sends a sparse codec (``jc.top_k``) at higher
    densities in the first ``N`` steps, DGC's warm-up (:func:`jaxcomp.compressed_allreduce`).
    It is off by default: top-k 1% trains without it about as well as momentum SGD on the
    convergence tasks, and its dense stages cost bytes (docs: "Choosing a codec", "the
    density warm-up").
    ``error_feedback="ef21"`` (an exchange option) gives EF21-SGDM (Fatkhullin, Tyurin,
    Richtarik, NeurIPS 2023, "Momentum Provably Improves Error Feedback!", EF21-SGDM with
    ``eta = 1 - beta``): each device compresses the change of its estimate of its momentum,
    which converges with small minibatches where plain EF21 does not.

    Every codec and strategy works: ``**exchange`` goes to
    :func:`jaxcomp.compressed_allreduce` (``strategy``, ``error_feedback``, ``min_size``,
    ``mask``, ``inner_axis_name``, ``bucket_bytes``, ``param_specs``, ...). The state is
    that transform's (the momentum is its per-device ``momentum`` field) and
    ``optax.scale_by_learning_rate``'s: initialize it with ``jc.sharded_init`` under
    ``shard_map``. Do not chain another momentum optimizer after it.

    Args:
      learning_rate: a float or an optax schedule (of the step count).
      codec: a jaxcomp codec, e.g. ``jc.sign()``, ``jc.top_k(0.01)``, ``jc.int_quant(8)``.
      axis_name: the data-parallel mesh axis.
      momentum: ``beta`` in [0, 1); 0 or None is EF-SGD without momentum.
      nesterov: send Nesterov's look-ahead (True) or the momentum (False, heavy ball);
        None (default): the look-ahead for biased codecs (``codec.unbiased`` False). With
        ``momentum`` 0 or None it changes nothing and is accepted, as ``optax.sgd(lr,
        momentum=None, nesterov=True)`` accepts it: there is no momentum to look ahead of,
        and the default (None) must work for every momentum (unlike
        :func:`jaxcomp.compressed_allreduce`'s ``worker_nesterov``, refused without
        ``worker_momentum``).
      **exchange: options of :func:`jaxcomp.compressed_allreduce`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update is the step to add to the
      params (identical on every device).
      Its update refuses gradient leaves that are not floating (integer, bool, ``float0``)
      with a TypeError naming them (the exchange transforms pass them through): keep
      integer params out of the tree it optimizes (docs/errors.md).

    Raises:
      ValueError: at construction, ``momentum`` or ``axis_name`` outside its rule (the message names
        the argument; the rules: docs/errors.md).
      TypeError: at construction, ``momentum``, ``nesterov``, ``worker_momentum`` or ``axis_name``
        of the wrong kind.

    Example::

        tx = jc.sgd(optax.cosine_decay_schedule(0.05, 1000), jc.sign(), "data")
        opt_state = jc.sharded_init(tx, params, mesh, "data")

    References:
      Zheng, Huang, Kwok, 2019 (dist-EF-SGDM); Karimireddy et al., ICML 2019, "Error
      Feedback Fixes SignSGD and other Gradient Compression Schemes"; Fatkhullin et al., 2023
      (EF21-SGDM).
    """
    options = exchange_options(exchange)
    for name in ("worker_momentum", "worker_nesterov"):
        if name in options:
            raise TypeError(f"jc.sgd sets `{name}` itself: use `momentum` / `nesterov`")
    beta = check_momentum("momentum", momentum)
    # Without momentum there is nothing to look ahead of: as optax.sgd(lr, momentum=None,
    # nesterov=True), the flag changes nothing here, so it is not passed on (the exchange
    # refuses worker_nesterov without worker_momentum).
    ahead = look_ahead(nesterov, codec) and beta is not None
    return floating_only(
        "sgd",
        optax.chain(
            compressed_allreduce(
                codec, axis_name, worker_momentum=beta, worker_nesterov=ahead, **options
            ),
            optax.scale_by_learning_rate(heavy_ball_rate(learning_rate, beta)),
        ),
    )


def floating_only(
    name: str, tx: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose update first refuses gradient leaves that are not floating (integer,
    bool, ``float0``: :func:`jaxcomp._src.skeleton.check_floating`), naming them; the same
    init and state."""
    tx = optax.with_extra_args_support(tx)

    def update_fn(updates, state, params=None, **extra_args):
        skeleton.check_floating(name, updates)
        return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, update_fn)
