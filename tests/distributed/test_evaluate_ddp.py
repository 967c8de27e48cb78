"""``evaluate()`` under torchrun, 2 gloo ranks: every rank takes part; the reduced metrics equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_process import HIDDEN_GPUS
from eval_trainers import VAL_SIZE, EvalTrainer

from trainloop.checkpoint.files import checkpoint_format
from trainloop.hooks.validation import ValidationHook

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = SUPPORT.parents[1]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def test_two_rank_evaluate_of_a_sharded_checkpoint_equals_a_single_process_evaluation(tmp_path):
    assert VAL_SIZE % 2 == 1  # the validation set does not divide by the world size
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **HIDDEN_GPUS, PYTHONPATH=os.pathsep.join([str(SUPPORT), str(REPO)]))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(SUPPORT / "eval_ddp_worker.py"), str(tmp_path / "ws"), str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["evaluated"] == ranks[1]["evaluated"]  # reduced: every rank has the whole set's metric
    assert ranks[0]["evaluated"]["val/count"] == VAL_SIZE  # each sample once: none dropped, none repeated
    for r in ranks:
        assert r["kind"] == "evaluate"
        assert r["evaluated"]["val/loss"] == pytest.approx(r["trained"], rel=1e-12)  # the weights validated at 4
    # One process, no process group, reading the sharded checkpoint the two ranks wrote.
    single = EvalTrainer(max_steps=4, hooks=[ValidationHook("val_metrics", interval=2)])
    alone = single.evaluate(tmp_path / "ws" / "checkpoints" / "4")
    assert alone["val/count"] == VAL_SIZE
    assert alone["val/loss"] == pytest.approx(ranks[0]["evaluated"]["val/loss"], rel=1e-9)
    assert checkpoint_format(tmp_path / "ws" / "checkpoints" / "4") == "sharded"
