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
