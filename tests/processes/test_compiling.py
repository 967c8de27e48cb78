"""examples/compiling/train.py for real: a CPU inductor run whose batches change shape at step 5.

One run (compiling is slow here), read back from its workspace: the steps marked as compiling in
the trace and the metrics, the recompilation's reason as dynamo gives it, logged once each, the
compiling steps left out of the throughput, and a checkpoint whose keys are the model's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainloop.checkpoint.weights import read_weights
from trainloop.core.metrics import read_metrics
from trainloop.machine import read_compile_marks, read_trace

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "compiling" / "train.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    workspace = tmp_path_factory.mktemp("compiling") / "ws"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINLOOP_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(workspace)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workspace, result


def test_the_compiling_steps_are_marked_in_the_trace_with_the_recompilation_reason(run):
    workspace, _ = run
    first, again = read_compile_marks(workspace / "trace.jsonl")
    assert (first.step, first.recompilation, first.reasons) == (1, False, ())
    assert (again.step, again.recompilation) == (5, True)
    (reason,) = again.reasons
    assert "size mismatch at index 0. expected 2, actual 3" in reason
    assert max(e.step for e in read_trace(workspace / "trace.jsonl")) == 8  # the transitions read past the marks


def test_each_compilation_is_logged_once_and_the_recompilation_names_its_reason(run):
    _, result = run
    compiled = [line for line in result.stderr.splitlines() if "torch.compile compiled" in line]
    recompiled = [line for line in result.stderr.splitlines() if "torch.compile recompiled" in line]
    assert len(compiled) == 1
    assert compiled[0].startswith("INFO")
    assert "at step 1" in compiled[0]
    assert len(recompiled) == 1
    assert recompiled[0].startswith("WARNING")
    assert "at step 5" in recompiled[0]
    assert "size mismatch at index 0. expected 2, actual 3" in recompiled[0]
    assert "compiling 1 step" in next(line for line in result.stderr.splitlines() if "Step 4/8" in line)


def test_the_metrics_count_the_compiling_steps_and_leave_them_out_of_the_throughput(run):
    workspace, _ = run
    rows = {row["step"]: row for row in read_metrics(workspace / "metrics.jsonl") if "loss" in row}
    assert sorted(rows) == [4, 8]
    assert (rows[4]["compile_steps"], rows[4]["recompilations"]) == (1, 0)
    assert (rows[8]["compile_steps"], rows[8]["recompilations"]) == (1, 1)
    # Steps 2-4 trained on 2 samples each, steps 6-8 on 3: the compiling steps 1 and 5 are not counted.
    assert (rows[4]["throughput/items"], rows[8]["throughput/items"]) == (6, 9)


def test_the_checkpoint_of_a_compiled_model_has_the_models_own_keys(run):
    workspace, _ = run
    keys = set(read_weights(workspace).state_dict)
    assert keys == {"0.weight", "0.bias", "2.weight", "2.bias"}
