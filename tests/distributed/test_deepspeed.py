"""DeepSpeed as a strategy: its config checked against trainloop's settings, and the engine driven by the loop.

The checks before step 1 run in this process (nothing in them imports DeepSpeed) or through the command line in a
subprocess; what needs the engine runs in one ``torchrun`` launch of two CPU ranks (gloo), every case inside it
(tests/support/deepspeed_worker.py), read through a module-scoped fixture.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cli_process import Cli, cli_env
from ddp_worker import free_port
from torch import nn

from trainloop import CheckpointError, TrainerSettings
from trainloop.core.result import RefusedRunError
from trainloop.settings import SettingsFileError

SUPPORT = Path(__file__).resolve().parents[1] / "support"
ZERO3 = {"zero_optimization": {"stage": 3}}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


# -- the config against trainloop's settings: one line naming both, before anything is built ---------------------


@pytest.mark.parametrize(
    ("settings", "config", "message"),
    [
        ({}, {"gradient_clipping": 1.0}, "deepspeed.gradient_clipping is 1.0 but grad_clip is unset (no clipping)"),
        ({"grad_clip": 0.5}, {"gradient_clipping": 1.0}, "deepspeed.gradient_clipping is 1.0 but grad_clip is 0.5"),
        ({}, {"bf16": {"enabled": True}}, "deepspeed.bf16.enabled is True but mixed_precision is unset"),
        ({"mixed_precision": "bf16"}, {"bf16": {"enabled": False}},
         "deepspeed.bf16.enabled is False but mixed_precision is 'bf16'"),
        ({"mixed_precision": "bf16"}, {"fp16": {"enabled": True}},
         "deepspeed.fp16.enabled is True but mixed_precision is 'bf16'"),
        ({"gradient_accumulation_steps": 2}, {"gradient_accumulation_steps": 4},
         "deepspeed.gradient_accumulation_steps is 4 but gradient_accumulation_steps is 2"),
        ({}, {"zero_optimization": {"stage": 7}}, "deepspeed.zero_optimization.stage: 7 is not a ZeRO stage"),
        ({"optimizers": {"d": {"name": "SGD", "lr": 0.1}, "g": {"name": "SGD", "lr": 0.1}}}, {},
         "deepspeed drives one optimizer: declare optimizer, not optimizers"),
    ],
)
def test_a_config_that_contradicts_the_settings_is_refused_naming_both(settings, config, message):
    with pytest.raises(ValueError, match="deepspeed") as error:
        TrainerSettings(max_steps=1, deepspeed=config, **settings)
    assert message in str(error.value)


def test_a_config_that_agrees_with_the_settings_is_taken_from_a_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO3, "gradient_clipping": 0.5, "bf16": {"enabled": True}}))
    settings = TrainerSettings(max_steps=1, deepspeed=path, grad_clip=0.5, mixed_precision="bf16")
    assert settings.deepspeed == path
    with pytest.raises(SettingsFileError, match="the DeepSpeed config .*missing.json: "):
        TrainerSettings.load(overrides=["max_steps=1", f"deepspeed={tmp_path / 'missing.json'}"])


def test_what_trainloop_owns_is_filled_in():
    from trainloop.settings.deepspeed import filled_config

    filled = filled_config(ZERO3, accumulation=2, grad_clip=None, mixed_precision="bf16", batch_size=8)
    assert filled == {
        **ZERO3, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0, "bf16": {"enabled": True},
        "fp16": {"enabled": False}, "train_micro_batch_size_per_gpu": 8,
    }


def test_the_deepspeed_extra_is_pinned_and_installed_by_ci_as_the_readme_says():
    import tomllib

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["deepspeed"] == ["deepspeed==0.19.8"]
    ci = (root / ".ci" / "run").read_text()
    install = 'DS_BUILD_OPS=0 python -m pip install --quiet --no-build-isolation -e ".[deepspeed]"'
    assert ci.index('pip install --quiet torch==2.13.0') < ci.index(install)  # its sdist imports torch to build
    assert 'DS_BUILD_OPS=0 pip install --no-build-isolation -e ".[deepspeed]"' in (root / "README.md").read_text()


def test_importing_trainloop_imports_no_deepspeed():
    code = "import trainloop, trainloop.core.loop, trainloop.core.deepspeed, sys; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=cli_env())
    assert out.stdout == "False\n"


def test_the_managers_deepspeed_format_needs_its_engine_and_the_foreground(tmp_path):
    from trainloop.checkpoint.manager import CheckpointManager

    with pytest.raises(ValueError, match="pass it"):
        CheckpointManager(tmp_path, "deepspeed")
    with pytest.raises(ValueError, match="async_save: a DeepSpeed engine's checkpoint is saved in the foreground"):
        CheckpointManager(tmp_path, "deepspeed", async_save=True, engine=object())


# -- refused in building, before DeepSpeed is imported -------------------------------------------------------------


def _trainer(**settings):
    from tiny_trainer import TinyTrainer

    return TinyTrainer(**{"max_steps": 2, "device": "cpu", "deepspeed": ZERO3, **settings})


@pytest.fixture
def launched(monkeypatch):
    """The environment torchrun gives one process: DeepSpeed joins the process group from it (none is made here)."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("launched")
