"""How the CPU kernels are built: sources, flags, cache key, build directory.

A build is a ``Target``: an ISA ("native": ``-march=native``, the default;
"avx2": ``-march=x86-64-v3``, the AVX2 branches on any x86 CPU that has them;
``TANDEM_KERNEL_ISA`` picks), its compiler flags, and a module name that
hashes everything the binary depends on: the sources and headers, the flags,
the interpreter and, for "native", the CPU's instruction-set flags. Its
directory is ``<TANDEM_KERNEL_CACHE or ~/.cache/tandem/kernels>/torch-<version>/<name>``,
so machines that share a home directory but differ in AVX-512 or AMX get
builds of their own.

``load`` builds once per directory: processes wait on a file lock while one
compiles. A build that fails leaves ``BUILD_FAILED-<origin>`` in its
directory with the compiler's last lines, ``origin`` a hash of the checkout's
source directory and the flags: later processes of that checkout raise
``BuildFailed`` from it instead of compiling again, until the file is deleted,
``forget`` (``python -m engine.kernels --rebuild``) clears the directory or
``python -m engine.kernels`` (``make setup``) retries it. Another checkout
whose sources hash the same (the directory is keyed by their content) is not
held back by that marker: it compiles once itself. A build whose sources
changed while it compiled (an edit in the checkout) records nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
SOURCES = (  # the longest to compile first: ninja starts them in this order
    "bindings.cpp",
    "rows.cpp",
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "linear.cpp",
    "quant_linear.cpp",
    "quant_gemm.cpp",
    "quant_dense.cpp",
    "head_f16.cpp",
    "head_i8.cpp",
    "head_amx.cpp",
)
HEADERS = ("isa.h", "common.h", "attention.h", "head.h", "linear_tiles.h", "quant_blocks.h")

# C++20 for std::bit_cast (torch passes -std=c++20 as well); no FMA
# contraction outside the regions that ask for it, so that the kernels round
# as the PyTorch reference does.
CFLAGS = ("-std=c++20", "-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
LDFLAGS = ("-fopenmp",)
ISAS = {
    "native": ("-march=native",),
    # x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE; no AVX-512, no AMX.
    "avx2": ("-march=x86-64-v3",),
}
# What an ISA's binary needs of the CPU, as /proc/cpuinfo names it.
ISA_NEEDS = {
    "avx2": frozenset(
        {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave", "popcnt"}
        | {"cx16", "lahf_lm", "pni", "ssse3", "sse4_1", "sse4_2"}
    )
}
# /proc/cpuinfo flags that name instruction-set extensions, by prefix: what
# -march=native can turn on. Others (mitigations, "hypervisor", TSC traits)
# differ between kernels and VMs of one CPU type and stay out of the key.
ISA_FLAG_PREFIXES = (
    "mmx", "sse", "ssse", "pni", "avx", "amx", "apx", "fma", "f16c", "xop", "bmi", "abm",
    "lzcnt", "tbm", "popcnt", "movbe", "adx", "aes", "vaes", "pclmul", "vpclmul", "sha", "gfni",
    "rdrand", "rdseed", "rdpid", "3dnowprefetch", "prefetch", "xsave", "clflushopt", "clwb",
    "cx16", "lahf_lm", "lwp", "fsgsbase", "rtm", "hle", "mwaitx", "clzero", "pku", "wbnoinvd",
    "movdir", "enqcmd", "cldemote", "serialize", "tsxldtrk", "ptwrite", "waitpkg", "sgx",
    "pconfig", "uintr", "hreset", "cmpccxadd", "sm3", "sm4", "user_msr",
)  # fmt: skip

FAILED_MARKER = "BUILD_FAILED"
LOCK_FILE = "tandem.lock"
TAIL_LINES = 40  # of the compiler's output, kept in the marker
RETRY = "delete that file or run `python -m engine.kernels --rebuild` to try again"


class BuildFailed(RuntimeError):
    """The kernels did not build (now, or in an earlier process: see ``FAILED_MARKER``)."""


@dataclass(frozen=True)
class Target:
    """One build of the kernels: ISA, flags, module name and directory."""

    isa: str
    cflags: tuple[str, ...]
    name: str
    directory: Path
    sources: str = ""  # the hash of the sources and headers the name was made from

    @property
    def marker(self) -> Path:
        """Where this checkout's failed build with these flags is remembered."""
        origin = f"{SOURCE_DIR.resolve()}\0{' '.join((*self.cflags, '|', *LDFLAGS))}"
        return (
            self.directory / f"{FAILED_MARKER}-{hashlib.sha256(origin.encode()).hexdigest()[:12]}"
        )

    def markers(self) -> list[Path]:
        """Every failed build remembered in the directory, this checkout's or others'."""
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob(f"{FAILED_MARKER}*"))

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"


