"""Smoke runs of the benchmarks (``--quick``, narrowed further where noted) in subprocesses.

Each writes JSON into a temporary folder (``JAXCOMP_BENCH_RESULTS``) and the test asserts on
its numbers: ratios present and positive, bytes equal to the model, speedups finite.
Subprocesses, because each benchmark sets its own device count before jax starts.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, out: pathlib.Path, timeout: float = 300) -> str:
    flags = os.environ.get("JAXCOMP_TEST_XLA_COMPILE_FLAGS", "")  # tests/conftest.py
    env = {**os.environ, "JAXCOMP_BENCH_RESULTS": str(out), "XLA_FLAGS": flags}
    env["JAX_PLATFORMS"] = "cpu"  # the suite's CPU devices, also on a host with a GPU
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script.removesuffix('.py')}", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def run_here(
    script: str, *args: str, out: pathlib.Path, monkeypatch, first_devices: int = 0
) -> None:
    """``python -m benchmarks.SCRIPT ARGS`` run in this process, its JSON into ``out``: for
    benchmarks that run on the suite's 8 CPU devices (or on none, or on one), which saves a
    process's start-up (jax and matplotlib imported anew, about 4 s of CPU a run). The device
    count it asks for must be the suite's, since jax has started, unless it builds its meshes
    of the first ``first_devices`` devices only (``wire_bytes`` asks for 16, meshes of n)."""
    import importlib

    import jax

    import jaxcomp.cpu
    from benchmarks import common

    def use_cpu_devices(n: int = 8) -> None:
        if first_devices:
            assert first_devices <= jax.device_count(), f"{script}: the suite has 8 devices"
            return
        assert n == jax.device_count(), f"{script} asks for {n} devices, the suite has 8"

    monkeypatch.setattr(jaxcomp.cpu, "use_cpu_devices", use_cpu_devices)
    monkeypatch.setattr(common, "RESULTS", out)
    module = importlib.import_module(f"benchmarks.{script.removesuffix('.py')}")
    if hasattr(module, "use_cpu_devices"):  # imported by name (wire_bytes), maybe before
        monkeypatch.setattr(module, "use_cpu_devices", use_cpu_devices)
    assert module.main(list(args)) == 0


def load(out: pathlib.Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_wire_bytes_merge_replaces_rows_measured_again():
    from benchmarks import wire_bytes

    def row(codec, n, value, strategy="auto"):
        return {"tree": "t", "devices": n, "codec": codec, "strategy": strategy, "v": value}

    old = [row("sign", 8, 1), row("pmean", 8, 0, "-"), row("int8", 8, 2)]
    merged = wire_bytes.merge_rows(old, [row("int8", 8, 3), row("int8", 2, 4)])
    assert [(r["devices"], r["codec"], r["v"]) for r in merged] == [
        (2, "int8", 4),
        (8, "pmean", 0),
        (8, "int8", 3),
        (8, "sign", 1),
    ]
    # "fp16" is the scaled cast since 2026-11-26, not summable: a row of it measured through
    # allreduce before then goes once fp16 is measured again; bf16 keeps its allreduce row.
    old = [row("fp16", 8, 1, "allreduce"), row("fp16", 8, 2), row("bf16", 8, 3, "allreduce")]
    merged = wire_bytes.merge_rows(
        [row("pmean", 8, 0, "-"), *old],
        [row("pmean", 8, 6, "-"), row("fp16", 8, 4), row("bf16", 8, 5)],
    )
    assert [(r["codec"], r["strategy"], r["v"]) for r in merged] == [
        ("pmean", "-", 6),
        ("bf16", "allreduce", 3),
        ("bf16", "auto", 5),
        ("fp16", "auto", 4),
    ]


def test_wire_bytes_merge_lists_the_first_part_too():
    """The first part of a sweep wrote the file alone (no ``merged_runs``): merging the
    second lists both commands, not the second alone."""
    from benchmarks import wire_bytes

    first = {"environment": {"command": "python -m benchmarks.wire_bytes --devices 8"}}
    assert wire_bytes.merged_runs(first, "second") == [
        "python -m benchmarks.wire_bytes --devices 8",
        "second",
    ]
    assert wire_bytes.merged_runs({"merged_runs": ["a", "b"], **first}, "c") == ["a", "b", "c"]
    assert wire_bytes.merged_runs({}, "only") == ["only"]


def test_codec_speed_merge_replaces_rows_timed_again_and_names_the_runs():
    """``codec_speed --merge``: the old file's rows in its order, those timed again (same
    codec and size) replaced, new ones last; ``runs`` names the run that wrote the old file
    and the new one, and the rendered table says which codecs each timed."""
    from benchmarks import codec_speed
    from docs.hooks import bench_tables

    def row(codec, size, ratio):
        return {"codec": codec, "size": size, "in_copies": ratio, "compression": 4.0}

    def env(command, date):
        return {"backend": "cpu", "device": "cpu", "command": command, "date_utc": date}

    old = {
        "environment": env("python benchmarks/codec_speed.py --reps 5", "2026-11-22"),
        "reps": 5,
        "pipeline": 1,
        "seconds": 500.0,
        "rows": [row("identity", 8, 2.0), row("fp8", 8, 1.3), row("int8", 8, 1.4)],
    }
    new = {
        "environment": env("codec_speed --codecs fp8 new --merge", "2026-11-27"),
        "reps": 5,
        "pipeline": 1,
        "seconds": 30.0,
        "rows": [row("fp8", 8, 2.5), row("new", 8, 3.0)],
    }
    merged = codec_speed.merge(old, new)
    assert [(r["codec"], r["in_copies"]) for r in merged["rows"]] == [
        ("identity", 2.0),
        ("fp8", 2.5),
        ("int8", 1.4),
        ("new", 3.0),
    ]
    assert merged["seconds"] == 530.0 and merged["environment"] == new["environment"]
    assert [(r["command"], r["codecs"]) for r in merged["runs"]] == [
        ("python benchmarks/codec_speed.py --reps 5", ["identity", "fp8", "int8"]),
        ("codec_speed --codecs fp8 new --merge", ["fp8", "new"]),
    ]
    again = codec_speed.merge(merged, {**new, "rows": [row("int8", 8, 1.5)]})
    assert len(again["runs"]) == 3 and again["runs"][0] == merged["runs"][0]
    text = bench_tables._codec_speed(merged, bench_tables.RESULTS / "codec_speed.json")
    assert "`fp8`, `new` from `codec_speed --codecs fp8 new --merge` (2026-11-27)" in text
    assert "the other 2 codecs from `python benchmarks/codec_speed.py --reps 5`" in text
    assert "| `fp8` | 4.0x | 2.5 |" in text
    assert "joined by" not in bench_tables._codec_speed(old, bench_tables.RESULTS / "x.json")
    assert codec_speed.merge_mismatch(old, new) is None
    assert codec_speed.merge_mismatch(old, {**new, "reps": 7}) == "reps 5 != 7"


def test_codec_speed_merge_refuses_a_file_timed_otherwise(tmp_path, capsys):
    """One table, one way of timing: ``--merge`` onto a file of another ``--reps`` is a usage
    error naming the flag, before anything is timed."""
    from benchmarks import codec_speed

    path = tmp_path / "speed.json"
    before = {"environment": {"backend": "cpu", "device": "cpu"}, "reps": 7, "pipeline": 1}
    path.write_text(json.dumps({**before, "rows": []}))
    with pytest.raises(SystemExit) as exit_:
        codec_speed.main(["--codecs", "sign", "--reps", "5", "--merge", "--out", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --merge" in err and "reps 7 != 5" in err
    assert json.loads(path.read_text())["rows"] == []


@pytest.mark.slow
def test_wire_bytes_quick_matches_model(tmp_path, monkeypatch):
    # --quick narrowed to one codec at n = 4, with every strategy, inside the test budget
    # (int8's bytes per strategy and n: tests/test_scale.py's two-phase/all-gather test).
    args = ("--quick", "--codecs", "sign", "--devices", "4", "--all-strategies", "resnet18")
    run_here("wire_bytes.py", *args, out=tmp_path, monkeypatch=monkeypatch, first_devices=4)
    data = load(tmp_path, "wire_bytes_quick.json")
    rows = data["rows"]
    assert {r["codec"] for r in rows} == {"pmean", "sign"}
    assert (tmp_path / "wire_bytes_quick.png").stat().st_size > 0
    for r in rows:
        assert r["bytes_per_device"] > 0
        assert r["model_bytes_per_device"] == pytest.approx(r["bytes_per_device"], rel=1e-9)
    pmean = next(r for r in rows if r["codec"] == "pmean")
    assert pmean["bytes_per_device"] == pytest.approx(2 * 3 / 4 * 4 * pmean["params"], rel=1e-9)
    saving = {(r["codec"], r["strategy"]): r["saving"] for r in rows}
    assert saving[("sign", "two_phase")] > 25  # 1 bit + one scale per leaf: ~31x
    assert saving[("sign", "allgather")] < saving[("sign", "two_phase")]  # all-gather grows with n
    assert saving[("sign", "auto")] == max(v for (c, _), v in saving.items() if c == "sign")


@pytest.mark.slow
def test_codec_speed_and_alpha_beta_quick(tmp_path, monkeypatch):
    args = ("--quick", "--sizes", "1048576", "--reps", "3")  # on one device: the suite's first
    run_here("codec_speed.py", *args, out=tmp_path, monkeypatch=monkeypatch)
    speed = load(tmp_path, "codec_speed_quick.json")
    assert speed["environment"]["backend"] in ("cpu", "gpu", "tpu")
    assert speed["environment"]["device"]
    names = {r["codec"] for r in speed["rows"]}
    assert {"sign", "int8"} <= names
    for r in speed["rows"]:
        assert r["copy_ms"] > 0 and r["encode_ms"] > 0 and r["decode_ms"] > 0
        assert math.isfinite(r["in_copies"]) and r["in_copies"] > 0
        assert r["compression"] == pytest.approx(4 * r["size"] / r["payload_bytes"])

    run_here("alpha_beta.py", "--quick", out=tmp_path, monkeypatch=monkeypatch)  # no jax
    model = load(tmp_path, "alpha_beta_quick.json")
    assert model["codec_cost_source"].startswith("codec_speed_quick.json")
    rows = model["rows"]
    for r in rows:
        assert r["step_s"] > 0 and r["speedup"] > 0
    pmean = [r for r in rows if r["codec"] == "pmean"]
    assert all(r["speedup"] == pytest.approx(1.0) for r in pmean)
    # More bandwidth never makes compression pay more (same n, same codec).
    sign = {(r["bandwidth"], r["devices"]): r["speedup"] for r in rows if r["codec"] == "sign"}
    assert all(sign[("1 Gbit/s", n)] >= sign[("100 Gbit/s", n)] for n in (8, 64, 1024))


@pytest.mark.slow
def test_network_quick(tmp_path):
    stdout = run_bench("network.py", "--quick", "--size", "1048576", "--reps", "2", out=tmp_path)
    if "skipped" in stdout:
        pytest.skip(stdout.strip())
    assert shutil.which("ip") is not None
    result = load(tmp_path, "network_quick.json")
    rows = result["rows"]
    assert [r["codec"] for r in rows] == ["pmean", "sign"]
    pmean, sign = rows
    assert pmean["bytes_per_device"] == pytest.approx(4 * 1048576)  # 2 processes: 2(n-1)/n = 1
    assert pmean["bytes_per_device"] / sign["bytes_per_device"] > 30
    for r in rows:
        assert r["allreduce_ms"] > 0 and r["link_ms"] > 0 and r["allreduce_speedup"] > 0
    # The shaped link holds: plain pmean cannot beat the rate limit by much (burst, timing).
    assert pmean["efficiency"] < 1.3
    # This run's namespace is gone (another run on the host may hold one of its own).
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert result["namespace"].startswith("jaxcomp-bench-")
    assert result["namespace"] not in out.split()


@pytest.mark.slow
def test_teacher_task_is_fixed():
    """The held-out classifier task: the same teacher, inputs and labels on every call."""
    import numpy as np

    from benchmarks import common

    (x, y), (xt, yt) = common.load_teacher_split()
    assert x.shape == (4000, 32) and xt.shape == (1000, 32) and x.dtype == np.float32
    train = [379, 244, 240, 455, 408, 711, 531, 571, 337, 124]
    assert np.bincount(y, minlength=10).tolist() == train
    assert np.bincount(yt, minlength=10).tolist() == [90, 67, 50, 126, 111, 170, 122, 143, 87, 34]
    (x2, y2), _ = common.load_teacher_split()
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


def test_exchange_diagnostics_against_the_uncompressed_update():
    """Two devices, one leaf: momenta m_1 = (1, 0), m_2 = (0, 1) (previous zero), lr 0.1,
    beta 0.9: the uncompressed heavy-ball update is -1 * mean m = (-0.5, -0.5)."""
    from types import SimpleNamespace

    import numpy as np

    from benchmarks.convergence import exchange_diagnostics

    m = np.eye(2)
    old = (SimpleNamespace(momentum={"w": np.zeros((2, 2))}),)
    new = (SimpleNamespace(momentum={"w": m}, memory={"w": 3 * m}, server_residual={"w": None}),)
    before, after = {"w": np.zeros(2)}, {"w": np.array([-1.0, 0.0])}
    d = exchange_diagnostics(before, after, old, new, 0.1, look_ahead=False)
    assert d["update_over_uncompressed"] == pytest.approx(1 / math.sqrt(0.5))
    assert d["cosine"] == pytest.approx(math.sqrt(0.5))
    # rms over devices of ||e_i|| = 3, ||mean m|| = sqrt(0.5)
    assert d["memory_over_momentum"] == pytest.approx(3 / math.sqrt(0.5))
    assert d["server_over_momentum"] == 0.0
    # The look-ahead sends m + 0.9 (m - 0) = 1.9 m: same direction, 1.9x the norm.
    d = exchange_diagnostics(before, after, old, new, 0.1, look_ahead=True)
    assert d["update_over_uncompressed"] == pytest.approx(1 / (1.9 * math.sqrt(0.5)))


def test_dgc_diagnostics_hold_back_over_distance_moved():
    """Two devices, one leaf moved by (3, 4) (norm 5): accumulations v_1 = (2, 0),
    v_2 = (0, 2) hold back lr * ||mean v|| = 0.1 * sqrt(2); velocities u_i = (1, 1) the same
    over 2; plain (None) leaves are skipped."""
    from types import SimpleNamespace

    import numpy as np

    from benchmarks.convergence import dgc_diagnostics

    state = (
        SimpleNamespace(
            accumulation={"w": 2 * np.eye(2), "b": None},
            velocity={"w": np.ones((2, 2)), "b": None},
        ),
    )
    d = dgc_diagnostics({"w": np.zeros(2)}, {"w": np.array([3.0, 4.0])}, state, lr=0.1)
    assert d["held_back_over_moved"] == pytest.approx(0.1 * math.sqrt(2) / 5)
    assert d["velocity_over_moved"] == pytest.approx(0.1 * math.sqrt(2) / 5)


def test_zero_one_regimes_count_the_warmup_and_the_skipped_rounds():
    """The branches 0/1 Adam's steps take, as the benchmark counts them for its bytes per
    step (300 steps, var_freeze_step=100, var_update_scaler=8): FULL the 25 warm-up steps
    (``warmup_steps=25``, the library's default until 2026-11-26) plus the 13 variance
    rounds after them (28, 32, ..., 52 on a gap of 4; 56, 64, ..., 96 on a gap of 8); with
    ``local_step_scaler=100`` every other step from 200 is skipped (50), with the library's
    1000 none before step 1100."""
    from collections import Counter

    from benchmarks.convergence import regime

    def counts(method):
        return Counter(regime(method, t, None) for t in range(300))

    assert counts("zero_one_adam") == {0: 38, 1: 262}
    assert counts("zero_one_adam-scaler100") == {0: 38, 1: 212, 2: 50}


def test_lm_zero_one_diagnosis_rows_count_their_rounds():
    """The rounds the LM benchmark weighs the bytes of 0/1 Adam's diagnosis rows by (300
    steps, the freeze at 100 unless moved): the defaults' 50 warm-up steps and 12 variance
    rounds (52, 56, ..., 96) float32; coded, those 12 send the momentum through the codec;
    frozen at 50 after 50 warm-up steps, 1-bit Adam's 50 and 250; a warm-up to the freeze,
    100 and 200."""
    from collections import Counter

    from benchmarks import lm

    run = lm.Run(300, 6e-3, 8)

    def counts(name):
        return dict(Counter(lm.RECIPES[name].regime(run, t) for t in range(300)))

    assert counts("zero_one_adam-var16-warmup50") == {"full": 62, "compressed": 238}
    assert counts("zero_one_adam-var16-warmup50-f32") == {"full": 62, "compressed": 238}
    coded = {"full": 50, "compressed": 238, "variance": 12}
    assert counts("zero_one_adam-var16-warmup50-coded") == coded
    assert counts("zero_one_adam-var16-freeze50-warmup50") == {"full": 50, "compressed": 250}
    assert counts("zero_one_adam-var16-warmup100") == {"full": 100, "compressed": 200}


def test_convergence_quick(tmp_path, monkeypatch):
    args = ("--quick", "--steps", "30", "--eval-at", "10")  # 8 devices, the suite's
    run_here("convergence.py", *args, out=tmp_path, monkeypatch=monkeypatch)
    data = load(tmp_path, "convergence_quick.json")
    assert data["complete"]
    runs = {r["method"]: r for r in data["runs"]}
    assert set(runs) == {"none", "sign", "int8"}
    assert runs["none"]["compression"] == pytest.approx(1.0)
    assert runs["sign"]["compression"] > 10 and runs["int8"]["compression"] > 2.5
    for r in runs.values():
        assert len(r["curve"]) == 30 and all(math.isfinite(v) for v in r["curve"])
        assert r["curve"][-1] < r["curve"][0]  # it learns
        assert 0.5 < r["value"] <= 1.0  # digits test accuracy after 30 steps
        assert 0.0 < r["checkpoints"]["10"] <= 1.0  # and after 10 (--eval-at)
    assert runs["none"]["checkpoint_delta"] == {"10": 0.0}
    assert (tmp_path / "convergence_digits_quick.png").stat().st_size > 0


@pytest.mark.slow
def test_gpu_step_quick(tmp_path, monkeypatch):
    # The compressed training step against plain pmean on one device (any backend; here the
    # suite's first); one codec (the quick default adds sign, whose encode the hot-path smoke
    # run covers).
    out = tmp_path / "step.json"
    args = ["--quick", "--codecs", "int8", "--reps", "3", "--pipeline", "2", "--out", str(out)]
    run_here("gpu_step.py", *args, out=tmp_path, monkeypatch=monkeypatch)
    data = json.loads(out.read_text())
    assert data["complete"] and data["pipeline"] == 2
    assert data["environment"]["backend"] in ("cpu", "gpu", "tpu")
    rows = data["rows"]
    assert [r["codec"] for r in rows] == ["pmean", "int8", "pmean"]
    assert rows[0]["vs_pmean"] == pytest.approx(1.0)
    assert rows[1]["error_feedback"] == "residual"
    for r in rows:
        assert r["step_ms"] > 0 and math.isfinite(r["vs_pmean"]) and r["vs_pmean"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_hot_path_compile_size_mesh_bytes_quick(tmp_path, monkeypatch):
    # Layout-agnostic smoke runs: ratios present and finite, no targets (before/after differ).
    run_bench("hot_path.py", "--quick", "--reps", "3", "--label", "t", out=tmp_path)
    hot = load(tmp_path, "hot_path_t_quick.json")
    assert hot["copy_ms"] > 0 and hot["label"] == "t"
    assert [r["name"] for r in hot["rows"]] == ["sign", "int8", "sign (no feedback)"]
    for r in hot["rows"]:
        assert r["update_ms"] > 0 and math.isfinite(r["copies"]) and r["copies"] > 0
        # page faults per call counted; the quick tree's leaves (<= 4 MB) stay below glibc's
        # mmap threshold, so at most the temporaries' pages fault
        assert r["setting"] == "default" and 0 <= r["fault_copies"] <= r["temp_copies"] + 0.05
    # Compiled, deterministic: the update's temporaries in copies of the gradient (1 device,
    # gradient and state donated). With residual feedback one gradient-sized buffer, g + e
    # or the donated gradient's copy (int8 1.17, sign 0.95 measured); without feedback the
    # scale's eight-group fold, an eighth of a leaf (0.26; 0.06 when reduced at once).
    temps = {r["name"]: r["temp_copies"] for r in hot["rows"]}
    assert temps["int8"] < 1.25 and temps["sign"] < 1.0 and temps["sign (no feedback)"] < 0.3
    assert (tmp_path / "hot_path_t_quick.png").stat().st_size > 0

    # compile_size and mesh_bytes: 8 devices, the suite's (hot_path times 1 device, and
    # counts its own process's page faults: a process of its own)
    args = ("--quick", "--strategies", "auto")
    run_here("compile_size.py", *args, out=tmp_path, monkeypatch=monkeypatch)
    rows = load(tmp_path, "compile_size_quick.json")["rows"]
    assert [(r["codec"], r["strategy"]) for r in rows] == [("pmean", "-"), ("sign", "auto")]
    for r in rows:
        assert r["compile_s"] > 0 and r["hlo_instructions"] > 0 and r["collectives"] >= 1

    run_here("mesh_bytes.py", "--quick", "--no-run", out=tmp_path, monkeypatch=monkeypatch)
    mesh = load(tmp_path, "mesh_bytes_quick.json")
    assert len(mesh["rows"]) == 4 and mesh["mesh"] == {"data": 4, "model": 2}
    assert 0.3 < mesh["pmean_sharded_over_replicated"] < 0.7  # pmean of model shards: ~half
    assert mesh["sharded_over_replicated"] > 0


def test_hot_path_settings_are_named_not_by_a_temporary_path():
    """A setting's name in the rows and the JSON: its ``NAME:`` prefix, else its variables
    with file paths cut to file names (a temporary path named the jemalloc rows before)."""
    from benchmarks.hot_path import setting_env, setting_name

    je = "LD_PRELOAD=/tmp/je/usr/lib/libjemalloc.so.2,MALLOC_CONF=oversize_threshold:0,a:-1"
    assert setting_name("jemalloc:" + je) == "jemalloc"
    assert setting_name(je) == "LD_PRELOAD=libjemalloc.so.2,MALLOC_CONF=oversize_threshold:0,a:-1"
    assert (
        setting_env("jemalloc:" + je)
        == setting_env(je)
        == {
            "LD_PRELOAD": "/tmp/je/usr/lib/libjemalloc.so.2",
            "MALLOC_CONF": "oversize_threshold:0,a:-1",
        }
    )
    tunable = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
    assert setting_name(tunable) == tunable and setting_name("reuse") == "reuse"
    with pytest.raises(ValueError, match="NAME:"):
        setting_env("Jemalloc:LD_PRELOAD=x")


def test_lm_link_time_to_loss_interpolates():
    from benchmarks import lm_link

    evals = [(30, 10.0, 3.0), (60, 20.0, 2.0), (90, 30.0, 1.5)]
    assert lm_link.time_to(evals, 2.5) == pytest.approx(15.0)  # halfway from 3.0 to 2.0
    assert lm_link.time_to(evals, 3.5) == pytest.approx(10.0)  # reached at the first eval
    assert lm_link.time_to(evals, 1.0) is None
    runs = [
        {"recipe": "adamw", "evals": evals, "final_eval_loss": 1.5, "train_seconds": 30.0},
        {"recipe": "x", "evals": [(30, 1.0, 2.5), (60, 2.0, 2.0)], "final_eval_loss": 2.0,
         "train_seconds": 2.0},
    ]  # fmt: skip
    lm_link.summarize(runs)
    assert runs[1]["time_to_target_s"] is None and runs[1]["speedup_to_target"] is None
    assert runs[1]["speedup_at_own_loss"] == pytest.approx(20.0 / 2.0)  # adamw hit 2.0 at 20 s


def test_lm_link_split_projects_time_to_target(tmp_path, monkeypatch):
    """benchmarks/lm_link.py: NAME:STEPS rows, steps to the target, the step split into
    compute (the unshaped step) and exchange, and the projection: the unshaped CPU time plus
    the link model of the bytes per step over the steps to target."""
    from benchmarks import lm_link

    assert lm_link.parse_recipe("onebit_adam:450", 300) == ("onebit_adam", 450)
    assert lm_link.parse_recipe("onebit_adam", 300) == ("onebit_adam", 300)
    with pytest.raises(ValueError, match="--recipes"):
        lm_link.parse_recipe("onebit_adam:0", 300)
    adamw = [(30, 30.0, 3.0), (60, 60.0, 2.0)]  # 1000 ms a step, target 2.0 at step 60
    fast = [(30, 3.0, 2.5), (60, 6.0, 2.1), (90, 9.0, 1.9)]  # 100 ms a step, 2.0 at step 75

    def rows():
        return [
            {"recipe": "adamw", "evals": adamw, "final_eval_loss": 2.0, "train_seconds": 60.0,
             "ms_per_step": 1000.0, "steps": 60, "bytes_per_step": 2_812_500},
            {"recipe": "x", "evals": fast, "final_eval_loss": 1.9, "train_seconds": 9.0,
             "ms_per_step": 100.0, "steps": 90, "bytes_per_step": 1.0,
             "bytes_each_step": [93_750] * 25 + [0] * 65},
        ]  # fmt: skip

    runs = rows()
    lm_link.summarize(runs)
    assert lm_link.steps_to(fast, 2.0) == pytest.approx(75.0)
    assert runs[1]["speedup_to_target"] == pytest.approx(60.0 / 7.5)
    unshaped = [
        {"recipe": "adamw", "ms_per_step": 80.0, "cpu_ms_per_step": 40.0, "steps": 30},
        {"recipe": "x", "ms_per_step": 90.0, "cpu_ms_per_step": 45.0, "steps": 30},
        {"recipe": "y", "error": "not run"},
    ]
    lm_link.split(runs, unshaped, 4, 100e6)  # 4 processes, 100 Mbit/s
    a, x = runs
    assert (a["compute_ms_per_step"], a["exchange_ms_per_step"]) == (80.0, 920.0)
    assert (x["exchange_ms_per_step"], x["cpu_ms_per_step_unshaped"]) == (10.0, 45.0)
    assert a["steps_to_target"] == 60 and x["steps_to_target"] == pytest.approx(75.0)
    # the link: 4 x bytes x 8 / 1e8 s; adamw 2.8125 MB: 900 ms; x: its first 75 steps, 31.25 kB
    assert a["link_ms_per_step"] == pytest.approx(900.0)
    assert x["link_ms_per_step"] == pytest.approx(10.0)
    # adamw: 60 x (40 + 900) ms = 56.4 s; x: 75 x (45 + 10) ms = 4.125 s; link only 54 / 0.75
    assert x["projected_speedup_to_target"] == pytest.approx(56.4 / 4.125)
    assert x["link_speedup_to_target"] == pytest.approx(54.0 / 0.75)
    # --split-from: the same from two result files (the unshaped one a --rate none run)
    runs = rows()
    shaped = {"runs": runs, "rate": "100mbit", "num_processes": 4, "tbf": "burst 256kb",
              "environment": {"command": "lm_link"}}  # fmt: skip
    lm_link.summarize(runs)
    (tmp_path / "lm_link_s.json").write_text(json.dumps(shaped))
    other = {"runs": unshaped, "environment": {"command": "lm_link --rate none"}}
    (tmp_path / "lm_link_u.json").write_text(json.dumps(other))
    monkeypatch.setattr(lm_link.common, "RESULTS", tmp_path)
    monkeypatch.setattr(lm_link, "draw", lambda *a: None)  # the PNG: matplotlib, seconds
    assert lm_link.main(["--label", "s", "--split-from", "u"]) == 0
    written = load(tmp_path, "lm_link_s.json")
    assert written["runs"][1]["projected_speedup_to_target"] == pytest.approx(56.4 / 4.125)
    assert written["unshaped"]["command"] == "lm_link --rate none"


def test_lm_link_baseline_lr_reaches_the_workers(monkeypatch, tmp_path):
    """benchmarks/lm_link.py --baseline-lr: adamw's own peak lr, passed to every worker and
    recorded as the config's baseline_lr; no --recipes entry: adamw alone; a bad lr is named."""
    from benchmarks import lm_link

    seen = {}

    def fake_launch(ns, rate, script, argv, n, timeout, procs):
        worker = lm_link._parser().parse_args(argv)
        seen.update(lr=worker.baseline_lr, recipes=worker.recipes, ns=ns)
        seen["config"] = lm_link.run_config(worker, n)
        pathlib.Path(worker.out).write_text(json.dumps({"config": seen["config"], "runs": []}))
        return 0

    monkeypatch.setattr(lm_link.network, "launch", fake_launch)
    ap = lm_link._parser()
    args = ap.parse_args(["--rate", "none", "--baseline-lr", "4.5e-3", "--recipes"])
    lm_link._check(ap, args)
    data = lm_link._launch(args, "none", args.recipes, args.steps)
    assert (seen["lr"], seen["recipes"], seen["ns"]) == (4.5e-3, [], None)
    assert data["config"]["baseline_lr"] == 4.5e-3 and data["config"]["lr"] == 3e-3
    assert data["config"]["batch_per_device"] == 4  # 16 sequences over 4 processes
    assert "baseline_lr" not in lm_link.run_config(ap.parse_args([]), 4)
    with pytest.raises(SystemExit):
        lm_link._check(ap, ap.parse_args(["--baseline-lr", "0"]))


