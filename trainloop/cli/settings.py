"""The settings ``run``, ``validate`` and ``predict`` check.

The file < ``TRAINLOOP_*`` environment < ``--set``, validated by the trainer's settings class, then preflighted.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
from pathlib import Path

from trainloop.cli.errors import CliError
from trainloop.cli.trainer_class import load_trainer_class
from trainloop.core.preflight import preflight
from trainloop.core.result import RunKind
from trainloop.settings.model import SettingsFileError, TrainerSettings
from trainloop.settings.sources import SettingsInput, read_settings_input
from trainloop.trainer import BaseTrainer

__all__ = ["checked_settings", "settings_class_for"]


def settings_class_for(trainer_spec: str | None) -> type[TrainerSettings]:
    """The settings class to validate with: the trainer's ``settings_class``, or the base one."""
    if trainer_spec is None:
        return TrainerSettings
    return load_trainer_class(trainer_spec).settings_class


def checked_settings(
    args: argparse.Namespace, trainer_required: bool, kind: RunKind = "train"
) -> tuple[TrainerSettings, type[BaseTrainer] | None]:
    """Resolve, validate and preflight the settings ``args`` name, with the trainer they name.

    The layers are defaults < the file < ``TRAINLOOP_*`` environment < ``--set``. The trainer
    is ``--trainer``, else the settings' ``trainer`` key; its ``settings_class`` validates them,
    and ``trainloop.core.preflight`` checks them against it for a run of ``kind``
    (``"train"``, ``"predict"``). Nothing is built or written.

    Raises:
        CliError: Any problem, one line each, naming the file, variable or override and field.
    """
    try:
        found = read_settings_input(args.settings_file, os.environ, args.set)
    except SettingsFileError as error:
        raise CliError(str(error)) from None
    spec, given_as = args.trainer, "--trainer"
    if spec is not None:
        found.set(["trainer"], spec, f"--trainer {spec}")  # recorded: settings.json says what ran
    elif isinstance(found.data.get("trainer"), str):
        spec = found.data["trainer"]
        given_as = f"{found.source_of(('trainer',))}: trainer"
    no_trainer = CliError(
        f"{args.settings_file}: no trainer to run: give --trainer MODULE:CLASS or a \"trainer\" key in the settings"
    )
    if spec is None and trainer_required and found.data.get("trainer") is None:
        raise no_trainer
    trainer_class = load_trainer_class(spec, given_as) if spec is not None else None
    settings_class = trainer_class.settings_class if trainer_class is not None else TrainerSettings
    try:
        settings = settings_class.validate_input(found)  # also reports a "trainer" that is not a name
    except SettingsFileError as error:
        hint = _trainer_hint(found) if trainer_class is None else None
        raise CliError("\n".join([*error.problems, *([hint] if hint else [])])) from None
    if trainer_class is None and trainer_required:
        raise no_trainer
    problems = preflight(settings, trainer_class, source_of=found.source_of, kind=kind)
    if problems:
        raise CliError("\n".join(problems))
    return settings, trainer_class


def _trainer_hint(found: SettingsInput) -> str | None:
    """With no trainer named, a line saying which trainer would know the unknown top-level keys.

    A trainer's own fields (``lr``, ``batch_size``...) are unknown to the base ``TrainerSettings``:
    the working directory's modules are read (parsed, not imported) for a trainer whose
    ``settings_class`` declares them, and the line names it.
    """
    fields = list(TrainerSettings.model_fields)
    unknown = [
        key for key in found.data
        if isinstance(key, str) and key not in fields and key != "$schema"
        and not difflib.get_close_matches(key, fields, n=1, cutoff=0.6)  # a typo: its line says "did you mean"
    ]
    if not unknown:
        return None
    where = found.source_of((unknown[0],))
    names = ", ".join(map(repr, unknown))
    declaring = _trainers_declaring(set(unknown), Path.cwd())
    if declaring:
        specs = " or ".join(f"--trainer {spec}" for spec in declaring)
        what = "are settings" if len(unknown) > 1 else "is a setting"
        return f'{where}: {names} {what} of {" and ".join(declaring)}: name the trainer with {specs} or a "trainer" key'
    what = "are not TrainerSettings fields" if len(unknown) > 1 else "is not a TrainerSettings field"
    return (
        f"{where}: {names} {what}: if your trainer's settings_class declares "
        f"{'them' if len(unknown) > 1 else 'it'}, name the trainer with --trainer MODULE:CLASS or a \"trainer\" key"
    )


def _trainers_declaring(keys: set[str], directory: Path) -> list[str]:
    """``module:Class`` of the trainers in ``directory``'s modules whose settings declare every one of ``keys``.

    The settings are the ``settings_class`` (a class of the same module); the modules are read with ``ast``, not
    imported.
    """
    found = []
    for path in sorted(directory.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        for cls in classes.values():
            settings = _assigned_name(cls, "settings_class")
            if settings in classes and keys <= _declared_fields(classes[settings], classes):
                found.append(f"{path.stem}:{cls.name}")
    return found


def _assigned_name(cls: ast.ClassDef, attribute: str) -> str | None:
    """The name ``cls`` assigns to ``attribute`` in its body (``settings_class = DigitsSettings``)."""
    for node in cls.body:
        target = (
            node.targets[0]
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            else getattr(node, "target", None)
        )
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == attribute and isinstance(value, ast.Name):
            return value.id
    return None


def _declared_fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> set[str]:
    """The annotated fields of ``cls`` and of its bases defined in the same module."""
    fields: set[str] = set()
    todo, seen = [cls], set()
    while todo:
        node = todo.pop()
        if node.name in seen:
            continue
        seen.add(node.name)
        fields |= {
            item.target.id
            for item in node.body
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        }
        todo += [classes[base.id] for base in node.bases if isinstance(base, ast.Name) and base.id in classes]
    return fields
