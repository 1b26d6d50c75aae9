#!/usr/bin/env bash
# Install the official SDK (baseten-loops 0.32.0, Python >= 3.12) into its own venv, for
# tests/test_local_sdk_compat.py. Usage: scripts/install_sdk_venv.sh [VENV_DIR]
#
# VENV_DIR defaults to sdk-venv/ in the test cache: $LOOPS_TEST_CACHE, else
# ${XDG_CACHE_HOME:-~/.cache}/loops-tests (tests/external.py looks there). The SDK wheel is
# taken from the cache's wheels/ when .ci/run downloaded it there, else from the index.
# The venv's Python (>= 3.12) is $LOOPS_SDK_BASE_PYTHON, else the first of python3.12,
# python3.13, python3.14, python3 on PATH that is >= 3.12, else the oldest such pyenv version
# (the SDK's floor, 3.12, is the one its dependencies are surest to have wheels for).
# Exits non-zero when it cannot make a working venv.
set -euo pipefail
sdk="baseten-loops==0.32.0"
cache="${LOOPS_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/loops-tests}"
venv="${1:-$cache/sdk-venv}"

has_sdk() {
  "$1" -c 'import importlib.metadata as m, sys; import baseten.loops
sys.exit(m.version("baseten-loops") != "0.32.0")' >/dev/null 2>&1
}

at_least_312() {
  "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

base_python() {
  if [ -n "${LOOPS_SDK_BASE_PYTHON:-}" ]; then
    at_least_312 "$LOOPS_SDK_BASE_PYTHON" && { echo "$LOOPS_SDK_BASE_PYTHON"; return 0; }
    echo "LOOPS_SDK_BASE_PYTHON=$LOOPS_SDK_BASE_PYTHON is not a Python >= 3.12" >&2
    return 1
  fi
  local candidate
  for candidate in python3.12 python3.13 python3.14 python3; do
    # A pyenv shim exists for every installed version but fails unless that version is active.
    if command -v "$candidate" >/dev/null 2>&1 && at_least_312 "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for candidate in $(pyenv versions --bare 2>/dev/null | sort -V); do
      candidate="$(pyenv root)/versions/$candidate/bin/python"
      if [ -x "$candidate" ] && at_least_312 "$candidate"; then
        echo "$candidate"
        return 0
      fi
    done
  fi
  echo "no Python >= 3.12 found on PATH or in pyenv; set LOOPS_SDK_BASE_PYTHON to one" >&2
  return 1
}

if [ -x "$venv/bin/python" ] && has_sdk "$venv/bin/python"; then
  echo "SDK venv ready: $venv"
  exit 0
fi
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "$venv exists and is not a venv; give another VENV_DIR" >&2
  exit 1
fi
base="$(base_python)"
"$base" -m venv --clear "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check --find-links "$cache/wheels" "$sdk"
has_sdk "$venv/bin/python" || { echo "the SDK does not import in $venv" >&2; exit 1; }
echo "SDK venv ready: $venv (Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'))"