def test_lm_resume_keeps_every_command():
    """benchmarks/lm.py --resume: the file's first command stays, every later one is listed."""
    from benchmarks import lm

    first = lm.resumed_environment(None, {"command": "python -m benchmarks.lm", "jax": "a"})
    assert first["commands"] == ["python -m benchmarks.lm"]
    again = lm.resumed_environment(first, {"command": "lm --resume --recipes x", "jax": "b"})
    assert again["command"] == "python -m benchmarks.lm" and again["jax"] == "b"
    assert again["commands"] == ["python -m benchmarks.lm", "lm --resume --recipes x"]
    old_file = {"command": "lm --recipes adamw"}  # written before commands were kept
    assert lm.resumed_environment(old_file, {"command": "lm --resume"})["commands"] == [
        "lm --recipes adamw",
        "lm --resume",
    ]


def test_lm_resume_keeps_merged_provenance():
    """benchmarks/lm.py --resume: the ``merged`` list of the file resumed (e.g. the adamw row
    of --baseline-from) stays in the file written; a new file has none."""
    from benchmarks import lm

    before = {"runs": [], "merged": ["lm --tag third (its adamw run)"]}
    out = lm.result_file(before, {"command": "c"}, {"seed": 0}, [{"recipe": "adamw"}])
    assert out["merged"] == ["lm --tag third (its adamw run)"]
    assert out["runs"] == [{"recipe": "adamw"}] and out["config"] == {"seed": 0}
    assert "merged" not in lm.result_file({}, {"command": "c"}, {}, [])


