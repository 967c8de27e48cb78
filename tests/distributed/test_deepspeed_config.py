"""DeepSpeed's config as a user meets it: checked against what DeepSpeed reads, refused in one line before step 1.

The engine cases (offload, the warnings a run prints) run in tests/support/deepspeed_worker.py's one launch and
are asserted in tests/distributed/test_deepspeed.py; these run in this process or through the command line.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from cli_process import Cli, cli_env
from pydantic import ValidationError

from trainloop import TrainerSettings
from trainloop.core.result import RefusedRunError
from trainloop.settings.deepspeed import deepspeed_problems

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (trainloop[deepspeed])")
ZERO3 = {"zero_optimization": {"stage": 3}}
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _trainer(**settings):
    from tiny_trainer import TinyTrainer

    return TinyTrainer(**{"max_steps": 2, "device": "cpu", "deepspeed": ZERO3, **settings})


def _launched(monkeypatch):
    """The environment torchrun gives one process (DeepSpeed reads it to join the process group)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)


def _refusal(trainer, workspace):
    """The one-line refusal ``trainer.train()`` ends in, before step 1 and before ``workspace`` is made."""
    with pytest.raises(RefusedRunError) as error:
        trainer.train()
    assert trainer.step == 0
    assert not workspace.exists()
    return str(error.value)


def test_a_process_no_launcher_started_is_one_line_saying_how_to_launch_it(tmp_path, monkeypatch):
    # Without torchrun's environment DeepSpeed would look for MPI and end in mpi4py's traceback.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert _refusal(_trainer(workspace=tmp_path / "ws"), tmp_path / "ws") == (
        "deepspeed joins the process group a launcher describes, and this process has no RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT, LOCAL_RANK: launch it with torchrun (torchrun --nproc-per-node 1 -m trainloop run "
        "... for one process)"
    )


@needs_deepspeed
def test_a_torch_optimizer_under_offload_is_one_line_saying_what_deepspeed_wants(tmp_path, monkeypatch):
    _launched(monkeypatch)
    assert _refusal(_trainer(deepspeed=OFFLOAD, workspace=tmp_path / "ws"), tmp_path / "ws") == (
        "TinyTrainer.build_optimizer() returned SGD, but deepspeed's offload_optimizer (device 'cpu') steps "
        "DeepSpeed's CPU optimizer: return deepspeed.ops.adam.DeepSpeedCPUAdam, or set "
        '"zero_force_ds_cpu_optimizer": false to step this one on the CPU'
    )


def test_several_optimizers_are_refused_before_forward_is_checked_against_them(monkeypatch):
    # forward(batch) takes no optimizer's name: the DeepSpeed refusal is what the user must fix first.
    _launched(monkeypatch)
    trainer = _trainer()
    trainer.build_optimizer = lambda: {  # type: ignore[method-assign]
        "a": torch.optim.SGD(trainer.model.parameters(), lr=0.1),
        "b": torch.optim.SGD(trainer.model.parameters(), lr=0.1),
    }
    with pytest.raises(RefusedRunError) as error:
        trainer.train()
    assert str(error.value) == (
        "TinyTrainer.build_optimizer() returned several optimizers (a, b), but deepspeed drives one: "
        "return one optimizer"
    )


# -- the config read as DeepSpeed reads it: a key it would ignore, a section it would refuse --------------------------

#: A real-world config: ZeRO-3 with both offloads, bf16 (mixed_precision), fp16's loss scaling declared off,
#: DeepSpeed's own optimizer and scheduler blocks, activation checkpointing, profilers, monitors, logging.
RICH = {
    "train_micro_batch_size_per_gpu": 4,
    "train_batch_size": 32,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "communication_data_type": "fp32",
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "bf16": {"enabled": True},
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100}},
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                 "cpu_checkpointing": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True,
                       "output_file": None},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
    "tensorboard": {"enabled": False, "output_path": "logs/", "job_name": "run"},
    "csv_monitor": {"enabled": False, "output_path": "logs/", "job_name": "run"},
    "checkpoint": {"tag_validation": "Warn"},
    "data_types": {"grad_accum_dtype": "fp32"},
    "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True},
}


def _valid_configs():
    from deepspeed_config_cases import CASES as OFFLOADS
    from deepspeed_worker import CASES

    docs = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    declared = docs[docs.index("## DeepSpeed"):].split("deepspeed={", 1)[1].split("},\n", 1)[0]
    yield "docs", eval("{" + declared + "}"), None  # the docs' example's config, as written there
    yield from ((name, config, None) for name, (config, _) in CASES.items())
    yield from ((name, config, None) for name, (config, _) in OFFLOADS.items())
    yield "rich", RICH, "bf16"


@needs_deepspeed
def test_valid_configs_pass_deepspeeds_reading():
    for name, config, precision in _valid_configs():
        assert deepspeed_problems(config, accumulation=2, mixed_precision=precision) == [], name
        TrainerSettings(max_steps=1, deepspeed=config, mixed_precision=precision, gradient_accumulation_steps=1)


