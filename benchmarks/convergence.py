"""What compression does to accuracy: every codec family on three tasks, against pmean.

Tasks (all ship offline), each data-parallel on 8 CPU devices (or the accelerators there):

* ``digits`` — scikit-learn digits, MLP 64-256-10, SGD momentum 0.9, lr 0.05, batch 256;
  metric: test accuracy (397 held-out images);
* ``mnist1d`` — the ``mnist1d`` package's generated dataset (4000/1000, 40 features), MLP
  40-256-256-10, same optimizer; metric: test accuracy;
* ``teacher`` — a task labelled by a fixed random teacher network
  (``common.load_teacher_split``: 32 Gaussian features, 4000/1000, 10 classes), MLP
  32-256-256-10, same optimizer; no recipe was tuned on it (the held-out check);
* ``char`` — the character transformer of ``benchmarks/char_transformer.py`` on
  ``pydoc_data.topics`` (Adam, cosine schedule); metric: held-out loss in nats per byte.

Methods: ``none`` (plain pmean), every codec of ``jc.CODECS`` plus the sparse defaults of
``benchmarks/common.py`` through ``jc.compressed_allreduce`` (error feedback ``auto``,
strategy ``auto``, ``min_size=1024``), and the transforms of :data:`TRANSFORMS` (DGC,
PowerSGD, majority vote where the strategy exists) — new registrations join automatically.
Same seed, initialization, batches and number of steps for every method. Bytes per step are
the ring-model bytes each device sends, read from the lowered step program (the collectives
``jc.comm_report`` reports as ``logical``). Writes ``benchmarks/results/convergence.json``
(after every run, so a bounded background run keeps what finished) and
``convergence_<task>.png`` (loss curves)::

    python -m benchmarks.convergence                     # all methods, all tasks (long on CPU)
    python -m benchmarks.convergence --quick             # digits, none/sign/int8, 40 steps
    python -m benchmarks.convergence --tasks digits --methods none sign topk1% dgc0.1%
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import optax

import jaxcomp as jc
from benchmarks import common
from jaxcomp._src import warmup

AXIS = "data"
TASKS = ("digits", "mnist1d", "teacher", "char")
STEPS = {"digits": 1000, "mnist1d": 2000, "teacher": 1000, "char": 300}
# Transforms that are not one codec: name -> (factory(axis) -> transform, has its own momentum).
TRANSFORMS: dict[str, tuple[Callable[[str], Any], bool]] = {
    "dgc0.1%": (lambda axis: jc.dgc(0.001, axis), True),
    "dgc0.1%-nowarmup": (lambda axis: jc.dgc(0.001, axis, warmup_steps=0), True),
    **{
        f"dgc0.1%-warmup{w}": (lambda axis, w=w: jc.dgc(0.001, axis, warmup_steps=w), True)
        for w in (100, 150, 200, 300)
    },
    "dgc0.1%-nesterov": (lambda axis: jc.dgc(0.001, axis, nesterov=True), True),
    "dgc0.1%-nomask": (lambda axis: jc.dgc(0.001, axis, momentum_masking=False), True),
    "powersgd4": (lambda axis: jc.powersgd(4, axis), False),
    "signsgd_mv": (
        lambda axis: jc.compressed_allreduce(jc.sign(None), axis, strategy="majority_vote"),
        False,
    ),
    # 16-bit casts (unscaled: the rows were run before fp16 was scaled by default) through
    # two_phase with and without a residual memory (jc.autotune runs them without: a cast
    # drops only rounding). The codec rows "fp16" (scaled, no memory: the default since
    # 2026-11-26) and "fp16_unscaled" (psum'ed, residual: the default before) beside them.
    **{
        f"{c}-twophase{tag}": (
            lambda axis, c=c, ef=ef: jc.compressed_allreduce(
                jc.cast(c, scaled=False),
                axis,
                min_size=1024,
                strategy="two_phase",
                error_feedback=ef,
            ),
            False,
        )
        for c in ("fp16", "bf16")
        for tag, ef in (("", "residual"), ("-nofeedback", None))
    },
    # Scaled fp8 casts (the default since 2026-11-27) with and without a residual memory:
    # the measurement behind error_feedback="auto" for them (docs/choosing-a-codec.md).
    **{
        f"{c}-scaled{tag}": (
            lambda axis, c=c, ef=ef: jc.compressed_allreduce(
                jc.cast(c, scaled=True), axis, min_size=1024, error_feedback=ef
            ),
            False,
        )
        for c in ("fp8_e4m3", "fp8_e5m2")
        for tag, ef in (("", "residual"), ("-nofeedback", None))
    },
    # Error-feedback memories kept in bfloat16 (against the codec rows "sign", "int8").
    "sign-bf16memory": (
        lambda axis: jc.compressed_allreduce(
            jc.sign(), axis, min_size=1024, memory_dtype="bfloat16"
        ),
        False,
    ),
    "int8-bf16memory": (
        lambda axis: jc.compressed_allreduce(
            jc.int_quant(8), axis, min_size=1024, memory_dtype="bfloat16"
        ),
        False,
    ),
}
# Optimizer-level recipes: name -> factory(axis, learning rate or schedule) -> the whole
# optimizer (the exchange and the step). Classifiers use the baseline's lr (0.05); the char
# task runs them at their own peak lr (RECIPE_CHAR_LR) with the baseline's cosine schedule.
RECIPES: dict[str, Callable[[str, Any], Any]] = {
    "sgd-sign": lambda axis, lr: jc.sgd(lr, jc.sign(), axis),
    "sgd-sign-nesterov": lambda axis, lr: jc.sgd(lr, jc.sign(), axis, nesterov=True),
    "sgd-sign-heavyball": lambda axis, lr: jc.sgd(lr, jc.sign(), axis, nesterov=False),
    # One compression (all-gather, ~3.4x the bytes at 8 devices): no owner re-encoding.
    "sgd-sign-heavyball-allgather": lambda axis, lr: jc.sgd(
        lr, jc.sign(), axis, nesterov=False, strategy="allgather"
    ),
    "sgd-sign-b64": lambda axis, lr: jc.sgd(lr, jc.sign(block_size=64), axis),
    "sgd-sign-b64-heavyball": lambda axis, lr: jc.sgd(
        lr, jc.sign(block_size=64), axis, nesterov=False
    ),
    "sgd-sign-ef21": lambda axis, lr: jc.sgd(lr, jc.sign(), axis, error_feedback="ef21"),
    "sgd-topk1%": lambda axis, lr: jc.sgd(lr, jc.top_k(0.01), axis),
    "sgd-topk1%-heavyball": lambda axis, lr: jc.sgd(lr, jc.top_k(0.01), axis, nesterov=False),
    # DGC's density warm-up (25%, 6.25%, 1.5625% for ~33 steps each, then 1%): off by default.
    "sgd-topk1%-warmup100": lambda axis, lr: jc.sgd(lr, jc.top_k(0.01), axis, warmup_steps=100),
    # One compression (all-gather, ~3.5x the bytes of two_phase at 8 devices) and the warm-up.
    "sgd-topk1%-allgather-warmup100": lambda axis, lr: jc.sgd(
        lr, jc.top_k(0.01), axis, strategy="allgather", warmup_steps=100
    ),
    "sgd-int8": lambda axis, lr: jc.sgd(lr, jc.int_quant(8), axis),
    "sgd-topk1%-accordion": lambda axis, lr: jc.sgd(
        lr, jc.top_k(0.01), axis, adaptive=jc.accordion(jc.top_k(0.1), interval=ACCORDION_EVERY)
    ),
    "sgd-sign-accordion": lambda axis, lr: jc.sgd(
        lr, jc.sign(), axis, adaptive=jc.accordion(jc.int_quant(8), interval=ACCORDION_EVERY)
    ),
    "sgd-none": lambda axis, lr: jc.sgd(lr, jc.identity(), axis, error_feedback=None),
    "adam": lambda axis, lr: optax.chain(
        jc.compressed_allreduce(jc.identity(), axis, error_feedback=None), optax.adam(lr)
    ),
    # The library's defaults (adam_bound=True since 2026-11-26); -unbounded: the default before.
    "onebit_adam": lambda axis, lr: jc.onebit_adam(lr, axis, freeze_step=ONEBIT_FREEZE),
    "onebit_adam-unbounded": lambda axis, lr: jc.onebit_adam(
        lr, axis, freeze_step=ONEBIT_FREEZE, adam_bound=False
    ),
    "zero_one_adam": lambda axis, lr: jc.zero_one_adam(lr, axis, **ZERO_ONE["zero_one_adam"]),
    # Skipped rounds from step 200, gaps up to 16 at the classifiers' constant lr: diverges
    # on mnist1d (docs/choosing-a-codec.md, "1-bit Adam and 0/1 Adam").
    "zero_one_adam-scaler100": lambda axis, lr: jc.zero_one_adam(
        lr, axis, **ZERO_ONE["zero_one_adam-scaler100"]
    ),
}
# Recipes whose step holds one lax.cond/switch between exchanges: the program counts every
# branch, so their bytes per step are ``CommReport.mean_bytes_per_device`` weighted by the
# branches the steps took. method -> the names of the branches, in branch-index order.
REGIMES: dict[str, tuple[str, ...]] = {
    "onebit_adam": ("compressed", "warmup"),  # lax.cond(count < freeze_step, warm-up, ...)
    "onebit_adam-unbounded": ("compressed", "warmup"),
    "zero_one_adam": ("full", "compressed", "skipped"),  # lax.switch(round kind, ...)
    "zero_one_adam-scaler100": ("full", "compressed", "skipped"),
    "sgd-topk1%-accordion": ("other", "critical"),  # lax.cond(critical, gentle, codec)
    "sgd-sign-accordion": ("other", "critical"),
}


# Methods with a density warm-up (one lax.switch on the step count, stage by stage, then the
# codec): method -> (warm-up steps, stages, branches of the switch). Their bytes per step are
# the steady state's (the last branch); "mean_bytes_per_step" weighs every stage by its steps.
def _warmup(steps: int, ratio: float) -> tuple[int, int, int]:
    stages = len(warmup.densities(ratio))
    return steps, stages, stages + 1


WARMUPS: dict[str, tuple[int, int, int]] = {
    "sgd-topk1%-warmup100": _warmup(100, 0.01),
    "sgd-topk1%-gtopk-warmup100": _warmup(100, 0.01),  # 25%, 6.25%, 1.5625%, then 1%
    # 25%, 6.25%, 1.5625%, 0.4%, then 0.1%, over the warm-up's steps.
    **{
        m: _warmup(warmup.DGC_WARMUP_STEPS, 0.001)
        for m in ("dgc0.1%", "dgc0.1%-nesterov", "dgc0.1%-nomask")
    },
    **{f"dgc0.1%-warmup{w}": _warmup(w, 0.001) for w in (100, 150, 200, 300)},
}


def warmup_bytes(method: str, report: Any, steps: int) -> dict:
    """Bytes per step of a warm-up method: steady state (after the warm-up), the mean over
    ``steps`` steps, and each branch's."""
    length, stages, branches = WARMUPS[method]
    per_stage = warmup.stage_steps(steps, length, stages)
    counts = per_stage[: branches - 1] + [sum(per_stage[branches - 1 :])]
    stages = branches - 1
    each = report.branch_bytes(logical=True)
    stage_bytes = [each[None] + each[0, i] for i in range(stages + 1)]
    return {
        "bytes_per_step": stage_bytes[-1],
        "mean_bytes_per_step": report.mean_bytes_per_device(counts, logical=True),
        "regime_bytes": {f"stage{i}": b for i, b in enumerate(stage_bytes)},
        "regime_steps": {f"stage{i}": c for i, c in enumerate(counts)},
    }