def test_lm_modelled_time_to_loss_and_moment_reset():
    """benchmarks/lm.py: the modelled time to a loss (steps from the curve, bytes over the
    link, no measurement), and DiLoCo's inner moments zeroed at a sync, counts kept."""
    import numpy as np
    import optax

    from benchmarks import lm

    run = {"curve": [3.0] * 30 + [2.0] * 40, "slow_bytes_per_step": 1.25e6, "train_seconds": 7.0}
    assert lm.steps_to_loss(run["curve"], 2.5) == 40  # the 20-step mean reaches 2.5 at step 40
    assert lm.steps_to_loss(run["curve"], 1.9) is None
    assert lm.step_compute(run) == pytest.approx(0.1)  # no step_seconds: train_seconds / steps
    # 40 steps x (0.1 s + 8 x 1.25e6 bits / 1e8 bit/s) = 40 x 0.2 s
    assert lm.modelled_seconds(run, 2.5, 100e6) == pytest.approx(8.0)
    run["step_seconds"] = [0.3, 0.05, 0.05]
    assert lm.modelled_seconds(run, 2.5, 1e9, compute=0.0) == pytest.approx(0.4)
    assert lm.step_compute(run) == pytest.approx(0.05)  # the median

    tx = lm.reset_every(optax.adam(0.1), 2)
    s = tx.init(np.zeros(3, np.float32))
    g = np.ones(3, np.float32)
    for _ in range(3):
        _, s = tx.update(g, s)
    mu, count = s[0][0].mu, s[0][0].count
    np.testing.assert_allclose(mu, 0.1 * g, rtol=1e-6)  # zeroed before the 3rd update, then one
    assert int(count) == 3 and int(s[1]) == 3  # the counts (schedule, bias correction) kept


