#!/usr/bin/env bash
# Online against offline training on the same kept replies, same steps, same batches (issue:
# "at 1x, online training gives the same held-out tau as offline"). One extraction with
# features (the fifteenth session's recipe less its sampled set: ShareGPT two turns, GSM8K,
# HumanEval at four seeds), then two trainings at once on one GPU from the same ids and batch
# plan: features=offline (read from the store) and features=online (engine=hf captures each
# micro-batch beside the drafter), then both evaluated in-process, the exports split into out/.
# usage: setsid bash lease-pipeline.sh END_EPOCH COMMIT [DEV]   (repository root; DEV=cpu: a tiny dry run)
set -uo pipefail
END=$1; COMMIT=$2; DEV=${3:-cuda}
W=${W:-/tmp/w}; mkdir -p $W/out $W/out2
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
log(){ echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $W/pipeline.log; }
M="model=smollm2-135m-int4-rtn"
d(){ python -c "import sys;print('['+','.join(['$DEV:0' if '$DEV'=='cuda' else 'cpu']*int(sys.argv[1]))+']')" $1; }
if [ "$DEV" = cuda ]; then
  GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
  LIM=${LIM:-8000}; NT=160; NSG=4; NG=${NG:-2}; GN=256; HE=${HE:-"0 1 2 3"}; EXP="experiment=h200 loop.num_workers=4"; EL=20; NEW=128; RATE=0.14; MAXS=4272
  MT=data.mtbench_path=/tmp/pay/bundle/question.jsonl; BENCH="[gsm8k,humaneval,sharegpt,mtbench]"
else
  GPU=cpu; LIM=6; NT=16; NSG=1; NG=1; GN=16; HE="0"; EXP="device=cpu loop.tracker=none"; EL=1; NEW=16; RATE=3; MAXS=4
  MT=data.mtbench_path=../shared/data/mt-bench/question.jsonl; BENCH="[gsm8k,humaneval,sharegpt,mtbench]"
fi
XCAP=$(( END - T0 - 800 )); [ $XCAP -lt 240 ] && XCAP=240
X="timeout $XCAP python extract.py $M engine.device=$DEV capture.aux_dtype=bfloat16"
log "start; $GPU; $(( END - T0 )) s to the end; extraction capped at $XCAP s; code $COMMIT"
( $X data.limit=$LIM capture.max_turns=2 sampling.max_new_tokens=$NT engine.max_batch_tokens=16384 parallel.workers=$NSG parallel.devices=$(d $NSG) output_dir=$W/f-sg > $W/x-sg.log 2>&1; log "f-sg rc $?" ) & P="$!"
( $X data=gsm8k data.limit=$LIM capture.max_turns=1 sampling.max_new_tokens=$GN engine.generate_batch_size=32 parallel.workers=$NG parallel.devices=$(d $NG) output_dir=$W/f-gsm8k > $W/x-gsm8k.log 2>&1; log "f-gsm8k rc $?" ) & P="$P $!"
he(){ for s in "$@"; do t=0.7; [ $s = 0 ] && t=0; $X data=humaneval data.limit=$LIM data.test_fraction=0.5 capture.max_turns=1 sampling.max_new_tokens=$GN sampling.temperature=$t sampling.seed=$s output_dir=$W/f-he$s > $W/x-he$s.log 2>&1; log "f-he$s rc $?"; done; }
he $HE & P="$P $!"
if [ "$DEV" = cuda ]; then ( while sleep 30; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader >> $W/smi.log; [ -f $W/DONE ] && break; done ) & fi
wait $P
F=""
for f in f-sg f-gsm8k f-he0 f-he1 f-he2 f-he3; do
  [ -d $W/$f ] || continue
  if grep -qs '"complete": true' $W/$f/manifest.json; then F="$F,$W/$f"; else log "$f incomplete: left out"; fi
done
F=${F#,}
for f in $W/x-*.log; do echo "== $(basename $f .log)"; grep -E "samples .* of|generated tokens|this run:" $f | tail -3; done > $W/extraction.txt
left=$(( END - $(date +%s) - 420 ))
STEPS=$(python -c "print(min($MAXS, max(4, int(($left - 90) / $RATE))))")
lim=$(python -c "print(round(max(1.0, $left / 60), 2))")
log "extracted; train offline and online at once, $STEPS steps each (rate assumed $RATE s) on $F, time limit $lim min"
T(){ python train.py $EXP $M features_dir="'$F'" loop.max_steps=$STEPS loop.epochs=1000 loop.time_limit_min=$lim "$@"; }
( T output_dir=$W/d-off > $W/train-off.log 2>&1; log "offline trained rc $?: $(grep -E 'validation: acc per step' $W/train-off.log | tail -1)" ) & P="$!"
( T features=online output_dir=$W/d-on > $W/train-on.log 2>&1; log "online trained rc $?: $(grep -E 'validation: acc per step' $W/train-on.log | tail -1)" ) & P="$P $!"
wait $P
for r in off on; do
  S=$W/d-$r/export/sglang
  [ -f $S/model.safetensors ] || { log "no export for $r"; continue; }
  (cd $S && sha256sum model.safetensors > $W/export-$r.sha256 && split -b 15M -d -a 1 model.safetensors $W/out/drafter-$r.part)
done
tar -czf $W/out/train.tgz -C $W --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pkl' \
  pipeline.log extraction.txt $(cd $W && ls x-*.log train-*.log export-*.sha256 smi.log 2>/dev/null) \
  $(cd $W && ls -d d-*/metrics.json f-*/manifest.json d-*/export/sglang/*.json 2>/dev/null) 2>>$W/pipeline.log
log "drafters in out/: $(ls $W/out | tr '\n' ' ')"
touch $W/TRAINED
left=$(( END - $(date +%s) - 25 ))
log "evaluate both at once, budget $left s"
P=""
for r in off on; do
  S=$W/d-$r/export/sglang; [ -f $S/model.safetensors ] || continue
  ( timeout $left python evaluate.py $M engine.device=$DEV data.names=$BENCH $MT data.limit=$EL max_new_tokens=$NEW \
      drafter_dir=$S output_dir=$W/eval-$r workers=3 devices=$(d 3) > $W/evaluate-$r.log 2>&1; log "evaluated $r rc $?" ) & P="$P $!"
done
wait $P  # not a bare wait: the nvidia-smi loop runs until DONE (the lease's run waited on it; eval.tgz was made by hand)
tar -czf $W/out2/eval.tgz -C $W --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pkl' \
  pipeline.log $(cd $W && ls evaluate-*.log 2>/dev/null) $(cd $W && ls -d eval-* 2>/dev/null) 2>>$W/pipeline.log
log "done"; touch $W/DONE
