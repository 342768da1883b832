"""The Flax NNX example trains data-parallel on 8 devices: compressed runs keep accuracy."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import flax_nnx_train as example  # noqa: E402

STEPS = 1000


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