@needs_deepspeed
def test_a_key_deepspeed_would_ignore_is_one_line_naming_it_and_the_closest_key():
    config = {**RICH, "zero_optimisation": {"stage": 2}, "gradient_clippin": 1.0,
              "flops_profiler": {"enabeld": True}, "optimizer": {"type": "AdamW", "parms": {"lr": 1e-3}}}
    with pytest.raises(ValidationError) as error:
        TrainerSettings(max_steps=1, deepspeed=config, mixed_precision="bf16")
    assert {(item["loc"], item["msg"]) for item in error.value.errors()} == {
        (("deepspeed", "zero_optimisation"), "deepspeed.zero_optimisation: DeepSpeed reads no key 'zero_optimisation' "
         "here, so it would be ignored; did you mean 'zero_optimization'?"),
        (("deepspeed", "gradient_clippin"), "deepspeed.gradient_clippin: DeepSpeed reads no key 'gradient_clippin' "
         "here, so it would be ignored; did you mean 'gradient_clipping'?"),
        (("deepspeed", "flops_profiler", "enabeld"), "deepspeed.flops_profiler.enabeld: DeepSpeed reads no key "
         "'enabeld' here, so it would be ignored; did you mean 'enabled'?"),
        (("deepspeed", "optimizer", "parms"), "deepspeed.optimizer.parms: DeepSpeed reads no key 'parms' here, so it "
         "would be ignored; did you mean 'params'?"),
    }


def test_without_deepspeed_its_reading_is_not_checked(monkeypatch):
    # The run is refused for that itself: `deepspeed: DeepSpeed is not installed; install it with ...`.
    monkeypatch.setitem(__import__("sys").modules, "deepspeed", None)
    assert deepspeed_problems({"zero_optimisation": {}}, accumulation=1, mixed_precision=None) == []


@needs_deepspeed
def test_the_command_line_names_each_key_where_it_was_written_exit_2_and_writes_nothing(tmp_path):
    # Sections DeepSpeed's pydantic models refuse at initialize (an unknown key, a wrong value) are told at
    # validation too, every section at once; the file that holds the config is named.
    (tmp_path / "ds.json").write_text(json.dumps({
        "zero_optimization": {"stag": 2, "offload_optimizer": {"devise": "cpu"}},
        "fp16": {"loss_scael": 0}, "gradient_clippin": 1.0,
    }))
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "deepspeed": "ds.json"}))
    env = cli_env(DS_ACCELERATOR="cpu")
    result = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path, env=env).result()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    prefix = "trainloop run: error: run.json: deepspeed."
    assert sorted(result.stderr.splitlines()) == sorted([
        f"{prefix}zero_optimization.stag: DeepSpeed reads no key 'stag' here, so it would be ignored; "
        "did you mean 'stage'? (in ds.json)",
        f"{prefix}zero_optimization.offload_optimizer.devise: DeepSpeed reads no key 'devise' here, so it would be "
        "ignored; did you mean 'device'? (in ds.json)",
        f"{prefix}fp16.loss_scael: DeepSpeed reads no key 'loss_scael' here, so it would be ignored; "
        "did you mean 'loss_scale'? (in ds.json)",
        f"{prefix}gradient_clippin: DeepSpeed reads no key 'gradient_clippin' here, so it would be ignored; "
        "did you mean 'gradient_clipping'? (in ds.json)",
    ])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "run.json"]


@needs_deepspeed
def test_a_deepspeed_value_is_blamed_on_where_it_was_set(tmp_path):
    # --set, an environment variable, the file: each line names the layer that set the value it is about.
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "deepspeed": ZERO3}))
    env = cli_env(DS_ACCELERATOR="cpu", TRAINLOOP_DEEPSPEED__GRADIENT_CLIPPING="1.0")
    result = Cli(
        "validate", "run.json", "--set", "deepspeed.zero_optimization.stage=7", "--set", "grad_clip=0.5",
        cwd=tmp_path, env=env,
    ).result()
    assert result.returncode == 2, result.stderr
    assert sorted(result.stderr.splitlines()) == [
        "trainloop validate: error: --set deepspeed.zero_optimization.stage=7: deepspeed.zero_optimization.stage: 7 "
        "is not a ZeRO stage (0, 1, 2 or 3)",
        "trainloop validate: error: TRAINLOOP_DEEPSPEED__GRADIENT_CLIPPING, --set grad_clip=0.5: "
        "deepspeed.gradient_clipping is 1.0 but grad_clip is 0.5: declare it once, in grad_clip",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


@needs_deepspeed
def test_auto_is_taken_where_trainloop_fills_the_value_and_refused_where_it_does_not():
    # HF's Trainer reads "auto" as "from the trainer's settings": trainloop fills these itself.
    from trainloop.settings.deepspeed import filled_config

    hf = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    settings = TrainerSettings(max_steps=2, deepspeed=hf, gradient_accumulation_steps=2, mixed_precision="bf16")
    filled = filled_config(settings.deepspeed, accumulation=2, grad_clip=None, mixed_precision="bf16", batch_size=4)
    assert "train_batch_size" not in filled  # DeepSpeed derives it
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (4, 2)
    assert (filled["gradient_clipping"], filled["bf16"]["enabled"], filled["fp16"]["enabled"]) == (0.0, True, False)
    # Sizes HF computes from the model: trainloop does not, so "auto" there is one line each.
    with pytest.raises(ValidationError) as error:
        TrainerSettings(max_steps=2, deepspeed={"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert [e["msg"] for e in error.value.errors()] == [
        'deepspeed.zero_optimization.reduce_bucket_size: "auto" is filled in by HF\'s Trainer; trainloop fills only '
        "gradient_accumulation_steps, gradient_clipping, the micro and global batch sizes and bf16/fp16 enabled: give "
        "a value, or leave the key out for DeepSpeed's default"
    ]


@needs_deepspeed
def test_a_precision_deepspeeds_accelerator_lacks_is_one_line_before_step_1(tmp_path, monkeypatch):
    # DeepSpeed's CPU accelerator has no fp16: its initialize raised a ValueError after the run had started.
    _launched(monkeypatch)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert _refusal(_trainer(mixed_precision="fp16", workspace=tmp_path / "ws"), tmp_path / "ws") == (
        "mixed_precision is 'fp16', which DeepSpeed's cpu accelerator does not support: declare another "
        "mixed_precision (or none)"
    )
