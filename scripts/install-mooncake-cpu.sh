#!/usr/bin/env bash
# Install Mooncake's non-CUDA build into the active virtual environment, for engine=remote on a
# CPU machine (tests/test_remote_capture.py). Its library links libibverbs (RDMA) even when only
# TCP is used; on a machine without it, the Debian/Ubuntu packages are unpacked into
# .mooncake-libs/ (no root needed) and the tests preload them. Exit 1 when the import still fails.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1 msgpack
if python -c "import mooncake.store" 2>/dev/null; then exit 0; fi
libs="$PWD/.mooncake-libs"
mkdir -p "$libs/debs"
(cd "$libs/debs" && apt-get download libibverbs1 libnl-3-200 libnl-route-3-200 > /dev/null 2>&1)
for deb in "$libs"/debs/*.deb; do dpkg -x "$deb" "$libs/root"; done
dirs=$(find "$libs/root" -name 'lib*.so.*' -printf '%h\n' | sort -u | paste -sd:)
LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python -c "import mooncake.store"
echo "mooncake: libibverbs and libnl unpacked under .mooncake-libs/root (the tests preload them)" >&2
