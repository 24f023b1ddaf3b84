#!/usr/bin/env bash
# Join the bundle parts copied to /tmp/pay (one 58 MB part at a time), check them, install the
# wheels into /tmp/site and the target into a copy of the repository at /tmp/repo, and start
# lease-pipeline.sh there in its own process session (it outlives this script).
# usage: bash lease-start.sh END_EPOCH COMMIT   (repository root)
set -euo pipefail
(cd /tmp/pay && sha256sum --quiet -c SUMS)
rm -rf /tmp/repo && mkdir /tmp/repo && tar --exclude=./data --exclude=./.pay --exclude=./.git --exclude="./.venv*" -cf - . | tar -xf - -C /tmp/repo
(cd /tmp/pay && cat b.tar.* | tar -xf -)
bash /tmp/pay/bundle/unpack.sh /tmp/site /tmp/repo/data/models
cd /tmp/repo && PYTHONPATH=/tmp/site LIM=${LIM:-8000} NG=${NG:-2} HE=${HE:-"0 1 2 3"} setsid nohup bash docs/data/h100-2026-12-07-online-parity/lease-pipeline.sh "$1" "$2" \
  > /tmp/pipeline.out 2>&1 < /dev/null &
sleep 5; cat /tmp/pipeline.out
