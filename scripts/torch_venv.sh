#!/usr/bin/env bash
# Makes build/torch-VERSION, the virtual environment with another torch release that build_against_torch.sh builds
# and tests in (make compat, make gpu-prebuilt), unless a complete one is there, and prints its path (the one line it
# writes on stdout; pip's output goes to stderr):
#
#   scripts/torch_venv.sh VERSION
#
# It needs nothing of the checkout's own set-up (it imports no torch), so CI makes it while `make setup` installs
# and builds: pip is mostly one core's work, and that leaves the other idle (`make torch-venv`).
# Only the packages the build and the check need: torch without its dependencies (its CUDA libraries are taken from
# the installed torch's nvidia packages when it is imported, instead of downloading several GB of them again).
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 TORCH_VERSION" >&2
  exit 2
fi
VERSION="$1"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="$(pwd)/build/torch-$VERSION"
# Written last: a venv without it (an install that failed or was stopped) is made again.
COMPLETE="$VENV/.complete"

if [[ ! -f "$COMPLETE" ]]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q --no-deps "torch==$VERSION" >&2
  # pyproject.toml's license is an SPDX expression with license-files (PEP 639), which setuptools reads from 77 on;
  # a new venv starts with the setuptools its Python bundles (65 for 3.11), which "setuptools<82" alone leaves in place.
  "$VENV/bin/pip" install -q filelock typing-extensions sympy networkx jinja2 fsspec numpy ninja \
    pytest pytest-xdist expecttest hypothesis scipy "setuptools>=77,<82" >&2
  touch "$COMPLETE"
fi
echo "$VENV"
