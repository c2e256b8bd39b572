#!/usr/bin/env bash
# GPU checks of the class-sharded proxies on a machine with one CUDA GPU (under 5 minutes):
# GPU vs CPU equivalence of every loss (fp32, bf16 embeddings), W=2 ranks sharing the GPU
# vs W=1, the train loop with bf16 autocast, and a throughput figure (C=1M, d=512, B=1024).
# Usage: tests/gpu/check_gpu.sh [--classes N] [--dim D] [--batch B] [--steps S]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
export GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 PYTHONWARNINGS=ignore::FutureWarning
timeout 280 "$PY" tests/gpu/check_gpu.py "$@"