def test_lm_diloco_pseudo_gradient_spread():
    """benchmarks/lm_diloco.py: the per-sync pseudo-gradient figures (norms, cosine) by hand."""
    import numpy as np

    from benchmarks import lm_diloco

    x = np.array([1.0, 0.0, 0.0])
    orthogonal = lm_diloco.pseudo_gradients(x - np.array([[3.0, 0, 0], [0, 3.0, 0]]), x)
    assert orthogonal["delta_norm"] == pytest.approx(3.0)
    assert orthogonal["mean_delta_norm"] == pytest.approx(3.0 / np.sqrt(2))  # |(3, 3)| / 2
    assert orthogonal["delta_cosine"] == pytest.approx(0.0)
    same = lm_diloco.pseudo_gradients(x - np.array([[1.0, 2.0, 2.0]] * 3), x)
    assert same["delta_norm"] == same["mean_delta_norm"] == pytest.approx(3.0)
    assert same["delta_cosine"] == pytest.approx(1.0)
    opposite = lm_diloco.pseudo_gradients(x - np.array([[1.0, 0, 0], [-1.0, 0, 0]]), x)
    assert opposite["mean_delta_norm"] == 0.0 and opposite["delta_cosine"] == pytest.approx(-1.0)


def test_lm_diloco_feedback_record_by_hand():
    """benchmarks/lm_diloco.py: what SparseLoCo's error feedback sent at one sync, from the
    memory before and after, the replicas and the anchor (a leaf without memory ignored)."""
    import numpy as np

    from benchmarks import lm_diloco

    anchor = [np.array([1.0, 0.0]), np.array([5.0])]
    theta = [np.array([[0.0, 0.0], [1.0, -2.0]]), np.array([[0.0], [1.0]])]  # D: (1,0), (0,2)
    before = [np.array([[0.0, 2.0], [0.0, 0.0]]), None]
    after = [np.array([[0.0, 1.0], [0.0, 0.0]]), None]  # replica 0 keeps (0, 1), 1 keeps none
    rec = lm_diloco.feedback_record(before, after, theta, anchor, beta=0.5)
    # targets 0.5 e + D: (1, 1) and (0, 2); payloads (1, 0) and (0, 2)
    assert rec["target_over_delta"] == pytest.approx((np.sqrt(2) + 1.0) / 2)
    assert rec["sent_over_delta"] == pytest.approx(1.0)
    assert rec["memory_over_delta"] == pytest.approx(0.5)
    assert rec["sent_cosine"] == pytest.approx(1.0)


