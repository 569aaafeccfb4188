"""How the CPU kernels are built (engine/kernels/build.py): the cache key, a
failed build remembered, the ISA override. No test here compiles the kernels;
one runs the compiler on a flag it rejects."""

from __future__ import annotations

import logging
import shutil
from types import ModuleType

import pytest
import torch
from torch.utils import cpp_extension

import engine.kernels as kernels
from engine.kernels import build
from engine.kernels.__main__ import main

pytestmark = pytest.mark.unit


def cpuinfo(flags: str = "", model: str = "Intel(R) Xeon(R) Platinum 8480+") -> str:
    """A /proc/cpuinfo of two CPUs with these flags beyond an AVX2 machine's."""
    base = (
        "fpu vme sse sse2 ssse3 pni sse4_1 sse4_2 popcnt cx16 lahf_lm movbe xsave avx avx2 fma "
        "f16c bmi1 bmi2 abm hypervisor constant_tsc"
    )
    record = f"model name\t: {model}\nflags\t\t: {base} {flags}\nbogomips\t: 4000.00\n"
    return "".join(f"processor\t: {i}\n{record}\n" for i in range(2))


AVX2_CPU = cpuinfo()


def name(text: str = AVX2_CPU, **kwargs) -> str:
    return build.target("native", cpuinfo=text, **kwargs).name


def test_the_key_follows_the_instruction_set_flags():
    assert name() == name(cpuinfo())
    assert name(cpuinfo("avx512f avx512bw avx512vl")) != name()
    assert name(cpuinfo("avx512f avx512_vnni")) != name(cpuinfo("avx512f"))
    assert name(cpuinfo("avx512f amx_tile amx_int8")) != name(cpuinfo("avx512f"))
    assert name(cpuinfo("gfni vaes")) != name()


def test_the_key_ignores_what_does_not_change_the_binary():
    # The model name alone (one CPU type sold under two names, a VM's
    # label), mitigations and hypervisor flags, the flags' order.
    assert name(cpuinfo(model="Some Other Xeon")) == name()
    assert name(cpuinfo("md_clear flush_l1d ibrs_enhanced")) == name()
    shuffled = AVX2_CPU.replace("avx avx2 fma", "fma avx2 avx")
    assert name(shuffled) == name()


def test_arm_features_are_keyed_whole():
    arm = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n"
    assert name(arm) != name(arm.replace(" crc32", " crc32 sve"))


def test_the_key_follows_the_compiler_flags():
    assert name(extra_cflags=("-DTANDEM_TEST=1",)) != name()
    cflags = build.target("native", cpuinfo=AVX2_CPU).cflags
    assert "-std=c++20" in cflags and "-march=native" in cflags


