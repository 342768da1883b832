"""Multi-process training over gloo (jaxcomp.launch): every process ends with the same params.

Also the launcher itself: a failing process makes the run fail fast (its status, within the
grace period, while its peer would sleep for minutes), a hung run is killed at the timeout,
and bad arguments are a ValueError naming them.
"""

import concurrent.futures
import io
import re
import sys
import time
from pathlib import Path

import pytest

from jaxcomp import launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_processes_end_with_identical_params():
    out = io.StringIO()
    status = launch.run(
        [str(ROOT / "examples" / "multihost.py"), "--steps", "20", "--hidden", "64", "--no-report"],
        2,
        local_devices=2,
        timeout=500,
        out=out,
    )
    text = out.getvalue()
    assert status == 0, text[-3000:]
    digests = dict(re.findall(r"^\[(\d)\] params sha256 ([0-9a-f]{64})$", text, re.M))
    assert sorted(digests) == ["0", "1"], text[-3000:]
    assert digests["0"] == digests["1"]
    # 2 processes x 2 devices = one 4-device mesh: the devices of both took part.
    assert re.search(r"^\[1\] process 1/2: 2 of 4 devices", text, re.M), text[-3000:]
    accuracies = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", text)]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1] > 50.0


@pytest.mark.slow
def test_fsdp_inside_diloco_replicas_across_processes_is_the_one_process_run():
    """examples/fsdp_lm.py --replicas 2 --replica-transform diloco --ef: FSDP (int8 weights,
    int4 gradients with error feedback) inside each replica group, the groups synced by
    ``jc.diloco`` (int8) every 2 steps. 2 processes x 4 CPU devices over gloo, one group a
    process (the replica axis crosses gloo, the data axis does not): both processes print the
    params SHA-256 of the same 4 steps on 1 process x 8 devices, bit for bit (the groups'
    mean, ``jc.mean_replica``, gathered on every process)."""
    sys.path.insert(0, str(ROOT / "examples"))
    import fsdp_lm

    flags = ["--replicas", "2", "--replica-transform", "diloco", "--sync-every", "2", "--ef"]
    flags += ["--steps", "4", "--d-model", "32", "--layers", "1", "--no-baseline", "--no-report"]
    out, script = io.StringIO(), [str(ROOT / "examples" / "fsdp_lm.py"), "--multiprocess"]
    # the 2 processes' start-up and compiles overlap the one-process run's: 2 cores busy
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        two = pool.submit(launch.run, script + flags, 2, local_devices=4, timeout=300, out=out)
        one = fsdp_lm.train(
            4,
            error_feedback=True,
            replicas=2,
            replica_transform="diloco",
            sync_every=2,
            d_model=32,
            layers=1,
            report_bytes=False,
        )
        status = two.result()
    text = out.getvalue()
    assert status == 0, text[-3000:]
    digests = dict(re.findall(r"^\[(\d)\] \[\d\] params sha256 ([0-9a-f]{64})$", text, re.M))
    assert sorted(digests) == ["0", "1"], text[-3000:]
    assert digests["0"] == digests["1"] == one["digest"]
    assert one["train_loss"][-1] < one["train_loss"][0] - 0.5  # it trained


def write(tmp_path, body):
    path = tmp_path / "script.py"
    path.write_text("import os, sys, time\nrank = int(os.environ['JAXCOMP_PROCESS_ID'])\n" + body)
    return str(path)


def test_failing_process_fails_the_run_fast(tmp_path):
    script = write(tmp_path, "if rank == 1:\n    sys.exit(3)\ntime.sleep(300)\n")
    out = io.StringIO()
    start = time.monotonic()
    status = launch.run([script], 2, timeout=120, grace=1.0, out=out)
    assert status == 3
    assert time.monotonic() - start < 30  # not the peer's 300 s sleep, nor the timeout
    assert "a peer failed" in out.getvalue()


def test_hung_run_is_killed_at_the_timeout(tmp_path):
    script = write(tmp_path, "print('rank', rank, 'up', flush=True)\ntime.sleep(300)\n")
    out = io.StringIO()
    start = time.monotonic()
    status = launch.run([script], 2, timeout=3.0, out=out)
    assert status == 124 and time.monotonic() - start < 30
    assert "[0] rank 0 up" in out.getvalue() and "[1] rank 1 up" in out.getvalue()