def test_lm_diloco_line_record_by_hand():
    """benchmarks/lm_diloco.py: the held-out loss along the applied outer step and along the
    exact mean pseudo-gradient, on a quadratic 'loss' whose minimum is known."""
    import numpy as np

    from benchmarks import lm_diloco

    class Task:  # loss = |params - (1, 2, 0)|^2 over the flat params
        def eval_loss(self, p):
            flat = np.concatenate([np.ravel(p["a"]), np.ravel(p["b"])])
            return float(np.sum((flat - np.array([1.0, 2.0, 0.0])) ** 2))

    like = {"a": np.zeros((1, 2), np.float32), "b": np.zeros(1, np.float32)}
    x_old = np.zeros(3)
    x_new = np.array([0.5, 1.0, 0.0])  # the applied step: half way to the minimum
    theta = np.array([[1.0, 2.0, 1.0], [1.0, 2.0, -1.0]])  # mean D = -(1, 2, 0)
    rec = lm_diloco.line_record(Task(), like, x_old, x_new, theta)
    assert rec["line"]["1.0"] == pytest.approx(1.25)  # (0.5, 1, 0) from (1, 2, 0)
    assert rec["line"]["0.5"] == pytest.approx(5 * 0.75**2)
    assert rec["line"]["1.5"] == pytest.approx(5 * 0.25**2)
    assert rec["mean_line"] == pytest.approx({"1.0": 0.0, "1.5": 1.25})
    assert rec["step_cosine"] == pytest.approx(1.0)  # both read from x_old: x - x_new, x - theta
    assert rec["step_nonzero"] == pytest.approx(2 / 3)


