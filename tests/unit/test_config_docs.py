"""Every option a user writes is documented: a docstring in the code and a
row in the configuration reference (docs/configuration.md), by its YAML path;
every YAML example in the docs is a valid config."""

from __future__ import annotations

import ast
import inspect
import itertools
import re
from pathlib import Path

import pytest
import yaml

from engine.config import EngineConfig
from router.config import (
    REMOVED_KEYS,
    RENAMED_KEYS,
    SECTIONS,
    ServeConfig,
    WorkerResources,
)
from tandem_cli.main import build_parser
from tandem_cli.serve import SERVE_FLAGS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = (ROOT / "docs" / "configuration.md").read_text()


def _documented_fields(cls: type) -> set[str]:
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        node.target.id
        for node, following in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign)
        and isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    }


def _paths() -> set[str]:
    return {f"{name}.{key}" for name, cls in SECTIONS.items() for key in cls.model_fields}


def _table(header: str) -> list[list[str]]:
    """The rows (cells, backquotes stripped) of every table whose first header
    cell is ``header``."""
    rows, inside = [], False
    for line in REFERENCE.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not inside:
            inside = cells[0] == header
        elif not set(cells[0]) <= {"-"}:
            rows.append([c.strip("`") for c in cells])
    return rows


@pytest.mark.parametrize("cls", [ServeConfig, *SECTIONS.values(), WorkerResources])
def test_every_field_has_a_docstring(cls):
    assert set(cls.model_fields) - _documented_fields(cls) == set()


def test_every_key_has_one_reference_row_and_every_row_is_a_key():
    keys = [row[0] for row in _table("key")]
    assert len(keys) == len(set(keys)), "a key has two rows"
    assert set(keys) == _paths()


def test_worker_resources_have_their_rows():
    keys = [row[0] for row in _table("resources key")]
    assert sorted(keys) == sorted(WorkerResources.model_fields)


def test_every_section_has_its_part_of_the_reference():
    for name in SECTIONS:
        assert f"Section `{name}`" in REFERENCE, name


def test_the_flag_table_is_the_flags():
    (subparsers,) = build_parser()._subparsers._group_actions
    flags = {
        action.dest: action.option_strings[0]
        for action in subparsers.choices["serve"]._actions
        if action.dest in SERVE_FLAGS
    }
    table = dict(_table("flag"))
    assert table == {flags[dest]: path for dest, path in SERVE_FLAGS.items()}


def test_the_upgrade_table_lists_every_renamed_and_removed_key():
    table = dict(_table("old key"))
    assert {k: v for k, v in table.items() if not v.startswith("no longer")} == RENAMED_KEYS
    removed = {k: v for k, v in table.items() if v.startswith("no longer")}
    assert set(removed) == set(REMOVED_KEYS)
    assert all(REMOVED_KEYS[k].split(", ")[1] in v for k, v in removed.items())


def _yaml_examples() -> list[tuple[str, str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [
        (f"{path.name}#{i}", block)
        for path in docs
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", path.read_text(), re.S))
    ]


@pytest.mark.parametrize(("where", "block"), _yaml_examples(), ids=lambda x: x[:40])
def test_every_yaml_example_in_the_docs_is_a_valid_config(where, block):
    ServeConfig.model_validate(yaml.safe_load(block))


def test_engine_options_have_docstrings():
    undocumented = set(EngineConfig.__dataclass_fields__) - _documented_fields(EngineConfig)
    assert undocumented == set()
