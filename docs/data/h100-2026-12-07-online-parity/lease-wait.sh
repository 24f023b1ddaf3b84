#!/usr/bin/env bash
# Wait up to $1 seconds for the pipeline's flag $2 (TRAINED or DONE), print its log, and copy
# $3 (out or out2) to the folder $4 (what is brought back to the CPU machine).
for _ in $(seq 1 $(( $1 / 10 ))); do [ -f /tmp/w/$2 ] && break; sleep 10; done
tail -n 25 /tmp/w/pipeline.log; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
[ -f /tmp/w/$2 ] && cp /tmp/w/$3/* "$4"/ && ls -la "$4"
true
