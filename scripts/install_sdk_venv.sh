#!/usr/bin/env bash
# Install the official SDK (baseten-loops 0.32.0, Python >= 3.12) into its own venv, outside
# the repo, for tests/test_local_sdk_compat.py. Usage: scripts/install_sdk_venv.sh [VENV_DIR]
# Honors LOOPS_SDK_PYTHON (the venv's python) and SDK_BASE_PYTHON (a python >= 3.12).
set -euo pipefail
venv="${1:-${LOOPS_SDK_VENV:-/work/sdkvenv}}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import baseten.loops" 2>/dev/null; then
  echo "SDK venv ready: $venv"
  exit 0
fi
base="${SDK_BASE_PYTHON:-}"
if [ -z "$base" ]; then
  for candidate in python3.13 python3.12 /root/.pyenv/versions/3.12.1/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 \
       && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      base="$candidate"
      break
    fi
  done
fi
if [ -z "$base" ]; then
  echo "no Python >= 3.12 found (set SDK_BASE_PYTHON); skipping the SDK venv" >&2
  exit 1
fi
"$base" -m venv "$venv"
"$venv/bin/pip" install -q baseten-loops==0.32.0
echo "SDK venv ready: $venv"
