"""Gossip (``jc.gossip``) against all-reduce data parallel: quality, mixing, bytes, link time.

Four parts, each in one run (``--parts``, default all):

* ``convergence`` — digits (MLP 64-256-10, 1000 steps), mnist1d (40-256-256-10, 2000
  steps) and the character transformer (300 steps), each on 8 devices: all-reduce data
  parallel (``dp``: ``jax.lax.pmean`` of the gradients, then the optimizer) against gossip
  replicas (each device steps on its own 1/8 of the same global batch, then mixes) with the
  same optimizer (SGD momentum 0.9, lr 0.05 / Adam with a cosine schedule for the
  transformer), seed, batches and steps: ``ring`` (exact), ``ring-int8`` and
  ``exp-int8`` (CHOCO-SGD, ``jc.int_quant(8)``, gamma 1). Metric: the mean model's test
  accuracy (held-out loss for the transformer), the worst replica's, and the consensus
  distance ``max_i ||x_i - mean|| / ||mean||`` every ``--cd-every`` steps and at the end.
* ``mixing`` — gossip alone (zero gradients) from 8 different replicas of the digits MLP:
  the consensus distance per round for ring, torus and exponential, exact and int8.
* ``bytes`` — bytes per device per step: :func:`jaxcomp.gossip_bytes` for n = 4, 8, 16
  and ``jc.comm_report`` of the compiled step on 4 and 8 CPU devices (the char transformer's
  params), against plain ``pmean`` of the same params.
* ``network`` — 4 JAX processes over gloo in a network namespace whose loopback is shaped
  to ``--rate`` (default 1gbit), with the machinery of ``benchmarks/network.py``: one
  training step of an MLP (``--hidden``, default 1024-2048-2048-1024, 8.4M params) with
  all-reduce data parallel (``dp``), int8 compressed all-reduce (``dp-int8``), and gossip
  (``ring``, ``ring-int8``, ``exp-int8``), median of ``--reps`` steps, same run. Needs root
  and iproute2, else skipped with a message.

Writes ``benchmarks/results/gossip.json`` and ``gossip_<part>.png``::

    python -m benchmarks.gossip                       # everything (long on 2 CPU cores)
    python -m benchmarks.gossip --quick               # digits 100 steps, mixing, bytes
    python -m benchmarks.gossip --parts network --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import common

AXIS = "data"
STEPS = {"digits": 1000, "mnist1d": 2000, "char": 300}
METHODS = {  # name -> jc.gossip keyword arguments (None: all-reduce data parallel)
    "dp": None,
    "ring": {"topology": "ring"},
    "ring-int8": {"topology": "ring", "codec": "int8"},
    "exp-int8": {"topology": "exponential", "codec": "int8"},
}
NET_ROWS = ["dp", "dp-int8", "ring", "ring-int8", "exp-int8"]


def gossip_kwargs(name: str) -> dict | None:
    import jaxcomp as jc

    kw = METHODS[name]
    if kw is None:
        return None
    kw = dict(kw)
    if kw.get("codec") == "int8":
        kw["codec"] = jc.int_quant(8)
    return kw


# --------------------------------------------------------------------------- training


def make_step(loss_fn, opt, method: str, mesh, params, batches: int = 2):
    """``(step, replicas, state, report_args)``: one jitted shard_map step on replicas.

    ``dp``: the gradients are ``pmean``-ed and ``opt`` applied (every replica the same);
    else ``jc.gossip(opt, ...)``. ``step(replicas, state, *batch) -> (replicas, state, loss)``.
    """
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    kw = gossip_kwargs(method)
    tx = opt if kw is None else jc.gossip(opt, AXIS, **kw)
    replicas = jc.replica_params(params, mesh, AXIS)
    state = jc.sharded_init(tx, params, mesh, AXIS)
    specs = jc.state_specs(state, AXIS)
    rspecs = jc.replica_specs(params, AXIS)

    def step(r, s, *batch):
        p = jc.own(r)
        loss, g = jax.value_and_grad(loss_fn)(p, *batch)
        if kw is None:
            g = jax.lax.pmean(g, AXIS)
        u, s = tx.update(g, s, p)
        return jc.slot(optax.apply_updates(p, u)), s, jax.lax.pmean(loss, AXIS)

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(rspecs, specs, *[P(AXIS)] * batches),
            out_specs=(rspecs, specs, P()),
        ),
        donate_argnums=(0, 1),
    )
    return fn, replicas, state


def gossip_bytes_of(step, *args) -> float:
    import jaxcomp as jc

    return jc.comm_report(step, *args).bytes_per_device


def train_classifier(task: str, method: str, steps: int, cd_every: int, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from benchmarks.convergence import load

    (xtr, ytr), (xte, yte) = load(task, seed)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    sizes = (xtr.shape[1], 256, 10) if task == "digits" else (xtr.shape[1], 256, 256, 10)

    init, logits_fn, loss_fn = common.classifier_mlp(sizes)

    params = jax.device_put(init(jax.random.PRNGKey(seed)), NamedSharding(mesh, P()))
    opt = optax.sgd(0.05, momentum=0.9)
    step, replicas, state = make_step(loss_fn, opt, method, mesh, params)
    batch = 256
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    rng = np.random.RandomState(seed)
    sample = (put(xtr[:batch]), put(ytr[:batch]))
    bytes_per_step = gossip_bytes_of(step, replicas, state, *sample)
    curve, distances = [], []
    start = time.perf_counter()
    for t in range(steps):
        idx = rng.randint(0, len(xtr), batch)
        replicas, state, loss = jax.block_until_ready(
            step(replicas, state, put(xtr[idx]), put(ytr[idx]))
        )
        curve.append(float(loss))
        if (t + 1) % cd_every == 0 or t + 1 == steps:
            distances.append((t + 1, float(jc.consensus_distance(replicas))))
    seconds = time.perf_counter() - start
    host = jax.device_get(replicas)
    accuracy = lambda p: float(jnp.mean(jnp.argmax(logits_fn(p, xte), -1) == yte))  # noqa: E731
    per_replica = [accuracy(jax.tree.map(lambda a, i=i: a[i], host)) for i in range(n)]
    return {
        "metric": "test_accuracy",
        "value": accuracy(jc.mean_replica(host)),
        "worst_replica": min(per_replica),
        "best_replica": max(per_replica),
        "consensus_distance": distances[-1][1],
        "consensus_curve": distances,
        "final_train_loss": float(np.mean(curve[-20:])),
        "curve": curve,
        "bytes_per_step": bytes_per_step,
        "train_seconds": seconds,
    }


def train_char(method: str, steps: int, cd_every: int, seed: int = 0, peak: float = 3e-3) -> dict:
    """The transformer of benchmarks/char_transformer.py (its data, batches and Adam with a
    cosine schedule, as ``char_transformer.train``), on replicas."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from benchmarks import char_transformer as ct

    context, bpd = 64, 2
    text = ct.load_text()
    split_at = int(0.9 * len(text))
    train_text, eval_text = text[:split_at], text[split_at:]
    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))

    def make_model():
        return ct.CharTransformer(context=context, d=128, layers=2, heads=4, rngs=nnx.Rngs(seed))

    graphdef = nnx.graphdef(nnx.eval_shape(make_model))
    params = jax.jit(lambda: nnx.state(make_model()))()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    lr = optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 20), steps)

    def loss_fn(p, tokens):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    step, replicas, state = make_step(loss_fn, optax.adam(lr), method, mesh, params, 1)

    def batch(rng, source, size):
        starts = rng.integers(0, len(source) - context - 1, size)
        return np.stack([source[s : s + context + 1] for s in starts]).astype(np.int32)

    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    data_rng = np.random.default_rng(seed)
    tokens = put(batch(data_rng, train_text, n * bpd))
    bytes_per_step = gossip_bytes_of(step, replicas, state, tokens)
    curve, distances = [], []
    start = time.perf_counter()
    for t in range(steps):
        if t:
            tokens = put(batch(data_rng, train_text, n * bpd))
        replicas, state, loss = jax.block_until_ready(step(replicas, state, tokens))
        curve.append(float(loss))
        if (t + 1) % cd_every == 0 or t + 1 == steps:
            distances.append((t + 1, float(jc.consensus_distance(replicas))))
    seconds = time.perf_counter() - start
    eval_tokens = jnp.asarray(batch(np.random.default_rng(12345), eval_text, 256))
    host = jax.device_get(replicas)
    evaluate = jax.jit(loss_fn)
    per_replica = [
        float(evaluate(jax.tree.map(lambda a, i=i: a[i], host), eval_tokens)) for i in range(n)
    ]
    return {
        "metric": "eval_loss_nats_per_byte",
        "value": float(evaluate(jc.mean_replica(host), eval_tokens)),
        "worst_replica": max(per_replica),
        "best_replica": min(per_replica),
        "consensus_distance": distances[-1][1],
        "consensus_curve": distances,
        "final_train_loss": float(np.mean(curve[-20:])),
        "curve": curve,
        "bytes_per_step": bytes_per_step,
        "train_seconds": seconds,
    }


