#!/usr/bin/env bash
# One hash of everything the extension library is built from (csrc/ and setup.py): a prebuilt library is used
# only where this matches the hash it was built with (scripts/build_against_torch.sh, scripts/gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc setup.py -type f \( -name '*.h' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu' -o -name '*.py' \) \
  -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