def regime(method: str, step: int, state: Any) -> int:
    """The branch of the step's conditional that step ``step`` (taken from ``state``) runs."""
    if method.startswith("onebit_adam"):
        return int(step < ONEBIT_FREEZE)
    if method in ZERO_ONE:
        return zero_one_kinds(method, max(4096, 1 << step.bit_length()))[step]
    return int(bool(state[0].adaptive.critical))


def branch_mean(method: str, report: Any, counts: list[int], logical: bool) -> tuple:
    """(bytes per step weighted by ``counts``, {branch name: its bytes}, {name: steps})."""
    names = REGIMES[method]
    each = report.branch_bytes(logical)
    mean = report.mean_bytes_per_device(counts, logical=logical)
    return mean, {n: each[0, i] for i, n in enumerate(names)}, dict(zip(names, counts, strict=True))


ONEBIT_FREEZE = 50
# 0/1 Adam's settings by method. "zero_one_adam": the LM benchmark's (benchmarks/lm.py), the
# library's local_step_scaler=1000: skipped rounds, every other step, from step 1100 only.
# warmup_steps=25: the quarter of var_freeze_step the recorded rows ran with (the library's
# default until 2026-11-26; var_freeze_step // 2 since).
ZERO_ONE = {
    "zero_one_adam": {"var_freeze_step": 100, "var_update_scaler": 8, "warmup_steps": 25},
    "zero_one_adam-scaler100": {
        "var_freeze_step": 100,
        "var_update_scaler": 8,
        "local_step_scaler": 100,
        "warmup_steps": 25,
    },
}


