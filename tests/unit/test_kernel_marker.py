"""A remembered failed build (engine/kernels/build.py's BUILD_FAILED markers)
holds back only the checkout and flags that failed: another checkout whose
sources hash the same compiles once itself, a build whose sources changed
while it compiled records nothing, and ``python -m engine.kernels`` (``make
setup``) retries a remembered failure. No test here runs the compiler."""

from __future__ import annotations

import shutil
from types import ModuleType

import pytest
from torch.utils import cpp_extension

import engine.kernels as kernels
from engine.kernels import build
from engine.kernels.__main__ import main

pytestmark = pytest.mark.unit

ERROR = "linear.cpp:12:3: error: 'frobnicate' was not declared in this scope"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache, a process that has loaded no kernels, and a copy of
    the sources (a checkout of its own)."""
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_loaded", {})
    sources = tmp_path / "checkout"
    sources.mkdir()
    for name in (*build.SOURCES, *build.HEADERS):
        shutil.copy(build.SOURCE_DIR / name, sources / name)
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    return tmp_path


def compiler(calls: list[str], fail: bool = False, during=None):
    """A stand-in for cpp_extension.load: runs ``during``, then fails or returns a module."""

    def load(**kwargs):
        calls.append(kwargs["name"])
        if during is not None:
            during()
        if fail:
            raise RuntimeError(f"Error building extension '{kwargs['name']}': {ERROR}")
        module = ModuleType(kwargs["name"])
        module.ISA = "avx512"
        return module

    return load


def fresh_process(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_loaded", {})


def test_another_checkouts_failure_does_not_disable_the_kernels(cache, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", compiler(calls, fail=True))
    assert kernels.cpu_ops() is None  # this checkout fails, and remembers it
    mine = build.target().marker
    assert mine.exists() and str(build.SOURCE_DIR) in mine.read_text()

    # The same sources in another checkout: the same directory, another marker name.
    other = cache / "other-checkout"
    shutil.copytree(build.SOURCE_DIR, other)
    monkeypatch.setattr(build, "SOURCE_DIR", other)
    assert build.target().directory == mine.parent and build.target().marker != mine
    fresh_process(monkeypatch)
    monkeypatch.setattr(cpp_extension, "load", compiler(calls))
    assert kernels.cpu_ops() is not None  # compiled once more, not held back
    assert len(calls) == 2
    assert build.target().markers() == []  # a success clears every stale failure


def test_a_remembered_failure_still_holds_back_its_own_checkout(cache, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", compiler(calls, fail=True))
    assert kernels.cpu_ops() is None
    fresh_process(monkeypatch)
    assert kernels.cpu_ops() is None
    assert len(calls) == 1


def test_sources_changed_during_the_build_record_nothing(cache, monkeypatch):
    calls: list[str] = []

    def edit():
        with open(build.SOURCE_DIR / "linear.cpp", "a") as out:
            out.write("\n// an edit while compiling\n")

    monkeypatch.setattr(cpp_extension, "load", compiler(calls, fail=True, during=edit))
    target = build.target()
    with pytest.raises(build.BuildFailed, match="sources changed"):
        build.load(target)
    assert target.markers() == []
    monkeypatch.setattr(cpp_extension, "load", compiler(calls))
    assert build.load(target) is not None  # the next try compiles
    assert len(calls) == 2


def test_the_setup_command_retries_a_remembered_failure(cache, monkeypatch, capsys):
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", compiler(calls, fail=True))
    assert kernels.cpu_ops() is None
    fresh_process(monkeypatch)
    monkeypatch.setattr(cpp_extension, "load", compiler(calls))
    assert main([]) == 0
    assert len(calls) == 2
    out = capsys.readouterr().out
    assert "trying again" in out and "CPU kernels: ready" in out
    assert not build.target().marker.exists()


def test_a_build_that_leaves_no_library_is_not_remembered(cache, monkeypatch):
    """A compiler killed midway (the memory limit): torch cannot import a .so
    that was never linked; the next process compiles again."""
    calls: list[str] = []

    def killed(**kwargs):
        calls.append(kwargs["name"])
        raise ImportError(f"{kwargs['name']}.so: cannot open shared object file")

    monkeypatch.setattr(cpp_extension, "load", killed)
    target = build.target()
    with pytest.raises(build.BuildFailed, match="without leaving its library"):
        build.load(target)
    assert target.markers() == []
