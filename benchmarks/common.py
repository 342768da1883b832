"""Shared helpers of the benchmarks: the results folder, JSON, plots, timing, codec lists.

Every benchmark writes ``benchmarks/results/<name>.json`` (``<name>_quick.json`` with
``--quick``, so a smoke run never overwrites a full run) and a PNG next to it, and records
the backend and device it ran on. Import this module before jax is used: it does not import
jax itself, so a benchmark can still call :func:`jaxcomp.cpu.use_cpu_devices` first.

Every benchmark imports it as ``from benchmarks import common`` and is run as
``python -m benchmarks.NAME`` from the repository root (no ``sys.path`` edits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
# JAXCOMP_BENCH_RESULTS redirects every output (the smoke tests write to a temporary folder).
RESULTS = pathlib.Path(os.environ.get("JAXCOMP_BENCH_RESULTS", ROOT / "benchmarks" / "results"))

# Codec families that are not (yet) one-line entries of jc.CODECS: name -> (the name of a
# jaxcomp factory, its keyword arguments). A name already in the registry is taken from
# there, so new registrations win.
EXTRA_CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "topk1%": ("top_k", {"ratio": 0.01, "approx": True}),
    "randk1%": ("random_k", {"ratio": 0.01}),
}


def result_path(name: str, quick: bool, suffix: str = "json") -> pathlib.Path:
    """``benchmarks/results/<name>[_quick].<suffix>`` (the folder is created)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}{'_quick' if quick else ''}.{suffix}"


def write_json(path: pathlib.Path, data: Any, quiet: bool = False) -> pathlib.Path:
    """Write ``data`` as indented JSON (numbers rounded by the caller) and, unless ``quiet``
    (a partial result saved as a run goes), say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    if not quiet:
        print(f"wrote {show_path(path)}", flush=True)
    return path


def show_path(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def environment() -> dict[str, Any]:
    """Backend, device kind and count, versions and host: goes into every result."""
    import jax

    return {
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "device_count": jax.device_count(),
        "cpu_cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([pathlib.Path(sys.executable).name, *_argv()]),
    }


def _argv() -> list[str]:
    """``sys.argv`` with ``-m benchmarks.NAME`` for a module run as ``python -m``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (["-m", spec.name] if spec else sys.argv[:1]) + sys.argv[1:]


def codec_names(include_extra: bool = True) -> list[str]:
    """Every registered codec (``jc.CODECS``) plus the sparse defaults of :data:`EXTRA_CODECS`."""
    import jaxcomp as jc

    names = list(jc.CODECS)
    if include_extra:
        names += [n for n in EXTRA_CODECS if n not in jc.CODECS]
    return names


def make_codec(name: str):
    """The codec called ``name``: from the registry, else from :data:`EXTRA_CODECS`."""
    import jaxcomp as jc

    if name in jc.CODECS:
        return jc.get_codec(name)
    if name in EXTRA_CODECS:
        factory, kwargs = EXTRA_CODECS[name]
        return getattr(jc, factory)(**kwargs)
    return jc.get_codec(name)  # raises the registry's ValueError naming the known codecs


def load_digits_split(seed: int = 0, permutation: Callable[[int], Any] | None = None):
    """sklearn's digits (1,797 8x8 images, shipped with scikit-learn: no download), pixels in
    [0, 1] as float32, labels int32, shuffled and split 1400 train / 397 test.

    Returns ``(x_train, y_train), (x_test, y_test)``. ``permutation(n)`` shuffles (default
    ``np.random.RandomState(seed).permutation``; powersgd_convergence's recorded runs used
    ``np.random.default_rng(0).permutation``).
    """
    import numpy as np
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype(np.float32), y.astype(np.int32)
    perm = (permutation or np.random.RandomState(seed).permutation)(len(x))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


#: The teacher network of :func:`load_teacher_split` is drawn from this seed (fixed: every run
#: and every method sees the same task).
TEACHER_SEED = 1234


