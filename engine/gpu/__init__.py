"""GPU kernels (Triton): used where the engine runs on a GPU."""