def test_lm_diloco_short_chunks_by_hand():
    """benchmarks/lm_diloco.py: the chunks of a chunked top-k holding fewer than ``k`` nonzero
    values (the zero padding of a short last chunk counted), and the zeros kept in them."""
    import numpy as np

    import jaxcomp as jc
    from benchmarks import lm_diloco

    full = np.ones(8, np.float32)  # chunks of 4, 2 kept: two full chunks
    sparse = np.array([0, 3, 0, 0, 0, 0, 0, 0, 1, 1], np.float32)  # 1, 0 and 2 of 2 (padded)
    rec = lm_diloco.short_chunks(jc.chunked_top_k(2, chunk=4), [full, sparse])
    assert rec["chunks"] == 5 and rec["short"] == 1 and rec["empty"] == 1
    assert rec["kept_zeros"] == 1 + 2 and rec["zeros"] == 7 and rec["values"] == 18
    assert rec["short_leaf_sizes"] == [10]


def test_lm_diloco_lowrank_and_topk_shares_by_hand():
    """benchmarks/lm_diloco.py: the share of ``|x|^2`` in the best rank-``r`` approximation
    (all of a rank-1 matrix; ``r / n`` of the identity) and in the top ``k`` of each chunk."""
    import numpy as np

    from benchmarks import lm_diloco

    outer = np.outer([1.0, 2.0, 3.0], [4.0, 5.0])
    assert lm_diloco.svd_kept(outer, (1, 2))[1] == pytest.approx(1.0)
    assert lm_diloco.svd_kept(np.eye(4), (1, 2, 4)) == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})
    assert lm_diloco.topk_kept(np.array([3.0, 0, 4, 0]), 1, 2) == pytest.approx(1.0)
    assert lm_diloco.topk_kept(np.array([3.0, 4, 0, 0]), 1, 4) == pytest.approx(16 / 25)
    assert lm_diloco.topk_kept(np.array([3.0, 4, 0]), 1, 2) == pytest.approx(16 / 25)  # padded


def test_lm_diloco_block_topk_and_waterfilling_by_hand():
    """benchmarks/lm_diloco.py: top-1 of each block of 4 in one bit at the mean magnitude of
    the kept values of each 8 (4 and 3 sent as 3.5 each), its packed bytes (2 indices of 2
    bits, 2 sign bits, a scale: a word each); and the per-leaf k, water-filled, spending the
    bytes on the leaf whose energy sits in more coordinates."""
    import numpy as np

    from benchmarks import lm_diloco

    x = np.array([4.0, -2, 0, 0, 1, 3, 0, 0])
    err, nbytes = lm_diloco.block_topk(x, 4, 1, 8)
    assert err == pytest.approx(0.5**2 + 2**2 + 1**2 + 0.5**2) and nbytes == 12
    err, nbytes = lm_diloco.block_topk(x, 4, 1, 8, exact=True)
    assert err == pytest.approx(2**2 + 1**2) and nbytes == 4 + 8
    spread = np.array([1.0] * 8)  # each value sent adds 1 to what is kept
    peaked = np.array([5.0] + [0.01] * 7)  # one value holds it all
    budget = lm_diloco.block_topk(spread, 8, 2, 8)[1] + lm_diloco.block_topk(peaked, 8, 2, 8)[1]
    uniform = lm_diloco.block_topk(spread, 8, 2, 8)[0] + lm_diloco.block_topk(peaked, 8, 2, 8)[0]
    err, nbytes = lm_diloco.waterfilled([spread, peaked], 8, budget)
    assert nbytes <= budget and err < uniform
    assert err == pytest.approx(7 * 0.01**2 + 0.0, abs=1e-3)  # spread sent whole, peaked's top 1


def test_lm_diloco_held_and_outer_cosine_schedules():
    """benchmarks/lm_diloco.py: the inner lr held at its peak after AdamW's 5% warm-up, and
    the outer lr from 0.7 at the first of the 10 outer steps of H = 30 to 0.07 at the last."""
    import numpy as np

    from benchmarks import lm, lm_diloco

    run = lm.Run(steps=300, lr=3e-3, devices=8)
    held = np.asarray(lm_diloco.held_schedule(run)(np.arange(300)))
    assert held[0] == 0.0 and held[5] == pytest.approx(1e-3)  # 3e-3 * 5 / 15
    np.testing.assert_allclose(held[15:], 3e-3, rtol=1e-6)
    outer = np.asarray(lm_diloco.outer_cosine(run, 30, 0.7)(np.arange(10)))
    assert outer[0] == pytest.approx(0.7) and outer[9] == pytest.approx(0.07)
    assert np.all(np.diff(outer) < 0)
    wsd = np.asarray(lm_diloco.wsd_schedule(run)(np.arange(301)))  # the last 60 steps decay
    np.testing.assert_allclose(wsd[:240], held[:240], rtol=1e-6)
    assert wsd[270] == pytest.approx(1.65e-3) and wsd[300] == pytest.approx(3e-4)
    assert np.all(np.diff(wsd[240:]) < 0)


def test_lm_baseline_lr_and_merge_against_the_tuned_baseline(tmp_path, monkeypatch):
    """benchmarks/lm.py ``--baseline-lr``: recorded in the config only where it differs from
    ``--lr``; runs merged from a file with another baseline keep their losses and get their
    gaps and byte ratios against the baseline of the file they are merged into."""
    import argparse
    import json

    from benchmarks import lm

    args = argparse.Namespace(**lm.CONFIGS["cpu"], data="pydoc", seed=0, baseline_lr=None)
    assert "baseline_lr" not in lm.run_config(args)
    args.baseline_lr = 6e-3
    tuned = lm.run_config(args)
    assert tuned["baseline_lr"] == 6e-3 and tuned["lr"] == 3e-3
    assert lm.same_run(tuned) == lm.run_config(
        argparse.Namespace(**{**vars(args), "baseline_lr": None})
    )

    def runs(base_loss, recipe=None):
        rows = [
            {
                "recipe": "adamw",
                "eval_loss": base_loss,
                "bytes_per_step": 3000.0,
                "slow_bytes_per_step": 3000.0,
                "train_seconds": 1.0,
            }
        ]
        if recipe:
            rows.append(
                {
                    "recipe": recipe,
                    "eval_loss": 2.1,
                    "bytes_per_step": 10.0,
                    "slow_bytes_per_step": 10.0,
                    "train_seconds": 1.0,
                }
            )
        return rows

    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(
            {
                "config": lm.same_run(tuned),
                "runs": runs(2.2, "x"),
                "environment": {"command": "old"},
            }
        )
    )
    monkeypatch.setattr(lm, "draw", lambda runs, path: None)
    target = tmp_path / "lm_new.json"
    target.write_text(json.dumps({"config": tuned, "runs": runs(2.0)}))
    merged = runs(2.0)
    assert lm.merge(target, merged, [old]) == 0
    x = next(r for r in json.loads(target.read_text())["runs"] if r["recipe"] == "x")
    # against the target's baseline (2.0), not the old file's (2.2)
    assert x["eval_loss"] == 2.1 and x["gap"] == pytest.approx(0.05)
    assert x["bytes_ratio"] == pytest.approx(300.0)
    # --label: another lr's run of the same recipe, named apart and measured against it
    other = tmp_path / "lr.json"
    other.write_text(
        json.dumps(
            {
                "config": {**lm.same_run(tuned), "lr": 6e-3},
                "runs": runs(1.9)[:1],
                "environment": {"command": "lr"},
            }
        )
    )
    with pytest.raises(ValueError, match="another config"):
        lm.merge(target, merged, [other])
    assert lm.merge(target, merged, [other], label="lr6e-3") == 0
    tuned_row = next(r for r in merged if r["recipe"] == "adamw@lr6e-3")
    assert tuned_row["gap"] == pytest.approx(1.9 / 2.0 - 1.0)
    # --baseline-from: recipes run at --lr 6e-3 without a baseline get the adamw run of a
    # file whose AdamW ran at 6e-3 (baseline_lr) while its recipes ran at 3e-3
    alone = tmp_path / "lm_alone.json"
    alone.write_text(
        json.dumps({"config": {**lm.same_run(tuned), "lr": 6e-3}, "runs": runs(2.0, "y")[1:]})
    )
    base = tmp_path / "lm_base.json"
    base.write_text(
        json.dumps({"config": tuned, "runs": runs(2.0, "z"), "environment": {"command": "b"}})
    )
    rows = json.loads(alone.read_text())["runs"]
    assert lm.merge(alone, rows, [], baseline=base) == 0
    data = json.loads(alone.read_text())
    assert [r["recipe"] for r in data["runs"]] == ["adamw", "y"]  # not its recipe z (3e-3)
    assert data["runs"][1]["gap"] == pytest.approx(2.1 / 2.0 - 1.0)
    assert data["runs"][1]["bytes_ratio"] == pytest.approx(300.0)
    assert data["merged"] == ["b (its adamw run)"]
    with pytest.raises(ValueError, match="AdamW ran another config"):
        lm.merge(alone, rows[1:], [], baseline=old)  # its AdamW ran at 3e-3, the recipes at 6e-3