def test_a_micro_batch_that_contradicts_the_data_loader_is_refused_before_step_1():
    trainer = _trainer(deepspeed={**ZERO3, "train_micro_batch_size_per_gpu": 3})
    with pytest.raises(RefusedRunError, match=r"deepspeed.train_micro_batch_size_per_gpu is 3 but the data loader's"):
        trainer.train()
    assert trainer.step == 0


@pytest.mark.usefixtures("launched")
def test_several_optimizers_are_refused_before_step_1():
    trainer = _trainer()
    trainer.build_optimizer = lambda: {  # type: ignore[method-assign]
        "a": torch.optim.SGD(trainer.model.parameters(), lr=0.1),
        "b": torch.optim.SGD(trainer.model.parameters(), lr=0.1),
    }
    trainer.forward = lambda batch, optimizer: (trainer.model(batch[0]).sum(), {})  # type: ignore[method-assign]
    with pytest.raises(RefusedRunError, match=r"returned several optimizers \(a, b\), but deepspeed drives one"):
        trainer.train()


@pytest.mark.usefixtures("launched")
def test_an_average_of_the_weights_is_refused_at_zero_stage_3_before_step_1(tmp_path):
    from trainloop import EmaHook

    trainer = _trainer(workspace=tmp_path / "ws", hooks=[EmaHook(decay=0.9)])
    with pytest.raises(RefusedRunError, match=r"EmaHook reads the model's parameters whole, but deepspeed's ZeRO stage 3"):
        trainer.train()
    assert trainer.step == 0
    assert not (tmp_path / "ws").exists()  # refused before anything was written
    assert EmaHook.reads_whole_parameters


def test_init_from_is_refused_under_deepspeed_by_validate_too(tmp_path):
    # The engine keeps its own copies of the weights: weights loaded into the module in restoring would be
    # silently ignored, so the declaration is refused, by `trainloop validate` as by a run.
    (tmp_path / "run.json").write_text(
        json.dumps({"max_steps": 2, "workspace": "ws", "deepspeed": ZERO3, "init_from": "weights.safetensors"})
    )
    result = Cli("validate", "run.json", cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    assert "init_from is not applied under deepspeed: load the weights in build_model() instead" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


@pytest.mark.usefixtures("launched")
def test_a_model_wrapped_in_ddp_is_refused_before_step_1():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        trainer = _trainer()
        build = trainer.build_model
        trainer.build_model = lambda: nn.parallel.DistributedDataParallel(build())  # type: ignore[method-assign]
        with pytest.raises(RefusedRunError, match="returned a model wrapped in DistributedDataParallel, but deepspeed"):
            trainer.train()
    finally:
        dist.destroy_process_group()


def test_lr_find_says_it_does_not_drive_the_engine():
    from trainloop import lr_find

    with pytest.raises(ValueError, match=r"lr_find\(\): the trainer's settings declare deepspeed"):
        lr_find(_trainer())


# -- the command line: exit 2, one line, nothing written ----------------------------------------------------------


def test_a_contradiction_on_the_command_line_is_one_line_exit_2_and_writes_nothing(tmp_path):
    (tmp_path / "run.json").write_text(
        json.dumps({"max_steps": 2, "workspace": "ws", "deepspeed": {**ZERO3, "gradient_clipping": 1.0}})
    )
    result = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "deepspeed.gradient_clipping is 1.0 but grad_clip is unset (no clipping)" in result.stderr
    assert result.stderr.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_deepspeed_not_installed_is_one_line_naming_the_extra(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['deepspeed'] = None  # not importable\n")
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "deepspeed": ZERO3}))
    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), env["PYTHONPATH"]])
    result = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path, env=env).result()
    assert result.returncode == 2, result.stderr
    assert "deepspeed: DeepSpeed is not installed; install it with pip install 'trainloop[deepspeed]'" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker", "run.json"]


