"""Compute ops shared by the modules: one grouped-GEMM interface, with a torch reference on every device
and Triton kernels dropped in on CUDA (see ``distwgrad.ops.grouped_gemm``)."""
