"""Device kernels: ``cpu`` (C sources built on first use) and ``triton`` (GPU)."""
