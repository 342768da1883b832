"""Start N local JAX processes over gloo, for testing multi-host code on one machine.

On a cluster or a TPU pod, ``jax.distributed.initialize()`` finds the coordinator itself
(SLURM, Open MPI, Cloud TPU, ...). On one machine there is nothing to detect, so this
launcher plays the cluster: it picks a free port, starts ``-n`` copies of a script with
``JAXCOMP_COORDINATOR``, ``JAXCOMP_NUM_PROCESSES`` and ``JAXCOMP_PROCESS_ID`` set, and the
script calls :func:`initialize`, which reads them (and falls back to auto-detection when
they are absent, so the same script runs on a pod unchanged)::

    python -m jaxcomp.launch -n 4 examples/multihost.py --steps 50

Every line a process prints is prefixed with ``[rank]``. All loops are bounded: the
launcher waits at most ``--timeout`` seconds, and when one process fails the others get
``--grace`` seconds to notice before they are killed, so a crash never becomes a hang.
The launcher names the first rank that failed and how (``[launch] rank 2 exited with status
1`` or ``... was killed by signal 9 (SIGKILL)``) and exits with that rank's status in the
shell's convention: the status itself, or ``128 + signal`` for a rank a signal killed (124
when the whole run timed out); 0 when all succeed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jaxcomp._src.cli import bounded

ENV_COORDINATOR = "JAXCOMP_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOMP_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOMP_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXCOMP_LOCAL_DEVICES"


def initialize(
    *,
    local_devices: int | None = None,
    heartbeat_timeout_seconds: int = 10,
    initialization_timeout: int = 60,
) -> None:
    """``jax.distributed.initialize`` for both worlds: the launcher's env, or a real cluster.

    Under :mod:`jaxcomp.launch` this selects gloo CPU collectives, gives each process
    ``local_devices`` CPU devices (default: ``$JAXCOMP_LOCAL_DEVICES`` or 1) and joins the
    local coordinator with short heartbeat timeouts, so a dead peer is noticed within
    about ``heartbeat_timeout_seconds``. Without the launcher's env it calls
    ``jax.distributed.initialize()`` with no arguments (cluster auto-detection). Call it
    before any other jax work.
    """
    import jax

    address = os.environ.get(ENV_COORDINATOR)
    if address is None:
        jax.distributed.initialize()
        return
    n_local = local_devices or int(os.environ.get(ENV_LOCAL_DEVICES, "1"))
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", n_local)
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=heartbeat_timeout_seconds,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, rank: int, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[{rank}] {line}")
        out.flush()
    stream.close()


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def exit_status(returncode: int) -> int:
    """A child's ``returncode`` in the shell's convention: ``-sig`` (killed) -> ``128 + sig``.

    ``subprocess`` reports a child killed by signal ``s`` as ``-s``; ``sys.exit(-9)`` would
    exit 247 (the low byte), which reads as no signal at all. The shell says ``128 + s``.
    """
    return 128 - returncode if returncode < 0 else returncode


def describe_status(rank: int, returncode: int) -> str:
    """``rank 2 exited with status 1`` or ``rank 2 was killed by signal 9 (SIGKILL)``."""
    if returncode >= 0:
        return f"rank {rank} exited with status {returncode}"
    try:
        name = f" ({signal.Signals(-returncode).name})"
    except ValueError:
        name = ""
    return f"rank {rank} was killed by signal {-returncode}{name}"


def _first_failure(procs: Sequence[subprocess.Popen]) -> tuple[int, int] | None:
    """``(rank, returncode)`` of the lowest rank that has ended with a non-zero status."""
    for rank, p in enumerate(procs):
        if p.returncode not in (None, 0):
            return rank, p.returncode
    return None


def run(
    argv: Sequence[str],
    num_processes: int,
    *,
    local_devices: int = 1,
    timeout: float = 600.0,
    grace: float = 30.0,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    out=None,
) -> int:
    """Run ``python argv...`` as ``num_processes`` processes; return the first failing status.

    The first rank seen failing is named on ``out`` (``[launch] rank r exited with status s``
    or ``... was killed by signal s (SIGNAME)``); its status is returned in the shell's
    convention (:func:`exit_status`: ``128 + signal`` for a killed rank), 124 when ``timeout``
    ran out with every rank still alive, 0 when all succeed.

    Example::

        status = run(["examples/multihost.py", "--steps", "5"], 2)  # 0 when both ranks succeed

    Raises:
      ValueError: ``num_processes`` < 1, ``local_devices`` < 1, or a non-positive timeout.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if local_devices < 1:
        raise ValueError(f"local_devices must be >= 1, got {local_devices}")
    if timeout <= 0 or grace < 0:
        raise ValueError(f"timeout must be > 0 and grace >= 0, got {timeout}, {grace}")
    out = out or sys.stdout
    base = dict(os.environ if env is None else env)
    base.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{free_port()}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_LOCAL_DEVICES: str(local_devices),
            "PYTHONUNBUFFERED": "1",
        }
    )
    procs, pumps = [], []
    for rank in range(num_processes):
        p = subprocess.Popen(
            [python, *argv],
            env={**base, ENV_PROCESS_ID: str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append(p)
        t = threading.Thread(target=_pump, args=(p.stdout, rank, out), daemon=True)
        t.start()
        pumps.append(t)
    status, deadline, failed_at = 0, time.monotonic() + timeout, None
    try:
        # poll() every process (a generator inside any() would stop at the first live one,
        # and a failed process behind it would never be noticed)
        while any([p.poll() is None for p in procs]):
            now = time.monotonic()
            first = _first_failure(procs)
            if first is not None and failed_at is None:
                out.write(f"[launch] {describe_status(*first)}\n")
                status, failed_at = exit_status(first[1]), now
            if now > deadline or (failed_at is not None and now - failed_at > grace):
                out.write(
                    f"[launch] killing the remaining processes "
                    f"({'timeout' if now > deadline else 'a peer failed'})\n"
                )
                _kill(procs)
                status = status or 124
                break
            time.sleep(0.1)
    finally:
        _kill(procs)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    first = _first_failure(procs)
    if not status and first is not None:
        out.write(f"[launch] {describe_status(*first)}\n")
        status = exit_status(first[1])
    return status


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomp.launch", description=__doc__.split("\n")[0]
    )
    parser.add_argument("-n", "--num-processes", type=bounded(int, 1), default=2)
    parser.add_argument(
        "--local-devices", type=bounded(int, 1), default=1, help="CPU devices per process"
    )
    parser.add_argument(
        "--timeout", type=bounded(float, 0, True), default=600.0, help="seconds for the whole run"
    )
    parser.add_argument(
        "--grace", type=bounded(float, 0), default=30.0, help="seconds after a failure"
    )
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    # else every process failed with "can't open file"; python also runs a directory or a
    # zip archive holding __main__.py, as the processes do
    if not os.path.exists(ns.script):
        parser.error(f"argument script: no such file: {ns.script}")
    return run(
        [ns.script, *ns.script_args],
        ns.num_processes,
        local_devices=ns.local_devices,
        timeout=ns.timeout,
        grace=ns.grace,
    )


if __name__ == "__main__":
    sys.exit(main())