def test_all_succeed_and_env_is_set(tmp_path):
    script = write(
        tmp_path,
        "print(os.environ['JAXCOMP_NUM_PROCESSES'], os.environ['JAXCOMP_LOCAL_DEVICES'],"
        " os.environ['JAXCOMP_COORDINATOR'].startswith('127.0.0.1:'), flush=True)\n",
    )
    out = io.StringIO()
    assert launch.run([script], 3, local_devices=2, timeout=60, out=out) == 0
    assert sorted(re.findall(r"^\[(\d)\] 3 2 True$", out.getvalue(), re.M)) == ["0", "1", "2"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": 2, "local_devices": 0}, "local_devices"),
        ({"num_processes": 2, "timeout": 0}, "timeout"),
        ({"num_processes": 2, "grace": -1}, "grace"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch.run([sys.executable, "-c", "pass"], **kwargs)


def test_cli_runs_a_script(tmp_path, capsys):
    script = write(tmp_path, "sys.exit(0 if len(sys.argv) == 2 and sys.argv[1] == 'x' else 5)\n")
    assert launch.main(["-n", "2", "--timeout", "60", script, "x"]) == 0
    assert launch.main(["-n", "2", "--timeout", "60", script]) == 5


SEEDED_BY_RANK = """
from jaxcomp.launch import initialize
initialize(local_devices=2)
import jax, jax.numpy as jnp, optax
import jaxcomp as jc
mesh = jax.make_mesh((4,), ("data",))
builds = {
    "sgd": lambda seed: jc.sgd(0.1, jc.random_k(0.1), "data", seed=seed),
    "sparseloco": lambda seed: jc.sparseloco(
        optax.sgd(0.1), "data", 2, mask="random", min_size=0, seed=seed
    ),
}
for tx_name, build in builds.items():
    for name, seed in (("same", 0), ("rank", rank)):
        try:
            jc.sharded_init(build(seed), {"w": jnp.ones((16, 16))}, mesh, "data")
            print(tx_name, "seed", name, "accepted", flush=True)
        except ValueError as e:
            print(tx_name, "seed", name, "refused", str(e).splitlines()[0][:120], flush=True)
"""


def test_a_per_process_seed_is_refused_at_sharded_init(tmp_path):
    """``seed=jax.process_index()``: the state's PRNG key (replicated) differed between the
    processes unchecked, each drew its own random-k indices and the params drifted apart
    (2 processes x 2 devices, 2 steps of jc.sgd: 3,720 apart). Now sharded_init refuses it on
    every process, naming the key; the same seed everywhere passes. The same for
    jc.sparseloco's shared mask (its key was a program constant, not state: params 30 apart
    after 2 steps), whose key is ``exchange[0].key``."""
    out = io.StringIO()
    status = launch.run([write(tmp_path, SEEDED_BY_RANK)], 2, local_devices=2, timeout=120, out=out)
    text = out.getvalue()
    assert status == 0, text[-3000:]
    leaves = {"sgd": "['[0].key']", "sparseloco": "['.exchange[0].key']"}
    for tx_name, leaf in leaves.items():
        for rank in "01":
            assert f"[{rank}] {tx_name} seed same accepted" in text, text[-3000:]
        refused = re.findall(rf"^\[(\d)\] {tx_name} seed rank refused (.*)$", text, re.M)
        assert sorted(r for r, _ in refused) == ["0", "1"], text[-3000:]
        assert all(leaf in m and "differ between the 2 processes" in m for _, m in refused), text


def test_replicated_state_leaves_are_compared_across_processes():
    """check_same_on_every_process with the all-gather stood in for: one process's key from
    another seed is refused naming the leaf; identical copies pass, and so does a process
    that holds no copy; single-bit and order changes change the fingerprint."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcomp as jc
    from jaxcomp._src import sharding

    mesh = jax.make_mesh((8,), ("data",))
    params = {"w": jnp.ones((16, 16))}
    mine = jc.sharded_init(jc.sgd(0.1, jc.random_k(0.1), "data", seed=0), params, mesh, "data")
    theirs = jc.sharded_init(jc.sgd(0.1, jc.random_k(0.1), "data", seed=1), params, mesh, "data")
    seen = []
    sharding.check_same_on_every_process(
        theirs, gather=lambda local: seen.append(local) or local[None]
    )
    sharding.check_same_on_every_process(mine, gather=lambda local: np.stack([local, local]))
    # a process that holds no copy (a mesh without its devices) sends zeros: left out
    none = lambda local: np.stack([local, np.zeros_like(local)])  # noqa: E731
    sharding.check_same_on_every_process(mine, gather=none)
    with pytest.raises(ValueError, match=r"\['\[0\]\.key'\] differ between the 2 processes.*seed"):
        sharding.check_same_on_every_process(mine, gather=lambda local: np.stack([local, seen[0]]))
    fp = sharding.fingerprint
    a = jnp.arange(6, dtype=jnp.uint32)
    assert (fp(a) == fp(jnp.arange(6, dtype=jnp.uint32))).all()
    assert (fp(a) != fp(a.at[3].set(2))).any() and (fp(a) != fp(a[::-1])).any()
    assert (fp(a) != fp(a.astype(jnp.int32))).any()  # the dtype counts
    assert (fp(jnp.array([True, False])) != fp(jnp.array([False, True]))).any()
    assert (fp(jax.random.key(0)) != fp(jax.random.key(1))).any()  # typed keys: their data
    # keys and counts are compared, float leaves (moments, anchors) are not read
    assert sharding._checked(mine[0].key) and sharding._checked(mine[0].count)
    assert not sharding._checked(jnp.zeros(3))
