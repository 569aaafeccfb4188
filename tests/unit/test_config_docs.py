"""Every option a user writes is documented: a docstring in the code and a
row in the README's configuration reference."""

from __future__ import annotations

import ast
import inspect
import itertools
from pathlib import Path

import pytest

from engine.config import EngineConfig
from router.config import ServeConfig, WorkerResources

pytestmark = pytest.mark.unit

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


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
def test_every_serve_option_has_a_docstring_and_a_readme_row(cls):
    fields = set(cls.model_fields)
    assert fields - _documented_fields(cls) == set()
    missing = [f for f in fields if f"| `{f}` |" not in README]
    assert missing == []


def test_engine_options_have_docstrings():
    undocumented = set(EngineConfig.__dataclass_fields__) - _documented_fields(EngineConfig)
    assert undocumented == set()
