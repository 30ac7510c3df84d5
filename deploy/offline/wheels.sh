#!/usr/bin/env bash
# Wheels of the queen's dependencies (and its build backend) into deploy/wheels/, for building
# the queen's image where its build cannot reach the package index (deploy/queen.Dockerfile
# installs from there when it holds wheels). Run from the repository root with the Python the
# image has (3.11, Linux x86_64 or the image's machine):
#
#   bash deploy/offline/wheels.sh [PYTHON]          # default: python3
set -euo pipefail
PY=${1:-python3}
cd "$(dirname "$0")/../.."
rm -f deploy/wheels/*.whl
# async-timeout: what redis needs on a Python before 3.11.3, as Debian bookworm's 3.11.2 is,
# which a newer Python here would not fetch.
"$PY" -m pip wheel --quiet --wheel-dir deploy/wheels ".[queen]" "setuptools>=69" wheel \
    "async-timeout>=4.0.3"
rm -f deploy/wheels/apiary-*.whl  # the image installs the project from its source
echo "$(ls deploy/wheels/*.whl | wc -l) wheels in deploy/wheels/"
