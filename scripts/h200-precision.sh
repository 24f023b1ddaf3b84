#!/usr/bin/env bash
# The precision study's GPU half on one H200 (docs/precision-study.md): features of the bf16
# parent and of the INT4 (GPTQ W4A16) deployment, extracted from the same ShareGPT prompts at the
# same time, one drafter trained identically on each, both SGLang exports packed (15 MB parts +
# sha256) so a CPU machine can serve them against INT4 (vLLM's INT4 kernel) and bf16.
#
#   bash scripts/h200-precision.sh                   # N=3000 prompts, 160 new tokens, 450 steps
#   N=500 STEPS=100 DEV=cpu W=1 bash scripts/h200-precision.sh   # a small CPU run of the same
#
# In process, the INT4 build is decompressed to dense weights on load, so smollm2-135m-int4 and
# smollm2-135m-int4-dequant give bit-identical features here; only one of them is extracted.
set -u
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10
DEV=${DEV:-cuda}; W=${W:-7}; N=${N:-3000}; M=${M:-160}; STEPS=${STEPS:-450}
R=${R:-runs/precision}; O=${O:-$R/logs}; P=${P:-$R/pack}; mkdir -p $O $R
T0=$(date +%s)
log() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $O/pipeline.log; }
devs() { python -c "import sys; print('[' + ','.join(['$DEV'] * int(sys.argv[1])) + ']')" "$1"; }
MODELS="smollm2-135m-bf16 smollm2-135m-int4"
for m in $MODELS; do
  log "warm-up $m"
  python extract.py engine.device=$DEV model=$m data.limit=4 capture.max_turns=1 sampling.max_new_tokens=8 \
    output_dir=$R/warm-$m > $O/warm-$m.log 2>&1 || { log "warm-up $m failed"; tail -20 $O/warm-$m.log; }
done
for m in $MODELS; do
  log "extract $m ($N prompts, $W replicas)"
  python extract.py engine.device=$DEV model=$m data.limit=$N capture.max_turns=1 sampling.max_new_tokens=$M \
    output_dir=$R/f-$m engine.max_batch_tokens=32768 parallel.workers=$W parallel.devices="$(devs $W)" \
    > $O/extract-$m.log 2>&1 &
done
wait; log "extracted"
for m in $MODELS; do
  python train.py experiment=h200 device=$DEV model=$m features_dir=$R/f-$m output_dir=$R/d-$m \
    loop.max_steps=$STEPS loop.epochs=100 > $O/train-$m.log 2>&1 &
done
wait; log "trained"
mkdir -p $P
for m in $MODELS; do
  mkdir -p $P/$m; cp -r $R/d-$m/export/sglang $P/$m/ 2>/dev/null; cp $R/d-$m/metrics.json $P/$m/ 2>/dev/null
  cp $R/f-$m/manifest.json $P/$m/features-manifest.json 2>/dev/null
done
cp $O/*.log $P/ 2>/dev/null
rm -f $P.all.part.*; tar czf $P.all.tgz -C $(dirname $P) $(basename $P) && split -b 15000000 $P.all.tgz $P.all.part.
sha256sum $P.all.tgz > $P.all.sha; ls -la $P.all.* | tee -a $O/pipeline.log
log "done"
