#!/usr/bin/env bash
set -u
W=/tmp/w16; mkdir -p $W
log() { echo "[$(date +%T)] $*" >> $W/bench.log; }
export PYTHONPATH=/tmp/site:$PWD
log "start"
nvidia-smi -L >> $W/bench.log 2>&1
python -m pip install -q --no-index --no-deps --target /tmp/site .gpu/small/*.whl >> $W/bench.log 2>&1
log "wheels rc $?"
python -m pytest -q -p no:cacheprovider tests/test_gqa.py > $W/pytest.txt 2>&1
log "pytest rc $?: $(tail -1 $W/pytest.txt)"
for F in "" "--gqa-fold"; do
  python benchmarks/round_breakdown.py --device cuda --cache-slots 2183 --compile-layers $F >> $W/rb.txt 2>&1
  log "round_breakdown '$F' rc $?"
done
python benchmarks/regenerate_speed.py --device cuda --batch-size 64 --prompt-len 512 --new-tokens 128 --repeats 4 \
  --methods graphs,graphs_gqa --json $W/regen64.json > $W/regen64.txt 2>&1
log "regen64 rc $?"
python benchmarks/regenerate_speed.py --device cuda --batch-size 256 --prompt-len 256 --new-tokens 128 --repeats 4 \
  --compile-layers --methods graphs,graphs_gqa,graphs_compiled_sdpa_eager,graphs_compiled_gqa --json $W/regen256.json > $W/regen256.txt 2>&1
log "regen256 rc $?"
timeout 240 python benchmarks/train_shapes.py --device cuda --steps 300 --pad-multiple 16,128 --sdpa both --json $W/shapes.json > $W/shapes.txt 2>&1
log "shapes rc $?"
log "done"
touch $W/DONE