@functools.lru_cache
def zero_one_kinds(method: str, steps: int) -> list[int]:
    """The round kind of each of 0/1 Adam ``method``'s first ``steps`` steps (one call)."""
    import numpy as np

    from jaxcomp._src.zero_one_adam import round_kind

    return np.asarray(round_kind(np.arange(steps), *zero_one_schedule(method))).tolist()


def zero_one_schedule(method: str) -> tuple[int, int, int, int, int]:
    """``(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
    warmup_steps)`` of 0/1 Adam ``method``: its settings, the library's defaults elsewhere
    (the warm-up's FULL rounds included)."""
    import inspect

    from jaxcomp._src.zero_one_adam import default_warmup

    defaults = inspect.signature(jc.zero_one_adam).parameters
    z = {k: p.default for k, p in defaults.items() if k != "var_freeze_step"}
    z.update(ZERO_ONE[method])
    keys = ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")
    return (*(z[k] for k in keys), default_warmup(z["var_freeze_step"], z["warmup_steps"]))


ACCORDION_EVERY = (
    25  # steps per Accordion detection interval  # 1-bit Adam's uncompressed warm-up (steps)
)
# Peak learning rates of the recipes by family: classifiers (baseline SGD 0.05) and char.
RECIPE_LR = {"sgd": {"classifier": 0.05, "char": 0.2}, "adam": {"classifier": 3e-3, "char": 3e-3}}


