#!/usr/bin/env bash
# Full-size run on one H200: extract (5,000 ShareGPT prompts from the INT4 target),
# train (experiment=h200), evaluate (3/1/4, T=0, 200 prompts per benchmark) and the two
# throughput benchmarks. Logs and reports go to $RUN (default runs/h200).
#
#   bash scripts/h200.sh                 # everything
#   STAGES="evaluate" bash scripts/h200.sh
#
# Sizes can be changed through the environment: PROMPTS, EVAL_PROMPTS, MAX_TURNS,
# MAX_NEW_TOKENS, EPOCHS, EVAL_MAX_NEW_TOKENS.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/h200}
PROMPTS=${PROMPTS:-5000}
EVAL_PROMPTS=${EVAL_PROMPTS:-200}
MAX_TURNS=${MAX_TURNS:-1}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
EPOCHS=${EPOCHS:-10}
EVAL_MAX_NEW_TOKENS=${EVAL_MAX_NEW_TOKENS:-128}
STAGES=${STAGES:-"extract train evaluate bench"}
FEAT=$RUN/features
DRAFTER=$RUN/drafter
mkdir -p "$RUN"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=10

stamp() { echo "[$(date +%H:%M:%S)] $*"; }

for stage in $STAGES; do
  case $stage in
  extract)
    stamp "extract: $PROMPTS prompts"
    python extract.py engine.device=cuda data.limit="$PROMPTS" capture.max_turns="$MAX_TURNS" \
      sampling.max_new_tokens="$MAX_NEW_TOKENS" output_dir="$FEAT" 2>&1 | tee "$RUN/extract.log"
    ;;
  train)
    stamp "train"
    python train.py experiment=h200 loop.epochs="$EPOCHS" features_dir="$FEAT" output_dir="$DRAFTER" \
      2>&1 | tee "$RUN/train.log"
    ;;
  evaluate)
    stamp "evaluate: $EVAL_PROMPTS prompts per benchmark, one process per benchmark"
    pids=()
    for b in gsm8k humaneval sharegpt ${MTBENCH:+mtbench}; do
      extra=()
      [ "$b" = mtbench ] && extra=(data.mtbench_path="$MTBENCH")
      python evaluate.py engine.device=cuda data.names="[$b]" data.limit="$EVAL_PROMPTS" max_new_tokens="$EVAL_MAX_NEW_TOKENS" \
        drafter_dir="$DRAFTER/export/sglang" output_dir="$RUN/eval/$b" "${extra[@]}" \
        >"$RUN/evaluate-$b.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    tail -n 25 "$RUN"/evaluate-*.log
    ;;
  bench)
    stamp "benchmarks"
    python benchmarks/extract_throughput.py --device cuda --batch-size 64 --seq-len 1024 --iters 10 2>&1 | tee "$RUN/bench_extract.log"
    python benchmarks/train_throughput.py --device cuda 2>&1 | tee "$RUN/bench_train.log"
    ;;
  esac
done
stamp "done"
