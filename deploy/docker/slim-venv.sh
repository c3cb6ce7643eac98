#!/bin/sh
# Make a virtualenv an image can ship (deploy/docker/Dockerfile): no test suites of the
# packages, machine code without its symbol tables. Libraries that
# auditwheel vendored (*.libs/) keep theirs: stripping their patched program headers breaks
# them ("ELF load command address/offset not page-aligned").
set -eu
venv=$1
find "$venv" -depth -type d -name tests -path "*/site-packages/*" -exec rm -rf {} +
find "$venv" -type f -name "*.so*" -not -path "*.libs/*" -exec strip --strip-unneeded {} +