# -- the engine: one torchrun launch of two CPU ranks, every case in it --------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (pip install 'trainloop[deepspeed]': see the README)")
    out = tmp_path_factory.mktemp("deepspeed") / "results.json"
    env = cli_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(SUPPORT / "deepspeed_worker.py"), str(out),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("[rank") and "Error" in line]
    assert result.returncode == 0, "\n".join([*errors[:10], result.stderr[-4000:]])  # each rank's first, then the end
    assert "terminate called" not in result.stderr  # ZeRO-3's engines were torn down: a clean exit
    return {**json.loads(out.read_text()), "root": out.parent}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_losses_equal_a_hand_written_deepspeed_loop_bit_for_bit(ranks, stage, accumulation):
    case = ranks[f"stage{stage}_acc{accumulation}"]
    assert len(case["by_hand"]) == 4 * accumulation
    assert case["trainloop"] == case["by_hand"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_losses_equal_a_hand_written_deepspeed_loop_bit_for_bit(ranks, stage):
    case = ranks[f"stage{stage}_bf16"]
    assert len(case["by_hand"]) == 4
    assert case["trainloop"] == case["by_hand"]
    assert case["trainloop"] != ranks[f"stage{stage}_acc1"]["trainloop"]  # bf16 did change the numbers


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_non_finite_update_never_reaches_the_weights_and_is_retried_as_ours(ranks, stage):
    case = ranks[f"non_finite_stage{stage}"]
    assert case["retries"] == [0, 1, 0, 0]  # step 2 retried once, on fresh batches
    assert case["finite"] == [True] * 4  # its retry and every later step trained on finite weights
    # Stage 0: trainloop refused the update before the engine stepped; 1 to 3: the engine skipped it, and said so.
    assert case["skipped_steps"] == (0 if stage == 0 else 1)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_resumed_run_equals_the_unbroken_one_bit_for_bit(ranks, stage):
    # deepspeed_worker.RESUMES: stage 0 mid-epoch, fp32, EMA; 1 at an epoch's end, accumulation 2, bf16, EMA;
    # 2 mid-epoch, accumulation 2, EMA; 3 at an epoch's end, bf16. Every run: dropout, a shuffled sampler, a
    # cosine schedule, and an update retried before the stop.
    case = ranks[f"resume_stage{stage}"]
    assert case["differ"] == [[], []]  # every entry below, on both ranks, torch.equal (dtype and shape too)
    compared = set(case["compared"])
    partitions = {0: "optimizer.state.0.exp_avg", 1: "optimizer.single_partition_of_fp32_groups.0",
                  2: "optimizer.single_partition_of_fp32_groups.0", 3: "optimizer.fp32_flat_groups.0"}[stage]
    expected = {
        "model.0.weight", "model.3.bias", partitions, "lr_scheduler.last_epoch", "engine.global_steps",
        "engine.skipped_steps", "engine.global_samples", "trainloop.training_state.step",
        "trainloop.training_state.epoch", "trainloop.training_state.rng.1.python", "rng",
        "trainloop.training_state.data_loader.1.trainloop_sampler_position.order",
    }
    assert [key for key in expected if not any(name.startswith(key) for name in compared)] == []
    assert any(key.startswith("optimizer.") and "exp_avg_sq" in key for key in compared)
    assert any(key.startswith("draws.") for key in compared)  # every forward's step, items and loss
    assert ("ema.n_averaged" in compared) == (stage < 3)  # EMA is refused at stage 3
    assert case["resumed_from"] == {0: 3, 1: 4, 2: 3, 3: 8}[stage]
    assert case["retried"] == [5 if stage == 3 else 2]  # a non-finite first try, before the stop
    # Stage 0: trainloop refused that update before the engine stepped; 1 to 3: the engine skipped it.
    assert case["engine"]["engine.skipped_steps"] == (0 if stage == 0 else 1)
    files = case["files"]
    assert {"manifest.json", "metadata.json", "training_state.pt"} <= set(files)
    partition_files = [name for name in files if name.startswith("deepspeed/engine/")]
    if stage == 0:
        assert partition_files == ["deepspeed/engine/mp_rank_00_model_states.pt"]
    else:  # each rank's partitions, under the manifest
        assert any("zero_pp_rank_0_" in name for name in partition_files)
        assert any("zero_pp_rank_1_" in name for name in partition_files)
    assert "deepspeed/latest" not in files  # trainloop's latest names the checkpoint
    metadata = json.loads((ranks["root"] / f"resume_stage{stage}" / "checkpoints" / case["kept"][0] / "metadata.json")
                          .read_text())
    assert metadata["format"] == "deepspeed"
    assert metadata["deepspeed"] == {"zero_stage": stage, "precision": "bf16" if stage in (1, 3) else "fp32"}
    # trainloop's keep-N (the previous one kept) and latest: saved at the interval (the stop step) and at the end
    assert case["kept"] == {0: ["10", "9", "latest"], 1: ["4", "6", "latest"], 2: ["3", "6", "latest"],
                            3: ["10", "8", "latest"]}[stage]


def test_optimizer_states_offloaded_to_the_cpu_resume_as_the_unbroken_run_bit_for_bit(ranks):
    # resume_stage2_offload: ZeRO-2 with offload_optimizer, stepped by DeepSpeed's CPU Adam (its kernel's own
    # beta powers brought to the loaded step), EMA, stopped mid-epoch after a retried update.
    case = ranks["resume_stage2_offload"]
    assert case["differ"] == [[], []]
    compared = set(case["compared"])
    assert any(key.startswith("optimizer.single_partition_of_fp32_groups.0") for key in compared)
    assert any(key.startswith("optimizer.") and "exp_avg_sq" in key for key in compared)
    assert {"ema.n_averaged", "engine.global_steps", "trainloop.training_state.step"} <= compared
    assert case["resumed_from"] == 3
    assert case["retried"] == [2]


def test_the_machine_trace_progress_throughput_profiler_and_report_show_a_deepspeed_run_as_any(ranks, tmp_path):
    # deepspeed_worker.machine_shows: ZeRO-2 on two ranks, 4 steps of 2 microsteps, a save every 2 steps, progress
    # with throughput, the profiler over steps 1 and 2. The same run without deepspeed, here in one process, goes
    # through the same states by the same edges: the engine's update is `stepping`, its backward `accumulating`.
    import deepspeed_worker

    from trainloop.cli import main
    from trainloop.machine.trace import read_trace

    workspace = Path(ranks["machine"]["workspace"])
    plain = deepspeed_worker.machine_case(None, tmp_path / "plain")
    plain.train()

    def walk(path):
        return [(e.step, e.source.value, e.dest.value, e.trigger) for e in read_trace(path / "trace.jsonl")]

    assert walk(workspace) == walk(tmp_path / "plain")
    assert ("accumulating", "stepping") in {(source, dest) for _, source, dest, _ in walk(workspace)}
    logged = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    plain_logged = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    # The same records at the same steps (two ranks add their totals), the items counted: 2 steps of 2 microsteps
    # of 4 items a window, on each rank.
    assert [sorted(k for k in row if "total" not in k) for row in logged] == [sorted(row) for row in plain_logged]
    windows = [row for row in logged if "throughput/items" in row]
    assert [(row["step"], row["throughput/items"], row["throughput/total_items"]) for row in windows] == [
        (2, 16, 32), (4, 16, 32)]
    assert all(row["throughput/items_per_second"] > 0 for row in windows)
    profiles = ranks["machine"]["profiles"]
    assert profiles  # rank 0's traces of the profiled steps
    assert all(name.endswith((".json", ".json.gz")) for name in profiles), profiles
    assert main(["report", str(workspace), "--output", str(tmp_path / "report.html")]) == 0
    assert "stepping" in (tmp_path / "report.html").read_text()


def test_a_damaged_partition_is_caught_by_the_manifest_and_an_older_checkpoint_taken(ranks):
    case = ranks["corrupt_stage2"]  # resume_stage2, saved at every step, rank 1's partition of step 3 damaged
    assert case["resumed_from"] == 2
    assert case["differ"] == [[], []]  # and still the unbroken run, bit for bit


def test_export_joins_the_partitions_into_weights_that_load_strictly_into_the_plain_module(ranks, tmp_path):
    from deepspeed_worker import model
    from safetensors.torch import load_file

    from trainloop.checkpoint import checkpoint_format, export_checkpoint

    for stage, last in ((0, "10"), (1, "6"), (2, "6"), (3, "10")):
        run = ranks["root"] / f"resume_stage{stage}"
        checkpoint = run / "checkpoints" / last
        assert checkpoint_format(checkpoint) == "deepspeed"
        output = tmp_path / f"stage{stage}.safetensors"
        assert export_checkpoint(checkpoint, output)["step"] == last
        weights = load_file(output)
        model().load_state_dict(weights, strict=True)
        # The run's own weights at its end: stage 0's the module's, stages 1 to 3 joined from two ranks' fp32
        # partitions (under bf16 the module holds them rounded).
        module = torch.load(run / "module.pt")
        assert weights.keys() == module.keys()
        assert all(weights[key].dtype == torch.float32 for key in weights)
        assert all(torch.equal(weights[key].to(module[key].dtype), module[key]) for key in weights)


def test_init_from_predict_evaluate_and_inspect_read_a_deepspeed_checkpoint(ranks, tmp_path):
    from deepspeed_worker import DeepSpeedTrainer, dataset
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    from trainloop import BaseHook
    from trainloop.checkpoint import export_checkpoint

    checkpoint = ranks["root"] / "resume_stage3" / "checkpoints" / "10"
    export_checkpoint(checkpoint, tmp_path / "w.safetensors")
    started: dict[str, torch.Tensor] = {}

    class Start(BaseHook):
        def on_before_train(self, trainer):  # after init_from, in restoring
            started.update({key: value.clone() for key, value in trainer.unwrapped_model.state_dict().items()})

    class PlainTrainer(DeepSpeedTrainer):
        def build_data_loader(self):  # one process, no sampler across ranks
            return DataLoader(dataset(), batch_size=4)

        def build_predict_data_loader(self):
            return DataLoader(dataset(), batch_size=16)

        def predict_step(self, batch):
            return self.model(batch[0])

    trainer = PlainTrainer(max_steps=1, device="cpu", init_from=str(checkpoint), metrics_file=False)
    trainer.build_hooks = lambda: [Start()]  # type: ignore[method-assign]
    trainer.train()  # a plain run, starting from the DeepSpeed run's weights
    expected = load_file(tmp_path / "w.safetensors")
    assert started.keys() == expected.keys()
    assert all(torch.equal(started[key], expected[key]) for key in expected)
    predicted = PlainTrainer(max_steps=1, device="cpu").predict(checkpoint=checkpoint)["predictions"]
    reference = __import__("deepspeed_worker").model()
    reference.load_state_dict(expected, strict=True)
    with torch.no_grad():
        assert torch.equal(predicted, reference(dataset().tensors[0]))
    from trainloop import ValidationHook

    def error(t):
        with torch.no_grad():
            return {"mse": (t.model(dataset().tensors[0]) - reference(dataset().tensors[0])).abs().max()}

    evaluating = PlainTrainer(max_steps=1, device="cpu", metrics_file=False)
    evaluating.build_hooks = lambda: [ValidationHook(error, interval=1)]  # type: ignore[method-assign]
    assert evaluating.evaluate(checkpoint=checkpoint) == {"val/mse": 0.0}  # the joined weights, evaluated
    result = Cli("inspect", "--json", checkpoint, cwd=tmp_path).result()
    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)  # DeepSpeed's own prints went to stderr
    assert described["format"] == "deepspeed"
    assert described["step"] == 10
    from trainloop.checkpoint.describe import describe_checkpoint, format_checkpoint

    text = format_checkpoint(describe_checkpoint(checkpoint), None)
    assert "optimizer:    in DeepSpeed's engine files (ZeRO stage 3, bf16), under deepspeed/engine\n" in text


