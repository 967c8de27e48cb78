"""The report's runs table says which runs trained and which evaluated; the trace's validating time is its own."""

from __future__ import annotations

import re

from eval_trainers import EvalTrainer

from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.validation import ValidationHook
from trainloop.report import write_report


def test_an_evaluate_run_is_a_row_of_its_kind_and_validating_has_its_time(tmp_path):
    def hooks():
        return [ValidationHook("val_metrics", interval=2), CheckpointingHook(interval=2)]

    EvalTrainer(max_steps=4, workspace=tmp_path, trace=True, hooks=hooks()).train()
    EvalTrainer(max_steps=4, workspace=tmp_path, trace=True, hooks=hooks()).evaluate()
    page = write_report(tmp_path).read_text()
    assert "<th>kind</th>" in page
    assert page.count("<td>train</td>") == 1
    assert page.count("<td>evaluate</td>") == 1
    # The training run's trace: validating entered after steps 2 and 4, its time in its own row.
    assert re.search(r"<tr><td>validating</td><td class=\"num\">[0-9.]+ s</td><td class=\"num\">[0-9.]+%</td>"
                     r"<td class=\"num\">2</td>", page)
