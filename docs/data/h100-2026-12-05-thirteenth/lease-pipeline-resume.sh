#!/usr/bin/env bash
# One lease: the ninth session's seven extractions + HumanEval seeds 4-7, a two-layer drafter
# trained with the ninth session's recipe (4,272 steps), exported and split into out/ at once,
# then evaluated in-process, then the round's cost at both depths if time is left.
# usage: setsid bash pipeline3.sh END_EPOCH   (repository root)
set -uo pipefail
END=$1
W=/tmp/w; mkdir -p $W/out $W/out2; T00=$(date +%s)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TQDM_MININTERVAL=20 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
log(){ echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a $W/pipeline.log; }
M="model=smollm2-135m-int4-rtn"
XCAP=$(( END - T0 - 560 )); [ $XCAP -lt 120 ] && XCAP=120
X="timeout $XCAP python extract.py $M engine.device=cuda capture.aux_dtype=bfloat16"
d(){ python -c "import sys;print('['+','.join(['cuda:0']*int(sys.argv[1]))+']')" $1; }
log "start; $(( END - T0 )) s to the end; extraction capped at $XCAP s; $(git rev-parse --short HEAD 2>/dev/null)"
log "pipeline4: waiting for the first extraction pass to end"
while pgrep -f "python extract.py" > /dev/null; do sleep 3; done
log "first pass over; resuming the incomplete ones"
inc(){ ! grep -qs '"complete": true' $W/$1/manifest.json; }
if inc f-sg; then ( $X data.limit=8000 capture.max_turns=2 sampling.max_new_tokens=160 engine.max_batch_tokens=32768 parallel.workers=6 parallel.devices=$(d 6) output_dir=$W/f-sg >> $W/x-sg.log 2>&1; log "f-sg resume rc $?" ) & fi
if inc f-sgs; then ( $X data.limit=8000 capture.max_turns=1 sampling.max_new_tokens=160 sampling.temperature=0.7 sampling.seed=1 engine.max_batch_tokens=32768 parallel.workers=4 parallel.devices=$(d 4) output_dir=$W/f-sgs >> $W/x-sgs.log 2>&1; log "f-sgs resume rc $?" ) & fi
he(){ for s in "$@"; do inc f-he$s || continue; t=0.7; [ $s = 0 ] && t=0; $X data=humaneval data.test_fraction=0.5 capture.max_turns=1 sampling.max_new_tokens=256 sampling.temperature=$t sampling.seed=$s output_dir=$W/f-he$s >> $W/x-he$s.log 2>&1; log "f-he$s resume rc $?"; done; }
he 1 2 0 3 &
he 5 6 4 7 &
wait
F=""
for f in f-sg f-gsm8k f-sgs f-he0 f-he1 f-he2 f-he3 f-he4 f-he5 f-he6 f-he7; do
  if grep -qs '"complete": true' $W/$f/manifest.json; then F="$F,$W/$f"; else log "$f incomplete: left out"; fi
done
F=${F#,}
for f in $W/x-*.log; do echo "== $(basename $f .log)"; grep -E "samples .* of|generated tokens|this run:" $f | tail -3; done > $W/extraction.txt
left=$(( END - $(date +%s) - 200 ))
lim=$(python -c "print(round(max(1.0, $left / 60 - 1.0), 2))")
log "extracted; train 2 layers, 4272 steps on $F, time limit $lim min"
python train.py experiment=h200 $M features_dir="'$F'" loop.max_steps=4272 loop.epochs=1000 loop.num_workers=4 \
  drafter.num_layers=2 output_dir=$W/d2 loop.time_limit_min=$lim > $W/train.log 2>&1
log "trained rc $?: $(grep -E 'validation: acc per step' $W/train.log | tail -1)"
S=$W/d2/export/sglang
if [ -f $S/model.safetensors ]; then
  (cd $S && sha256sum model.safetensors > $W/export.sha256 && split -b 15M -d -a 1 model.safetensors $W/out/drafter.part)
  tar -czf $W/out/train.tgz -C $W --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pkl' \
    pipeline.log export.sha256 extraction.txt x-sg.log x-gsm8k.log train.log d2/metrics.json \
    $(cd $W && ls -d f-*/manifest.json d2/export/sglang/*.json 2>/dev/null) 2>>$W/pipeline.log
  log "drafter in out/: $(ls $W/out | tr '\n' ' ')"
fi
touch $W/TRAINED
left=$(( END - $(date +%s) - 30 ))
log "evaluate, budget $left s"
timeout $left python evaluate.py $M engine.device=cuda data.names=[gsm8k,humaneval,sharegpt,mtbench] \
  data.mtbench_path=/tmp/pay/bundle/question.jsonl data.limit=20 max_new_tokens=128 \
  drafter_dir=$S output_dir=$W/eval workers=6 > $W/evaluate.log 2>&1
log "evaluated rc $?"
tar -czf $W/out2/eval.tgz -C $W --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='*.pkl' \
  pipeline.log evaluate.log $(cd $W && ls -d eval 2>/dev/null) 2>>$W/pipeline.log
touch $W/EVALUATED
left=$(( END - $(date +%s) - 20 ))
if [ $left -gt 60 ]; then
  for L in 2 1; do timeout $(( left / 2 )) python benchmarks/round_breakdown.py --device cuda --drafter-layers $L > $W/round-L$L.log 2>&1; log "round_breakdown L=$L rc $?"; done
  tar -czf $W/out2/round.tgz -C $W pipeline.log $(cd $W && ls round-L*.log 2>/dev/null)
fi
log "done"; touch $W/DONE