def cache_root() -> Path:
    root = os.environ.get("TANDEM_KERNEL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "tandem" / "kernels"
    return base / f"torch-{torch.__version__}"


def target(
    isa: str | None = None, *, cpuinfo: str | None = None, extra_cflags: tuple[str, ...] = ()
) -> Target:
    """The build for ``isa`` (default: ``TANDEM_KERNEL_ISA``, else "native") on
    this CPU, or on the one ``cpuinfo`` (a /proc/cpuinfo text) describes."""
    isa = isa or os.environ.get("TANDEM_KERNEL_ISA") or "native"
    if isa not in ISAS:
        raise ValueError(f"TANDEM_KERNEL_ISA={isa!r}: expected one of {', '.join(ISAS)}")
    cflags = (*CFLAGS, *ISAS[isa], *extra_cflags)
    sources = sources_digest()
    digest = hashlib.sha256(sources.encode())
    digest.update(" ".join((*cflags, "|", *LDFLAGS)).encode())
    digest.update(f"{platform.machine()} {sys.implementation.cache_tag}".encode())
    if isa == "native":  # the binary uses whatever this CPU has
        digest.update(" ".join(sorted(cpu_isa_flags(cpuinfo))).encode())
    name = f"tandem_cpu_ops_{isa}_{digest.hexdigest()[:12]}"
    return Target(isa, cflags, name, cache_root() / name, sources)


def sources_digest() -> str:
    """A hash of every source and header, as they are now."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()


def cpu_isa_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set extensions of the CPU (of ``cpuinfo``, a
    /proc/cpuinfo text, when given): x86's "flags" that name one, every Arm
    "Features" entry; the processor's name where neither is listed."""
    line = _cpuinfo_isa_line() if cpuinfo is None else _isa_line(cpuinfo.splitlines())
    key, _, value = line.partition(":")
    flags = value.split()
    if key.strip() == "flags":
        return frozenset(f for f in flags if f.startswith(ISA_FLAG_PREFIXES))
    return frozenset(flags) if flags else frozenset([platform.processor() or platform.machine()])


@functools.cache
def _cpuinfo_isa_line() -> str:
    try:
        with open("/proc/cpuinfo") as lines:  # the first CPU's record is enough
            return _isa_line(lines)
    except OSError:
        return ""


def _isa_line(lines) -> str:
    for line in lines:
        if line.startswith(("flags", "Features")):
            return line.strip()
    return ""


def supported(isa: str, cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or ``cpuinfo``'s) runs a build for ``isa``."""
    return ISA_NEEDS.get(isa, frozenset()) <= cpu_isa_flags(cpuinfo)


def load(target: Target) -> ModuleType:
    """The kernels of ``target``, compiled first when they are not yet (about a
    minute). Raises BuildFailed when the compiler fails, now or in an earlier
    process (then without compiling again)."""
    if not supported(target.isa):
        missing = sorted(ISA_NEEDS[target.isa] - cpu_isa_flags())
        raise BuildFailed(f"a {target.isa} build needs a CPU with {', '.join(missing)}")
    target.directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.directory):
        if target.marker.exists():
            raise BuildFailed(
                f"the build in {target.directory} failed earlier and is not retried "
                f"({target.marker} holds the compiler's output; {RETRY}): "
                f"{_errors(target.marker.read_text())}"
            )
        for other in target.markers():  # another checkout's failure: try once ourselves
            log.warning("%s records a failed build of another checkout; building here", other)
        # torch's own build lock, left behind by a build that was killed:
        # no one else is building here while we hold ours.
        (target.directory / "lock").unlink(missing_ok=True)
        if not target.library.exists():
            log.warning(
                "Building the CPU kernels (%s: %s) in %s: about a minute, once per CPU type, "
                "kernel source and torch version",
                target.isa,
                " ".join(ISAS[target.isa]),
                target.directory,
            )
        try:
            module = _compile(target)
        except Exception as exc:
            output = str(exc).strip() or type(exc).__name__
            why = _not_remembered(exc, target)
            if why:
                raise BuildFailed(
                    f"the build in {target.directory} failed {why} (not remembered; the "
                    f"next process compiles again): {_errors(output)}"
                ) from exc
            _remember(target, f"{type(exc).__name__}: {output}")
            raise BuildFailed(
                f"the build in {target.directory} failed ({target.marker} keeps the compiler's "
                f"output, and later processes do not try again; {RETRY}): {_errors(output)}"
            ) from exc
        for stale in target.markers():  # built: no failure here is current any more
            stale.unlink(missing_ok=True)
        return module


def forget(target: Target) -> None:
    """Clears ``target``'s directory (a remembered failure, objects, the
    library), so that the next ``load`` compiles from scratch."""
    if not target.directory.is_dir():
        return
    with _exclusive(target.directory):
        for path in target.directory.iterdir():
            if path.name == LOCK_FILE:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def forget_failure(target: Target) -> bool:
    """Deletes this checkout's remembered failure, so that the next ``load``
    compiles again (keeping the objects built); whether there was one."""
    if not target.marker.exists():
        return False
    with _exclusive(target.directory):
        target.marker.unlink(missing_ok=True)
    return True


def describe(exc: Exception) -> str:
    """One line for a failed load: BuildFailed's own, else the exception's last line."""
    if isinstance(exc, BuildFailed):
        return str(exc)
    last = str(exc).strip().splitlines()[-1:] or [""]
    return f"{type(exc).__name__}: {last[0]}"


def _compile(target: Target) -> ModuleType:
    from torch.utils import cpp_extension

    # The ninja that pip installed lives beside this interpreter, maybe not on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(
        name=target.name,
        sources=[str(SOURCE_DIR / name) for name in SOURCES],
        extra_cflags=list(target.cflags),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(target.directory),
        verbose=False,
    )


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """One process at a time in a build directory (released when the process dies)."""
    with open(directory / LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process building the CPU kernels in %s", directory)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _not_remembered(exc: Exception, target: Target) -> str:
    """Why a failure says nothing about the sources, or "": they changed during
    the build, or the library built is missing (a compiler or linker killed
    midway, say by the memory limit, leaves no .so for torch to import)."""
    if sources_digest() != target.sources:
        return "while its sources changed"
    if isinstance(exc, ImportError) and not target.library.exists():
        return "without leaving its library (a killed compiler?)"
    return ""


def _remember(target: Target, output: str) -> None:
    lines = output.splitlines()
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    text = (
        f"The CPU kernel build failed on {platform.node()} at {when} (pid {os.getpid()}).\n"
        f"Sources: {SOURCE_DIR.resolve()}\n"
        f"Processes of that checkout do not try again: {RETRY}.\n"
        f"Flags: {' '.join(target.cflags)}\n"
        f"The compiler's last {min(len(lines), TAIL_LINES)} lines:\n\n"
        + "\n".join(lines[-TAIL_LINES:])
        + "\n"
    )
    try:
        target.marker.write_text(text)
    except OSError as exc:
        log.warning("could not record the failed build in %s: %s", target.marker, exc)


def _errors(output: str, limit: int = 8) -> str:
    """The compiler's error lines in ``output`` (else its last line), each once, joined."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = dict.fromkeys(
        line
        for line in lines
        if "error:" in line.lower() and "Error building extension" not in line
    )
    return " | ".join(list(errors)[:limit] or lines[-1:])
