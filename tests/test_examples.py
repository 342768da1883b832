"""The Flax NNX example trains data-parallel on 8 devices: compressed runs keep accuracy."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import flax_nnx_train as example  # noqa: E402

# 120 steps (test compile flags, 8 CPU devices): none 97.2%, sign 97.7% (22.0x fewer bytes),
# int8 97.5% (3.8x); 200 steps: 98.0%, 97.7%, 98.0%; 400 steps: 98.5%, 98.0%, 98.5%.
STEPS = 120


@pytest.fixture(scope="module")
def baseline():
    return example.train("none", steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("codec,floor_ratio", [("sign", 20.0), ("int8", 3.5)])
def test_digits_accuracy_within_1_5_points(baseline, codec, floor_ratio):
    result = example.train(codec, steps=STEPS)
    print(f"{codec}: {result.accuracy:.4f} vs {baseline.accuracy:.4f}, {result.ratio:.1f}x")
    assert baseline.accuracy >= 0.96
    assert result.accuracy >= baseline.accuracy - 0.015
    assert result.ratio >= floor_ratio


def test_demo_table_runs(capsys):
    assert example.main(["--codec", "int4", "--steps", "20"]) == 0
    out = capsys.readouterr().out
    assert "bytes/step/device" in out and "int4" in out and "none" in out


def test_adamw_path_trains_and_compresses():
    """``--optimizer adamw``: nnx.Optimizer(model, chain(compressed_allreduce, adamw)) learns."""
    result = example.train("int8", steps=30, optimizer="adamw", lr=2e-3, strategy="two_phase")
    print(
        f"adamw/int8: loss {result.initial_test_loss:.3f} -> {result.test_loss:.3f}, "
        f"acc {result.accuracy:.3f}, {result.ratio:.1f}x"
    )
    assert np.isfinite(result.test_loss)
    assert result.test_loss < 0.5 * result.initial_test_loss
    assert result.accuracy >= 0.8
    assert result.ratio >= 3.5  # int8 vs f32 pmean, two-phase


def test_fsdp_baseline_is_float32_across_replicas_too(monkeypatch, capsys):
    """examples/fsdp_lm.py --replicas 2: the float32 baseline averages across the replica
    groups with the identity codec, not with --replica-codec. Until 2026-11-27 it used the
    replica codec (int8 by default): at 2 x 4 devices, d_model 32, 1 layer, its step read
    192.8 KiB per device instead of float32's 210.7 and the printed bytes ratio 0.243
    instead of 0.222. The runs are recorded, not trained (``train`` replaced)."""
    import fsdp_lm

    calls = []

    def fake(steps, **kwargs):
        calls.append(kwargs)
        loss = {"eval_loss": 1.0, "train_loss": [2.0, 1.0], "bytes_per_device": 1024.0}
        return {**loss, "seconds": 0.0, "digest": "0" * 64, "params": 1}

    monkeypatch.setattr(fsdp_lm, "train", fake)
    assert fsdp_lm.main(["--replicas", "2", "--replica-codec", "int4", "--steps", "1"]) == 0
    codecs = {(c["weights"], c["grads"]): c["replica_codec"] for c in calls}
    assert codecs == {("int8", "int4"): "int4", ("none", "none"): "identity"}
    assert "replicas identity" in capsys.readouterr().out
    calls.clear()
    assert fsdp_lm.main(["--replicas", "2", "--steps", "1", "--no-baseline"]) == 0
    assert [c["replica_codec"] for c in calls] == ["int8"]  # the default across groups


def test_fsdp_replica_exchange_names_the_shard_axis(monkeypatch):
    """examples/fsdp_lm.py --replicas 2 steps under ``shard_map(check_vma=False)``, where
    jax's types do not say that the leaves are shards over "data": the exchange across the
    replica groups gets ``shard_axis="data"``. Without it a NaN in one shard froze that
    shard's devices' memories only, and jc.compressed_allreduce warns since 2026-11-27 (the
    example printed that warning). Its step sends 6 bytes more for it at 2 x 4 devices,
    ``d_model`` 32, 1 layer (47,957 -> 47,963 B/device): the flag's psum over "data"."""
    import fsdp_lm

    class Built(Exception):
        pass

    def record(codec, axis_name, **kwargs):
        raise Built(axis_name, kwargs)

    monkeypatch.setattr(fsdp_lm.jc, "compressed_allreduce", record)
    with pytest.raises(Built) as info:
        fsdp_lm.train(1, replicas=2, d_model=32, layers=1)
    assert info.value.args == ("replica", {"shard_axis": "data"})


