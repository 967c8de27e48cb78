"""Checkpoints on a real S3 server (moto's server mode on 127.0.0.1): train, resume, prune, and a
process killed in the middle of an upload, through s3fs as a cloud bucket is reached."""

from __future__ import annotations

import importlib.util
import json
import logging
import signal

import pytest
import torch
import torch.multiprocessing as mp
import upload_child
from child_process import ChildProcess
from cli_process import Cli, assert_one_clean_error, cli_env
from ddp_worker import free_port
from s3_server import s3  # noqa: F401  # the fixture
from tiny_trainer import TinyTrainer
from upload_child import hooks

from trainloop import BaseHook, TrainerSettings
from trainloop.checkpoint import read_checkpoint, read_weights
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.location import location
from trainloop.settings.init_from import InitFromSettings


def unbroken(max_steps: int) -> dict[str, torch.Tensor]:
    trainer = TinyTrainer(TrainerSettings(max_steps=max_steps))
    trainer.train()
    return trainer.model.state_dict()


def assert_same_weights(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize(("format", "async_save"), [("full", False), ("sharded", True)])
def test_a_run_saves_prunes_and_resumes_exactly_on_s3(s3, format, async_save):  # noqa: F811
    url = f"{s3.bucket()}/runs/a/checkpoints"

    def run(max_steps):
        hook = CheckpointingHook(
            interval=2, keep_previous=1, path=url, storage_options=s3.options, format=format, async_save=async_save
        )
        trainer = TinyTrainer(TrainerSettings(max_steps=max_steps), hooks=[hook])
        trainer.train()
        return trainer

    run(5)
    keys = s3.keys(url)
    assert {key.split("/")[0] for key in keys} == {"4", "5", "latest"}  # 2 pruned; the layout on disk
    assert "5/manifest.json" in keys
    assert "4/manifest.json" in keys
    shard = "5/sharded/__0_0.distcp" if format == "sharded" else "5/model.pt"
    assert shard in keys
    assert s3.fs().cat_file(f"{url}/latest") == b"5\n"
    manifest = json.loads(s3.fs().cat_file(f"{url}/5/manifest.json"))
    assert set(manifest["files"]) == {key.removeprefix("5/") for key in keys if key.startswith("5/")} - {"manifest.json"}

    resumed = run(8)  # resumes from 5
    assert resumed.step == 8
    assert_same_weights(resumed.model, unbroken(8))
    assert s3.fs().cat_file(f"{url}/latest") == b"8\n"
    assert {key.split("/")[0] for key in s3.keys(url)} == {"6", "8", "latest"}


@pytest.mark.parametrize(("format", "async_save"), [("full", False), ("full", True), ("sharded", False)])
def test_a_process_killed_mid_upload_leaves_the_previous_checkpoint_which_resumes(
    s3, tmp_path, caplog, format, async_save  # noqa: F811
):
    url = f"{s3.bucket()}/checkpoints"
    child = ChildProcess(
        __import__("upload_child").__file__, [url, format, str(int(async_save)), "4"], tmp_path, env=s3.env()
    )
    try:
        child.wait_for("paused 4", timeout=300)
        partial = [key for key in s3.keys(url) if key.startswith("4/")]
        if format == "full":  # the files before the paused one are uploaded: a visible partial checkpoint
            assert partial == ["4/big_state.pt", "4/model.pt", "4/training_state.pt"], partial
        assert "4/manifest.json" not in partial
        assert s3.fs().cat_file(f"{url}/latest") == b"2\n"
        child.proc.send_signal(signal.SIGKILL)
        assert child.proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.proc.poll() is None:
            child.proc.kill()

    assert read_checkpoint(location(f"{url}/2", s3.options))["training_state"]["step"] == 2
    trainer = TinyTrainer(TrainerSettings(max_steps=6), hooks=hooks(url, format, async_save, None, s3.options))
    with caplog.at_level(logging.INFO, logger="trainloop"):
        trainer.train()
    said = caplog.text
    if format == "full":
        assert f"Removed {url}/4: a save or a removal that did not finish" in said
    assert f"Resumed from {url}/2 at step 2" in said
    assert "Skipping checkpoint" not in said  # the partial one was never a candidate
    assert_same_weights(trainer.model, unbroken(6))
    assert f"Saved checkpoint {url}/4" in said  # saved anew, complete, then pruned by 6
    assert {key.split("/")[0] for key in s3.keys(url)} == {"6", "latest"}
    assert s3.fs().cat_file(f"{url}/latest") == b"6\n"


def test_init_from_reads_weights_from_s3_with_declared_storage_options(s3):  # noqa: F811
    url = f"{s3.bucket()}/pretrain"
    pretrain = TinyTrainer(
        TrainerSettings(max_steps=3),
        hooks=[CheckpointingHook(interval=3, path=url, storage_options=s3.options)],
    )
    pretrain.train()
    settings = TrainerSettings.model_validate(
        {"max_steps": 1, "init_from": {"path": url, "storage_options": s3.options}}  # as a settings file declares it
    )
    assert isinstance(settings.init_from, InitFromSettings)
    assert settings.init_from.path == url
    started = {}

    class Probe(BaseHook):
        def on_before_train(self, trainer):
            started.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    TinyTrainer(settings, hooks=[Probe()]).train()
    assert started.keys() == pretrain.model.state_dict().keys()
    for key, value in pretrain.model.state_dict().items():
        assert torch.equal(started[key], value), key


def test_the_command_line_trains_inspects_exports_evaluates_and_reports_through_s3(s3, tmp_path):  # noqa: F811
    """Every command takes the URL as it takes a path; fsspec's variables reach the server, no flags."""
    bucket = s3.bucket()
    url = f"{bucket}/run/checkpoints"
    hooks = [
        {"type": "validation", "evaluate": "val_metrics", "interval": 3},
        {"type": "checkpointing", "interval": 3, "keep_interval": 3, "path": url},
    ]
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 6, "workspace": "ws", "hooks": hooks}))
    env = cli_env(**s3.env())
    trainer = ("--trainer", "eval_trainers:EvalTrainer")
    trained = Cli("run", "run.json", *trainer, cwd=tmp_path, env=env).result()
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert {key.split("/")[0] for key in s3.keys(url)} == {"3", "6", "latest"}
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(":")]  # no local folder named "s3:"

    runs = {
        "inspect": Cli("inspect", url, cwd=tmp_path, env=env),
        "export": Cli("export", url, "--output", f"{bucket}/model.safetensors", cwd=tmp_path, env=env),
        "export_local": Cli("export", f"{url}/3", "--output", "model3.safetensors", cwd=tmp_path, env=env),
        "evaluate": Cli("evaluate", "run.json", *trainer, cwd=tmp_path, env=env),
        "evaluate_3": Cli("evaluate", "run.json", *trainer, "--checkpoint", f"{url}/3", cwd=tmp_path, env=env),
        "report": Cli("report", "ws", cwd=tmp_path, env=env),
    }
    results = {name: run.result() for name, run in runs.items()}
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
    assert f"checkpoint:   {url}/6  (latest of {url})" in results["inspect"].stdout
    assert "files:        metadata.json" in results["inspect"].stdout
    assert "model.safetensors" in s3.keys(bucket)
    assert read_weights(location(f"{bucket}/model.safetensors", s3.options)).step == 6
    assert read_weights(tmp_path / "model3.safetensors").step == 3
    latest, third = json.loads(results["evaluate"].stdout), json.loads(results["evaluate_3"].stdout)
    assert latest.keys() == third.keys() == {"val/loss", "val/count"}
    assert latest != third
    page = (tmp_path / "ws" / "report.html").read_text()
    assert f"{url}/6" in page
    assert f"{url}/3" in page


