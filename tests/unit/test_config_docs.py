"""Every option a user writes is documented: a docstring in the code and a
row in the configuration reference (docs/configuration.md)."""

from __future__ import annotations

import ast
import inspect
import itertools
from pathlib import Path

import pytest

from engine.config import EngineConfig
from router.config import ServeConfig, WorkerResources

pytestmark = pytest.mark.unit

REFERENCE = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()


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


@pytest.mark.parametrize("cls", [ServeConfig, WorkerResources])
def test_every_serve_option_has_a_docstring_and_a_reference_row(cls):
    fields = set(cls.model_fields)
    assert fields - _documented_fields(cls) == set()
    missing = [f for f in fields if f"| `{f}` |" not in REFERENCE]
    assert missing == []


def _reference_keys() -> list[str]:
    """The first cell of every row of the reference's ``| key | ... |`` tables."""
    keys, in_key_table = [], False
    for line in REFERENCE.splitlines():
        if not line.startswith("|"):
            in_key_table = False
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not in_key_table:
            in_key_table = cells[0] == "key"
        elif not set(cells[0]) <= {"-"}:
            keys.append(cells[0].strip("`"))
    return keys


def test_every_reference_row_is_an_option():
    options = set(ServeConfig.model_fields) | set(WorkerResources.model_fields)
    keys = _reference_keys()
    assert len(keys) == len(set(keys)), "a key has two rows"
    assert set(keys) - options == set()


def test_engine_options_have_docstrings():
    undocumented = set(EngineConfig.__dataclass_fields__) - _documented_fields(EngineConfig)
    assert undocumented == set()
