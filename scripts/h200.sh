#!/usr/bin/env bash
# Full-size run on one H200: extract (ShareGPT prompts answered by the INT4 target, several
# target replicas sharing the GPU), train (experiment=h200), the training throughput
# benchmark, evaluate (3/1/4, T=0; all prompts through parallel workers sharing the GPU for
# tau and lossless checks, then a few prompts per benchmark alone on the GPU for batch-1
# speed-up) and the extraction throughput benchmark. Logs and reports go to $RUN.
#
#   bash scripts/h200.sh                 # everything
#   STAGES="extract extract_gsm8k train" MAX_TURNS=2 bash scripts/h200.sh
#   STAGES="evaluate timing" bash scripts/h200.sh
#
# Sizes come from the environment: PROMPTS, EXTRACT_WORKERS, MAX_TURNS, MAX_NEW_TOKENS, EPOCHS,
# EVAL_PROMPTS, EVAL_WORKERS, EVAL_MAX_NEW_TOKENS, TIMING_PROMPTS, MTBENCH (path of MT-Bench's
# question.jsonl, adds that benchmark), FEAT (features folder, default $RUN/features: several
# runs can train on one extraction), TRAIN_OVERRIDES (extra train.py overrides, e.g.
# "drafter.lm_head_init=target") and GENERATE_CACHE (the extractions' engine.generate_cache:
# auto = the batched CUDA-graph decoder on CUDA, dynamic = the eager path; bench_regen times both).
# sweep (not in the default STAGES): SWEEP's Hydra multirun overrides (default: the drafter's
# FFN width, 1536 and 6144), trained one recipe at a time, each evaluated; run trainings one
# at a time: three sharing one H200 ran at 2.4 steps/s each against 12-14.5 alone
# (docs/notebook/results.md, 2026-12-04). With a time budget: TRAIN_OVERRIDES="loop.time_limit_min=6".
# A learning curve (what more data would buy): SWEEP="loop.train_fraction=0.25,0.5,1.0" with a fixed
# TRAIN_OVERRIDES="loop.max_steps=..." (the FFN width was measured not to be the lever, 2026-12-04;
# measured at 4,272 steps the same day: +0.110 replay tau for the last doubling, diminishing;
# python -m eagle3.sweep.curve <run>/metrics.json ... tabulates and plots it).
# A regulariser for the training/validation gap: SWEEP="drafter.feature_noise=0,0.05,0.1" (0.1 measured:
# no gain, docs/notebook/results.md).
# TTT step weights (every full-size run so far: drafter=ttt3, weights 1.0; 0.5 and TTT 5 measured small on
# CPU: no decoded difference, docs/notebook/results.md 2026-12-05): SWEEP="drafter.step_weight=0.8,1.0".
# The loss's target temperature (0.2 / 0.5 / 2 validated worse than 1 on CPU, decoded tau unchanged):
# SWEEP="drafter.target_temperature=0.5,1".
# Longer training (tried 2026-12-05, fifteenth session, one H100: 8,544 steps against 4,272 moved held-out
# tau by -0.11 to +0.08, inside every interval; docs/notebook/results.md): TRAIN_OVERRIDES="loop.max_steps=8544".
# Drafter depth (the width was not the lever; a second decoder layer adds attention, and both
# engines serve it, docs/notebook/results.md 2026-12-05, eleventh session): SWEEP="drafter.num_layers=1,2".
# bench_train_compile and bench_loader (not in the default STAGES): loop.compile_drafter and loop.fused_loss timed against eager,
# and the batches/s the training data path delivers (is it what holds the first ~1,500 steps at 2-5 steps/s?).
# bench_shapes (not in the default STAGES): the slow start (the first ~500 steps at about a third of the
# later rate) is cuDNN attention's setup for each new batch shape, about 240 ms each (one H100, sixteenth
# session); benchmarks/train_shapes.py replays the shapes of a run, padded to 16 or 128, with SDPA's cuDNN
# backend on and off. experiment=h200 pads to 128 since (projected 13% of the training steps' time).
# bench_train_ops (not in the default STAGES): one Kimi-shaped training step profiled by aten operator and input shape
# (benchmarks/train_throughput.py --profile-ops), to find the small kernels that the 50% MFU target needs gone.
# bench_train_flex (not in the default STAGES): drafter.ttt_attention=flex (block-sparse TTT attention) checked
# against the dense mask's gradients on the GPU, then timed against it on the Kimi-shaped drafter.
# bench_regen (not in the default STAGES): benchmarks/regenerate_speed.py at batch 256. extract_gsm8k regenerates the train and validation splits that
# extraction carves out of GSM8K's test set (1,259 of its 1,319 questions; there is no GSM8K train
# set offline) into $RUN/features-gsm8k; train then reads both folders when that extraction
# finished, and evaluation scores GSM8K on the 60 held-out questions (those trained on are left out). A multi-turn extraction (MAX_TURNS > 1) is
# planned by turn count; every turn (MAX_TURNS=null) is slow: docs/performance.md.
# extract_sampled (not in the default STAGES) answers the same ShareGPT prompts once more at
# temperature SAMPLED_TEMPERATURE (SAMPLED_TURNS turns, default 1) into $RUN/features-sampled; train then
# reads it too (the recipe of docs/notebook/results.md, 2026-12-03, third session):
#   STAGES="extract extract_gsm8k extract_sampled train evaluate timing" MAX_TURNS=2 bash scripts/h200.sh
# More data of the same kind: SAMPLED_SEEDS="1 2 3" answers them once per seed (seed 1 into
# features-sampled, seed s into features-sampled-s<s>); train reads every one that finished.
# extract_humaneval (not in the default STAGES): code prompts, the only ones offline being HumanEval's: half of
# them (data.test_fraction=0.5: 84 to train on, 80 held out, which evaluation then scores), one reply per seed
# in HUMANEVAL_SEEDS (0 = greedy, others sampled at SAMPLED_TEMPERATURE) into $RUN/features-humaneval-s<seed>.
# Measured at full size (docs/notebook/results.md, 2026-12-05): HumanEval tau 2.35 on the held-out half, the other
# benchmarks unchanged; worth its 2.5% of the generated tokens.
# GPU memory: each ShareGPT replica (engine.max_batch_tokens=32768) holds about 14.5 GB; 14 replicas of several
# extractions at once fit one H200 but not an 80 GB H100 (docs/notebook/results.md, thirteenth session). A replica that runs
# out of memory halves its batch limits and goes on (eagle3/engines/hf/oom.py); fewer replicas run faster than that.
# A time-boxed GPU: DEADLINE=<epoch seconds> caps training with loop.time_limit_min so that
# EVAL_RESERVE seconds (default 300) are left, and stops evaluation at the deadline.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/h200}
PROMPTS=${PROMPTS:-8000}
EXTRACT_WORKERS=${EXTRACT_WORKERS:-4}
MAX_TURNS=${MAX_TURNS:-1}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-160}  # ShareGPT replies; the 2026-12-04 runs' length
EPOCHS=${EPOCHS:-10}
EVAL_PROMPTS=${EVAL_PROMPTS:-200}
EVAL_WORKERS=${EVAL_WORKERS:-12}
EVAL_MAX_NEW_TOKENS=${EVAL_MAX_NEW_TOKENS:-128}
TIMING_PROMPTS=${TIMING_PROMPTS:-10}
STAGES=${STAGES:-"extract extract_gsm8k train bench_train evaluate timing bench_extract fsdp_check"}
FEAT=${FEAT:-$RUN/features}
TRAIN_OVERRIDES=${TRAIN_OVERRIDES:-}
SAMPLED_TEMPERATURE=${SAMPLED_TEMPERATURE:-0.7}
SAMPLED_TURNS=${SAMPLED_TURNS:-1}
SAMPLED_SEEDS=${SAMPLED_SEEDS:-1}
HUMANEVAL_SEEDS=${HUMANEVAL_SEEDS:-0 1 2 3}
DEADLINE=${DEADLINE:-}
EVAL_RESERVE=${EVAL_RESERVE:-300}
SWEEP=${SWEEP:-"drafter.intermediate_size=1536,6144"}
GENERATE_CACHE=${GENERATE_CACHE:-auto}
# float8_e4m3fn: aux states in about half the disk (benchmarks/fp8_features.py: no measurable cost to a drafter)
AUX_DTYPE=${AUX_DTYPE:-bfloat16}
DRAFTER=$RUN/drafter
mkdir -p "$RUN"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10