def test_lm_demo_schedules_are_the_documented_ones():
    """benchmarks/lm_demo.py: ``-end1`` (the peak held after the warm-up) is ``jc.demo``'s
    documented ``optax.linear_schedule(0, peak, warmup)`` at every step, ``-end0.1`` AdamW's."""
    import numpy as np
    import optax

    from benchmarks import lm, lm_demo

    run = lm.Run(steps=300, lr=3e-3, devices=8)
    t = np.arange(0, 301)
    held = np.asarray(lm_demo.schedule(run, 3e-3, 1.0)(t))
    np.testing.assert_array_equal(held, np.asarray(optax.linear_schedule(0.0, 3e-3, 15)(t)))
    assert held[15] == held[300] == np.float32(3e-3)
    np.testing.assert_array_equal(lm_demo.schedule(run, 4e-3, 0.1)(t), run.schedule(4e-3)(t))
    assert lm_demo.schedule(run, 4e-3, 0.6)(300) == pytest.approx(2.4e-3)
    # -wsd20: the documented join of the warm-up and a linear decay over the last 20%.
    wsd = optax.join_schedules(
        [
            optax.linear_schedule(0.0, 3e-3, 15),
            optax.linear_schedule(3e-3, 3e-4, 60, transition_begin=225),
        ],
        [15],
    )
    np.testing.assert_array_equal(lm_demo.schedule(run, 3e-3, 1.0, tail=0.2)(t), wsd(t))
    assert lm_demo.schedule(run, 3e-3, 1.0, warmup=0.1)(30) == np.float32(3e-3)


def test_lm_demo_mean_of_signs():
    """benchmarks/lm_demo.mean_of_signs: with the same gradient on every device it is DeMo's
    sign update exactly (the same momentum left); with different ones each value is a mean of
    8 signs (a multiple of 1/4 in [-1, 1]) and the momentum is still DeMo's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc
    from benchmarks import lm_demo
    from jaxcomp._src import demo

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    params = {"w": jnp.zeros((8, 70))}
    g = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 8, 70))}
    same = {"w": jnp.broadcast_to(g["w"][:1], g["w"].shape)}

    def runner(tx):
        """One compiled step of ``tx`` from its initial state, for both gradients."""
        s0 = jc.sharded_init(tx, params, mesh, "d")
        spec = jc.state_specs(s0, "d")
        f = jax.shard_map(
            lambda gg, s: tx.update(jax.tree.map(lambda x: x[0], gg), s, params),
            mesh=mesh,
            in_specs=(P("d"), spec),
            out_specs=(P(), spec),
            check_vma=False,
        )
        step = jax.jit(f)

        def run(grads):
            grads = jax.device_put(grads, NamedSharding(mesh, P("d")))
            return jax.tree.map(np.asarray, step(grads, s0))

        return run

    mine = runner(lm_demo.mean_of_signs("d", decay=0.95))
    base = runner(demo.scale_by_demo("d", decay=0.95, topk=18, bits=4))
    for grads in (same, g):
        (u, s), (ub, sb) = mine(grads), base(grads)
        np.testing.assert_allclose(s.momentum["w"], sb.momentum["w"], rtol=1e-6, atol=1e-6)
        if grads is same:
            np.testing.assert_array_equal(u["w"], ub["w"])
        else:
            assert np.all(np.abs(u["w"]) <= 1) and np.all(np.mod(u["w"] * 4, 1) == 0)
            assert 0 < np.abs(u["w"]).mean() < 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_network_children_finds_the_launchers_workers():
    """benchmarks/network.py: a launch with no namespace kills the launcher's workers (in
    sessions of their own) by parent; ``children`` finds exactly them."""
    import signal

    from benchmarks import network

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        for _ in range(50):  # until both sleeps have started
            kids = network.children(shell.pid)
            if len(kids) == 2:
                break
            time.sleep(0.02)
        assert len(kids) == 2 and shell.pid not in kids
        assert network.children(kids[0]) == []
    finally:
        for pid in network.children(shell.pid):
            os.kill(pid, signal.SIGKILL)
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_lm_branch_bytes_refuses_an_unknown_second_conditional(monkeypatch):
    """benchmarks/lm.py weights a second lax.cond as 0/1 Adam's variance cond only where the
    recipe has a 'variance' regime and the cond has 2 branches: anything else is an error, not
    bytes weighted by the wrong counts."""
    import types

    import jaxcomp as jc
    from benchmarks import lm

    conds = [
        types.SimpleNamespace(index=0, num_branches=2),
        types.SimpleNamespace(index=1, num_branches=3),
    ]
    report = types.SimpleNamespace(logical_conditionals=conds)
    monkeypatch.setattr(jc, "comm_report", lambda *a: report)
    recipe = lm.Recipe(make=None, branches=("a", "b"), regime=lambda run, t: "a" if t < 2 else "b")
    with pytest.raises(ValueError, match="variance cond"):
        lm.branch_bytes(recipe, lm.Run(steps=4, lr=1e-3, devices=8), None, None, None, None)


def test_exact_optimum_quick(tmp_path, monkeypatch):
    """--quick: identity and int8, 50 steps. The identity's distance is exact gradient
    descent's on the mean loss, ``w_T = w* (1 - (1 - lr mean_i h_i)^T)`` per coordinate."""
    import numpy as np

    from benchmarks import exact_optimum as eo

    run_here("exact_optimum.py", "--quick", out=tmp_path, monkeypatch=monkeypatch)
    rows = {r["exchange"]: r for r in load(tmp_path, "exact_optimum_quick.json")["rows"]}
    assert set(rows) == {"identity", "int8"} and rows["identity"]["steps"] == 50
    h, _, best = eo.problem()
    for lr in eo.LRS:
        w = {k: best[k] * (1 - (1 - lr * h[k].astype(np.float64).mean(0)) ** 50) for k in best}
        expected = eo.distance(w, best)
        assert rows["identity"][f"lr {lr:g}"] == pytest.approx(expected, rel=2e-3)
        assert rows["int8"][f"lr {lr:g}"] == pytest.approx(expected, rel=0.05)