def load_teacher_split(
    seed: int = 0, dim: int = 32, hidden: int = 64, classes: int = 10, train: int = 4000
):
    """A classification task labelled by a fixed random teacher network (generated: no download).

    Inputs ``x ~ N(0, I_dim)``; the teacher is ``tanh(x W1) W2`` with ``W1 ~ N(0, 1/dim)``
    (``dim x hidden``) and ``W2 ~ N(0, 1/hidden)`` (``hidden x classes``), both drawn from
    ``TEACHER_SEED + seed``; the label is the teacher's argmax. ``train`` examples to train
    on, 1000 held out. No recipe was tuned on it: it checks that what holds on digits and
    mnist1d is not tuned to them.

    Returns ``(x_train, y_train), (x_test, y_test)``, float32 inputs and int32 labels.
    """
    import numpy as np

    rng = np.random.RandomState(TEACHER_SEED + seed)
    w1 = rng.randn(dim, hidden) / np.sqrt(dim)
    w2 = rng.randn(hidden, classes) / np.sqrt(hidden)
    x = rng.randn(train + 1000, dim).astype(np.float32)
    y = (np.tanh(x @ w1) @ w2).argmax(-1).astype(np.int32)
    return (x[:train], y[:train]), (x[train:], y[train:])


# The MLP of the training-step benchmarks (network.py, gpu_step.py): 25.2M parameters.
MLP = (1024, 4096, 4096, 1024)


def mlp_params(sizes: tuple[int, ...] = MLP, seed: int = 42) -> dict[str, Any]:
    """``{"w0", "b0", ...}``: normal weights scaled by ``1/sqrt(fan_in)``, zero biases."""
    import jax
    import jax.numpy as jnp

    key, params = jax.random.PRNGKey(seed), {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (a, b)) / jnp.sqrt(float(a))
        params[f"b{i}"] = jnp.zeros((b,))
    return params


def mlp_loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    """Mean squared error of the ReLU MLP of :func:`mlp_params` (no activation on the output)."""
    import jax
    import jax.numpy as jnp

    layers = len(params) // 2
    h = x
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        h = jax.nn.relu(h) if i < layers - 1 else h
    return jnp.mean((h - y) ** 2)


def mlp_train_step(codec: Any, params: Any, mesh: Any, axis: str, lr: float = 1e-3, **kw: Any):
    """One data-parallel SGD step of :func:`mlp_loss`, jitted ``shard_map`` over ``axis``.

    ``codec=None``: plain ``jax.lax.pmean`` of the gradient, then ``optax.sgd(lr)``; else
    ``optax.chain(jc.compressed_allreduce(codec, axis, **kw), optax.sgd(lr))`` (error feedback
    on by default). Params are replicated, the batch sharded on ``axis``. Returns
    ``(step, state)``: ``step(params, state, x, y) -> (params, state)``.
    """
    import optax

    import jaxcomp as jc

    opt = optax.sgd(lr)
    tx = opt if codec is None else optax.chain(jc.compressed_allreduce(codec, axis, **kw), opt)
    return mlp_tx_step(tx, params, mesh, axis, pmean_first=codec is None)


def mlp_tx_step(tx: Any, params: Any, mesh: Any, axis: str, *, pmean_first: bool, donate=False):
    """One data-parallel step of :func:`mlp_loss` through the optax transform ``tx``, jitted
    ``shard_map`` over ``axis`` (params replicated, batch sharded, the state from
    ``jc.sharded_init``). ``pmean_first``: ``jax.lax.pmean`` the gradient before ``tx`` (plain
    optimizers); ``donate``: params and state donated. Returns ``(step, state)``."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    state = jc.sharded_init(tx, params, mesh, axis)
    specs = jc.state_specs(state, axis)

    def step(p, s, x, y):
        g = jax.grad(mlp_loss)(jax.lax.pcast(p, axis, to="varying"), x, y)
        if pmean_first:
            g = jax.lax.pmean(g, axis)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    fn = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), specs, P(axis), P(axis)), out_specs=(P(), specs)
    )
    return jax.jit(fn, donate_argnums=(0, 1) if donate else ()), state


def classifier_mlp(sizes: tuple[int, ...]) -> tuple[Callable, Callable, Callable]:
    """A ReLU MLP classifier of layer ``sizes``: ``(init(key) -> params, logits(params, x),
    loss(params, x, y))``, He-initialized weights ``w{i}``, zero biases ``b{i}``, mean
    softmax cross-entropy (the model of the convergence, gossip and time-to-accuracy runs)."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(key):
        p = {}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            key, sub = jax.random.split(key)
            p[f"w{i}"] = jax.random.normal(sub, (a, b)) * math.sqrt(2.0 / a)
            p[f"b{i}"] = jnp.zeros((b,))
        return p

    def logits(p, x):
        for i in range(len(sizes) - 1):
            x = x @ p[f"w{i}"] + p[f"b{i}"]
            x = jax.nn.relu(x) if i < len(sizes) - 2 else x
        return x

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

    return init, logits, loss


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 1, pipeline: int = 1) -> float:
    """Median wall time of ``fn()`` over ``reps`` samples, each blocked until ready.

    ``pipeline > 1``: a sample is that many calls back to back, blocked once at the end, over
    ``pipeline`` (throughput: on a GPU the host's dispatch overlaps the device's work, so
    small arrays are not measured as the ~0.1 ms a blocked round trip costs).
    """
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(pipeline - 1):
            fn()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) / pipeline)
    return statistics.median(times)


