#!/usr/bin/env bash
# L2: GPU tests (marked `gpu`: Triton kernels in bf16 at realistic shapes, CUDA module paths) on a CUDA
# machine. Keep NVLink multicast off (shared hosts).
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ALLOW_EMPTY=1 bash qa/_pytest.sh tests -m gpu -q -p no:cacheprovider "$@"