stamp() { echo "[$(date +%H:%M:%S)] $*"; }
same_gpu() { python -c "import sys; print('[' + ','.join(['cuda:0'] * int(sys.argv[1])) + ']')" "$1"; }
benches="gsm8k,humaneval,sharegpt${MTBENCH:+,mtbench}"
features() {  # $FEAT plus the GSM8K, sampled and HumanEval extractions that finished
  local f="$FEAT" extra
  for extra in "$RUN"/features-gsm8k "$RUN"/features-sampled "$RUN"/features-sampled-s* "$RUN"/features-humaneval-s*; do
    grep -qs '"complete": true' "$extra/manifest.json" && f="$f,$extra"
  done
  echo "$f"
}
limits() {  # train.py's time limit from DEADLINE, leaving EVAL_RESERVE seconds (at least a minute)
  [ -n "$DEADLINE" ] || return 0
  local m=$(( (DEADLINE - $(date +%s) - EVAL_RESERVE) / 60 ))
  echo "loop.time_limit_min=$(( m < 1 ? 1 : m ))"
}
until_deadline() {  # run a command, stopped at DEADLINE if one is set (not started once it has passed)
  [ -n "$DEADLINE" ] || { "$@"; return; }
  local s=$(( DEADLINE - $(date +%s) ))
  [ "$s" -gt 0 ] || { echo "DEADLINE has passed; not running: $1 ..." >&2; return 1; }
  timeout "$s" "$@"
}
mt=(); [ -n "${MTBENCH:-}" ] && mt=(data.mtbench_path="$MTBENCH")