@pytest.mark.parametrize("transform", ["diloco", "sparseloco"])
def test_fsdp_replica_groups_step_apart_from_sharded_init(monkeypatch, transform):
    """examples/fsdp_lm.py --replicas 2 --replica-transform diloco / sparseloco: each replica
    group steps on its own params (FSDP inside, int8 weights / int4 gradients), the state
    from ``jc.sharded_init(tx, params, mesh, "replica", param_specs=...)`` with every leaf
    ``P("data")``, the groups synced every 2 steps. 4 steps at 2 x 4 devices, d_model 32,
    1 layer: the train loss falls (measured 5.909 -> 5.032 with DiLoCo, -> 5.173 with
    SparseLoCo) and the evaluated mean of the groups is finite and below the first loss
    (held-out 5.108 and 5.414). Until 2026-11-27 the example had the
    compressed all-reduce across groups only (HSDP), and ``jc.sharded_init`` with
    ``param_specs`` failed for these transforms."""
    import fsdp_lm

    given = []
    real = fsdp_lm.jc.sharded_init

    def record(tx, params, mesh, axis_name, param_specs=None):
        given.append((axis_name, param_specs))
        return real(tx, params, mesh, axis_name, param_specs=param_specs)

    monkeypatch.setattr(fsdp_lm.jc, "sharded_init", record)
    r = fsdp_lm.train(
        4,
        replicas=2,
        replica_transform=transform,
        sync_every=2,
        d_model=32,
        layers=1,
        report_bytes=False,
    )
    (axis_name, specs), *_ = given
    assert axis_name == "replica"
    assert set(_spec_strings(specs)) == {"P('data',)"}
    assert r["train_loss"][-1] < r["train_loss"][0] - 0.5
    assert np.isfinite(r["eval_loss"]) and r["eval_loss"] < r["train_loss"][0] - 0.3


def _spec_strings(specs):
    """The PartitionSpecs of a spec tree, as strings."""
    import jax
    from jax.sharding import PartitionSpec as P

    return [str(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))]


def test_gossip_says_which_side_sends_more():
    """examples/gossip.py's last line: float32 gossip with 3 neighbours sends 112.6 KiB per
    device per step against pmean's 65.7 KiB; it printed "0.6x more" for pmean."""
    import gossip

    assert gossip.compare(115320.0, 67270.0) == "gossip sends 1.7x more"
    assert gossip.compare(9000.0, 67270.0) == "7.5x more than gossip"


def test_periodic_examples_count_the_bytes_of_the_run():
    """diloco.py / muloco.py / sparseloco_demo.py: bytes per step over the run's steps, from
    the steps at which an exchange lands. Until 2026-11-27 they printed a period's average
    whatever --steps: at --steps 6 --sync-every 4 (one sync) diloco's float32 exchange read
    33618 B/step (134470 / 4) where the run sent 22412 (134470 / 6)."""
    import diloco
    import sparseloco_demo

    assert diloco.exchanges(6, sync_every=4, fragments=1, delay=0) == [3]
    assert diloco.exchanges(8, sync_every=4, fragments=2, delay=1) == [2, 4, 6]
    assert diloco.exchanges(3, sync_every=4, fragments=1, delay=0) == []
    assert [sparseloco_demo.syncs(s, 10) for s in (9, 10, 300, 305)] == [0, 1, 30, 30]