def test_the_docs_zero3_example_trains_a_transformer_on_two_cpu_ranks(tmp_path):
    if not HAS_DEEPSPEED:
        pytest.skip("DeepSpeed is not installed (pip install 'trainloop[deepspeed]': see the README)")
    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    section = text[text.index("## DeepSpeed"):]
    script = tmp_path / "zero3.py"
    script.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    env = cli_env(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(script),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "terminate called" not in result.stderr  # ZeRO-3 under the trainer ends cleanly
    printed = [line for line in result.stdout.splitlines() if line.startswith("loss ")]
    assert len(printed) == 1, result.stdout[-2000:]  # rank 0 alone
    loss = float(printed[0].split()[1])
    assert printed[0] == f"loss {loss:.2f} after 20 steps under ZeRO-3 on 2 ranks"
    assert loss < 2.0  # from ~4.2 (uniform over 64 tokens): it learns the sequence


class _Files:
    """Stands for a checkpoint's verified files: load_engine closes them when it refuses."""

    closed = False

    def close(self):
        self.closed = True


class _Engine:
    """What load_engine asks of an engine before it reads anything: its ZeRO stage and precision."""

    def __init__(self, stage, bf16=False):
        self.stage, self.bf16 = stage, bf16

    def zero_optimization_stage(self):
        return self.stage

    def bfloat16_enabled(self):
        return self.bf16

    def fp16_enabled(self):
        return False


def _engine_checkpoint(path, ranks=2, layout=None):
    """A DeepSpeed checkpoint's names: ``ranks`` ranks' partitions, and metadata with ``layout`` (None: as written
    before the layout was recorded)."""
    engine = path / "deepspeed" / "engine"
    engine.mkdir(parents=True)
    for r in range(ranks):
        (engine / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    metadata = {"step": 4, "epoch": 0, "format": "deepspeed"} | ({"deepspeed": layout} if layout else {})
    (path / "metadata.json").write_text(json.dumps(metadata))
    return path


def test_a_checkpoint_of_another_world_size_is_one_line_saying_how(tmp_path):
    from trainloop.checkpoint.deepspeed import load_engine

    checkpoint = _engine_checkpoint(tmp_path)  # an older checkpoint: no layout recorded, its ranks still checked
    files = _Files()
    with pytest.raises(CheckpointError) as error:
        load_engine(_Engine(2), checkpoint, files)
    assert str(error.value) == (
        f"{checkpoint}: its ZeRO partitions were saved by 2 ranks and this run has 1: resume it on 2 ranks, or start "
        "a new run (another workspace) from its weights, read in build_model() with trainloop.checkpoint.read_weights"
    )
    assert files.closed
    with pytest.raises(CheckpointError, match="holds no DeepSpeed engine's state, so it cannot resume"):
        load_engine(_Engine(2), tmp_path / "deepspeed", files)


def test_a_checkpoint_of_another_stage_and_precision_is_one_line_each(tmp_path):
    from trainloop.checkpoint.deepspeed import load_engine

    checkpoint = _engine_checkpoint(tmp_path, ranks=1, layout={"zero_stage": 2, "precision": "fp32"})
    files = _Files()
    with pytest.raises(CheckpointError) as error:
        load_engine(_Engine(3, bf16=True), checkpoint, files)
    assert str(error.value).splitlines() == [
        f"{checkpoint}: was saved at ZeRO stage 2 and this run's deepspeed config declares stage 3: resume it with "
        "zero_optimization.stage 2, or start a new run (another workspace) from its weights, read in build_model() "
        "with trainloop.checkpoint.read_weights",
        f"{checkpoint}: was saved with mixed_precision unset and this run declares 'bf16': resume it with "
        "mixed_precision unset, or start a new run (another workspace) from its weights, read in build_model() with "
        "trainloop.checkpoint.read_weights",
    ]
    assert files.closed


@pytest.mark.parametrize(
    ("case", "saved", "declared"),
    [("refused_stage3", "saved at ZeRO stage 2", "declares stage 3"),
     ("refused_stage1", "saved at ZeRO stage 0", "declares stage 1"),
     ("refused_bf16", "saved with mixed_precision unset", "declares 'bf16'")],
)
def test_a_resume_at_another_stage_or_precision_is_refused_before_deepspeed_reads_it(ranks, case, saved, declared):
    # On two ranks, by the engine of the run that resumes (deepspeed_worker.refused), the checkpoints left as they were.
    refused = ranks[case]
    assert refused["untouched"]
    assert refused["unrecorded"]  # no line in runs.jsonl: a refusal is no run
    assert refused["exit_code"] == 2  # what trainloop run exits with (a usage error, as the preflight's)
    assert len(refused["error"].splitlines()) == 1
    assert saved in refused["error"]
    assert declared in refused["error"]
    assert "trainloop.checkpoint.read_weights" in refused["error"]


def test_a_checkpoint_written_before_the_layout_was_recorded_still_loads(ranks):
    # resume_stage2's last checkpoint (step 6) with metadata.json as it was written before: the engine loaded it.
    assert ranks["older_stage2"] == {"step": 6, "global_steps": 7}


def test_the_command_line_refuses_a_resume_at_another_stage_in_one_line_exit_2_writing_nothing(ranks, tmp_path):
    # The two ranks' ZeRO-0 checkpoint, and settings declaring stage 1: validate and run find it in the preflight
    # (one process reads the latest checkpoint's metadata), before DeepSpeed is imported.
    import shutil

    shutil.copytree(ranks["root"] / "resume_stage0" / "checkpoints", tmp_path / "ws" / "checkpoints", symlinks=True)
    (tmp_path / "run.json").write_text(json.dumps({
        "max_steps": 10, "seed": 0, "device": "cpu", "workspace": "ws",
        "deepspeed": {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True},
        "hooks": [{"type": "checkpointing", "interval": 3, "keep_previous": 1}],
    }))

    def listing():
        return sorted((p.relative_to(tmp_path).as_posix(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))

    before = listing()
    line = (
        f"run.json: hooks[0].load: {Path('ws/checkpoints/10')}: was saved at ZeRO stage 0 and this run's deepspeed "
        "config declares stage 1: resume it with zero_optimization.stage 0, or start a new run (another workspace) "
        "from its weights, read in build_model() with trainloop.checkpoint.read_weights"
    )
    validated = Cli("validate", "run.json", cwd=tmp_path)
    ran = Cli("run", "run.json", "--trainer", "deepspeed_worker:ResumeTrainer", cwd=tmp_path)
    for command, result in (("validate", validated.result()), ("run", ran.result())):
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr == f"trainloop {command}: error: {line}\n"
    assert listing() == before  # nothing written: no lock, no runs.jsonl, the checkpoints as they were


# -- offload: optimizer states (and at stage 3 the parameters) on the CPU (tests/support/deepspeed_config_cases.py) -------


@pytest.mark.parametrize("case", ["offload_stage2_cpu_adam", "offload_stage3_cpu_adam", "offload_stage2_torch_adamw"])
def test_offload_equals_a_hand_written_loop_and_resumes_as_the_unbroken_run(ranks, case):
    # DeepSpeed's CPU Adam (built on first use), or a torch optimizer with zero_force_ds_cpu_optimizer false.
    results = ranks[case]
    assert len(results["by_hand"]) == 4
    assert results["trainloop"] == results["by_hand"]
    assert results["resumed"] == results["trainloop"][2:]  # steps 3 and 4, after the resume from step 2


def test_a_run_shows_no_torch_deprecations_deepspeed_caused_and_every_one_forward_did(ranks):
    # A ZeRO-3 run of 4 steps x 2 microsteps whose forward calls all_gather_into_tensor itself: torch's
    # FutureWarnings for DeepSpeed's own collectives (on every microstep) are not shown; forward's all are.
    assert ranks["future_warnings"] == {"all_gather_into_tensor": 8, "all": 8}  # before: 33 and 41
