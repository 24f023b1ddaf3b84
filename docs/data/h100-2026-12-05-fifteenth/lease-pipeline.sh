#!/usr/bin/env bash
# Fifteenth session: the ninth session's seven extractions (one-layer recipe), then as many
# training steps as fit (up to 8,544 = twice the ninth's 4,272; the cosine schedule planned for
# that count), exported and split into out/, then evaluated in-process.
# usage: setsid bash pipeline5.sh END_EPOCH COMMIT   (repository root)
set -uo pipefail
END=$1; COMMIT=$2
W=/tmp/w; mkdir -p $W/out $W/out2
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
log(){ echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $W/pipeline.log; }
M="model=smollm2-135m-int4-rtn"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [ "$MEM" -gt 100000 ]; then MBT=32768; NSG=6; NSGS=4; NG=2; RATE=0.085; else MBT=16384; NSG=4; NSGS=3; NG=2; RATE=0.10; fi
XCAP=$(( END - T0 - 700 )); [ $XCAP -lt 300 ] && XCAP=300
X="timeout $XCAP python extract.py $M engine.device=cuda capture.aux_dtype=bfloat16"
d(){ python -c "import sys;print('['+','.join(['cuda:0']*int(sys.argv[1]))+']')" $1; }
log "start; $GPU, $MEM MiB; $(( END - T0 )) s to the end; extraction capped at $XCAP s; code $COMMIT; batch tokens $MBT, workers $NSG/$NSGS/$NG"
( $X data.limit=8000 capture.max_turns=2 sampling.max_new_tokens=160 engine.max_batch_tokens=$MBT parallel.workers=$NSG parallel.devices=$(d $NSG) output_dir=$W/f-sg > $W/x-sg.log 2>&1; log "f-sg rc $?" ) & P="$!"
( $X data.limit=8000 capture.max_turns=1 sampling.max_new_tokens=160 sampling.temperature=0.7 sampling.seed=1 engine.max_batch_tokens=$MBT parallel.workers=$NSGS parallel.devices=$(d $NSGS) output_dir=$W/f-sgs > $W/x-sgs.log 2>&1; log "f-sgs rc $?" ) & P="$P $!"
( $X data=gsm8k capture.max_turns=1 sampling.max_new_tokens=256 engine.generate_batch_size=32 parallel.workers=$NG parallel.devices=$(d $NG) output_dir=$W/f-gsm8k > $W/x-gsm8k.log 2>&1; log "f-gsm8k rc $?" ) & P="$P $!"
he(){ for s in "$@"; do t=0.7; [ $s = 0 ] && t=0; $X data=humaneval data.test_fraction=0.5 capture.max_turns=1 sampling.max_new_tokens=256 sampling.temperature=$t sampling.seed=$s output_dir=$W/f-he$s > $W/x-he$s.log 2>&1; log "f-he$s rc $?"; done; }
he 0 1 2 3 & P="$P $!"
( while sleep 30; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $W/smi.log; [ -f $W/EXTRACTED ] && break; done ) &
wait $P
F=""
for f in f-sg f-gsm8k f-sgs f-he0 f-he1 f-he2 f-he3; do
  if grep -qs '"complete": true' $W/$f/manifest.json; then F="$F,$W/$f"; else log "$f incomplete: left out"; fi
done
F=${F#,}
touch $W/EXTRACTED
for f in $W/x-*.log; do echo "== $(basename $f .log)"; grep -E "samples .* of|generated tokens|this run:" $f | tail -3; done > $W/extraction.txt
left=$(( END - $(date +%s) - 170 ))
STEPS=$(python -c "print(min(8544, max(500, int(($left - 75) / $RATE))))")
lim=$(python -c "print(round(max(1.0, $left / 60), 2))")
log "extracted; train 1 layer, $STEPS steps (rate assumed $RATE s) on $F, time limit $lim min"
python train.py experiment=h200 $M features_dir="'$F'" loop.max_steps=$STEPS loop.epochs=1000 loop.num_workers=4 \
  output_dir=$W/d loop.time_limit_min=$lim > $W/train.log 2>&1
log "trained rc $?: $(grep -E 'validation: acc per step' $W/train.log | tail -1)"
S=$W/d/export/sglang
if [ -f $S/model.safetensors ]; then
  (cd $S && sha256sum model.safetensors > $W/export.sha256 && split -b 15M -d -a 1 model.safetensors $W/out/drafter.part)
  tar -czf $W/out/train.tgz -C $W --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pkl' \
    pipeline.log smi.log export.sha256 extraction.txt $(cd $W && ls x-*.log) train.log d/metrics.json \
    $(cd $W && ls -d f-*/manifest.json d/export/sglang/*.json 2>/dev/null) 2>>$W/pipeline.log
  log "drafter in out/: $(ls $W/out | tr '\n' ' ')"
fi
touch $W/TRAINED
left=$(( END - $(date +%s) - 25 ))
log "evaluate, budget $left s"
timeout $left python evaluate.py $M engine.device=cuda data.names=[gsm8k,humaneval,sharegpt,mtbench] \
  data.mtbench_path=/tmp/pay/bundle/question.jsonl data.limit=20 max_new_tokens=128 \
  drafter_dir=$S output_dir=$W/eval workers=6 > $W/evaluate.log 2>&1
log "evaluated rc $?"
tar -czf $W/out2/eval.tgz -C $W --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pkl' \
  pipeline.log evaluate.log $(cd $W && ls -d eval 2>/dev/null) 2>>$W/pipeline.log
log "done"; touch $W/DONE
