"""Export: a checkpoint's weights to one ``.safetensors`` file that ``safetensors.torch.load_file``
reads back exactly (tied weights included), from the CLI and at the end of a run."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from cli_process import Cli, cli_env
from ddp_worker import free_port
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_trainer import TinyTrainer
from weights_worker import TiedTrainer, sharded_tied_run

from trainloop import TrainerSettings, __version__
from trainloop.checkpoint.export import export_checkpoint, settings_hash
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.ema import EmaHook
from trainloop.hooks.export import ExportHook


def metadata_of(path):
    with safe_open(str(path), framework="pt") as opened:
        return opened.metadata()


def assert_exact(loaded, expected):
    assert sorted(loaded) == sorted(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype, key
        assert torch.equal(loaded[key], value), key


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_tied")
    mp.spawn(sharded_tied_run, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return out


def test_a_2_rank_sharded_checkpoint_exports_bit_exactly_tied_weights_included(sharded_run, tmp_path):
    reference = torch.load(sharded_run / "reference.pt", weights_only=True)
    assert "lm_head.weight" in reference
    assert "wte.weight" in reference
    metadata = export_checkpoint(sharded_run / "ws" / "checkpoints", tmp_path / "model.safetensors")
    assert_exact(load_file(tmp_path / "model.safetensors"), reference)
    assert metadata == metadata_of(tmp_path / "model.safetensors")
    assert (metadata["step"], metadata["weights"], metadata["trainloop_version"]) == ("3", "model", __version__)
    settings = TrainerSettings.model_validate_json(json.dumps({"max_steps": 3, "seed": 0, "workspace": str(sharded_run / "ws")}))
    assert metadata["settings_sha256"] == settings_hash(settings.model_dump_json())


def test_the_end_of_run_export_under_ddp_has_clean_keys_and_records_the_tie(sharded_run):
    end = sharded_run / "ws" / "end.safetensors"
    reference = torch.load(sharded_run / "reference.pt", weights_only=True)
    assert_exact(load_file(end), reference)  # no "module." from DDP
    metadata = metadata_of(end)
    assert json.loads(metadata["tied"]) == {"lm_head.weight": "wte.weight"}
    assert metadata["step"] == "3"


def test_a_full_checkpoint_with_tied_weights_exports_through_the_cli(tmp_path):
    trainer = TiedTrainer(max_steps=2, workspace=tmp_path / "ws", hooks=[CheckpointingHook(interval=2), EmaHook(decay=0.5)])
    trainer.train()
    model = Cli("export", "ws", "--output", "out/model.safetensors", cwd=tmp_path, env=cli_env())
    ema = Cli("export", "ws/checkpoints/2", "-o", "ema.safetensors", "--weights", "ema", cwd=tmp_path, env=cli_env())
    result = model.result()
    assert result.returncode == 0, result.stderr
    assert result.stderr == "trainloop export: wrote the model weights of step 2 to out/model.safetensors\n"
    expected = {k: v.detach() for k, v in trainer.unwrapped_model.state_dict().items()}
    assert_exact(load_file(tmp_path / "out" / "model.safetensors"), expected)
    assert json.loads(metadata_of(tmp_path / "out" / "model.safetensors")["tied"]) == {"lm_head.weight": "wte.weight"}
    assert ema.result().returncode == 0, ema.result().stderr
    (ema_hook,) = (hook for hook in trainer.hooks if isinstance(hook, EmaHook))  # a default LoggingHook leads
    averaged = {k: v.detach() for k, v in ema_hook.ema_model.module.state_dict().items()}
    assert_exact(load_file(tmp_path / "ema.safetensors"), averaged)
    assert not torch.equal(averaged["block.weight"], expected["block.weight"])


def test_export_of_nothing_exits_1_naming_the_path_and_writes_nothing(tmp_path):
    result = Cli("export", "missing", "--output", "model.safetensors", cwd=tmp_path, env=cli_env()).result()
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == "trainloop export: error: missing: no such file or directory\n"
    assert list(tmp_path.iterdir()) == []


def test_the_end_of_run_export_is_declared_in_settings_and_skipped_on_an_early_exit(tmp_path):
    settings = {"max_steps": 2, "workspace": str(tmp_path / "ws"), "hooks": [{"type": "export", "path": "final.safetensors"}]}
    trainer = TinyTrainer(TrainerSettings.model_validate(settings))
    trainer.train()
    assert_exact(load_file(tmp_path / "ws" / "final.safetensors"), {k: v.detach() for k, v in trainer.model.state_dict().items()})

    class StopAtOnce(TinyTrainer):
        def forward(self, batch):
            self.request_exit()
            return super().forward(batch)

    stopped = StopAtOnce(TrainerSettings.model_validate({**settings, "workspace": str(tmp_path / "stopped")}))
    stopped.train()
    assert not (tmp_path / "stopped" / "final.safetensors").exists()


@pytest.mark.parametrize(("output", "said"), [(".", "is a directory"), ("outdir", "is a directory")])
def test_an_unusable_output_is_a_usage_error_and_writes_nothing(tmp_path, output, said):
    (tmp_path / "outdir").mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = Cli("export", "ws", "--output", output, cwd=tmp_path, env=cli_env()).result()
    assert result.returncode == 2
    assert result.stderr == f"trainloop export: error: --output {output!r} {said}: give the .safetensors file to write\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_ema_weights_without_an_ema_hook_fail_before_the_first_step(tmp_path):
    trainer = TinyTrainer(max_steps=3, workspace=tmp_path / "ws", hooks=[ExportHook(weights="ema")], metrics_file=False)
    with pytest.raises(ValueError, match="ExportHook weights='ema' needs exactly one EmaHook, found 0"):
        trainer.train()
    assert trainer.step == 0  # refused before training, not after it


def test_the_preflight_refuses_ema_weights_when_no_ema_hook_is_declared_or_built(tmp_path):
    from trainloop import BaseTrainer
    from trainloop.core.preflight import preflight

    class Declares(BaseTrainer):  # builds no hooks in code: only settings.hooks can give the EMA hook
        build_data_loader = build_model = forward = TinyTrainer.build_data_loader

    export = {"type": "export", "weights": "ema"}
    alone = TrainerSettings(max_steps=2, workspace=tmp_path, optimizer={"name": "SGD", "lr": 0.1}, hooks=[export])
    assert preflight(alone, Declares) == ["hooks[0].weights: 'ema' needs an EMA hook, and settings.hooks declares none"]
    with_ema = alone.model_copy(update={"hooks": TrainerSettings(hooks=[{"type": "ema"}, export], max_steps=2).hooks})
    assert preflight(with_ema, Declares) == []
    assert preflight(alone, TinyTrainer) == []  # it overrides build_hooks: trusted, and checked before step 1


def test_an_output_that_is_not_safetensors_is_refused_and_nothing_is_written(tmp_path):
    # Issue 29, defect 6: `--output model.pt` exited 0 with safetensors bytes under a torch name, which
    # torch.load and init_from then failed on.
    TinyTrainer(max_steps=2, workspace=tmp_path / "ws", hooks=[CheckpointingHook(interval=2)]).train()
    before = sorted(p.name for p in tmp_path.iterdir())
    result = Cli("export", "ws", "--output", "model.pt", cwd=tmp_path).result()
    assert result.returncode == 2
    assert result.stderr == (
        "trainloop export: error: --output 'model.pt' ends in '.pt': export writes a .safetensors file; give a name "
        "ending in .safetensors\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    declared = {"max_steps": 2, "workspace": "ws2", "hooks": [{"type": "export", "path": "model.pt"}]}
    (tmp_path / "run.json").write_text(json.dumps(declared))
    refused = Cli("validate", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path).result()
    assert refused.returncode == 2
    assert refused.stderr == (
        "trainloop validate: error: run.json: hooks[0].path: 'model.pt' ends in '.pt': the export is a .safetensors file\n"
    )


def test_an_output_that_cannot_be_created_exits_1_naming_it_before_the_checkpoint_is_read(tmp_path):
    # Issue 29, defect 5: an uncaught SafetensorError naming a temporary .tmpXXXX file.
    TinyTrainer(max_steps=2, workspace=tmp_path / "ws", hooks=[CheckpointingHook(interval=2)]).train()
    (tmp_path / "afile").write_text("")
    outputs = {"afile/model.safetensors": "--output afile/model.safetensors: afile: is a file, not a directory"}
    if os.path.isdir("/proc/self"):  # a filesystem that refuses new files whatever the permissions say (root too)
        outputs["/proc/model.safetensors"] = "--output /proc/model.safetensors: cannot create a file in /proc: No such file or directory"
    runs = {output: Cli("export", "ws", "--output", output, cwd=tmp_path) for output in outputs}
    for output, run in runs.items():
        result = run.result()
        assert result.returncode == 1, result.stderr
        assert result.stderr == f"trainloop export: error: {outputs[output]}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ws"]
    if os.path.isdir("/proc/self"):
        from trainloop.checkpoint import CheckpointError

        with pytest.raises(CheckpointError, match=r"^/proc/model.safetensors: cannot write: Error while serializing: I/O error"):
            export_checkpoint(tmp_path / "ws", "/proc/model.safetensors")


def test_an_export_hook_path_that_cannot_be_written_is_refused_before_the_first_step(tmp_path):
    # Issue 29, defect 12: a directory in its place failed with IsADirectoryError after the whole run.
    (tmp_path / "ws" / "model.safetensors").mkdir(parents=True)
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 2, "workspace": "ws", "hooks": [{"type": "export"}]}))
    runs = [Cli(command, "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path) for command in ("run", "validate")]
    for command, run in zip(("run", "validate"), runs, strict=True):
        result = run.result()
        assert result.returncode == 2
        assert result.stderr == (
            f"trainloop {command}: error: run.json: hooks[0].path: ws/model.safetensors: is a directory, not a file\n"
        )
    assert [p.name for p in (tmp_path / "ws").iterdir()] == ["model.safetensors"]
    built = TinyTrainer(max_steps=2, workspace=tmp_path / "ws", hooks=[ExportHook()], metrics_file=False)
    with pytest.raises(ValueError, match="ExportHook path: .*ws/model.safetensors: is a directory, not a file"):
        built.train()
    assert built.step == 0