def recipe_lr(method: str, task: str) -> float:
    family = "sgd" if method.startswith("sgd") else "adam"
    return RECIPE_LR[family]["char" if task == "char" else "classifier"]


# Run order: the figures that matter most first, so a bounded run has them.
PRIORITY = ["none", "sign", "int8", "topk1%", "powersgd4", "dgc0.1%", "fp16", "int4", "qsgd"]


def method_names() -> list[str]:
    names = ["none", *common.codec_names()]
    for name in TRANSFORMS:
        if name == "signsgd_mv" and "majority_vote" not in jc.STRATEGIES:
            continue
        names.append(name)
    names.extend(RECIPES)
    ordered = [n for n in PRIORITY if n in names]
    return ordered + [n for n in names if n not in ordered]


def transform_factory(name: str) -> tuple[Callable[[str], Any] | None, bool]:
    """(axis -> transform returning the mean gradient, or None for pmean; own momentum?)."""
    if name == "none":
        return None, False
    if name in TRANSFORMS:
        return TRANSFORMS[name]
    codec = common.make_codec(name)
    return (lambda axis: jc.compressed_allreduce(codec, axis, min_size=1024)), False


# --------------------------------------------------------------------------- classifiers


def load(task: str, seed: int = 0):
    import numpy as np

    if task == "digits":
        return common.load_digits_split(seed)
    if task == "teacher":
        return common.load_teacher_split(seed)
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = seed
    data = make_dataset(args)
    mean, std = data["x"].mean(), data["x"].std()
    norm = lambda a: ((a - mean) / std).astype(np.float32)  # noqa: E731
    return (norm(data["x"]), data["y"].astype(np.int32)), (
        norm(data["x_test"]),
        data["y_test"].astype(np.int32),
    )