def test_every_source_file_is_compiled_and_keyed(tmp_path, monkeypatch):
    here = {p.name for p in build.SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")}
    assert here == {*build.SOURCES, *build.HEADERS}
    for source in here:
        shutil.copy(build.SOURCE_DIR / source, tmp_path / source)
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    before = name()
    for source in sorted(here):
        with open(tmp_path / source, "a") as out:
            out.write("\n// an edit\n")
        assert name() != before, f"{source} is not in the key"
        before = name()


def test_the_isa_override_has_its_own_key_and_flags(monkeypatch):
    native = build.target("native", cpuinfo=AVX2_CPU)
    avx2 = build.target("avx2", cpuinfo=AVX2_CPU)
    assert avx2.name != native.name and avx2.directory != native.directory
    assert "-march=x86-64-v3" in avx2.cflags and "-march=native" not in avx2.cflags
    # One AVX2 binary runs on every CPU that has AVX2: not keyed on the CPU.
    assert build.target("avx2", cpuinfo=cpuinfo("avx512f amx_tile")).name == avx2.name
    monkeypatch.setenv("TANDEM_KERNEL_ISA", "avx2")
    assert build.target(cpuinfo=AVX2_CPU) == avx2
    monkeypatch.setenv("TANDEM_KERNEL_ISA", "avx3")
    with pytest.raises(ValueError, match="TANDEM_KERNEL_ISA='avx3'"):
        build.target()


def test_an_avx2_build_needs_a_cpu_with_avx2():
    assert build.supported("avx2", AVX2_CPU)
    assert not build.supported("avx2", AVX2_CPU.replace(" avx2 ", " "))
    assert not build.supported("avx2", AVX2_CPU.replace(" fma ", " "))
    assert build.supported("native", "processor\t: 0\n")


def test_the_cache_directory_follows_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    target = build.target("native", cpuinfo=AVX2_CPU)
    assert target.directory.parent.parent == tmp_path
    assert target.directory.parent.name == f"torch-{torch.__version__}"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache, and a process that has loaded no kernels yet."""
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", {})
    return tmp_path


def compiler(calls: list[str], error: str | None = None):
    """A stand-in for torch's cpp_extension.load: fails with ``error``, or
    returns an empty module."""

    def load(**kwargs):
        calls.append(kwargs["name"])
        if error is not None:
            raise RuntimeError(f"Error building extension '{kwargs['name']}': {error}")
        module = ModuleType(kwargs["name"])
        module.ISA = "avx512"
        return module

    return load


UNDECLARED = (
    "[1/9] c++ -c linear.cpp\nFAILED: linear.o\n"
    "linear.cpp:12:3: error: 'frobnicate' was not declared in this scope\n"
    "ninja: build stopped: subcommand failed."
)


def test_a_failed_build_is_remembered_and_logged_once(cache, monkeypatch, caplog):
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", compiler(calls, UNDECLARED))
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels.cpu_ops() is None
        assert kernels.cpu_ops() is None
    assert len(calls) == 1
    marker = build.target().marker
    assert "'frobnicate' was not declared" in marker.read_text()
    fallbacks = [r for r in caplog.records if "using the PyTorch path" in r.getMessage()]
    assert len(fallbacks) == 1
    assert "frobnicate" in fallbacks[0].getMessage()
    assert "--rebuild" in fallbacks[0].getMessage()

    # Another process: nothing in memory, the marker on disk; no compiling.
    monkeypatch.setattr(kernels, "_loaded", {})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels.select("auto", torch.device("cpu"), torch.float32) is None
    assert len(calls) == 1
    assert "failed earlier" in caplog.text and "frobnicate" in caplog.text
    assert str(marker) in caplog.text
    with pytest.raises(RuntimeError, match=r"did not build: .*frobnicate"):
        kernels.select("on", torch.device("cpu"), torch.float32)


def test_rebuild_forgets_a_failed_build(cache, monkeypatch, capsys):
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", compiler(calls, UNDECLARED))
    assert kernels.cpu_ops() is None
    assert main(["--rebuild"]) == 1  # asked for, and failed again
    assert len(calls) == 2

    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setattr(cpp_extension, "load", compiler(calls))
    assert main(["--rebuild"]) == 0
    assert len(calls) == 3
    assert not build.target().marker.exists()
    assert "CPU kernels: ready" in capsys.readouterr().out


def test_a_build_says_where_and_how_long_before_it_starts(cache, monkeypatch, caplog):
    seen_before_compiling: list[str] = []

    def load(**kwargs):
        seen_before_compiling.append(caplog.text)
        return compiler([])(**kwargs)

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        assert kernels.cpu_ops() is not None
    target = build.target()
    assert str(target.directory) in seen_before_compiling[0]
    assert "about a minute" in seen_before_compiling[0]

    # Built already (the library is there): loading says nothing.
    monkeypatch.setattr(kernels, "_loaded", {})
    target.library.touch()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.kernels"):
        assert kernels.cpu_ops() is not None
    assert caplog.text == ""


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_the_compilers_own_error_is_kept(cache, monkeypatch):
    """The real compiler, given a flag it does not know: it fails at once."""
    target = build.target(extra_cflags=("-fno-such-flag-for-tandem",))
    with pytest.raises(build.BuildFailed, match="no-such-flag-for-tandem"):
        build.load(target)
    assert "no-such-flag-for-tandem" in target.marker.read_text()

    def compile_again(**kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(cpp_extension, "load", compile_again)
    with pytest.raises(build.BuildFailed, match=r"failed earlier.*no-such-flag-for-tandem"):
        build.load(target)
