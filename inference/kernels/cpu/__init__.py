"""The CPU kernels: C sources in ``csrc/`` built on first use (``build``), and one module per
kernel family (``linear``, ``attention``, ``elementwise``, ``forward``) wrapping them."""
