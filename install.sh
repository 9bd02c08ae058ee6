#!/usr/bin/env bash
# Install pbkv into ./.venv (created if missing). `--test` adds the test dependencies.
#
# torch: pbkv accepts any torch the environment already has. When none is installed we ask for
# torch==2.13.0 explicitly: on this project's machines pip takes its CPU build from the local
# wheel store; an open range would make pip download a multi-GB CUDA build from PyPI instead.
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
[ -x .venv/bin/python ] || python3 -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    pip install "torch==2.13.0"
fi
pip install -e ".${extras}"