def exchange_diagnostics(
    before: dict, after: dict, old: Any, new: Any, lr: float, look_ahead: bool, beta: float = 0.9
) -> dict:
    """One step of a ``jc.sgd`` recipe measured against the uncompressed recipe.

    On the compressed leaves (those with an error-feedback memory): the applied update's norm
    over the uncompressed update's ``-lr / (1 - beta) * mean_i s_i`` (``s_i`` the momentum
    ``m_i``, or the look-ahead ``m_i + beta (m_i - m_i^prev)``), their cosine, and the
    error-feedback memory (root mean square over devices of ``||e_i||``) and the two-phase
    server residual (``||s||``, all chunks) over ``||mean_i m_i||``.
    """
    import numpy as np

    o, w = old[0], new[0]
    keys = [k for k in before if hasattr(w.memory[k], "shape")]
    flat = lambda f: np.concatenate([np.asarray(f(k), np.float64).ravel() for k in keys])  # noqa: E731
    m_new = lambda k: np.asarray(w.momentum[k], np.float64)  # noqa: E731
    m_old = lambda k: np.asarray(o.momentum[k], np.float64)  # noqa: E731
    send = lambda k: m_new(k) + (beta * (m_new(k) - m_old(k)) if look_ahead else 0.0)  # noqa: E731
    ref = flat(lambda k: -lr / (1 - beta) * send(k).mean(0))
    step = flat(lambda k: np.asarray(after[k]) - np.asarray(before[k]))
    mean_m = np.linalg.norm(flat(lambda k: m_new(k).mean(0)))
    n = w.memory[keys[0]].shape[0]
    memory = np.sqrt(sum(np.sum(np.asarray(w.memory[k], np.float64) ** 2) for k in keys) / n)
    residual = w.server_residual or {}  # None without a two-phase leaf
    server = [residual[k] for k in keys if hasattr(residual.get(k), "shape")]
    served = np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in server))
    return {
        "update_over_uncompressed": float(np.linalg.norm(step) / np.linalg.norm(ref)),
        "cosine": float(step @ ref / (np.linalg.norm(step) * np.linalg.norm(ref))),
        "memory_over_momentum": float(memory / mean_m),
        "server_over_momentum": float(served / mean_m),
    }


def dgc_diagnostics(start: Any, params: Any, state: Any, lr: float = 0.05) -> dict:
    """What ``jc.dgc`` holds back, against how far the weights have moved since step 0.

    On the sparsified leaves: ``lr * ||mean_i v_i|| / ||w - w_0||`` (the update waiting in the
    devices' accumulations ``v_i``, over the distance travelled) and the same for the
    velocities ``u_i``."""
    import numpy as np

    s = state[0]
    keys = [k for k, v in s.accumulation.items() if hasattr(v, "shape")]
    flat = lambda f: np.concatenate([np.asarray(f(k), np.float64).ravel() for k in keys])  # noqa: E731
    moved = np.linalg.norm(flat(lambda k: np.asarray(params[k]) - np.asarray(start[k])))
    held = np.linalg.norm(flat(lambda k: np.asarray(s.accumulation[k]).mean(0)))
    return {
        "held_back_over_moved": float(lr * held / moved),
        "velocity_over_moved": float(
            lr * np.linalg.norm(flat(lambda k: np.asarray(s.velocity[k]).mean(0))) / moved
        ),
    }