def progress(items: Iterable[Any], desc: str, total: int | None = None) -> Iterable[Any]:
    """A tqdm bar on stderr when tqdm is installed (it is in the bench extra)."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr)


def plot(path: pathlib.Path, draw: Callable[[Any], None], title: str) -> pathlib.Path:
    """Save one matplotlib figure drawn by ``draw(ax)`` (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    draw(ax)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {show_path(path)}", flush=True)
    return path


def plot_grid(
    path: pathlib.Path, draws: list[Callable[[Any], None]], title: str, ncols: int = 2
) -> pathlib.Path:
    """Like :func:`plot`, one panel per ``draws[i](ax)`` on a grid of ``ncols`` columns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrows = max(1, -(-len(draws) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.8 * nrows), squeeze=False)
    for ax, draw in zip(axes.flat, draws, strict=False):
        draw(ax)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(draws) :]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {show_path(path)}", flush=True)
    return path


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub markdown table (what the README shows)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- --help


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with every option's default and the epilog's paragraphs kept."""


#: Options that count something (steps, repetitions, rows, sizes, processes): at least 1.
COUNT_FLAGS = frozenset(
    {"--steps", "--reps", "--batch", "--size", "--sizes", "--d-model", "--layers", "--heads"}
    | {"--hidden", "--num-processes", "--processes", "--rounds", "--periods"}
)


def at_least(kind: type, low: float) -> Callable[[str], Any]:
    """An argparse ``type``: a finite ``kind`` of at least ``low``, else a usage error naming
    the option (``--steps -1`` trained nothing and wrote a result marked complete)."""

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be finite and >= {low}")
        return value

    parse.__name__ = kind.__name__  # argparse says "invalid int value: 'x'"
    return parse


class ArgumentParser(argparse.ArgumentParser):
    """Every ``int`` / ``float`` option is finite and ``>= 0`` (no benchmark takes a negative
    number), one of :data:`COUNT_FLAGS` ``>= 1``: checked when the option is parsed."""

    def add_argument(self, *names: str, **kwargs: Any):
        if kwargs.get("type") in (int, float):
            kwargs["type"] = at_least(kwargs["type"], 1 if COUNT_FLAGS & set(names) else 0)
        return super().add_argument(*names, **kwargs)


def arg_parser(doc: str, *, writes: str, takes: str) -> argparse.ArgumentParser:
    """The argument parser of a benchmark script. Its ``--help`` gives the first paragraph of
    the script's docstring, every option's default, which result files a run overwrites and
    how long a run takes (``takes``: measured on the hosts named). Its ``int`` and ``float``
    options refuse negative and non-finite values, and 0 for a count (:class:`ArgumentParser`)."""
    epilog = (
        f"Writes {writes} in benchmarks/results/ (or in $JAXCOMP_BENCH_RESULTS), replacing "
        "the committed file of that name: the docs' tables are rendered from it "
        "(`python -m docs.hooks.bench_tables --write` re-renders them; `git checkout "
        f"benchmarks/results` undoes a run). Takes {takes}."
    )
    return ArgumentParser(
        description=" ".join(doc.strip().split("\n\n")[0].split()),
        epilog="\n".join(textwrap.wrap(epilog, 88)),
        formatter_class=HelpFormatter,
    )
