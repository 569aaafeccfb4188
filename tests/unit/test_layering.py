"""The layout's rules, read from the code's imports: engine/ is the model
and its cache and imports no serving layer, network or Ray; protocol/ is
torch-free."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SERVING = {"grpc", "redis", "ray", "socket", "ssl", "socketserver", "asyncio.streams"}
OURS = {"kv_transfer", "block_index", "net", "worker", "router", "prefill_pool", "decode_pool"}


def imported(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (absolute imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def offenders(folder: str, forbidden: set[str]) -> dict[str, set[str]]:
    found = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        bad = imported(path) & forbidden
        if bad:
            found[str(path.relative_to(REPO))] = bad
    return found


def test_engine_imports_no_serving_layer_network_or_ray():
    assert offenders("engine", SERVING | OURS) == {}


def test_protocol_imports_nothing_heavy():
    assert offenders("protocol", {"torch", "transformers", "numpy", "ray", "grpc"} | OURS) == {}


def test_the_check_sees_an_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom ray.util import x\nfrom . import y\n")
    assert imported(module) == {"os", "ray"}
