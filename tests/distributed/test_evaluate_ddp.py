"""``evaluate()`` under torchrun, 2 and 3 gloo ranks: every rank takes part; the reduced metrics equal one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_process import HIDDEN_GPUS
from cli_process import cli_env
from eval_trainers import VAL_SIZE, EvalTrainer, ItemMeansTrainer

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


def torchrun_cli(ranks, *args, cwd):
    """``torchrun --nproc_per_node=RANKS -m trainloop ARGS`` started now (gloo on the CPU); ``.wait()`` for it."""
    env = {k: v for k, v in cli_env().items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **HIDDEN_GPUS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "trainloop", *args]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-4000:]
    return out


def test_validation_and_trainloop_evaluate_over_ranks_count_each_item_once_as_one_process_does(tmp_path):
    # Validation sets that do not divide by the ranks: 7 items on 2, 10 (shuffled) on 3. Each rank's
    # DistributedSampler pads them; val_metrics reduces with ItemMeans, which leaves the padding out.
    hooks = [
        {"type": "validation", "evaluate": "val_metrics", "interval": 2},
        {"type": "checkpointing", "interval": 2, "keep_interval": 2},
    ]
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 4, "workspace": "ws", "val_items": 7, "hooks": hooks}))
    trainer = ("--trainer", "eval_trainers:TorchrunItemMeansTrainer")
    finished(torchrun_cli(2, "run", "run.json", *trainer, cwd=tmp_path))
    on_two = torchrun_cli(2, "evaluate", "run.json", *trainer, "--checkpoint", "ws/checkpoints/2", cwd=tmp_path)
    on_three = torchrun_cli(
        3, "evaluate", "run.json", *trainer, "--checkpoint", "ws/checkpoints/4", "--set", "val_items=10",
        "--set", "val_shuffle=true", cwd=tmp_path,
    )  # fmt: skip
    validated = {
        line["step"]: line
        for line in map(json.loads, (tmp_path / "ws" / "metrics.jsonl").read_text().splitlines())
        if "val/loss" in line
    }
    evaluated = {2: json.loads(finished(on_two)), "10 items": json.loads(finished(on_three))}

    def alone(step, **settings):  # one process, no process group, the same weights
        single = ItemMeansTrainer(max_steps=4, hooks=[ValidationHook("val_metrics", interval=2)], **settings)
        return single.evaluate(tmp_path / "ws" / "checkpoints" / str(step))

    expected = {2: alone(2), 4: alone(4), "10 items": alone(4, val_items=10, val_shuffle=True)}
    found = {2: validated[2], 4: validated[4]}  # the training run's validations, through ValidationHook
    pairs = [(found[2], expected[2]), (found[4], expected[4]), (evaluated[2], expected[2]), (evaluated["10 items"], expected["10 items"])]
    for ranks, one in pairs:
        # The targets are data: the reduction alone, float64 sums in another order. The loss is the
        # model's: a batch of other items may round an item's output otherwise in float32.
        assert ranks["val/target"] == pytest.approx(one["val/target"], rel=1e-12)
        assert ranks["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)
        # Summing and counting what each rank drew counts the padding (item 0 twice on 2 ranks).
        assert ranks["val/naive/loss"] != pytest.approx(one["val/loss"], rel=1e-3)
        assert one["val/naive/loss"] == pytest.approx(one["val/loss"], rel=1e-12)
