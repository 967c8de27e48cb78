"""``trainloop predict`` under ``torchrun``, two gloo ranks: every item once, in dataset order.

13 items over 2 ranks: each rank's ``DistributedSampler`` gives it 7, one of them padding (a repeat
of the sampler's first item). With and without shuffling, the file equals what one process predicts
with the same weights, row for row.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from child_process import HIDDEN_GPUS
from cli_process import cli_env
from predict_trainers import PredictTrainer
from safetensors.torch import load_file

from trainloop import CheckpointingHook

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ws = tmp_path_factory.mktemp("trained") / "ws"
    PredictTrainer(max_steps=5, workspace=ws, hooks=[CheckpointingHook(interval=5)]).train()
    return ws / "checkpoints" / "5"


def torchrun_predict(tmp_path, checkpoint, shuffle):
    (tmp_path / "predict.json").write_text(f'{{"max_steps": 5, "items": 13, "batch_size": 4, "shuffle": {str(shuffle).lower()}}}')
    env = {k: v for k, v in cli_env().items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **HIDDEN_GPUS)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainloop",
        "predict", "predict.json", "--trainer", "predict_trainers:TorchrunPredictTrainer",
        "--checkpoint", str(checkpoint), "--output", "out.safetensors",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_two_ranks_predict_every_item_once_in_dataset_order(tmp_path, checkpoint, shuffle):
    done = torchrun_predict(tmp_path, checkpoint, shuffle)
    written = load_file(tmp_path / "out.safetensors")
    alone = PredictTrainer(max_steps=5, items=13).predict(checkpoint=checkpoint)  # one process, same weights
    assert sorted(written) == ["x", "y"]
    assert written["x"].shape == (13, 4)
    assert torch.equal(written["x"], alone["x"])  # each item once, at its index: the inputs say so exactly
    torch.testing.assert_close(written["y"], alone["y"])
    assert done.stderr.count("Predicted 13 items") == 2  # every rank gathered all of them
    assert done.stderr.count("Wrote the predictions of 13 items") == 1  # rank 0 wrote them


def test_without_a_distributed_sampler_two_ranks_are_refused(tmp_path, checkpoint, monkeypatch):
    # The same trainer, but its loader is not split across the ranks: a clear error, no file.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), cli_env()["PYTHONPATH"]]))
    (tmp_path / "plain_predict.py").write_text(
        "from predict_trainers import TorchrunPredictTrainer\n"
        "from tiny_trainer import make_data\n"
        "from torch.utils.data import DataLoader\n"
        "class Plain(TorchrunPredictTrainer):\n"
        "    def build_predict_data_loader(self):\n"
        "        return DataLoader(make_data(13, seed=1), batch_size=4)\n"
    )
    (tmp_path / "predict.json").write_text('{"max_steps": 5}')
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TRAINLOOP_")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **HIDDEN_GPUS)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainloop",
        "predict", "predict.json", "--trainer", "plain_predict:Plain", "--checkpoint", str(checkpoint),
        "--output", "out.pt",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "trainloop predict: error: predict under 2 ranks needs a DataLoader with a DistributedSampler" in done.stderr
    assert not (tmp_path / "out.pt").exists()
