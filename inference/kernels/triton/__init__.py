"""Triton kernels over the paged KV cache (GPU; on a CPU under ``TRITON_INTERPRET=1``)."""