def test_wire_bytes_flags_name_only_rows_it_measures(capsys):
    """benchmarks/wire_bytes.py (`make bench`): the defaults, and a usage error naming the
    flag for a device count out of range (was a ValueError traceback), an unknown codec
    (failed minutes in), a --compiled row or an --all-strategies tree the run does not
    measure (ignored without a word until 2026-11-27)."""
    import argparse

    from benchmarks import wire_bytes

    ap = argparse.ArgumentParser(prog="wire_bytes")
    flags = dict(quick=True, trees=None, codecs=None, devices=None)

    def resolve(**kw):
        ns = argparse.Namespace(**{**flags, "all_strategies": None, "compiled": None, **kw})
        return wire_bytes.resolve(ap, ns)

    assert resolve() == (["resnet18"], wire_bytes.QUICK_CODECS, [2, 8], set(), [])
    full = resolve(quick=False)
    assert full[3] == {("resnet18", 8, c) for c in ("pmean", "sign", "int8", "bf16")}
    assert full[4] == ["resnet18"]
    assert resolve(quick=False, trees=["gpt2"])[3:] == (set(), [])
    assert resolve(compiled=["resnet18:8:*"])[3] == {("resnet18", 8, "*")}
    bad = [
        ({"devices": [1]}, "--devices"),
        ({"codecs": ["int9"]}, "--codecs"),
        ({"compiled": ["resnet18:4:int8"]}, "--compiled"),
        ({"compiled": ["gpt2:8:int8"]}, "--compiled"),
        ({"compiled": ["resnet18"]}, "--compiled"),
        ({"all_strategies": ["gpt2"]}, "--all-strategies"),
    ]
    for kw, flag in bad:
        with pytest.raises(SystemExit):
            resolve(**kw)
        assert f"argument {flag}:" in capsys.readouterr().err, kw


def test_lm_diloco_denominator_ratio_skips_what_it_cannot_compare():
    """benchmarks/lm_diloco.py: the replicas' Adam denominator over data parallel's, and None
    where Muon inside holds an Adam ``nu`` for fewer leaves than AdamW data parallel (until
    2026-11-27 ``--diagnose`` of a Muon-inside row with the baseline raised a broadcast error
    after training the baseline)."""
    import numpy as np

    from benchmarks import lm_diloco

    nu, base = np.array([4.0, 9.0, 16.0]), np.array([1.0, 1.0, 4.0])
    assert lm_diloco.denominator_ratio(nu, base) == pytest.approx(2.0)  # median of 2, 3, 2
    assert lm_diloco.denominator_ratio(nu, None) is None  # --no-baseline
    assert lm_diloco.denominator_ratio(nu[:2], base) is None  # Muon inside: fewer leaves


def test_lm_batch_seed_changes_the_batches_not_the_initialization():
    """benchmarks/lm.py ``--batch-seed``: another order of batches for the same
    initialization (the batches of ``--seed`` equal to it, the params of ``--seed``),
    recorded in the config only where given."""
    import argparse

    import jax
    import numpy as np

    from benchmarks import lm

    small = dict(d_model=16, layers=1, heads=2, context=8, batch_per_device=2, steps=4, lr=3e-3)

    def task(seed, batch_seed=None):
        args = argparse.Namespace(
            **small, data="pydoc", seed=seed, batch_seed=batch_seed, baseline_lr=None
        )
        return lm.Task(args, 2), lm.run_config(args)

    (a, config_a), (b, config_b), (c, _) = task(2), task(2, 12), task(12)
    assert "batch_seed" not in config_a and config_b["batch_seed"] == 12
    same = jax.tree.map(np.array_equal, a.params, b.params)
    assert all(jax.tree.leaves(same))
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, b.params, c.params)))
    first_a, first_b, first_c = a.batch(), b.batch(), c.batch()
    assert not np.array_equal(first_a, first_b)
    np.testing.assert_array_equal(first_b, first_c)


def test_lm_gap_windows_by_hand():
    """benchmarks/lm_gap_windows.py: the training-loss gap per window of the same steps, the
    held-out gaps at steps 150 and 300, the late rise after the first third."""
    from benchmarks import lm_gap_windows

    base = [2.0] * 6
    curve = [2.2, 2.2, 2.1, 2.1, 2.4, 2.4]  # windows of 2: +10%, +5%, +20%
    assert lm_gap_windows.window_gaps(curve, base, 2) == pytest.approx([10.0, 5.0, 20.0])
    run = {"recipe": "r", "curve": curve, "evals": [[150, 2.2], [300, 2.4]]}
    adamw = {"recipe": "adamw", "curve": base, "evals": [[150, 2.0], [300, 2.0]]}
    rec = lm_gap_windows.row("pair", run, adamw, 0.5, 2)
    assert rec["w1"] == 10.0 and rec["w3"] == 20.0
    assert rec["late rise"] == 15.0  # the last window (+20%) over the smallest after w1 (+5%)
    assert rec["held-out 150"] == 10.0 and rec["held-out 300"] == 20.0
    assert lm_gap_windows.held_out_gap(run, adamw, 200) is None


def test_lm_diloco_shrinking_intervals_keep_the_syncs():
    """benchmarks/lm_diloco.py: ``shrinking(h, steps)`` makes ``steps // h`` intervals from
    ``1.5 h`` down to ``0.5 h`` that end on ``steps``: the syncs (so the bytes) of ``h``."""
    from benchmarks import lm_diloco

    assert lm_diloco.shrinking(30, 300) == (45, 42, 38, 35, 32, 28, 25, 22, 18, 15)
    eight = lm_diloco.shrinking(8, 300)
    assert len(eight) == 37 and sum(eight) == 296  # H = 8's 37 syncs, the last at step 296
    assert eight[0] == 12 and eight[-1] == 4


def test_lm_diloco_growing_intervals_keep_the_syncs():
    """benchmarks/lm_diloco.py: ``growing(h, steps)``, the same intervals as ``shrinking``
    from ``0.5 h`` up to ``1.5 h``: the syncs (so the bytes) of ``h``, ending on ``steps``."""
    from benchmarks import lm_diloco

    grow = lm_diloco.growing(30, 300)
    assert grow == (15, 18, 22, 25, 28, 32, 35, 38, 42, 45)
    assert len(grow) == 300 // 30 and sum(grow) == 300


def test_lm_diloco_outer_wsd_holds_then_decays_over_the_last_syncs():
    """benchmarks/lm_diloco.py: ``outer_wsd(lr, syncs)`` is ``lr`` at every outer step but
    the last ``tail`` (count 0-based), decayed linearly to ``final x lr`` at the last."""
    from benchmarks import lm_diloco

    lrs = [float(lm_diloco.outer_wsd(1.5, 10)(k)) for k in range(10)]
    assert lrs == pytest.approx([1.5] * 8 + [1.125, 0.75])
    assert float(lm_diloco.outer_wsd(2.0, 4, tail=1, final=0.25)(3)) == pytest.approx(0.5)


def test_sharded_benchmark_loads_its_example_without_examples_on_the_path(monkeypatch):
    """``python -m benchmarks.sharded`` from the root: ``examples/fsdp_lm.py`` imports
    ``_flags``, which is not importable there (it failed with ModuleNotFoundError)."""
    from benchmarks import sharded

    monkeypatch.setattr(
        sys, "path", [p for p in sys.path if not p.rstrip("/").endswith("examples")]
    )
    monkeypatch.delitem(sys.modules, "_flags", raising=False)
    lm = sharded.example()
    assert callable(lm.bounded) and hasattr(lm, "main")
