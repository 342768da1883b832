"""DeMo's update rule on the LM benchmark (``benchmarks/lm.py``), against AdamW data parallel.

Adds the rows of :data:`RECIPES` to ``benchmarks.lm.RECIPES`` and runs that benchmark (the
same model, tokens, steps and bytes accounting as every other LM recipe)::

    python -m benchmarks.lm_demo --recipes demo-4e-3-sign demo-4e-3-rms --tag demo

Every row is ``jc.demo`` with AdamW's schedule at the peak lr in its name, its weight decay
(0.1), momentum decay 0.9 and 64 x 64 blocks with 16 components each unless the name says
otherwise: ``-sign`` the sign of the decoded mean (DeMo), ``-rms`` the decoded mean over its
root mean square per leaf, ``-kK-cC``: ``topk=K``, ``chunk=C``. Writes
``benchmarks/results/lm_TAG.json`` and ``.png``.
"""

from __future__ import annotations

from typing import Any

from benchmarks import lm, lm_diloco


def _demo(
    peak: float,
    update: str,
    warmup: int | None = None,
    post: Any = None,
    end: float = 0.1,
    **kw: Any,
) -> lm.Recipe:
    def make(run: lm.Run, axis: Any) -> Any:
        import optax

        from jaxcomp._src import demo

        kw.setdefault("decay", 0.9)
        if update == "rms":
            post_ = _rms
        else:
            post_ = post
        adam = post_() if post_ else optax.identity()
        sched = optax.warmup_cosine_decay_schedule(
            0.0,
            peak,
            max(1, run.steps // 20) if warmup is None else warmup,
            run.steps,
            end_value=end * peak,
        )
        return optax.chain(
            demo.scale_by_demo(axis, sign=update == "sign", **kw),
            adam,
            optax.add_decayed_weights(lm.WEIGHT_DECAY),
            optax.scale_by_learning_rate(sched),
        )

    return lm.Recipe(make)


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


def _adam(b1: float, b2: float) -> Any:
    import optax

    return optax.scale_by_adam(b1=b1, b2=b2)


def _lion(b1: float, b2: float) -> Any:
    import optax

    return optax.scale_by_lion(b1=b1, b2=b2)


RECIPES: dict[str, lm.Recipe] = {
    "demo-4e-3-sign": _demo(4e-3, "sign"),
    "demo-3e-3-rms": _demo(3e-3, "rms"),
    "demo-4e-3-rms": _demo(4e-3, "rms"),
    "demo-6e-3-rms": _demo(6e-3, "rms"),
    "demo-8e-3-rms": _demo(8e-3, "rms"),
    "demo-3e-3-adam0.99": _demo(3e-3, "mean", post=lambda: _adam(0.0, 0.99)),
    "demo-3e-3-adam0.95": _demo(3e-3, "mean", post=lambda: _adam(0.0, 0.95)),
    "demo-3e-3-adam0.9-0.99": _demo(3e-3, "mean", post=lambda: _adam(0.9, 0.99)),
    "demo-3e-3-lion": _demo(3e-3, "mean", post=lambda: _lion(0.9, 0.99)),
    "demo-1e-3-lion": _demo(1e-3, "mean", post=lambda: _lion(0.9, 0.99)),
    "demo-4e-3-sign-end0": _demo(4e-3, "sign", end=0.0),
    "demo-4e-3-sign-end0.3": _demo(4e-3, "sign", end=0.3),
    "demo-4e-3-sign-end0.6": _demo(4e-3, "sign", end=0.6),
    "demo-4e-3-sign-end1": _demo(4e-3, "sign", end=1.0),
    "demo-3e-3-sign-end1": _demo(3e-3, "sign", end=1.0),
    "demo-5e-3-sign-end1": _demo(5e-3, "sign", end=1.0),
    "demo-4e-3-sign-end0.3-k20-b4": _demo(4e-3, "sign", end=0.3, topk=20, bits=4),
    "demo-4e-3-sign-end0.3-k24-b2": _demo(4e-3, "sign", end=0.3, topk=24, bits=2),
    "demo-4e-3-sign-k20-b4": _demo(4e-3, "sign", topk=20, bits=4),
    "demo-4e-3-sign-k22-b2": _demo(4e-3, "sign", topk=22, bits=2),
    "demo-4e-3-sign-k32": _demo(4e-3, "sign", topk=32),
    "demo-4e-3-sign-k4-c32": _demo(4e-3, "sign", topk=4, chunk=32),
    "demo-4e-3-sign-decay0.95": _demo(4e-3, "sign", decay=0.95),
}


def main(argv: list[str] | None = None) -> int:
    lm.RECIPES.update(lm_diloco.RECIPES)
    lm.RECIPES.update(RECIPES)
    return lm.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
