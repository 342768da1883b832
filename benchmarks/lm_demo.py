"""DeMo's update rule and learning-rate schedule on the LM benchmark (``benchmarks/lm.py``),
against AdamW data parallel.

Adds the rows of :data:`RECIPES` to ``benchmarks.lm.RECIPES`` (with those of
``benchmarks.lm_diloco``) and runs that benchmark (the same model, tokens, steps and bytes
accounting as every other LM recipe)::

    python -m benchmarks.lm_demo --tag demo --recipes demo-3e-3-sign-end1-decay0.95
    python -m benchmarks.lm_demo --tag demo_seed1 --seed 1 --recipes demo-3e-3-sign-end1-decay0.95

Every row is DeMo (``jaxcomp._src.demo.scale_by_demo``: 64 x 64 blocks, 16 components
each, 8-bit values, momentum decay 0.9 unless ``-decayD``, every leaf), then AdamW's
decoupled weight decay (0.1) and the learning rate: 5% linear warm-up to the peak in the
row's name, then a cosine to ``END`` times the peak (``-endEND``; none: 0.1, AdamW's
schedule; ``-end1``: the peak held to the end, ``optax.linear_schedule(0, peak, warmup)``,
``jc.demo``'s recipe); ``-kK-bB``: ``topk=K``, ``bits=B``. The update applied: ``-sign``
DeMo's sign of the decoded mean ``q``; ``-rms`` ``q`` over its root mean square per leaf;
``-adam0.99`` ``q`` through ``optax.scale_by_adam(b1=0, b2=0.99)``; ``-lion`` ``q`` through
``optax.scale_by_lion(0.9, 0.99)``. The rows ``demo-3e-3-k18-b4-*`` (and
``demo-3e-3-k20-b2``) are that recipe (3e-3 held, decay 0.95, 18 components of 4 bits) with
one change: ``-meansign`` the mean over the devices of each one's sign
(:func:`mean_of_signs`); ``-nesterov0.9`` the sign of a Nesterov look-ahead of ``q``;
``-warm10`` a 10% warm-up; ``-wsd20`` the peak decayed linearly to a tenth over the last 20%
of the steps; ``-wd0`` no weight decay; ``-chunk128-k72`` 128 x 128 blocks of 72
components (the same density); ``-k20-b2`` 20 components of 2 bits (the same bytes per
block). The rows ``demo-PEAK-decayD-kK-bB-wsd20[-warm2]`` are that recipe at another peak,
momentum decay, components and bits (``-warm2``: a 2% warm-up), each with at most one more
change: ``-wsd50`` the tail over the last half; ``-wsd20to0`` the tail down to 0; ``-wd0.2``
weight decay 0.2; ``-mink4`` 4 components in every small block (``min_topk=4``); ``-snr`` the
sign scaled per leaf by the rms of Adam's direction of ``q`` (:func:`_snr`). Writes
``benchmarks/results/lm_TAG.json`` and ``.png``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks import lm, lm_diloco


def _rms() -> Any:
    """Each leaf of the decoded mean over its root mean square (0 stays 0)."""
    import jax
    import jax.numpy as jnp
    import optax

    def leaf(q):
        s = jnp.max(jnp.abs(q))
        safe = jnp.where(s > 0, s, 1.0)
        rms = safe * jnp.sqrt(jnp.mean(jnp.square(q / safe)))
        return jnp.where(s > 0, q / rms, q)

    return optax.stateless(lambda u, p=None: jax.tree.map(leaf, u))


def _adam() -> Any:
    import optax

    return optax.scale_by_adam(b1=0.0, b2=0.99)


def _lion() -> Any:
    import optax

    return optax.scale_by_lion(b1=0.9, b2=0.99)


def _nesterov(beta: float = 0.9) -> Callable[[], Any]:
    """The sign of a Nesterov look-ahead of the decoded means: ``u <- beta u + q``, the update
    ``sign(q + beta u)`` (``u`` is the same on every device, as ``q`` is)."""

    def make() -> Any:
        import jax
        import jax.numpy as jnp
        import optax

        return optax.chain(
            optax.trace(beta, nesterov=True),
            optax.stateless(lambda u, p=None: jax.tree.map(jnp.sign, u)),
        )

    return make


def _snr(b1: float = 0.9, b2: float = 0.99) -> Callable[[], Any]:
    """The sign of the decoded mean ``q`` scaled per leaf by the rms of Adam's direction of
    ``q``: ``m <- b1 m + (1 - b1) q``, ``v <- b2 v + (1 - b2) q^2`` (bias-corrected), the update
    ``sign(q) rms_leaf(m / sqrt(v))`` (in [0, 1]: 1 where ``q`` keeps its sign, smaller where
    it flips; ``m``, ``v`` the same on every device, as ``q`` is)."""

    def make() -> Any:
        import jax
        import jax.numpy as jnp
        import optax

        adam = optax.scale_by_adam(b1=b1, b2=b2, eps=0.0, eps_root=1e-30)

        def update_fn(q, state, params=None):
            d, state = adam.update(q, state, params)
            rms = jax.tree.map(lambda x: jnp.sqrt(jnp.mean(jnp.square(x))), d)
            return jax.tree.map(lambda x, r: jnp.sign(x) * r, q, rms), state

        return optax.GradientTransformation(adam.init, update_fn)

    return make


def mean_of_signs(axis: Any, *, decay: float, chunk: int = 64, topk: int = 18, bits: int = 4):
    """DeMo whose update is the mean over the devices of the sign of each device's decoded
    components, ``mean_i sign(IDCT(S_i))`` (in [-1, 1]: smaller where the devices disagree),
    instead of ``sign(mean_i IDCT(S_i))``. The same payloads and all-gather as
    ``jaxcomp._src.demo.scale_by_demo`` (every leaf a float, finite gradients: a diagnosis)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxcomp._src import buckets, demo

    base = demo.scale_by_demo(axis, chunk=chunk, topk=topk, decay=decay, bits=bits)

    def update_fn(updates, state, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        moms = treedef.flatten_up_to(state.momentum)
        moms = [decay * m[0] + g.astype(jnp.float32) for g, m in zip(leaves, moms, strict=True)]
        blocks = [demo.Blocks.of(m.shape, chunk) for m in moms]
        codecs = [demo._codec(b, chunk, topk, bits) for b in blocks]
        payloads = [c.encode(b.forward(m)) for c, b, m in zip(codecs, blocks, moms, strict=True)]
        gathered = buckets.exchange(payloads, lambda x: jax.lax.all_gather(x, axis, to="invarying"))
        out, kept = [], []
        for c, b, m, p, g in zip(codecs, blocks, moms, payloads, gathered, strict=True):
            each = jax.vmap(lambda x, c=c, b=b: b.inverse(c.decode(x, b.size)))(g)
            out.append(jnp.mean(jnp.sign(each), axis=0).astype(m.dtype))
            kept.append((m - b.inverse(c.decode(p, b.size)))[None])
        new = demo.DeMoState(jax.tree.unflatten(treedef, kept), state.count + 1)
        return jax.tree.unflatten(treedef, out), new

    return optax.GradientTransformation(base.init, update_fn)


def schedule(
    run: lm.Run,
    peak: float,
    end: float,
    warmup: float = 0.05,
    tail: float = 0.0,
    floor: float = 0.1,
) -> Any:
    """AdamW's schedule (``warmup`` of the steps linear, then cosine) ending at ``end * peak``
    instead of a tenth; ``tail > 0``: warm-up, the peak held, then a linear decay to
    ``floor * peak`` over the last ``tail`` of the steps (warm-up, stable, decay)."""
    import optax

    steps = max(1, round(run.steps * warmup))
    if tail:
        last = max(1, round(tail * run.steps))
        parts = [
            optax.linear_schedule(0.0, peak, steps),
            optax.constant_schedule(peak),
            optax.linear_schedule(peak, floor * peak, last),
        ]
        return optax.join_schedules(parts, [steps, run.steps - last])
    return optax.warmup_cosine_decay_schedule(0.0, peak, steps, run.steps, end * peak)


def _demo(
    peak: float,
    then: Callable[[], Any] | None = None,
    end: float = 0.1,
    decay: float = 0.9,
    warmup: float = 0.05,
    tail: float = 0.0,
    floor: float = 0.1,
    weight_decay: float = lm.WEIGHT_DECAY,
    meansign: bool = False,
    **kw: Any,
) -> lm.Recipe:
    """DeMo at ``peak``, its decoded mean through ``then()`` (None: its sign; ``meansign``:
    :func:`mean_of_signs`)."""

    def make(run: lm.Run, axis: Any) -> Any:
        import optax

        from jaxcomp._src import demo

        if meansign:
            first = mean_of_signs(axis, decay=decay, **kw)
        else:
            first = demo.scale_by_demo(axis, decay=decay, sign=then is None, **kw)
        return optax.chain(
            first,
            then() if then else optax.identity(),
            optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity(),
            optax.scale_by_learning_rate(schedule(run, peak, end, warmup, tail, floor)),
        )

    return lm.Recipe(make)


RECIPES: dict[str, lm.Recipe] = {
    "demo-4e-3-sign": _demo(4e-3),
    "demo-3e-3-sign": _demo(3e-3),
    "demo-4e-3-rms": _demo(4e-3, _rms),
    "demo-3e-3-adam0.99": _demo(3e-3, _adam),
    "demo-3e-3-lion": _demo(3e-3, _lion),
    "demo-4e-3-sign-end0": _demo(4e-3, end=0.0),
    "demo-4e-3-sign-end0.3": _demo(4e-3, end=0.3),
    "demo-4e-3-sign-end0.6": _demo(4e-3, end=0.6),
    "demo-4e-3-sign-end1": _demo(4e-3, end=1.0),
    "demo-3e-3-sign-end1": _demo(3e-3, end=1.0),
    "demo-2e-3-sign-end1": _demo(2e-3, end=1.0),
    "demo-3e-3-sign-end1-decay0.95": _demo(3e-3, end=1.0, decay=0.95),
    "demo-3e-3-sign-end1-k18-b4": _demo(3e-3, end=1.0, topk=18, bits=4),
    "demo-3e-3-sign-end1-decay0.95-k18-b4": _demo(3e-3, end=1.0, decay=0.95, topk=18, bits=4),
}
# The recipe above (jc.demo's recommended settings) at other peaks and momentum decays.
RECIPES.update(
    {
        f"demo-{peak}-sign-end1-decay{decay}-k18-b4": _demo(
            float(peak), end=1.0, decay=float(decay), topk=18, bits=4
        )
        for peak in ("2e-3", "3e-3", "4.5e-3", "6e-3", "8e-3")
        for decay in ("0.8", "0.9", "0.95", "0.98")
    }
)

# jc.demo's recipe (3e-3 held, decay 0.95, k18-b4), one change at a time.
_K18 = {"end": 1.0, "decay": 0.95, "topk": 18, "bits": 4}
RECIPES.update(
    {
        "demo-3e-3-k18-b4-meansign": _demo(3e-3, meansign=True, **_K18),
        "demo-3e-3-k18-b4-nesterov0.9": _demo(3e-3, _nesterov(0.9), **_K18),
        "demo-3e-3-k18-b4-warm10": _demo(3e-3, warmup=0.1, **_K18),
        "demo-3e-3-k18-b4-wd0": _demo(3e-3, weight_decay=0.0, **_K18),
        "demo-3e-3-k18-b4-chunk128-k72": _demo(3e-3, chunk=128, **{**_K18, "topk": 72}),
        "demo-3e-3-k20-b2": _demo(3e-3, **{**_K18, "topk": 20, "bits": 2}),
        "demo-3e-3-k18-b4-wsd20": _demo(3e-3, tail=0.2, **_K18),
    }
)

# The -wsd20 recipe at other peaks and momentum decays (on the held-out model, d_model 64: 6e-3
# is the width rule 3e-3 x 128 / d_model, 4e-3 is 2/3 of its AdamW's peak as 3e-3 is of 4.5e-3).
RECIPES.update(
    {
        f"demo-{peak}-decay{decay}-k18-b4-wsd20": _demo(
            float(peak), tail=0.2, **{**_K18, "decay": float(decay)}
        )
        for peak in ("3e-3", "4e-3", "4.5e-3", "5e-3", "6e-3")
        for decay in ("0.95", "0.98")
    }
)
# From there one change at a time: the tail over the last half (-wsd50), a 2% warm-up (-warm2,
# at peaks 3e-3 to 6e-3), then from -warm2 at 5e-3: -minkK, -wsd30, -wsd20to0, decay 0.9 or 0.98,
# 5-bit values or 21 components of 3 bits (the same bytes), weight decay 0.2; and -snr. The
# k20-b3 rows at 1.5e-3 to 3e-3 are the third width's (d_model 192: the rule's peak is 2e-3);
# 2.4e-3 is the rule's peak on the fifth pair's d_model 160.
RECIPES.update(
    {
        "demo-4e-3-decay0.95-k18-b4-wsd50": _demo(4e-3, tail=0.5, **_K18),
        **{
            f"demo-{peak}-decay{decay}-k18-b4-wsd20-warm2": _demo(
                float(peak), tail=0.2, warmup=0.02, **{**_K18, "decay": float(decay)}
            )
            for peak in ("3e-3", "3.75e-3", "4e-3", "5e-3", "6e-3")
            for decay in ("0.95", "0.98")
        },
        **{
            f"demo-5e-3-decay0.95-k18-b4-wsd20-warm2-mink{k}": _demo(
                5e-3, tail=0.2, warmup=0.02, min_topk=k, **_K18
            )
            for k in (2, 4)
        },
        "demo-5e-3-decay0.95-k18-b4-wsd30-warm2": _demo(5e-3, tail=0.3, warmup=0.02, **_K18),
        "demo-5e-3-decay0.95-k18-b4-wsd20to0-warm2": _demo(
            5e-3, tail=0.2, floor=0.0, warmup=0.02, **_K18
        ),
        "demo-5e-3-decay0.9-k18-b4-wsd20-warm2": _demo(
            5e-3, tail=0.2, warmup=0.02, **{**_K18, "decay": 0.9}
        ),
        **{
            f"demo-{peak}-decay0.95-k{k}-b{b}-wsd20-warm2": _demo(
                float(peak), tail=0.2, warmup=0.02, **{**_K18, "topk": k, "bits": b}
            )
            for peak in ("1.5e-3", "2e-3", "2.4e-3", "2.5e-3", "3e-3", "4e-3", "5e-3", "6e-3")
            for k, b in ((18, 5), (21, 3), (20, 3))
        },
        # The rule's recipe with AdamW's 5% warm-up in place of 2% (slice L12: the third
        # pair's seed-2 gap forms over steps 25-50, after the 2% warm-up).
        **{
            f"demo-{peak}-decay0.95-k20-b3-wsd20": _demo(
                float(peak), tail=0.2, warmup=0.05, **{**_K18, "topk": 20, "bits": 3}
            )
            for peak in ("3e-3", "4e-3", "6e-3")
        },
        "demo-5e-3-decay0.95-k18-b4-wsd20-warm2-wd0.2": _demo(
            5e-3, tail=0.2, warmup=0.02, weight_decay=0.2, **_K18
        ),
        **{
            f"demo-{peak}-decay0.95-k18-b4-wsd20-snr": _demo(float(peak), _snr(), tail=0.2, **_K18)
            for peak in ("6e-3", "12e-3")
        },
    }
)


def main(argv: list[str] | None = None) -> int:
    lm.RECIPES.update(lm_diloco.RECIPES)
    lm.RECIPES.update(RECIPES)
    return lm.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
