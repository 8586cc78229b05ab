"""Triton kernels, installed as ``distwgrad.kernels`` (setuptools package-dir mapping).

Kept light on purpose: importing this package imports neither Triton nor any kernel. Import the kernel
modules themselves (``from distwgrad.kernels import grouped_gemm``); ``distwgrad.ops`` does that only
for CUDA tensors.
"""
