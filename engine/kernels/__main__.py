"""Build the CPU kernels now (``make setup`` runs this).

    python -m engine.kernels              build (or load) the kernels for this CPU; a
                                          failed build remembered earlier is retried once
    python -m engine.kernels --rebuild    forget a failed build and compile from scratch
    python -m engine.kernels --isa avx2   the AVX2 branches (also: TANDEM_KERNEL_ISA=avx2)

Exits 0 when the kernels cannot be built (the engine then runs its PyTorch
path), unless --rebuild was asked for.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from engine.kernels import build, cpu_ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="clear the build directory (a remembered failure, objects) and compile again",
    )
    parser.add_argument(
        "--isa",
        choices=sorted(build.ISAS),
        help="the ISA to build for (default: TANDEM_KERNEL_ISA, else native)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.isa:
        os.environ["TANDEM_KERNEL_ISA"] = args.isa
    target = build.target()
    print(f"CPU kernels: {target.isa} build in {target.directory}")
    if not args.rebuild and build.forget_failure(target):
        print("CPU kernels: a failed build was remembered here; trying again")
    ops = cpu_ops(rebuild=args.rebuild)
    if ops is None:
        print("CPU kernels: not built; the engine uses its PyTorch path")
        return 1 if args.rebuild else 0
    print(f"CPU kernels: ready ({ops.__name__}, {ops.ISA} branches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
