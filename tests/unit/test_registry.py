"""Built-in plugins are declared as entry points exactly as in the built-in table, and all load."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from ds4d.registry import BUILTINS, KINDS, PluginError, available, resolve

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_builtin_table_matches_pyproject_entry_points():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    for kind in KINDS:
        assert declared.get(f"ds4d.{kind}", {}) == BUILTINS[kind], kind


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_plugin_loads(kind):
    for name, spec in available(kind).items():
        factory = spec.load()
        assert callable(factory), (kind, name)


def test_unknown_plugin_names_what_is_installed():
    with pytest.raises(PluginError, match="installed: .*fcfs"):
        resolve("scheduler_policy", "lottery")