def train_classifier(
    task: str,
    method: str,
    steps: int,
    seed: int = 0,
    eval_at: tuple[int, ...] = (),
    diagnose: int = 0,
) -> dict:
    """MLP data-parallel with ``method``; test accuracy, loss curve, bytes per step.

    ``eval_at``: also the test accuracy after these many steps (``"checkpoints"``); with the
    constant learning rate of the classifiers it is the accuracy of a run that long (same
    seed, batches and steps so far). ``diagnose``: every that many steps of a ``jc.sgd``
    recipe, :func:`exchange_diagnostics`, of ``jc.dgc``, :func:`dgc_diagnostics`
    (``"diagnostics"``). ``seed`` draws the
    initialization and the batches; the data (split, mnist1d's set, the teacher) stay those of
    seed 0, so seeds measure the training's noise on one fixed task and test set."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    (xtr, ytr), (xte, yte) = load(task)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    sizes = (xtr.shape[1], 256, 10) if task == "digits" else (xtr.shape[1], 256, 256, 10)

    init, logits_fn, loss_fn = common.classifier_mlp(sizes)

    if method in RECIPES:
        factory, tx = RECIPES[method], RECIPES[method](AXIS, recipe_lr(method, task))
    else:
        factory, own_momentum = transform_factory(method)
        opt = optax.sgd(0.05) if own_momentum else optax.sgd(0.05, momentum=0.9)
        tx = opt if factory is None else optax.chain(factory(AXIS), opt)
    params = jax.device_put(init(jax.random.PRNGKey(seed)), NamedSharding(mesh, P()))

    def build(tx, averages: bool):
        state = jc.sharded_init(tx, params, mesh, AXIS)
        specs = jc.state_specs(state, AXIS)

        def step(p, s, x, y):
            loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
            if not averages:
                g = jax.lax.pmean(g, AXIS)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, jax.lax.pmean(loss, AXIS)

        step = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs, P())
        )
        return jax.jit(step), state

    batch = 256
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    sample = (put(xtr[:batch]), put(ytr[:batch]))

    step, state = build(tx, factory is not None)
    report = jc.comm_report(step, params, state, *sample)
    logical_bytes = report.logical_bytes_per_device
    counts = [0] * len(REGIMES.get(method, ()))
    rng = np.random.RandomState(seed)
    curve = []
    checkpoints, diagnostics = {}, []
    sgd_recipe = method in RECIPES and method.startswith("sgd") and method != "sgd-none"
    # (lr, look-ahead) of a jc.sgd recipe whose diagnostics are taken, else None.
    watch = (
        (recipe_lr(method, task), "heavyball" not in method) if diagnose and sgd_recipe else None
    )

    origin = jax.device_get(params) if diagnose and method.startswith("dgc") else None

    def accuracy(p) -> float:
        logits = logits_fn(jax.device_get(p), jnp.asarray(xte))
        return float(jnp.mean(jnp.argmax(logits, -1) == yte))

    start = time.perf_counter()
    for t in range(steps):
        if counts:
            counts[regime(method, t, state)] += 1
        idx = rng.randint(0, len(xtr), batch)
        before = (params, state)
        params, state, loss = jax.block_until_ready(
            step(params, state, put(xtr[idx]), put(ytr[idx]))
        )
        if watch and (t + 1) % diagnose == 0:
            d = exchange_diagnostics(*before[:1], params, before[1], state, *watch)
            diagnostics.append({"step": t + 1, **d})
        if origin is not None and (t + 1) % diagnose == 0:
            diagnostics.append({"step": t + 1, **dgc_diagnostics(origin, params, state)})
        curve.append(float(loss))
        if t + 1 in eval_at and t + 1 < steps:
            checkpoints[t + 1] = accuracy(params)
    seconds = time.perf_counter() - start
    regimes, taken, bytes_per_step = {}, {}, logical_bytes
    if counts:
        bytes_per_step, regimes, taken = branch_mean(method, report, counts, logical=True)
    warm = warmup_bytes(method, report, steps) if method in WARMUPS else {}
    if warm:
        bytes_per_step, regimes, taken = (
            warm["bytes_per_step"],
            warm["regime_bytes"],
            warm["regime_steps"],
        )
    return {
        "metric": "test_accuracy",
        "value": accuracy(params),
        "checkpoints": checkpoints,
        "diagnostics": diagnostics,
        "final_train_loss": float(np.mean(curve[-20:])),
        "curve": curve,
        "bytes_per_step": bytes_per_step,
        "mean_bytes_per_step": warm.get("mean_bytes_per_step", bytes_per_step),
        "program_bytes": logical_bytes,  # every branch of the step's program
        "regime_bytes": regimes,
        "regime_steps": taken,
        "train_seconds": seconds,
        "seed": seed,
    }


def train_char(method: str, steps: int, seed: int = 0) -> dict:
    """The character transformer of benchmarks/char_transformer.py with ``method``."""
    from benchmarks import char_transformer

    if method in RECIPES:
        compression, optimizer = RECIPES[method], "recipe"
        lr = recipe_lr(method, "char")
    else:
        factory, own_momentum = transform_factory(method)
        compression = "none" if factory is None else factory
        # DGC: its momentum, not a second.
        optimizer, lr = ("plain_sgd" if own_momentum else "adam"), None
    r = char_transformer.train(
        compression,
        steps,
        optimizer=optimizer,
        lr=lr,
        seed=seed,
        return_details=True,
        report_bytes=True,
    )
    if method.endswith("accordion"):
        raise ValueError(
            f"{method}: its regimes are read from the state each step, which the char loop "
            "does not expose; run it on digits or mnist1d"
        )
    regimes, taken, bytes_per_step = {}, {}, r["bytes_per_device"]
    if method in REGIMES:
        counts = [0] * len(REGIMES[method])
        for t in range(steps):
            counts[regime(method, t, None)] += 1
        bytes_per_step, regimes, taken = branch_mean(method, r["report"], counts, logical=False)
    return {
        "metric": "eval_loss_nats_per_byte",
        "value": r["eval_loss"],
        "final_train_loss": float(sum(r["train_loss"][-20:]) / min(20, len(r["train_loss"]))),
        "curve": r["train_loss"],
        "bytes_per_step": bytes_per_step,
        "program_bytes": r["bytes_per_device"],
        "regime_bytes": regimes,
        "regime_steps": taken,
        "train_seconds": r["seconds"],
    }


# --------------------------------------------------------------------------- output


def previous_runs(path) -> list[dict]:
    """The runs of an earlier (bounded or interrupted) result file, to go on from (--resume)."""
    import json

    if not path.exists():
        return []
    return json.loads(path.read_text())["runs"]


def finish(runs: list[dict]) -> None:
    """Ratios and deltas against the ``none`` run of the same task (and checkpoints)."""
    for r in runs:
        seed = r.get("seed", 0)
        base = next(
            (
                b
                for b in runs
                if b["task"] == r["task"] and b["method"] == "none" and b.get("seed", 0) == seed
            ),
            None,
        )
        if base is None:
            continue
        if "bytes_per_step" in base and "bytes_per_step" in r:  # value-only runs have none
            r["compression"] = base["bytes_per_step"] / r["bytes_per_step"]
        r["delta"] = r["value"] - base["value"]
        marks = {str(k): v for k, v in base.get("checkpoints", {}).items()}  # JSON: str keys
        r["checkpoint_delta"] = {
            str(k): v - marks[str(k)]
            for k, v in r.get("checkpoints", {}).items()
            if str(k) in marks
        }


def print_table(runs: list[dict]) -> None:
    print(f"\n{'task':8s} {'method':11s}{'ratio':>8s}{'metric':>9s}{'delta':>9s}{'KiB/step':>10s}")
    for r in runs:
        print(
            f"{r['task']:8s} {r['method']:11s}{r.get('compression', math.nan):>7.1f}x"
            f"{r['value']:>9.4f}{r.get('delta', math.nan):>+9.4f}"
            f"{r.get('bytes_per_step', math.nan) / 1024:>10.1f}"
        )


def draw(runs: list[dict], quick: bool, label: str = "") -> None:
    import numpy as np

    for task in dict.fromkeys(r["task"] for r in runs):

        def one(ax, task=task):
            for r in runs:
                if r["task"] != task or "curve" not in r:  # value-only runs have no curve
                    continue
                c = np.asarray(r["curve"])
                w = max(1, len(c) // 50)
                smooth = np.convolve(c, np.ones(w) / w, mode="valid")
                ax.plot(smooth, label=r["method"], color="black" if r["method"] == "none" else None)
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss (moving average)")
            ax.legend(fontsize=6, ncol=3)

        common.plot(
            common.result_path(f"convergence{label}_{task}", quick, "png"),
            one,
            f"{task}: training loss per method, same seed and batches",
        )


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes=(
            "convergence.json and convergence_TASK.png (`--label L`: convergence_L.*; `--quick`: "
            "*_quick)"
        ),
        takes=(
            "about 2 hours of training on the 2-core CPU host for every method and task (7,639 "
            "s); `--label recipes` with its methods 20 minutes (1,166 s); `--quick` about 2 "
            "minutes"
        ),
    )
    ap.add_argument("--quick", action="store_true", help="digits, none/sign/int8, 40 steps")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=None, help="tasks (None: all)")
    ap.add_argument("--methods", nargs="+", default=None, help="default: every codec family")
    ap.add_argument("--steps", type=int, default=None, help="default per task: " + str(STEPS))
    ap.add_argument("--devices", type=int, default=8, help="CPU devices when no accelerator")
    ap.add_argument(
        "--eval-at", nargs="*", type=int, default=[], help="also the accuracy after N steps"
    )
    ap.add_argument(
        "--diagnose",
        type=int,
        default=0,
        help="every N steps of a jc.sgd recipe: update norm and cosine against the "
        "uncompressed update, error-feedback memory and server residual norms; of jc.dgc: "
        "the update its accumulations hold back over the distance the weights moved",
    )
    ap.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=[0],
        help="seeds of the initialization and batches (the data stay seed 0's); one run each",
    )
    ap.add_argument("--budget", type=float, default=None, help="stop starting runs after s")
    ap.add_argument("--label", default="", help="write convergence_LABEL.json (and .png)")
    ap.add_argument(
        "--resume", action="store_true", help="keep the runs already in the result file"
    )
    args = ap.parse_args(argv)
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(args.devices)
    tasks = args.tasks or (["digits"] if args.quick else list(TASKS))
    methods = args.methods or (["none", "sign", "int8"] if args.quick else method_names())
    if methods[0] != "none":
        methods = ["none", *[m for m in methods if m != "none"]]
    path = common.result_path("convergence" + (f"_{args.label}" if args.label else ""), args.quick)
    runs: list[dict] = previous_runs(path) if args.resume else []
    start = time.perf_counter()
    jobs = [(m, t, s) for s in args.seeds for m in methods for t in tasks]
    done = {(r["method"], r["task"], r["steps"], r.get("seed", 0)) for r in runs}
    todo = [
        (m, t, s)
        for m, t, s in jobs
        if (m, t, args.steps or (40 if args.quick else STEPS[t]), s) not in done
    ]
    for method, task, seed in common.progress(todo, "convergence"):
        if args.budget is not None and time.perf_counter() - start > args.budget:
            print(f"budget of {args.budget:.0f} s spent: stopping before {method}/{task}")
            break
        steps = args.steps or (40 if args.quick else STEPS[task])
        t0 = time.perf_counter()
        if task == "char":
            r = train_char(method, steps, seed=seed)
        else:
            r = train_classifier(
                task, method, steps, seed, eval_at=tuple(args.eval_at), diagnose=args.diagnose
            )
        r.update(task=task, method=method, steps=steps, seed=seed, seconds=time.perf_counter() - t0)
        runs.append(r)
        finish(runs)
        print(
            f"{task:8s} {method:11s} seed {seed} {r['metric']} {r['value']:.4f} "
            f"{r.get('compression', math.nan):.1f}x fewer bytes  {r['seconds']:.0f} s",
            flush=True,
        )
        out = {"environment": common.environment(), "complete": False, "runs": runs}
        common.write_json(path, out)
    finished = {(r["method"], r["task"], r.get("seed", 0)) for r in runs}
    out = {
        "environment": common.environment(),
        "complete": all(job in finished for job in jobs),
        "runs": runs,
    }
    common.write_json(path, out)
    print_table(runs)
    draw(runs, args.quick, f"_{args.label}" if args.label else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