def part_convergence(args) -> list[dict]:
    runs = []
    tasks = args.tasks or (["digits"] if args.quick else list(STEPS))
    for task in tasks:
        steps = args.steps or (100 if args.quick else STEPS[task])
        for method in args.methods:
            t0 = time.perf_counter()
            if task == "char":
                r = train_char(method, steps, args.cd_every, peak=args.char_lr)
            else:
                r = train_classifier(task, method, steps, args.cd_every)
            r.update(task=task, method=method, steps=steps, seconds=time.perf_counter() - t0)
            if task == "char":
                r["peak_lr"] = args.char_lr
            runs.append(r)
            base = next((b for b in runs if b["task"] == task and b["method"] == "dp"), None)
            if base is not None:
                r["delta_vs_dp"] = r["value"] - base["value"]
                r["relative_vs_dp"] = r["value"] / base["value"] - 1
            print(
                f"{task:8s} {method:10s} {r['metric']} {r['value']:.4f} "
                f"(worst replica {r['worst_replica']:.4f}) consensus {r['consensus_distance']:.4f} "
                f"{r['bytes_per_step'] / 1024:.1f} KiB/step  {r['seconds']:.0f} s",
                flush=True,
            )
    return runs


# --------------------------------------------------------------------------- mixing


def part_mixing(args) -> list[dict]:
    """Consensus distance per round of gossip alone, from 8 different replicas."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    n = jax.device_count()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    shapes = {"w0": (64, 256), "b0": (256,), "w1": (256, 10), "b1": (10,)}
    rng = np.random.default_rng(0)
    base = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    start = {  # replicas 10% apart from their mean, in different directions
        k: (v + 0.01 * rng.standard_normal((n, *v.shape))).astype(np.float32)
        for k, v in base.items()
    }
    rows = []
    rounds = args.rounds
    codecs = {"int8": jc.int_quant(8), "sign": jc.sign(), "topk10%": jc.top_k(0.1)}
    # Every topology exact and int8 (gamma 1); then coarse codecs on the ring at two gammas.
    cases = [(t, c, 1.0) for t in ("ring", "torus", "exponential") for c in (None, "int8")]
    cases += [("ring", c, g) for c in ("sign", "topk10%") for g in args.gammas]
    for topology, codec, gamma in cases:
        tx = jc.gossip(
            optax.sgd(0.0),
            AXIS,
            topology=topology,
            codec=None if codec is None else codecs[codec],
            gamma=gamma,
        )
        # Public copies start at the replicas themselves (as after training, not at init).
        state = jc.sharded_init(tx, base, mesh, AXIS)
        if codec is not None:
            own = {k: jnp.asarray(v) for k, v in start.items()}
            sh = NamedSharding(mesh, P(AXIS))
            state = state._replace(
                public=jax.device_put(own, sh), mixed=_mixed_of(own, topology, n, sh)
            )
        specs = jc.state_specs(state, AXIS)
        rspecs = jc.replica_specs(base, AXIS)

        def step(r, s, tx=tx):
            p = jc.own(r)
            g = jax.tree.map(jnp.zeros_like, p)
            u, s = tx.update(g, s, p)
            return jc.slot(optax.apply_updates(p, u)), s

        fn = jax.jit(
            jax.shard_map(step, mesh=mesh, in_specs=(rspecs, specs), out_specs=(rspecs, specs))
        )
        r = jax.device_put(start, NamedSharding(mesh, P(AXIS)))
        curve = [float(jc.consensus_distance(r))]
        for _ in range(rounds):
            r, state = jax.block_until_ready(fn(r, state))
            curve.append(float(jc.consensus_distance(r)))
        name = f"{topology}{'' if codec is None else '-' + codec}"
        name += "" if gamma == 1.0 else f" gamma={gamma:g}"
        below = lambda level, c=curve: next(  # noqa: E731
            (i for i, v in enumerate(c) if v <= level * c[0]), None
        )
        row = {
            "method": name,
            "topology": topology,
            "codec": codec,
            "gamma": gamma,
            "devices": n,
            "spectral_gap": jc.topology(topology, n).spectral_gap(),
            "curve": curve,
            "rounds_to_1e-2": below(1e-2),
            "rounds_to_1e-4": below(1e-4),
        }
        rows.append(row)
        print(
            f"mixing {name:16s} gap {row['spectral_gap']:.3f}  rounds to 1/100: "
            f"{row['rounds_to_1e-2']}, to 1/10^4: {row['rounds_to_1e-4']}  "
            f"after {rounds}: {curve[-1] / curve[0]:.2e}",
            flush=True,
        )
    return rows


def _mixed_of(public, topology, n, sharding):
    """``s_i = sum_j w_ij x_hat_j`` for stacked public copies (the mixing matrix applied)."""
    import jax
    import jax.numpy as jnp

    import jaxcomp as jc

    w = jnp.asarray(jc.topology(topology, n).matrix(), jnp.float32)
    return jax.device_put(jax.tree.map(lambda x: jnp.tensordot(w, x, axes=1), public), sharding)


# --------------------------------------------------------------------------- bytes


def part_bytes(args) -> list[dict]:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from benchmarks import char_transformer as ct

    def make_model():
        return ct.CharTransformer(context=64, d=128, layers=2, heads=4, rngs=nnx.Rngs(0))

    params = jax.jit(lambda: nnx.state(make_model()))()
    d = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    rows = []
    for n in (4, 8, 16):
        pmean = 2 * (n - 1) / n * 4 * d
        for name in ("ring", "ring-int8", "exp-int8", "torus-int8"):
            topology = {"ring": "ring", "exp": "exponential", "torus": "torus"}[name.split("-")[0]]
            codec = jc.int_quant(8) if name.endswith("int8") else None
            model = jc.gossip_bytes(params, n, topology=topology, codec=codec)
            row = {"n": n, "method": name, "params": d, "model": model, "pmean_model": pmean,
                   "ratio_to_pmean": model / pmean}  # fmt: skip
            if n <= jax.device_count() and name in ("ring-int8", "exp-int8", "ring"):
                mesh = jax.make_mesh(
                    (n,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n]
                )
                placed = jax.device_put(params, NamedSharding(mesh, P()))
                tokens = jax.device_put(
                    np.zeros((n * 2, 65), np.int32), NamedSharding(mesh, P(AXIS))
                )
                graphdef = nnx.graphdef(nnx.eval_shape(make_model))

                def loss_fn(p, t, graphdef=graphdef):
                    logits = nnx.merge(graphdef, p)(t[:, :-1])
                    return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

                step, replicas, state = make_step(loss_fn, optax.adam(1e-3), name, mesh, placed, 1)
                report = jc.comm_report(step, replicas, state, tokens)
                dp, dp_r, dp_s = make_step(loss_fn, optax.adam(1e-3), "dp", mesh, placed, 1)
                dp_report = jc.comm_report(dp, dp_r, dp_s, tokens)
                # The step's loss pmean (4 bytes) is not gossip: leave it out of both.
                scalar = sum(c.bytes_per_device for c in report.collectives if c.array_bytes == 4)
                row["comm_report"] = report.bytes_per_device - scalar / 2
                row["comm_report_pmean"] = dp_report.bytes_per_device - scalar / 2
                row["kinds"] = sorted({c.kind for c in report.collectives})
                row["largest_allreduce_bytes"] = max(
                    (c.array_bytes for c in report.collectives if c.kind == "all-reduce"),
                    default=0,
                )
            rows.append(row)
            print(
                f"bytes n={n:2d} {name:11s} model {model / 1024:8.1f} KiB  "
                f"comm_report {row.get('comm_report', float('nan')) / 1024:8.1f} KiB  "
                f"pmean {pmean / 1024:8.1f} KiB  ratio {model / pmean:.3f}",
                flush=True,
            )
    return rows


# --------------------------------------------------------------------------- network


def net_worker(args) -> None:
    """One of the processes of the shaped-link part; rank 0 writes ``args.out``."""
    from jaxcomp.launch import initialize

    initialize()
    import warnings

    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n, rank = jax.device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    sizes = (1024, args.hidden, args.hidden, 1024)
    sharded = NamedSharding(mesh, P(AXIS))
    rng = np.random.RandomState(rank)
    xb = rng.standard_normal((args.batch, sizes[0])).astype(np.float32)
    yb = rng.standard_normal((args.batch, sizes[-1])).astype(np.float32)
    bx = jax.make_array_from_callback((n * args.batch, sizes[0]), sharded, lambda idx: xb)
    by = jax.make_array_from_callback((n * args.batch, sizes[-1]), sharded, lambda idx: yb)
    rows = []
    for name in args.rows:
        t0 = time.perf_counter()
        params = jax.jit(lambda: common.mlp_params(sizes), out_shardings=NamedSharding(mesh, P()))()
        if name == "dp-int8":
            tx = optax.chain(jc.compressed_allreduce(jc.int_quant(8), AXIS), optax.sgd(1e-3))
            step, replicas, state = _dp_compressed_step(tx, mesh, params)
        else:
            step, replicas, state = make_step(common.mlp_loss, optax.sgd(1e-3), name, mesh, params)
        bytes_per_device = jc.comm_report(step, replicas, state, bx, by).bytes_per_device
        for _ in range(3):
            replicas, state, _ = jax.block_until_ready(step(replicas, state, bx, by))
        ts = []
        for _ in range(args.reps):
            t1 = time.perf_counter()
            replicas, state, _ = jax.block_until_ready(step(replicas, state, bx, by))
            ts.append(time.perf_counter() - t1)
        row = {
            "method": name,
            "devices": n,
            "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
            "bytes_per_device": bytes_per_device,
            "step_ms": 1e3 * float(np.median(ts)),
            "step_min_ms": 1e3 * float(np.min(ts)),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
        del step, replicas, state
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f)


def _dp_compressed_step(tx, mesh, params):
    """Data parallel with ``tx`` (a chain that averages the gradients itself) on replicas."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    replicas = jc.replica_params(params, mesh, AXIS)
    state = jc.sharded_init(tx, params, mesh, AXIS)
    specs = jc.state_specs(state, AXIS)
    rspecs = jc.replica_specs(params, AXIS)

    def step(r, s, x, y):
        p = jc.own(r)
        loss, g = jax.value_and_grad(common.mlp_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return jc.slot(optax.apply_updates(p, u)), s, jax.lax.pmean(loss, AXIS)

    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(rspecs, specs, P(AXIS), P(AXIS)),
            out_specs=(rspecs, specs, P()),
        ),
        donate_argnums=(0, 1),
    )
    return fn, replicas, state


