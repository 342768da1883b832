"""Compressed vs plain all-reduce over a real, rate-limited network: N JAX processes, gloo.

The benchmark makes its own network namespace ``jaxcomp-bench-<pid>``, brings its loopback
up and shapes it with a token bucket::

    ip netns add jaxcomp-bench-<pid>
    ip netns exec jaxcomp-bench-<pid> ip link set lo up
    ip netns exec jaxcomp-bench-<pid> \
        tc qdisc add dev lo root tbf rate 1gbit burst 256kb latency 10ms

then starts ``-n`` JAX processes in it with ``python -m jaxcomp.launch`` (gloo CPU
collectives, one CPU device each). All their traffic — the collectives and the coordinator —
stays on that loopback. The namespace is deleted on exit, also on an error, Ctrl-C or
SIGTERM; every loop is bounded (the launcher has a timeout, repetitions are fixed). Needs
root and iproute2; otherwise it says so and exits 0 (skipped).

Per codec, in the same run as plain ``jax.lax.pmean`` (``pmean`` rows):

* ``allreduce``: one ``jc.pmean(g, "data", codec)`` (strategy ``auto``) of a ``--size``
  (25M) float32 gradient, median of ``--reps`` blocked calls;
* ``step``: one training step of an MLP of about that size (1024-4096-4096-1024, 25.2M
  params, batch 8 per process, MSE) with ``jc.compressed_allreduce(codec)`` (error feedback
  on) + SGD, against the same step with ``pmean``; ``powersgd4`` is
  ``jc.powersgd(4, "data", start_step=0)`` + SGD (a step row only, no all-reduce row; no
  warm-up branch compiled, so its bytes are the compressed exchange's). Steps
  are jitted with params and optimizer state donated, each step feeding the next; median of
  ``--reps`` after 3 warm-up steps;
* ``autotune``: the exchange ``jc.autotune`` picks for the MLP on this link, ranking whole
  steps of its loss, batch and SGD (``loss_fn=``; plain ``pmean`` and ``AUTOTUNE_CHECK``
  candidates timed), its table in the row (``autotune``: predicted and measured steps), then
  the step with that exchange like the other rows;
* ``codec_ms``: encode + decode of the gradient on one device with no network (where the
  time goes when compression does not pay);
* ``link_ms``: the link limit: every process's bytes cross the one shaped loopback queue, so
  ``n * bytes_per_device * 8 / rate`` (bytes per device from the lowered program, ring
  model); ``efficiency = link_ms / allreduce_ms``.

The peer, in the same processes on the same link right after (rows ``torch-*``, skipped
with a message when torch is not importable; install its CPU build with
``pip install torch==2.13.0``): torch ``DistributedDataParallel`` over gloo on the same
MLP, batch and SGD, with its plain all-reduce (``torch-allreduce``), ``fp16_compress_hook``
(``torch-fp16``) and the PowerSGD hook at rank 4 (``torch-powersgd4``,
``start_powerSGD_iter=2``). DDP gets one bucket (``bucket_cap_mb`` above the model's size:
over gloo the PowerSGD hook aborts with several). ``--torch-threads`` (default: cores over
processes) sets ``torch.set_num_threads``. Every step speedup is against the same
framework's plain step in the same run (``step_speedup``); ``vs_torch`` is the torch peer's
step time over jaxcomp's (``pmean``/``fp16``/``powersgd4`` against ``torch-allreduce``/
``torch-fp16``/``torch-powersgd4``; above 1: jaxcomp faster).

Writes ``benchmarks/results/network.json`` and ``network.png``::

    sudo python -m benchmarks.network                        # 1gbit, 100mbit, 10gbit
    sudo python -m benchmarks.network --quick                # 1gbit, 4M floats, pmean + sign
    sudo python -m benchmarks.network --rates 1gbit --codecs sign int8 topk1% -n 2
    sudo python -m benchmarks.network --rates 1gbit --label before   # network_before.json
    sudo python -m benchmarks.network --rates 10gbit --label before --merge   # adds 10gbit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from benchmarks import common

AXIS = "data"
CODECS = ["sign", "int8", "fp16", "topk1%", "powersgd4"]
RATES = ["1gbit", "100mbit", "10gbit"]
MLP = common.MLP
TBF = ("burst", "256kb", "latency", "10ms")
LR = 1e-3
WARMUP_STEPS = 3  # the first compiles; torch's PowerSGD hook compresses from step 2 on
POWERSGD_START = 2  # torch's minimum start_powerSGD_iter with error feedback / warm start
TORCH_ROWS = ["torch-allreduce", "torch-fp16", "torch-powersgd4"]
TORCH_PEER = {"pmean": "torch-allreduce", "fp16": "torch-fp16", "powersgd4": "torch-powersgd4"}
TORCH_INSTALL = (
    "install torch's CPU build to add them: pip install torch==2.13.0 "
    "(from PyPI proper: add --index-url https://download.pytorch.org/whl/cpu)"
)
#: Candidates jc.autotune times as whole steps besides plain pmean: the best of each default
#: codec (bf16, fp16, int8), then three more codec-strategy pairs by predicted step.
AUTOTUNE_CHECK = 6
BUCKET_MB = 1024  # one DDP bucket: larger than the 101 MB of the MLP's gradients


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (tc's units: kbit, mbit, gbit are powers of 1000)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"`rate` must look like 1gbit, 100mbit or 500kbit, got {rate!r}")


def powersgd_rank(name: str) -> int | None:
    """``"powersgd4"`` -> 4; ``None`` for a codec name."""
    if not name.startswith("powersgd"):
        return None
    return int(name[len("powersgd") :] or 4)


def torch_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


# --------------------------------------------------------------------------- worker side


def worker(args) -> None:
    """One of the N processes: time each codec, then the torch peer; rank 0 writes ``args.out``."""
    from jaxcomp.launch import initialize

    initialize()
    import warnings

    import jax
    import numpy as np
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from jaxcomp._src import accounting

    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n, rank = jax.device_count(), jax.process_index()
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Explicit,))
    sharded, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    d = args.size
    rng = np.random.RandomState(rank)
    local = rng.standard_normal((1, d)).astype(np.float32)
    grads = jax.make_array_from_callback((n, d), sharded, lambda idx: local)
    key = jax.random.PRNGKey(0)

    def timed(fn, *a, reps=args.reps):
        jax.block_until_ready(fn(*a))  # compile + warm-up
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts)), 1e3 * float(np.min(ts))

    def logical_bytes(fn, *a):
        text = fn.lower(*a).as_text()
        return sum(c.bytes_per_device for c in accounting.parse_stablehlo_collectives(text, n))

    # ---- the model (benchmarks/common.py): params replicated, batch sharded
    def fresh_params():  # a new copy per row: every step donates its params
        return jax.jit(common.mlp_params, out_shardings=replicated)()

    # The count from the shapes: no 25M random values made (and compiled) when no step runs.
    n_params = sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(jax.eval_shape(common.mlp_params))
    )
    xb = rng.standard_normal((args.batch, MLP[0])).astype(np.float32)
    yb = rng.standard_normal((args.batch, MLP[-1])).astype(np.float32)
    bx = jax.make_array_from_callback((n * args.batch, MLP[0]), sharded, lambda idx: xb)
    by = jax.make_array_from_callback((n * args.batch, MLP[-1]), sharded, lambda idx: yb)

    def donated_step(exchange, params):
        """``(step, state)``: jit(shard_map) of one SGD step, params and state donated.

        ``exchange=None``: plain ``jax.lax.pmean`` of the gradient; else the jaxcomp
        transform chained in front of ``optax.sgd``."""
        opt = optax.sgd(LR)
        tx = opt if exchange is None else optax.chain(exchange, opt)
        state = jc.sharded_init(tx, params, mesh, AXIS)
        specs = jc.state_specs(state, AXIS)

        def step(p, s, x, y):
            g = jax.grad(common.mlp_loss)(jax.lax.pcast(p, AXIS, to="varying"), x, y)
            if exchange is None:
                g = jax.lax.pmean(g, AXIS)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        fn = jax.shard_map(
            step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
        )
        return jax.jit(fn, donate_argnums=(0, 1)), state

    def time_steps(step, params, state, reps=args.reps):
        first = jax.tree.leaves(params)[0]
        for _ in range(WARMUP_STEPS):
            params, state = jax.block_until_ready(step(params, state, bx, by))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            params, state = jax.block_until_ready(step(params, state, bx, by))
            ts.append(time.perf_counter() - t0)
        return 1e3 * float(np.median(ts)), 1e3 * float(np.min(ts)), first.is_deleted()

    def autotuned(params, mesh, row):
        """Run jc.autotune on the MLP's tree; record its table; the chosen exchange."""
        plan = jc.autotune(  # ranks whole steps: this MLP's loss, batch and optimizer
            params, mesh, AXIS, budget_s=args.timeout / 4, check=AUTOTUNE_CHECK,
            loss_fn=common.mlp_loss, batch=(bx, by), optimizer=optax.sgd(LR),
        )  # fmt: skip
        row["autotune"] = [
            {k: v for k, v in r._asdict().items() if k != "codec"} for r in plan.table
        ]
        chosen = (
            plan.table[0]
            if plan.codec is not None
            else next(r for r in plan.table if r.codec is None)
        )
        row["link"] = {k: fit._asdict() for k, fit in plan.link.items()}
        row["codec_ms"] = plan.codec_ms
        row["feedback_ms"] = plan.feedback_ms
        row["chosen"] = chosen.name if plan.codec is not None else "pmean"
        row["error_feedback"] = plan.error_feedback
        row["predicted_ms"], row["autotune_measured_ms"] = chosen.predicted_ms, chosen.measured_ms
        row["autotune_step_ms"], row["autotune_step_spread_ms"] = (
            chosen.step_ms,
            chosen.step_spread_ms,
        )
        if plan.codec is None:
            return {"codec": None}, "auto"
        return {
            "codec": plan.codec,
            "bucket_bytes": plan.bucket_bytes,
            "min_size": plan.min_size,
            "error_feedback": plan.error_feedback,
        }, plan.strategy

    rows = []
    for name in ["pmean", *args.codecs]:
        t_start = time.perf_counter()
        rank_r = powersgd_rank(name)
        # "fp16@two_phase": a codec and a strategy; "fp16:none": error feedback off.
        spec, _, feedback = name.partition(":")
        base, _, strategy = spec.partition("@")
        strategy, feedback = strategy or "auto", None if feedback == "none" else "auto"
        row = {"framework": "jaxcomp", "codec": name, "size": d, "devices": n}
        tuned = {}
        if name == "autotune":  # the plan jc.autotune picks for the MLP on this link
            tuned, strategy = autotuned(fresh_params(), mesh, row)
            codec = tuned.pop("codec")
            feedback = tuned.pop("error_feedback", None)  # the one the plan was timed with
        else:
            codec = None if name == "pmean" or rank_r else common.make_codec(base)
        if rank_r is None:
            if codec is None:
                body = lambda g: jax.lax.pmean(g[0], AXIS)  # noqa: E731
            else:
                body = lambda g, c=codec, s=strategy: jc.pmean(  # noqa: E731
                    g[0], AXIS, c, key=key, strategy=s
                )
            allreduce = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P()))
            row["bytes_per_device"] = logical_bytes(allreduce, grads)
            row["strategy"] = "-" if codec is None else jc.choose_strategy(codec, d, n, strategy)
            row["allreduce_ms"], row["allreduce_min_ms"] = timed(allreduce, grads)
        if codec is not None and rank_r is None:  # as the step runs it (resolved "auto")
            row["error_feedback"] = feedback_kind(feedback, codec)
        if codec is not None:
            one = jax.local_devices()[0]
            x1 = jax.device_put(local[0], one)
            enc = jax.jit(lambda v, c=codec: c.encode(v, key))
            dec = jax.jit(lambda pl, c=codec: c.decode(pl, d))
            payload = jax.block_until_ready(enc(x1))
            row["encode_ms"] = timed(enc, x1)[0]
            row["decode_ms"] = timed(dec, payload)[0]
        if not args.no_step:
            if rank_r:
                exchange = jc.powersgd(rank_r, AXIS, start_step=0)
            elif codec is not None:
                exchange = jc.compressed_allreduce(
                    codec, AXIS, strategy=strategy, error_feedback=feedback, **tuned
                )
            else:
                exchange = None
            params = fresh_params()
            step, state = donated_step(exchange, params)
            row["step_bytes_per_device"] = logical_bytes(step, params, state, bx, by)
            row["step_ms"], row["step_min_ms"], row["donated"] = time_steps(step, params, state)
            del step, state, params
        row["seconds"] = round(time.perf_counter() - t_start, 1)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    torch_note = None
    if not args.no_step and not args.no_torch:
        if torch_available():
            rows += torch_worker(args, n, rank, xb, yb)
        else:
            torch_note = f"torch not importable: torch rows skipped; {TORCH_INSTALL}"
            if rank == 0:
                print(torch_note, flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"params": n_params, "rows": rows, "torch_note": torch_note}, f)


