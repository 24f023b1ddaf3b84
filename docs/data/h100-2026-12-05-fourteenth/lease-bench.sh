#!/usr/bin/env bash
# Fourteenth session: benchmarks only (random-weight shapes; no target payload needed).
set -u
W=/tmp/w14; mkdir -p $W
log() { echo "[$(date +%T)] $*" >> $W/bench.log; }
export PYTHONPATH=/tmp/site:$PWD
log "start $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi -L >> $W/bench.log 2>&1
python -m pip install -q --no-index --no-deps --target /tmp/site .gpu/small/*.whl >> $W/bench.log 2>&1
log "wheels rc $?"
python -m pytest -q -p no:cacheprovider tests/test_capture_ranking.py tests/test_drafter.py > $W/pytest.txt 2>&1
log "pytest rc $?: $(tail -1 $W/pytest.txt)"
python benchmarks/extract_throughput.py --random-shape --device cuda --batch-size 64 --seq-len 512 --iters 6 > $W/capture.txt 2>&1
log "capture rc $?"
python benchmarks/train_throughput.py --device cuda --model kimi --iters 5 --compile on --gqa both --rounds 2 > $W/train_gqa.txt 2>&1
log "train gqa rc $?"
for L in 1 2; do
  python benchmarks/spec_decode_speed.py --device cuda --cache-slots 2183 --prompts 3 --repeats 3 --compile-layers \
    --drafter-layers $L --methods hf_static,base_static_compiled,spec_static_compiled,forced_static_compiled \
    --json $W/sds_L$L.json > $W/sds_L$L.txt 2>&1
  log "spec_decode_speed L$L rc $?"
done
for L in 1 2; do
  python benchmarks/round_breakdown.py --device cuda --cache-slots 2183 --drafter-layers $L > $W/rb_L$L.txt 2>&1
  log "round_breakdown L$L rc $?"
done
log "done"
touch $W/DONE
