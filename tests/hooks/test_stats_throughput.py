"""Throughput: items per second in the stats, the metrics file and the progress line, against a hand count."""

from __future__ import annotations

import itertools
import logging

import pytest
from cli_process import Cli, assert_one_clean_error
from tiny_trainer import ItemsTrainer, TinyTrainer, items_mask, make_data
from torch.utils.data import DataLoader

from trainloop import TrainerSettings
from trainloop.core.metrics import read_metrics
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.progress import ProgressHook
from trainloop.hooks.stats import StatsHook


def hand_counts(batches: int) -> list[int]:
    """``ItemsTrainer``'s count of each batch drawn, in order, counted here from the data itself."""
    per_epoch = [int(items_mask(x).sum()) for x, _ in DataLoader(make_data(), batch_size=8)]
    return list(itertools.islice(itertools.cycle(per_epoch), batches))


def test_items_over_each_window_match_a_hand_count_in_the_metrics_file(tmp_path):
    # 10 steps of 2 microsteps, logged every 4 steps: windows of 8, 8 and 4 batches.
    trainer = ItemsTrainer(
        max_steps=10, gradient_accumulation_steps=2, workspace=tmp_path, hooks=[LoggingHook(interval=4)]
    )
    trainer.train()
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "loss" in row]
    counts = hand_counts(20)
    assert [row["step"] for row in rows] == [4, 8, 10]
    assert [row["throughput/items"] for row in rows] == [sum(counts[:8]), sum(counts[8:16]), sum(counts[16:])]
    for row, steps in zip(rows, (4, 4, 2), strict=True):
        # The rate is the items over the steps' own time: step_time is their mean.
        assert row["throughput/items_per_second"] == pytest.approx(
            row["throughput/items"] / (row["step_time"] * steps), rel=1e-9
        )
        assert "throughput/total_items" not in row  # one process: no total across ranks
        assert "throughput/mfu" not in row  # no peak declared: none shown


def test_a_count_declared_in_the_records_is_counted_by_its_key_from_the_settings(tmp_path):
    hooks = [{"type": "logging", "interval": 3, "items": "tokens.input"}]
    ItemsTrainer(TrainerSettings(max_steps=3, workspace=tmp_path, hooks=hooks)).train()
    (row,) = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "loss" in row]
    assert row["throughput/items"] == 3 * 4 * 8  # 3 steps of a batch of 8, 4 "tokens" per sample


def test_flops_and_mfu_follow_from_the_declared_flops_per_item_and_peak():
    stats = StatsHook(interval=2, flops_per_item=1000.0, peak_flops=1e9)
    ItemsTrainer(max_steps=2, hooks=[stats]).train()
    rate = stats.latest.throughput
    assert rate.items == sum(hand_counts(2))
    assert rate.flops_per_second == pytest.approx(rate.items_per_second * 1000.0)
    assert rate.mfu == pytest.approx(rate.items_per_second * 1000.0 / 1e9)


def test_plain_losses_without_a_declared_key_have_no_throughput():
    stats = StatsHook(interval=2)
    TinyTrainer(max_steps=2, hooks=[stats]).train()
    assert stats.latest.throughput is None
    assert "throughput" not in stats.latest.to_records()


def test_a_declared_key_missing_from_the_records_fails_at_the_first_step_naming_it():
    trainer = ItemsTrainer(max_steps=5, hooks=[StatsHook(interval=5, items="tokens.output")])
    with pytest.raises(KeyError, match=r"StatsHook\(items='tokens.output'\): forward's records at step 1 have no"):
        trainer.train()
    assert trainer.step == 1


def test_the_progress_line_shows_items_per_second(caplog):
    caplog.set_level(logging.INFO, logger="trainloop")
    ItemsTrainer(max_steps=2, hooks=[ProgressHook(interval=2, bar=False, flops_per_item=10.0, peak_flops=1e6)]).train()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step 2/2")]
    assert " items/s " in line
    assert " mfu " in line
    assert "total items/s" not in line  # not synced across ranks


def test_peak_flops_without_flops_per_item_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "run.yaml").write_text("max_steps: 2\nworkspace: ws\nhooks:\n  - type: logging\n    peak_flops: 1.0e+15\n")
    result = Cli("run", "run.yaml", "--trainer", "tiny_trainer:ItemsTrainer", cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    assert_one_clean_error(result.stderr, "peak_flops", "needs flops_per_item")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "ws").exists()


def test_progress_counts_what_the_logging_hook_declares_unless_it_declares_the_same():
    progress = ProgressHook(interval=2, bar=False)
    ItemsTrainer(max_steps=2, hooks=[LoggingHook(interval=2, items="tokens.input"), progress]).train()
    assert progress.latest.throughput.items == 2 * 4 * 8  # tokens.input, not Loss.count
    same = ProgressHook(interval=2, bar=False, items="tokens.input")
    ItemsTrainer(max_steps=2, hooks=[LoggingHook(interval=2, items="tokens.input"), same]).train()
    assert same.latest.throughput.items == 2 * 4 * 8
    ItemsTrainer(max_steps=2, hooks=[progress]).train()  # the same hook, a run without that LoggingHook
    assert progress.latest.throughput.items == sum(hand_counts(2))  # Loss.count again, as declared


def test_progress_and_logging_counting_different_items_is_refused_before_the_first_step():
    trainer = ItemsTrainer(max_steps=2, hooks=[LoggingHook(interval=2, items="tokens.input"), ProgressHook(items="x")])
    with pytest.raises(ValueError, match="ProgressHook and LoggingHook: items is 'x' on one and 'tokens.input' on"):
        trainer.train()
    assert trainer.step == 0


@pytest.mark.parametrize("command", ["validate", "run"])
def test_different_items_declared_in_a_settings_file_are_refused_naming_both_hooks(tmp_path, command):
    (tmp_path / "run.yaml").write_text(
        "max_steps: 2\nworkspace: ws\nhooks:\n  - type: logging\n    items: tokens.input\n"
        "  - type: progress\n    items: tokens\n"
    )
    result = Cli(command, "run.yaml", "--trainer", "tiny_trainer:ItemsTrainer", cwd=tmp_path).result()
    assert result.returncode == 2, result.stderr
    assert_one_clean_error(
        result.stderr, "hooks[1] (progress) and hooks[0] (logging): items is 'tokens' on one and 'tokens.input'"
    )
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "ws").exists()