def torch_ring_bytes(n: int, name: str, rank: int = 4, sizes: tuple[int, ...] = MLP) -> float:
    """Bytes per device of one DDP step's exchange in the ring model (the torch rows; jaxcomp's
    come from the lowered program) for the MLP of layer ``sizes``. PowerSGD hook: each weight
    (out x in) sends P (out x r) and Q (in x r) in f32, biases go uncompressed (as the hook
    does for 1-D tensors)."""
    shapes = [(b, a) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
    floats = sum(o * i + o for o, i in shapes)
    ring = 2 * (n - 1) / n
    if name == "torch-allreduce":
        return ring * 4 * floats
    if name == "torch-fp16":
        return ring * 2 * floats
    low = sum((o + i) * rank if o * i >= 2 * (o + i) * rank else o * i for o, i in shapes)
    return ring * 4 * (low + sum(o for o, _ in shapes))


def torch_worker(args, n: int, rank: int, xb, yb) -> list[dict]:
    """The peer: torch DDP over gloo, same processes and link, one bucket, SGD."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The peer runs on the CPU. A CUDA build of torch on a GPU host otherwise has its PowerSGD
    # hook synchronize the GPU with the CPU tensors' device, which raises (torch 2.11+cu130).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // n)
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", store=dist.FileStore(args.torch_store, n), rank=rank, world_size=n
    )
    x, y = torch.from_numpy(xb), torch.from_numpy(yb)
    rows = []
    try:
        for name in TORCH_ROWS:
            t_start = time.perf_counter()
            torch.manual_seed(42)
            layers: list = []
            for i, (a, b) in enumerate(zip(MLP[:-1], MLP[1:], strict=True)):
                layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(MLP) - 2 else [])
            model = DDP(nn.Sequential(*layers), bucket_cap_mb=BUCKET_MB)
            if name == "torch-fp16":
                model.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
            elif name == "torch-powersgd4":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=4,
                    start_powerSGD_iter=POWERSGD_START,
                )
                model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            opt = torch.optim.SGD(model.parameters(), lr=LR)

            def step(model=model, opt=opt):
                opt.zero_grad()
                loss = torch.mean((model(x) - y) ** 2)
                loss.backward()
                opt.step()

            for _ in range(WARMUP_STEPS):
                step()
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            logging = model._get_ddp_logging_data()
            row = {
                "framework": "torch",
                "codec": name,
                "devices": n,
                "torch": torch.__version__,
                "torch_threads": threads,
                "ddp_buckets": int(logging.get("num_buckets_reduced", -1)),
                "step_bytes_per_device": torch_ring_bytes(n, name),
                "step_ms": 1e3 * float(np.median(ts)),
                "step_min_ms": 1e3 * float(np.min(ts)),
                "seconds": round(time.perf_counter() - t_start, 1),
            }
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            del model, opt
    finally:
        dist.destroy_process_group()
    return rows


# --------------------------------------------------------------------------- driver side


class Namespace:
    """A network namespace with a shaped loopback; deleted by :meth:`close` (idempotent)."""

    def __init__(self, name: str):
        self.name, self.alive = name, False

    def run(self, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.name, *cmd], check=True, timeout=30)

    def open(self) -> Namespace:
        subprocess.run(["ip", "netns", "add", self.name], check=True, timeout=30)
        self.alive = True
        self.run("ip", "link", "set", "lo", "up")
        return self

    def shape(self, rate: str) -> None:
        self.run("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", rate, *TBF)

    def kill_all(self) -> None:
        """SIGKILL every process in the namespace: the launcher's workers run in sessions of
        their own, so killing the launcher's process group would leave them running."""
        found = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30
        )
        for pid in found.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.kill_all()
            subprocess.run(["ip", "netns", "del", self.name], timeout=30, check=False)


def skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"needs iproute2: {', '.join(missing)} not found"
    return None


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``; [] elsewhere): the launcher's
    workers run in sessions of their own, out of reach of its process group."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def launch(
    ns: Namespace | None,
    rate: str,
    script: str,
    argv: list[str],
    n: int,
    timeout: float,
    procs: list,
) -> int:
    """Run ``n`` copies of ``script argv...`` with ``python -m jaxcomp.launch`` in the
    namespace (None: the host's own, unshaped loopback; bounded by ``timeout`` + 60 s);
    return the launcher's exit status. The process is listed in ``procs`` while it runs (for
    a signal handler to kill); every process left in the namespace is killed on the way out."""
    prefix = ["ip", "netns", "exec", ns.name] if ns is not None else []
    cmd = [
        *prefix, sys.executable, "-m", "jaxcomp.launch",
        "-n", str(n), "--timeout", str(timeout), os.path.abspath(script), *argv,
    ]  # fmt: skip
    print(f"\n== {rate}: {' '.join(cmd[len(prefix) :])}", flush=True)
    # The launcher runs the script by path: the repository root goes on PYTHONPATH so that
    # ``from benchmarks import common`` resolves in the workers too.
    path = os.pathsep.join(p for p in (str(common.ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=common.ROOT, env=env)
    procs.append(proc)
    try:
        return proc.wait(timeout=timeout + 60)
    finally:
        if proc.poll() is None:
            if ns is None:  # no namespace to empty: the launcher's workers, by parent
                for pid in children(proc.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # reaped since it was listed
                        pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if ns is not None:
            ns.kill_all()  # workers left behind by a killed launcher
        procs.remove(proc)


def run_rate(ns: Namespace, rate: str, args, procs: list) -> dict:
    """Shape the loopback at ``rate`` and run the N workers in the namespace once."""
    ns.shape(rate)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    store_dir = tempfile.mkdtemp(prefix="jaxcomp-torch-store-")  # torch's rendezvous file
    argv = [
        "--worker", "--out", out, "--size", str(args.size),
        "--reps", str(args.reps_for(rate)), "--batch", str(args.batch),
        "--torch-store", os.path.join(store_dir, "store"),
        "--torch-threads", str(args.torch_threads),
        "--codecs", *args.codecs, *(["--no-step"] if args.no_step else []),
        *(["--no-torch"] if args.no_torch else []),
    ]  # fmt: skip
    try:
        code = launch(ns, rate, __file__, argv, args.num_processes, args.timeout, procs)
        if code != 0 or os.path.getsize(out) == 0:
            raise RuntimeError(f"workers at {rate} failed with status {code}")
        with open(out) as f:
            return json.load(f)
    finally:
        os.unlink(out)
        shutil.rmtree(store_dir, ignore_errors=True)


def summarize(rate: str, data: dict, n: int) -> list[dict]:
    """Ratios within the run: each row against its own framework's plain step."""
    bits = rate_bits(rate)
    rows = data["rows"]
    base = next(r for r in rows if r["codec"] == "pmean")
    torch_base = next((r for r in rows if r["codec"] == "torch-allreduce"), None)
    by_name = {r["codec"]: r for r in rows}
    for r in rows:
        r["rate"], r["mlp_params"] = rate, data["params"]
        if "allreduce_ms" in r:
            r["link_ms"] = 1e3 * n * r["bytes_per_device"] * 8 / bits
            r["efficiency"] = r["link_ms"] / r["allreduce_ms"]
            r["allreduce_speedup"] = base["allreduce_ms"] / r["allreduce_ms"]
            r["bytes_saving"] = base["bytes_per_device"] / r["bytes_per_device"]
        if "step_ms" in r:
            own = torch_base if r.get("framework") == "torch" else base
            if own is not None and "step_ms" in own:
                r["step_speedup"] = own["step_ms"] / r["step_ms"]
            r["step_link_ms"] = 1e3 * n * r["step_bytes_per_device"] * 8 / bits
        peer = by_name.get(TORCH_PEER.get(r["codec"], ""))
        if peer is not None and "step_ms" in r:
            r["vs_torch"] = peer["step_ms"] / r["step_ms"]
    predict_steps(rows, base)
    return rows


def feedback_kind(feedback: str | None, codec) -> str | None:
    """The error feedback ``jc.compressed_allreduce`` runs for ``error_feedback=feedback``."""
    from jaxcomp._src import feedback as fb

    return None if feedback is None else fb.resolve(feedback, codec)


def predict_steps(rows: list[dict], base: dict) -> None:
    """Each jaxcomp step row's predicted step from the ``autotune`` row's table, in place.

    Where the plan timed whole steps (its rows carry ``predicted_step_ms``): the table row of
    the same codec, strategy and error feedback (the plan's own row for ``autotune``, the plain
    row for ``pmean``), whose prediction is the fitted compute plus its predicted exchange,
    leave-one-out for the timed rows. Otherwise (older plans, exchanges timed alone): the plain
    step's compute (its step less the plan's measured plain exchange) plus the candidate's
    predicted exchange. ``step_prediction_error`` = predicted / measured - 1."""
    tuned = next((r for r in rows if "autotune" in r), None)
    if tuned is None or "step_ms" not in base:
        return
    table = tuned["autotune"]
    if any(c.get("predicted_step_ms", math.nan) == c.get("predicted_step_ms") for c in table):
        return _predict_from_steps(rows, table, tuned)
    plain = next(
        (c for c in table if c["name"] == "none" and c["measured_ms"] == c["measured_ms"]), None
    )
    if plain is None:
        return
    compute = base["step_ms"] - plain["measured_ms"]
    for r in rows:
        if r.get("framework") != "jaxcomp" or r["codec"] == "pmean" or "step_ms" not in r:
            continue
        name = r["codec"].partition(":")[0].partition("@")[0]
        match = [
            c for c in table
            if c["name"] == name and c["strategy"] == r.get("strategy")
            and c.get("error_feedback") == r.get("error_feedback") and not c.get("error")
        ]  # fmt: skip
        chosen = table[0] if r is tuned else min(match, key=lambda c: c["min_size"], default=None)
        if chosen is None or chosen["predicted_ms"] != chosen["predicted_ms"]:
            continue
        r["predicted_step_ms"] = compute + chosen["predicted_ms"]
        r["step_prediction_error"] = r["predicted_step_ms"] / r["step_ms"] - 1.0


def _matching(table: list[dict], r: dict) -> dict | None:
    """The table row of ``r``'s codec, strategy and error feedback (the least min_size)."""
    name = r["codec"].partition(":")[0].partition("@")[0]
    if name == "pmean":
        return next((c for c in table if c["name"] == "none"), None)
    match = [
        c for c in table
        if c["name"] == name and c["strategy"] == r.get("strategy")
        and c.get("error_feedback") == r.get("error_feedback") and not c.get("error")
    ]  # fmt: skip
    return min(match, key=lambda c: c["min_size"], default=None)


def _predict_from_steps(rows: list[dict], table: list[dict], tuned: dict) -> None:
    for r in rows:
        if r.get("framework") != "jaxcomp" or "step_ms" not in r:
            continue
        chosen = table[0] if r is tuned else _matching(table, r)
        if chosen is None or chosen.get("predicted_step_ms", math.nan) != chosen.get(
            "predicted_step_ms"
        ):
            continue
        r["predicted_step_ms"] = chosen["predicted_step_ms"]
        r["step_prediction_error"] = r["predicted_step_ms"] / r["step_ms"] - 1.0
        r["plan_step_ms"] = chosen.get("step_ms", math.nan)  # the plan's own timing, if any


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'rate':>8s} {'codec':16s}{'MB/dev':>8s}{'allreduce':>11s}{'speedup':>9s}"
        f"{'link ms':>9s}{'effic.':>8s}{'codec ms':>10s}{'step ms':>9s}{'speedup':>9s}"
        f"{'vs torch':>9s}"
    )
    for r in rows:
        mb = r.get("bytes_per_device", r.get("step_bytes_per_device", 0)) / 1e6
        line = f"{r['rate']:>8s} {r['codec']:16s}{mb:>8.2f}"
        if "allreduce_ms" in r:
            codec_ms = r.get("encode_ms", 0) + r.get("decode_ms", 0)
            line += (
                f"{r['allreduce_ms']:>9.0f}ms{r['allreduce_speedup']:>8.1f}x{r['link_ms']:>9.0f}"
                f"{r['efficiency']:>8.2f}{codec_ms:>10.0f}"
            )
        else:
            line += " " * 45
        if "step_ms" in r:
            line += f"{r['step_ms']:>9.0f}{r.get('step_speedup', float('nan')):>8.2f}x"
        if "vs_torch" in r:
            line += f"{r['vs_torch']:>8.2f}x"
        print(line)


def draw(rows: list[dict], path) -> None:
    import numpy as np

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    steps = any("step_speedup" in r for r in rows)
    metric = "step_speedup" if steps else "allreduce_speedup"
    names = list(dict.fromkeys(r["codec"] for r in rows if metric in r))

    def one(ax):
        width = 0.8 / len(rates)
        for i, rate in enumerate(rates):
            vals = [
                next((r[metric] for r in rows if r["rate"] == rate and r["codec"] == c), 0)
                for c in names
            ]
            ax.bar(np.arange(len(names)) + i * width, vals, width, label=rate)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel(
            "training-step speedup over own plain step (same run)"
            if steps
            else "all-reduce speedup over pmean (same run)"
        )
        ax.legend()

    n = rows[0]["devices"]
    what = (
        f"MLP {rows[0]['mlp_params'] / 1e6:.1f}M params"
        if steps
        else (f"{rows[0]['size'] / 1e6:.0f}M floats")
    )
    common.plot(path, one, f"{n} processes over gloo, shaped loopback, {what}")


def main(argv=None) -> int:
    ap = common.arg_parser(
        __doc__,
        writes="network.json and .png (`--label L`: network_L.*; `--quick`: *_quick)",
        takes="2-11 minutes (98-641 s; needs root and iproute2 for the shaped link)",
    )
    ap.add_argument("--quick", action="store_true", help="1gbit, 4M floats, pmean + sign")
    ap.add_argument(
        "--rates", nargs="+", default=None, help="tc rates (None: 1gbit 100mbit 10gbit)"
    )
    ap.add_argument(
        "--codecs",
        nargs="+",
        default=None,
        help=(
            f"default {' '.join(CODECS)} (powersgdR: rank R; NAME@STRATEGY, e.g. fp16@two_phase)"
        ).replace("%", "%%"),
    )
    ap.add_argument("-n", "--num-processes", type=int, default=2, help="JAX processes")
    ap.add_argument("--size", type=int, default=None, help="gradient floats (default 25M)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (default 5; 2 at <1gbit)")
    ap.add_argument("--batch", type=int, default=8, help="MLP batch per process")
    ap.add_argument("--no-step", action="store_true", help="only the all-reduce, no MLP step")
    ap.add_argument("--no-torch", action="store_true", help="no torch DDP peer rows")
    ap.add_argument(
        "--torch-threads", type=int, default=0, help="torch.set_num_threads (0: cores / procs)"
    )
    ap.add_argument("--label", default=None, help="write network_LABEL.json (e.g. before)")
    ap.add_argument(
        "--merge", action="store_true", help="keep the output file's rows of other rates"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rate, bounded")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--torch-store", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.codecs = args.codecs or (["sign"] if args.quick else CODECS)
    for name in args.codecs:
        if name.startswith("powersgd"):
            powersgd_rank(name)  # a ValueError here, not in the workers
    args.size = args.size or ((1 << 22) if args.quick else 25_000_000)
    args.no_step = args.no_step or args.quick
    rates = args.rates or (["1gbit"] if args.quick else RATES)
    for r in rates:
        rate_bits(r)
    args.reps_for = lambda r: args.reps or (5 if rate_bits(r) >= 1e9 else 2)
    reason = skip_reason()
    if reason:
        print(f"network.py: skipped: {reason}")
        return 0
    if not args.no_step and not args.no_torch and not torch_available():
        print(f"network.py: torch not importable: torch DDP rows skipped; {TORCH_INSTALL}")
        args.no_torch = True

    ns, procs = Namespace(f"jaxcomp-bench-{os.getpid()}"), []

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    start, load_before = time.perf_counter(), os.getloadavg()
    rows = []
    try:
        try:
            ns.open()
        except subprocess.CalledProcessError as e:
            print(f"network.py: skipped: cannot create a network namespace ({e})")
            return 0
        for rate in rates:
            measured = summarize(rate, run_rate(ns, rate, args, procs), args.num_processes)
            for r in measured:  # other work on the host skews timings: the 1-minute load
                r["host_load"] = round(os.getloadavg()[0], 2)
            rows += measured
    finally:
        for p in list(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        ns.close()
        for s, h in old.items():
            signal.signal(s, h)
    print_table(rows)
    out = {
        "environment": common.environment(),
        "num_processes": args.num_processes,
        "namespace": ns.name,  # deleted on exit (other runs on the host have their own)
        "tbf": " ".join(TBF),
        "warmup_steps": WARMUP_STEPS,
        # other work on the host skews timings: the 1-minute load before and after
        "loadavg": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "torch_rows": not args.no_torch and not args.no_step,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
    }
    name = "network" + (f"_{args.label}" if args.label else "")
    path = common.result_path(name, args.quick)
    if args.merge and path.exists():  # keep the rows of rates not measured this time
        kept = [r for r in json.loads(path.read_text())["rows"] if r["rate"] not in rates]
        out["rows"] = rows = kept + rows
        out["merged"] = sorted({r["rate"] for r in kept})
    common.write_json(path, out)
    draw(rows, common.result_path(name, args.quick, "png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
