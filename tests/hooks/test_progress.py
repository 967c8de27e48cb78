"""ProgressHook: progress lines, the bar on terminals only, and lines seen without logging set up."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helper_hooks import MemoryHook
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.progress import ProgressHook

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
NUMBER = r"\d+\.\d{4}"


class NanOnceTrainer(TinyTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        loss, records = super().forward(batch)
        return (loss * float("nan") if self.calls == 2 else loss), {**records, "deep": {"x": 2.0}}


class TwoGroups(TinyTrainer):
    def build_optimizer(self):
        return torch.optim.SGD(
            [
                {"params": self.model[0].parameters(), "lr": 0.1, "name": "body"},
                {"params": self.model[2].parameters(), "lr": 0.05},
            ]
        )


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainloop" and r.getMessage().startswith("Step ")]


def run_script(code: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that has never configured logging."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS / "support")])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, timeout=120, **kwargs
    )


# -- lines --------------------------------------------------------------------------------------


def test_line_format(caplog):
    caplog.set_level(logging.INFO, logger="trainloop")
    TinyTrainer(max_steps=4, grad_clip=1.0, hooks=[ProgressHook(interval=2, eta_warmup=100, bar=False)]).train()
    lines = progress_lines(caplog)
    assert len(lines) == 2
    for step, line in zip((2, 4), lines):
        assert re.fullmatch(
            rf"Step {step}/4: step {NUMBER}s data {NUMBER}s loss {NUMBER} grad_norm {NUMBER} lr 5\.00e-02", line
        ), line


def test_eta_appears_after_the_warmup(caplog):
    caplog.set_level(logging.INFO, logger="trainloop")
    TinyTrainer(max_steps=4, hooks=[ProgressHook(interval=1, eta_warmup=2, bar=False)]).train()
    lines = progress_lines(caplog)
    assert [" eta " in line for line in lines] == [False, False, True, True]
    assert re.search(r" eta \d+:\d\d:\d\d loss ", lines[2])
    assert " eta 0:00:00 " in lines[3]  # nothing left at the last step


def test_units_memory_retries_groups_and_records(caplog):
    caplog.set_level(logging.INFO, logger="trainloop")
    NanOnceTrainer(
        max_steps=2, max_non_finite_grad_retries=1,
        hooks=[MemoryHook(), ProgressHook(interval=2, with_records=True, eta_warmup=100, bar=False)],
    ).train()
    TwoGroups(max_steps=1, hooks=[ProgressHook(show_units=False, eta_warmup=0, bar=False)]).train()
    with_records, no_units = progress_lines(caplog)
    assert re.fullmatch(
        rf"Step 2/2: step {NUMBER}s data {NUMBER}s mem 1\.50GiB loss {NUMBER} retries 1 lr 5\.00e-02 "
        r"\| mse \S+ deep/x 2",
        with_records,
    ), with_records
    assert re.fullmatch(
        rf"Step 1/1: step {NUMBER} data {NUMBER} eta 0:00:00 loss {NUMBER} lr/body 1\.00e-01 lr/group_1 5\.00e-02",
        no_units,
    ), no_units


def test_lines_are_formatted_lazily_and_skipped_when_info_is_off(caplog):
    caplog.set_level(logging.WARNING, logger="trainloop")
    TinyTrainer(max_steps=3, hooks=[ProgressHook(bar=False)]).train()
    assert progress_lines(caplog) == []
    caplog.set_level(logging.INFO, logger="trainloop")
    TinyTrainer(max_steps=1, hooks=[ProgressHook(bar=False)]).train()
    (record,) = [r for r in caplog.records if r.name == "trainloop"]
    assert record.msg.startswith("Step %d/%d: step %.4fs")
    assert record.args[:2] == (1, 1)


def test_not_a_terminal_means_lines_not_a_bar(caplog, capfd):
    # Under pytest, standard output is captured: not a terminal, so the default (bar=True)
    # still logs lines and writes nothing to the console itself.
    caplog.set_level(logging.INFO, logger="trainloop")
    TinyTrainer(max_steps=4, hooks=[ProgressHook(interval=2)]).train()
    assert len(progress_lines(caplog)) == 2
    out, err = capfd.readouterr()
    assert "\r" not in out + err
    assert "step/s" not in out + err


# -- logging never configured ---------------------------------------------------------------------


def test_unconfigured_logging_still_shows_progress_in_a_fresh_process():
    result = run_script(
        """
        import logging
        from tiny_trainer import TinyTrainer
        from trainloop.hooks.progress import ProgressHook

        TinyTrainer(max_steps=4, hooks=[ProgressHook(interval=2)]).train()
        logger = logging.getLogger("trainloop")
        print("after:", len(logger.handlers), logger.level)
        """,
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "Step " in line]
    assert len(lines) == 2
    assert re.search(rf"INFO trainloop: Step 2/4: step {NUMBER}s data {NUMBER}s loss {NUMBER} lr", lines[0])
    assert "Step 4/4: " in lines[1]
    # No bar in a pipe, and the temporary handler and level are gone after the run.
    assert "\r" not in result.stdout + result.stderr
    assert result.stdout.strip() == "after: 0 0"


def test_configured_logging_is_left_alone_in_a_fresh_process():
    result = run_script(
        """
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s|%(message)s")
        from tiny_trainer import TinyTrainer
        from trainloop.hooks.progress import ProgressHook

        TinyTrainer(max_steps=2, hooks=[ProgressHook(interval=1)]).train()
        print("handlers:", len(logging.getLogger("trainloop").handlers), len(logging.getLogger().handlers))
        """,
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["trainloop|Step 1/2", "trainloop|Step 2/2"]
    assert lines[2:] == ["handlers: 0 1"]
    assert "Step" not in result.stderr


def test_fallback_handler_lives_for_the_run_only(capsys):
    logger = logging.getLogger("test_progress.unconfigured")
    logger.propagate = False  # so pytest's handlers on the root logger are out of its chain
    assert not logger.hasHandlers()
    assert logger.level == logging.NOTSET

    class Probe(BaseHook):
        def __init__(self):
            self.seen: list[tuple[int, int]] = []

        def on_after_step(self, trainer):
            self.seen.append((len(trainer.logger.handlers), trainer.logger.level))

    probe = Probe()
    try:
        TinyTrainer(max_steps=2, logger=logger, hooks=[ProgressHook(interval=1), probe]).train()
    finally:
        logger.propagate = True
    assert probe.seen == [(1, logging.INFO)] * 2
    assert logger.handlers == []
    assert logger.level == logging.NOTSET
    err = capsys.readouterr().err
    assert "test_progress.unconfigured: Step 1/2: step " in err
    assert "Step 2/2: " in err


def test_fallback_respects_a_level_set_on_the_logger(capsys):
    logger = logging.getLogger("test_progress.quiet")
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    try:
        TinyTrainer(max_steps=2, logger=logger, hooks=[ProgressHook(interval=1)]).train()
    finally:
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    assert logger.handlers == []
    assert "Step" not in capsys.readouterr().err


# -- terminals ------------------------------------------------------------------------------------


def _run_in_pty(code: str, stderr_too: bool = False) -> tuple[str, str]:
    """Run ``code`` with standard output (and, ``stderr_too``, standard error) on a 100-column pseudo-terminal.

    Returns (what the terminal showed, what a redirected standard error got).
    """
    pty = pytest.importorskip("pty")
    import fcntl
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS / "support")])}
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=slave, stderr=slave if stderr_too else subprocess.PIPE,
        env=env, cwd=ROOT,
    )
    os.close(slave)
    output = b""
    try:
        while select.select([master], [], [], 120)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            output += chunk
        stderr = process.communicate(timeout=120)[1]
    finally:
        os.close(master)
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, (stderr or b"").decode() + output.decode()
    return output.decode(), (stderr or b"").decode()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal sizing is Linux-only here")
def test_a_terminal_gets_a_bar_unless_bar_is_off():
    pytest.importorskip("tqdm")
    tty, stderr = _run_in_pty(
        """
        from tiny_trainer import TinyTrainer
        from trainloop.hooks.progress import ProgressHook

        TinyTrainer(max_steps=20, hooks=[ProgressHook(interval=5, eta_warmup=2)]).train()
        print("-- bar off --", flush=True)
        TinyTrainer(max_steps=4, hooks=[ProgressHook(interval=2, bar=False)]).train()
        """,
        stderr_too=True,
    )
    bar, lines = tty.split("-- bar off --")
    assert "\r" in bar
    assert "20/20" in bar
    assert "step/s" in bar
    assert "100%|" in bar
    assert re.search(rf"step/s, step {NUMBER}s data {NUMBER}s eta \d+:\d\d:\d\d loss {NUMBER} lr 5\.00e-02\]", bar)
    assert "Step 5/20" not in bar  # the bar replaces the lines
    assert "%|" not in lines
    assert "Step 2/4: step" in lines
    assert "Step 4/4: step" in lines
    assert stderr == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal sizing is Linux-only here")
def test_a_redirected_standard_error_gets_the_lines_and_the_terminal_the_bar():
    # `trainloop run run.json 2> train.log` in a terminal: the log is complete, the terminal shows the bar.
    pytest.importorskip("tqdm")
    tty, stderr = _run_in_pty(
        """
        from tiny_trainer import TinyTrainer
        from trainloop.hooks.progress import ProgressHook

        TinyTrainer(max_steps=20, hooks=[ProgressHook(interval=5, eta_warmup=2)]).train()
        """
    )
    assert "20/20" in tty
    assert "Step" not in tty
    assert re.findall(r"Step (\d+)/20: step", stderr) == ["5", "10", "15", "20"]
    assert "\r" not in stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal sizing is Linux-only here")
def test_the_bar_shows_validation_results_as_they_are_logged():
    pytest.importorskip("tqdm")
    tty, _ = _run_in_pty(
        """
        from tiny_trainer import TinyTrainer
        from trainloop import ProgressHook, ValidationHook

        values = {3: 0.75, 6: 0.5}
        hooks = [ProgressHook(interval=4), ValidationHook(lambda t: {"loss": values[t.step]}, interval=3)]
        TinyTrainer(max_steps=6, hooks=hooks).train()
        """
    )
    # At step 3 no report was due yet: the validation result shows on its own, then stays.
    assert re.search(r"3/6 \[[^\]]*val/loss 0\.75\]", tty)
    assert re.search(rf"6/6 \[[^\]]*loss {NUMBER} lr 5\.00e-02 val/loss 0\.5\]", tty)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pseudo-terminal sizing is Linux-only here")
def test_the_bar_shows_the_throughput_declared_once_on_the_logging_hook(tmp_path):
    pytest.importorskip("tqdm")
    tty, _ = _run_in_pty(
        f"""
        from tiny_trainer import ItemsTrainer
        from trainloop import TrainerSettings

        hooks = [
            {{"type": "logging", "interval": 3, "items": "tokens.input", "flops_per_item": 10.0, "peak_flops": 1e6}},
            {{"type": "progress", "interval": 3}},
        ]
        ItemsTrainer(TrainerSettings(max_steps=3, workspace={str(tmp_path)!r}, hooks=hooks)).train()
        """
    )
    from trainloop.core.metrics import read_metrics

    (row,) = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "loss" in row]
    assert row["throughput/items"] == 3 * 4 * 8  # the declared key's count, not Loss.count's
    # The bar's rate and MFU are the metrics': the same window, counted by the same key.
    assert f"items/s {row['throughput/items_per_second']:.4g}" in tty
    assert re.search(r" mfu \d", tty)  # the declared flops and peak (the line is cut at the terminal's width)


# -- parameters -----------------------------------------------------------------------------------


def test_defaults_and_settings_declaration():
    hook = ProgressHook()
    assert (hook.interval, hook.with_records, hook.sync, hook.eta_warmup, hook.show_units, hook.bar) == (
        1, False, False, 10, True, True,
    )
    assert HOOK_TYPES["progress"] is ProgressHook
    model = hook_settings_model(ProgressHook)
    built = model.model_validate_json(
        '{"type": "progress", "interval": 50, "with_records": true, "eta_warmup": 0, "bar": false}'
    ).build()
    assert type(built) is ProgressHook
    assert (built.interval, built.with_records, built.eta_warmup, built.bar) == (50, True, 0, False)
    with pytest.raises(ValidationError, match="eta_warmup"):
        model.model_validate_json('{"type": "progress", "eta_warmup": -1}')


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"interval": 0}, "interval"),
        ({"interval": "1"}, "interval"),
        ({"with_records": "yes"}, "with_records"),
        ({"sync": 1}, "sync"),
        ({"eta_warmup": -1}, "eta_warmup"),
        ({"eta_warmup": 1.5}, "eta_warmup"),
        ({"show_units": None}, "show_units"),
        ({"bar": "auto"}, "bar"),
    ],
)
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(ValidationError) as error:
        ProgressHook(**kwargs)
    assert error.value.errors()[0]["loc"][-1] == name
