"""Gossip across 2 local JAX processes over gloo (tests/scripts/gossip_train.py).

The payloads travel by ``collective-permute`` between processes. What the algorithm says must
agree does: exact gossip on a ring of 2 with ``gamma=1`` and ``every=2`` leaves the replicas
apart after a local step and equal (to rounding) after each mixing round; for it and for
int8 CHOCO-SGD the mean of the replicas is the mean of the local SGD steps, every step; both
processes see the same figures.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from jaxcomp import launch

SCRIPT = Path(__file__).parent / "scripts" / "gossip_train.py"
STEPS = 4


@pytest.mark.slow
def test_two_processes_mix_and_keep_the_mean():
    out = io.StringIO()
    status = launch.run([str(SCRIPT), "--steps", str(STEPS)], 2, timeout=300, grace=30, out=out)
    text = out.getvalue()
    assert status == 0, text[-4000:]
    rows = re.findall(r"^\[(\d)\] STEP (\d+) (\w+) (\S+) (\S+)$", text, re.M)
    by_rank = {
        r: {(int(t), name): (float(cd), float(err)) for rr, t, name, cd, err in rows if rr == r}
        for r in "01"
    }
    assert by_rank["0"] == by_rank["1"] and len(by_rank["0"]) == 2 * STEPS, text[-4000:]
    seen = by_rank["0"]
    for t in range(1, STEPS + 1):
        cd, err = seen[(t, "exact")]
        assert (cd < 1e-6) if t % 2 == 0 else (cd > 1e-3), (t, cd)
        assert err < 1e-6, (t, err)
        cd, err = seen[(t, "choco")]
        assert 0 < cd < 1e-2 and err < 1e-6, (t, cd, err)
