#!/usr/bin/env bash
# GPU readiness (issue 41): fp32 greedy identity of the engine on CUDA, its speed against plain
# decoding with the shipped drafter, one DSpark training step on the GPU. torch and transformers
# only (no Ray, no network); well under 10 minutes on one GPU. Exits 2 without CUDA.
# Details: infra/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" infra/gpu_check.py "$@"