def test_a_url_whose_filesystem_is_not_installed_is_refused_before_anything_runs(tmp_path):
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: gs:// URLs work")
    hooks = [{"type": "checkpointing", "interval": 3, "path": "gs://bucket/run"}]
    settings = {"max_steps": 6, "workspace": "ws", "hooks": hooks, "init_from": "gs://bucket/pretrain"}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    for command in ("validate", "run"):
        result = Cli(command, "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path).result()
        assert result.returncode == 2, result.stderr
        assert_one_clean_error(
            result.stderr,
            "hooks[0].path: gs://bucket/run: the gs:// filesystem is not installed: pip install 'trainloop[gcs]'",
            "init_from.path: gs://bucket/pretrain: the gs:// filesystem is not installed: pip install 'trainloop[gcs]'",
        )
        assert not (tmp_path / "ws").exists()


def test_a_missing_bucket_or_an_endpoint_that_does_not_answer_is_one_line(s3, tmp_path):  # noqa: F811
    """What the storage's client says when the run first touches the URL, as one line, exit 1."""
    hooks = [{"type": "checkpointing", "interval": 3, "path": "s3://no-such-bucket/run"}]
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 6, "workspace": "ws", "hooks": hooks}))
    ran = Cli("run", "run.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path, env=cli_env(**s3.env())).result()
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert_one_clean_error(
        ran.stderr, "object storage: FileNotFoundError: The specified bucket does not exist: 'no-such-bucket'"
    )
    assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr
    assert not s3.fs().exists("no-such-bucket")  # no bucket is ever created

    closed = cli_env(**{**s3.env(), "FSSPEC_S3_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"})
    inspected = Cli("inspect", "s3://bucket/run", cwd=tmp_path, env=closed).result()
    assert inspected.returncode == 1, inspected.stderr[-3000:]
    assert len(inspected.stderr.strip().splitlines()) == 1, inspected.stderr
    assert_one_clean_error(
        inspected.stderr, "object storage: EndpointConnectionError: Could not connect to the endpoint URL"
    )


def test_two_fsdp_ranks_write_their_shards_to_s3_and_resume_exactly(s3, tmp_path):  # noqa: F811
    """Each rank uploads its own shard through DCP's fsspec writer; rank 0 sees them all, then the manifest."""
    url = f"{s3.bucket()}/checkpoints"
    mp.start_processes(
        upload_child.ranks_worker, args=(2, free_port(), url, s3.options, str(tmp_path)), nprocs=2,
        start_method="spawn",
    )
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for result in results:
        assert result["started"] == 4
        for resumed, straight in zip(result["resumed"], results[0]["straight"], strict=True):
            assert torch.equal(resumed, straight)
    keys = s3.keys(url)
    assert {key.split("/")[0] for key in keys} == {"4", "8", "latest"}  # 2 pruned
    assert [key for key in keys if key.startswith("8/sharded/")] == [
        "8/sharded/.metadata", "8/sharded/__0_0.distcp", "8/sharded/__1_0.distcp",
    ]
    manifest = json.loads(s3.fs().cat_file(f"{url}/8/manifest.json"))
    assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(manifest["files"])


def test_cleaning_up_removes_only_what_a_save_writes(s3):  # noqa: F811
    url = f"{s3.bucket()}/checkpoints"
    fs = s3.fs()
    for key in ("0007/report.csv", "notes/readme.txt", "07/x", "6/model.pt"):  # 6: an upload that did not finish
        fs.pipe_file(f"{url}/{key}".removeprefix("s3://"), b"kept")
    trainer = TinyTrainer(TrainerSettings(max_steps=4), hooks=hooks(url, "full", False, None, s3.options))
    trainer.train()
    left = {key for key in s3.keys(url) if key.split("/")[0] not in {"2", "4", "latest"}}
    assert left == {"0007/report.csv", "notes/readme.txt", "07/x"}
    assert fs.cat_file(f"{url}/0007/report.csv".removeprefix("s3://")) == b"kept"


def test_a_typo_in_storage_options_is_one_line_before_anything_is_written(tmp_path):
    hooks = [{"type": "checkpointing", "interval": 2, "path": "s3://bkt/run", "storage_options": {"endpoint_urll": "x"}}]
    init_from = {"path": "s3://bkt/pre", "storage_options": {"endpoint_url": "x", "anonn": True}}
    settings = {"max_steps": 3, "workspace": "ws"}
    (tmp_path / "hook.json").write_text(json.dumps({**settings, "hooks": hooks}))
    (tmp_path / "init.json").write_text(json.dumps({**settings, "init_from": init_from}))
    started = {
        (command, name): Cli(command, f"{name}.json", "--trainer", "cli_trainers:CliTrainer", cwd=tmp_path)
        for command in ("validate", "run") for name in ("hook", "init")
    }
    expected = {
        "hook": "hook.json: hooks[0].storage_options.endpoint_urll: not an argument of S3FileSystem "
                "(did you mean endpoint_url?)",
        "init": "init.json: init_from.storage_options.anonn: not an argument of S3FileSystem (did you mean anon?)",
    }
    for (command, name), cli in started.items():
        result = cli.result()
        assert result.returncode == 2, result.stderr[-3000:]
        assert_one_clean_error(result.stderr, f"trainloop {command}: error: {expected[name]}")
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook.json", "init.json"]  # no ws/, run.lock, runs.jsonl


def test_a_second_run_on_a_live_runs_checkpoint_prefix_is_refused_and_loses_nothing(s3, tmp_path):  # noqa: F811
    from cli_process import two_runs_on_one_checkpoint_location

    two_runs_on_one_checkpoint_location(tmp_path, f"{s3.bucket()}/checkpoints", cli_env(**s3.env()), s3.options)
