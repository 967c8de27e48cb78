"""docs/ stays true to the code: generated parts are current, and the table of hook methods
matches where a real run calls them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer

from trainloop.hook_machinery.dispatch import HOOK_EVENTS

ROOT = Path(__file__).resolve().parents[2]


def test_generated_docs_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_hook_methods_run_in_the_one_state_the_docs_say(accumulation):
    hook = CaptureHook()
    TinyTrainer(max_steps=3, gradient_accumulation_steps=accumulation, hooks=[hook]).train()
    seen = {event: {state for name, state, _ in hook.calls if name == event} for event in HOOK_EVENTS}
    for event, state in HOOK_EVENTS.items():
        if state is not None and event != "on_exception":
            assert seen[event] == {state.value}, event


def test_on_exception_runs_in_its_state_before_on_after_train():
    hook = CaptureHook()

    class Failing(TinyTrainer):
        def forward(self, batch):
            if self.step == 2:
                raise ValueError("boom")
            return super().forward(batch)

    with pytest.raises(ValueError, match="boom"):
        Failing(max_steps=3, hooks=[hook]).train()
    assert hook.calls[-2:] == [("on_exception", HOOK_EVENTS["on_exception"].value, 2), ("on_after_train", "exiting", 2)]
    assert isinstance(hook.error, ValueError)


def _generate_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_machine_picture_is_drawn_from_the_current_table(monkeypatch):
    generate = _generate_module()
    assert generate.machine_svg_is_current(), "docs/img/machine.svg is stale: run python docs/generate.py"
    svg = generate.MACHINE_SVG.read_text()
    for t in generate.TRANSITIONS:  # every edge is in the picture (fail edges folded into one line)
        assert f'data-edge="{t.source.value}-&gt;{t.dest.value}:{t.trigger}"' in svg
    assert svg.count('class="edge folded"') == sum(t.trigger == "fail" for t in generate.TRANSITIONS)
    # A changed table makes it stale.
    monkeypatch.setattr(generate, "TRANSITIONS", generate.TRANSITIONS[:-1])
    assert not generate.machine_svg_is_current()
    text = (ROOT / "docs" / "machine.md").read_text()
    assert "](img/machine.svg)" in text
    assert "```mermaid" in text  # the source, folded, for code hosts that render it
    assert "](docs/img/machine.svg)" in (ROOT / "README.md").read_text()  # offline too: not Mermaid


def test_the_report_picture_shows_what_a_fresh_report_of_the_demo_shows(tmp_path):
    import pytest

    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from trainloop.report import build_report

    generate = _generate_module()
    # A quarter of the demo shows the same sections, charts and edges, in a quarter of the time.
    workspace = generate.run_digits_demo(tmp_path, max_steps=100)
    outline = generate.report_outline(build_report(workspace))
    assert outline == json.loads(generate.REPORT_OUTLINE.read_text()), (
        "docs/img/report.png shows another report than the demo makes now: run python docs/generate.py --pictures"
    )
    assert generate.REPORT_PNG.stat().st_size > 50_000
    assert "](docs/img/report.png)" in (ROOT / "README.md").read_text()
    assert "](img/report.png)" in (ROOT / "docs" / "results.md").read_text()


def test_the_architecture_picture_is_drawn_from_the_current_imports(monkeypatch):
    generate = _generate_module()
    svg = generate.ARCHITECTURE_SVG.read_text()
    assert svg == generate.architecture_svg(), "docs/img/architecture.svg is stale: run python docs/generate.py"
    graph = generate.import_graph()
    wings = {p.name + "/" for p in (ROOT / "trainloop").iterdir() if (p / "__init__.py").is_file()}
    assert wings <= set(graph)
    assert {"trainer", "core/"} <= set(graph)
    for source, dests in graph.items():  # every wing and every import between wings is drawn
        assert f"<title>{source}</title>" in svg
        for dest in dests:
            assert f"<title>{source} → {dest}</title>" in svg
    assert "machine/" in graph["core/"]  # the graph sees real imports: the loop runs the machine
    # An import added between two wings makes the picture stale.
    monkeypatch.setattr(generate, "import_graph", lambda: {**graph, "loss": graph["loss"] | {"trainer"}})
    assert generate.architecture_svg() != svg
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert "](img/architecture.svg)" in page
    for wing in wings:  # the layout table names every wing
        assert f"| `{wing}` |" in page


def test_the_cli_page_counts_every_subcommand_and_lists_each():
    # Issue 29: docs/cli.md said eight subcommands where there are nine.
    from trainloop.cli import COMMANDS

    page = (ROOT / "docs" / "cli.md").read_text()
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert f"It has {words[len(COMMANDS)]} subcommands:" in page
    assert all(f"| `trainloop {command}" in page for command in COMMANDS)


def test_the_results_page_shows_the_lr_key_a_declared_optimizer_logs(tmp_path):
    # Issue 29: docs/results.md showed lr/group_0 where a declared optimizer (as the demo's) logs lr/default.
    from cli_trainers import CliTrainer

    result = CliTrainer(max_steps=2, workspace=tmp_path, optimizer={"name": "SGD", "lr": 0.1}).train()
    assert "lr/default" in result.metrics
    page = (ROOT / "docs" / "results.md").read_text()
    assert "lr/default" in page
    assert "lr/group_0" not in page
