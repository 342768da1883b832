"""How far AdamW moves each kind of parameter per step on the LM benchmark's models, against
DeMo's sign step (every coordinate moved by the learning rate).

AdamW as the ``adamw`` row of ``benchmarks/lm.py`` (5% warm-up, cosine to a tenth, weight
decay 0.1, the run's tuned peak), trained on one device with the benchmark's global batch (the
same mean gradient as 8 data-parallel devices, the same batches, 300 steps). At the steps
listed, the root mean square over each group of leaves of AdamW's step without its weight
decay, ``lr_t m_hat / (sqrt(v_hat) + eps)`` (groups: the blocks' matrices, the token
embedding, the positions, the output head's matrix, the norms' scales, every bias), in units
of 1e-3, and of its direction ``m_hat / (sqrt(v_hat) + eps)`` over every parameter. DeMo's
``sign(q)`` step has rms equal to its learning rate in every group::

    python -m benchmarks.adam_steps --tag D --models 0 1   # the benchmark and the held-out pair
    python -m benchmarks.adam_steps --tag D3 --models 2    # the third width, d_model 192

Writes ``benchmarks/results/adam_steps[_TAG].json``.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import common

# (name, data (None: the installed jax's lax_numpy.py), d_model, layers, heads, AdamW's tuned peak)
MODELS = (
    ("benchmark (pydoc, d_model 128, 2 layers)", "pydoc", 128, 2, 4, 4.5e-3),
    ("held-out (lax_numpy.py, d_model 64, 3 layers)", None, 64, 3, 4, 6e-3),
    ("third width (pydoc, d_model 192, 2 layers, 6 heads)", "pydoc", 192, 2, 6, 3e-3),
)
AT = (15, 30, 60, 100, 150, 200, 250, 300)


def group(path: str) -> str:
    """The group of a leaf from its path in the model's state."""
    if "bias" in path:
        return "biases"
    if "/ln" in path or path.startswith("ln"):
        return "norms"
    for name in ("embed", "pos", "head"):
        if path.startswith(name):
            return name
    return "matrices"


def measure(
    name: str, data: str | None, d: int, layers: int, heads: int, peak: float, steps: int
) -> list:
    """The rows of one model: one per step of ``AT`` up to ``steps``."""
    import pathlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks import lm

    if data is None:
        data = str(pathlib.Path(jax.__file__).parent / "_src" / "numpy" / "lax_numpy.py")
    args = argparse.Namespace(
        data=data, context=64, batch_per_device=2, seed=0, d_model=d, layers=layers, heads=heads
    )
    task = lm.Task(args, 8)  # the global batch of 8 devices
    sched, adam = lm.Run(steps, peak, 8).schedule(), optax.scale_by_adam()
    flat = jax.tree_util.tree_flatten_with_path(task.params)[0]
    groups = [group("/".join(str(getattr(k, "key", k)) for k in p)) for p, _ in flat]

    @jax.jit
    def step(p, s, tokens, lr):
        g = jax.grad(task.loss)(p, tokens)
        u, s = adam.update(g, s, p)
        p = jax.tree.map(lambda x, v: x - lr * (v + lm.WEIGHT_DECAY * x), p, u)
        return p, s, [jnp.sum(jnp.square(v)) for v in jax.tree.leaves(u)]

    params, state, rows = task.params, adam.init(task.params), []
    task.reset()
    sizes = np.array([x.size for x in jax.tree.leaves(params)], float)
    for t in range(steps):
        lr = float(sched(t))
        params, state, sq = step(params, state, jnp.asarray(task.batch()), lr)
        if t + 1 not in AT:
            continue
        sq = np.array(jax.device_get(sq), float)
        row: dict[str, Any] = {"model": name, "step": t + 1, "adamw lr (1e-3)": lr * 1e3}
        for g in dict.fromkeys(groups):
            mask = np.array([x == g for x in groups])
            row[g] = lr * 1e3 * float(np.sqrt(sq[mask].sum() / sizes[mask].sum()))
        row["every leaf"] = lr * 1e3 * float(np.sqrt(sq.sum() / sizes.sum()))
        row["direction rms"] = float(np.sqrt(sq.sum() / sizes.sum()))
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(
        __doc__,
        writes="adam_steps.json (adam_steps_TAG.json with --tag)",
        takes="2-4 min per model on one CPU device of a loaded 2-core machine",
    )
    parser.add_argument("--steps", type=int, default=300, help="AdamW's steps (the schedule's)")
    parser.add_argument("--tag", default=None, help="write adam_steps_TAG.json instead")
    parser.add_argument(
        "--models", type=int, nargs="+", default=None, help="indices into MODELS (None: every one)"
    )
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_platforms", "cpu")
    chosen = [MODELS[i] for i in args.models] if args.models else MODELS
    rows = [r for m in chosen for r in measure(*m, args.steps)]
    name = "adam_steps" + (f"_{args.tag}" if args.tag else "")
    out = {"environment": common.environment(), "steps": args.steps, "rows": rows}
    common.write_json(common.result_path(name, False), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