for stage in $STAGES; do
  stamp "$stage"
  case $stage in
  extract)
    python extract.py engine.device=cuda data.limit="$PROMPTS" capture.max_turns="$MAX_TURNS" capture.aux_dtype="$AUX_DTYPE" \
      sampling.max_new_tokens="$MAX_NEW_TOKENS" output_dir="$FEAT" engine.generate_cache="$GENERATE_CACHE" \
      engine.max_batch_tokens=32768 parallel.workers="$EXTRACT_WORKERS" parallel.devices="$(same_gpu "$EXTRACT_WORKERS")" 2>&1 | tee "$RUN/extract.log"
    ;;
  extract_gsm8k)
    python extract.py engine.device=cuda data=gsm8k capture.max_turns=1 sampling.max_new_tokens=256 capture.aux_dtype="$AUX_DTYPE" \
      engine.generate_batch_size=32 output_dir="$RUN/features-gsm8k" engine.generate_cache="$GENERATE_CACHE" \
      parallel.workers="$EXTRACT_WORKERS" parallel.devices="$(same_gpu "$EXTRACT_WORKERS")" 2>&1 | tee "$RUN/extract-gsm8k.log"
    ;;
  extract_sampled)
    for seed in $SAMPLED_SEEDS; do
      out="$RUN/features-sampled"; [ "$seed" = 1 ] || out="$out-s$seed"
      python extract.py engine.device=cuda data.limit="$PROMPTS" capture.max_turns="$SAMPLED_TURNS" sampling.max_new_tokens="$MAX_NEW_TOKENS" capture.aux_dtype="$AUX_DTYPE" \
        sampling.temperature="$SAMPLED_TEMPERATURE" sampling.seed="$seed" output_dir="$out" \
        engine.generate_cache="$GENERATE_CACHE" \
        engine.max_batch_tokens=32768 parallel.workers="$EXTRACT_WORKERS" parallel.devices="$(same_gpu "$EXTRACT_WORKERS")" 2>&1 | tee "$out.log"
    done
    ;;
  extract_humaneval)
    for seed in $HUMANEVAL_SEEDS; do
      t=$SAMPLED_TEMPERATURE; [ "$seed" = 0 ] && t=0
      python extract.py engine.device=cuda data=humaneval data.test_fraction=0.5 capture.max_turns=1 sampling.max_new_tokens=256 \
        sampling.temperature="$t" sampling.seed="$seed" capture.aux_dtype="$AUX_DTYPE" engine.generate_cache="$GENERATE_CACHE" \
        output_dir="$RUN/features-humaneval-s$seed" 2>&1 | tee "$RUN/features-humaneval-s$seed.log"
    done
    ;;
  train)
    python train.py experiment=h200 loop.epochs="$EPOCHS" features_dir="'$(features)'" output_dir="$DRAFTER" \
      $TRAIN_OVERRIDES $(limits) 2>&1 | tee "$RUN/train.log"
    ;;
  sweep)  # Hydra multirun: one recipe at a time into $RUN/sweep/<n>, each then evaluated like `evaluate`
    python train.py -m experiment=h200 loop.epochs="$EPOCHS" features_dir="'$(features)'" output_dir="$RUN/sweep" \
      $TRAIN_OVERRIDES $SWEEP 2>&1 | tee "$RUN/sweep.log"
    for job in "$RUN"/sweep/[0-9]*; do
      python evaluate.py engine.device=cuda data.names="[$benches]" data.limit="$EVAL_PROMPTS" \
        max_new_tokens="$EVAL_MAX_NEW_TOKENS" drafter_dir="$job/export/sglang" output_dir="$job/eval" \
        workers="$EVAL_WORKERS" devices="$(same_gpu "$EVAL_WORKERS")" "${mt[@]}" 2>&1 | tee "$job/evaluate.log"
    done
    ;;
  bench_train)
    python benchmarks/train_throughput.py --device cuda --iters 5 --chain-chunks 0,128,256 --json "$RUN/bench_train.json" 2>&1 | tee "$RUN/bench_train.log"
    ;;
  bench_train_compile)  # loop.compile_drafter and loop.fused_loss against eager, alternating (not yet timed on a GPU)
    python benchmarks/train_throughput.py --device cuda --iters 5 --compile both --fused-loss both --rounds 2 2>&1 \
      | tee "$RUN/bench_train_compile.log"
    ;;
  bench_train_flex)  # drafter.ttt_attention=flex: its CUDA gradient test, then dense against flex, alternating
    python -m pytest -q tests/test_ttt.py -k flex 2>&1 | tee "$RUN/bench_train_flex.log"
    python benchmarks/train_throughput.py --device cuda --model kimi --iters 5 --attention both --compile on --rounds 2 \
      --json "$RUN/bench_train_flex.json" 2>&1 | tee -a "$RUN/bench_train_flex.log"
    ;;
  bench_train_ops)  # the Kimi-shaped step's GPU time by aten operator and shape: which small kernels stand between 43.5% and 50% MFU
    python benchmarks/train_throughput.py --device cuda --model kimi --iters 5 --compile on --gqa on --profile \
      --profile-ops "$RUN/bench_train_ops.txt" 2>&1 | tee "$RUN/bench_train_ops.log"
    ;;
  bench_shapes)  # the first steps' new batch shapes against repeated ones, by loop.pad_multiple and SDPA backend
    python benchmarks/train_shapes.py --device cuda --steps 600 --pad-multiple 16,128 --sdpa both \
      --json "$RUN/bench_shapes.json" 2>&1 | tee "$RUN/bench_shapes.log"
    ;;
  bench_loader)  # the training data path, pinning and host-to-device copies included, in batches/s
    python benchmarks/train_loader.py --device cuda --samples 1024 --batches 48 --workers 0,4,8 2>&1 | tee "$RUN/bench_loader.log"
    ;;
  evaluate)
    until_deadline python evaluate.py engine.device=cuda data.names="[$benches]" data.limit="$EVAL_PROMPTS" \
      max_new_tokens="$EVAL_MAX_NEW_TOKENS" drafter_dir="$DRAFTER/export/sglang" output_dir="$RUN/eval" \
      workers="$EVAL_WORKERS" devices="$(same_gpu "$EVAL_WORKERS")" "${mt[@]}" 2>&1 | tee "$RUN/evaluate.log"
    ;;
  timing)
    python evaluate.py engine.device=cuda data.names="[$benches]" data.limit="$TIMING_PROMPTS" \
      max_new_tokens="$EVAL_MAX_NEW_TOKENS" drafter_dir="$DRAFTER/export/sglang" output_dir="$RUN/eval-timing" \
      "${mt[@]}" 2>&1 | tee "$RUN/timing.log"
    ;;
  fsdp_check)  # the FSDP code path (1 process) trains the toy drafter like plain single-GPU training
    rm -rf "$RUN/fsdp"; mkdir -p "$RUN/fsdp"
    PYTHONPATH="tests:.:${PYTHONPATH:-}" python -c "from toy import write_features; write_features('$RUN/fsdp/f', n=40)"
    python tests/dist_train_worker.py "$RUN/fsdp/f" "$RUN/fsdp/plain" loop.max_steps=4 'device="cuda"' loop.mixed_precision='"no"' >"$RUN/fsdp.log" 2>&1
    accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes 1 tests/dist_train_worker.py \
      "$RUN/fsdp/f" "$RUN/fsdp/fsdp" loop.max_steps=4 'device="cuda"' loop.mixed_precision='"no"' >>"$RUN/fsdp.log" 2>&1
    python - "$RUN/fsdp" <<'PY' 2>&1 | tee -a "$RUN/fsdp.log"
import json, sys, torch
from safetensors.torch import load_file
d = sys.argv[1]
a, b = (load_file(f"{d}/{r}/export/sglang/model.safetensors") for r in ("plain", "fsdp"))
diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].is_floating_point())
m = json.load(open(f"{d}/fsdp/metrics.json"))
print(f"fsdp_check: distributed_type={m['distributed_type']} same keys={a.keys() == b.keys()} max |diff| of exported weights={diff:.3g}")
PY
    ;;
  bench_regen)
    python benchmarks/regenerate_speed.py --device cuda --batch-size 256 --prompt-len 256 --new-tokens 128 \
      --repeats 4 2>&1 | tee "$RUN/bench_regen.log"
    ;;
  bench_extract)
    python benchmarks/extract_throughput.py --device cuda --batch-size 64 --seq-len 1024 --iters 10 2>&1 | tee "$RUN/bench_extract.log"
    ;;
  esac
done
stamp "done"