def part_network(args) -> list[dict]:
    from benchmarks import network

    reason = network.skip_reason()
    if reason:
        print(f"gossip network: skipped: {reason}")
        return []
    bits = network.rate_bits(args.rate)
    ns = network.Namespace(f"jaxcomp-gossip-{os.getpid()}")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        "ip", "netns", "exec", ns.name, sys.executable, "-m", "jaxcomp.launch",
        "-n", str(args.num_processes), "--timeout", str(args.timeout),
        os.path.abspath(__file__), "--worker", "--out", out, "--reps", str(args.reps),
        "--hidden", str(args.hidden), "--batch", str(args.batch), "--rows", *args.rows,
    ]  # fmt: skip
    path = os.pathsep.join(p for p in (str(common.ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = None
    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        ns.open()
        ns.shape(args.rate)
        print(f"\n== {args.rate}: {' '.join(cmd[4:])}", flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True, cwd=common.ROOT, env=env)
        code = proc.wait(timeout=args.timeout + 60)
        if code != 0 or os.path.getsize(out) == 0:
            raise RuntimeError(f"gossip network workers failed with status {code}")
        with open(out) as f:
            rows = json.load(f)["rows"]
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ns.close()
        os.unlink(out)
        for s, h in old.items():
            signal.signal(s, h)
    base = next(r for r in rows if r["method"] == "dp")
    for r in rows:
        r["rate"] = args.rate
        r["link_ms"] = 1e3 * args.num_processes * r["bytes_per_device"] * 8 / bits
        r["step_ratio_to_dp"] = r["step_ms"] / base["step_ms"]
        r["speedup_vs_dp"] = base["step_ms"] / r["step_ms"]
        print(
            f"network {args.rate} {r['method']:10s} {r['bytes_per_device'] / 1e6:8.2f} MB/device "
            f"step {r['step_ms']:8.0f} ms  (link model {r['link_ms']:6.0f} ms)  "
            f"{r['speedup_vs_dp']:.2f}x vs dp",
            flush=True,
        )
    return rows


def _raise(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------- output


def draw(out: dict, quick: bool, label: str | None = None) -> None:
    import numpy as np

    suffix = f"_{label}" if label else ""
    runs = out.get("convergence", [])
    for task in dict.fromkeys(r["task"] for r in runs):

        def one(ax, task=task):
            for r in runs:
                if r["task"] != task:
                    continue
                c = np.asarray(r["curve"])
                w = max(1, len(c) // 50)
                ax.plot(np.convolve(c, np.ones(w) / w, mode="valid"), label=r["method"])
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss (mean over devices, moving average)")
            ax.legend()

        common.plot(
            common.result_path(f"gossip{suffix}_convergence_{task}", quick, "png"),
            one,
            f"{task}: gossip vs all-reduce data parallel, same seed and batches",
        )
    if out.get("mixing"):

        def mixing(ax):
            for r in out["mixing"]:
                c = np.asarray(r["curve"])
                ax.plot(
                    np.maximum(c / c[0], 1e-12),
                    label=f"{r['method']} (gap {r['spectral_gap']:.2f})",
                )
            ax.set_yscale("log")
            ax.set_xlabel("gossip round")
            ax.set_ylabel("consensus distance / initial")
            ax.legend()

        common.plot(
            common.result_path(f"gossip{suffix}_mixing", quick, "png"),
            mixing,
            f"gossip alone on {out['mixing'][0]['devices']} devices: how fast replicas agree",
        )


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes=(
            "gossip.json and gossip_PART.png (`--label L`: gossip_L.*; `--merge` keeps the other "
            "parts)"
        ),
        takes="about 20 minutes on the 2-core CPU host (1,169 s); the network part needs root",
    )
    ap.add_argument("--quick", action="store_true", help="digits 100 steps, mixing, bytes")
    ap.add_argument(
        "--parts",
        nargs="+",
        default=None,
        choices=("convergence", "mixing", "bytes", "network"),
        help="default: all (--quick: convergence, mixing, bytes)",
    )
    ap.add_argument(
        "--tasks", nargs="+", choices=list(STEPS), default=None, help="tasks (None: all)"
    )
    ap.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="methods"
    )
    ap.add_argument("--steps", type=int, default=None, help="default per task: " + str(STEPS))
    ap.add_argument("--char-lr", type=float, default=3e-3, help="char task: Adam's peak lr")
    ap.add_argument("--cd-every", type=int, default=50, help="consensus distance every k steps")
    ap.add_argument("--rounds", type=int, default=200, help="gossip rounds of the mixing part")
    ap.add_argument(
        "--gammas", nargs="+", type=float, default=[1.0, 0.2], help="mixing part: coarse codecs"
    )
    ap.add_argument("--devices", type=int, default=8, help="CPU devices when no accelerator")
    ap.add_argument("--rate", default="1gbit", help="shaped link rate (network part)")
    ap.add_argument("-n", "--num-processes", type=int, default=4, help="network part")
    ap.add_argument("--hidden", type=int, default=2048, help="MLP hidden width (network part)")
    ap.add_argument("--batch", type=int, default=8, help="MLP batch per process (network part)")
    ap.add_argument("--reps", type=int, default=5, help="timed steps (network part)")
    ap.add_argument("--rows", nargs="+", default=NET_ROWS, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds, network part")
    ap.add_argument("--label", default=None, help="write gossip_LABEL.json")
    ap.add_argument("--merge", action="store_true", help="keep the output file's other parts")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        net_worker(args)
        return 0
    from jaxcomp.cpu import use_cpu_devices

    use_cpu_devices(args.devices)
    parts = args.parts or (
        ["convergence", "mixing", "bytes"]
        if args.quick
        else ["convergence", "mixing", "bytes", "network"]
    )
    path = common.result_path("gossip" + (f"_{args.label}" if args.label else ""), args.quick)
    out: dict[str, Any] = {}
    if args.merge and path.exists():
        out = json.loads(path.read_text())
    functions = {
        "convergence": part_convergence,
        "mixing": part_mixing,
        "bytes": part_bytes,
        "network": part_network,
    }
    for part in parts:
        out[part] = functions[part](args)
        out["environment"] = common.environment()
        common.write_json(path, out)
    draw(out, args.quick, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
