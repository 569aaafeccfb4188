"""Build the CPU kernels now (``make setup`` runs this): python -m engine.kernels"""

import sys

from engine.kernels import cpu_ops

if __name__ == "__main__":
    ops = cpu_ops()
    if ops is None:
        print("CPU kernels: not built; the engine uses its PyTorch path")
        sys.exit(0)
    print(f"CPU kernels: built ({ops.__name__})")
