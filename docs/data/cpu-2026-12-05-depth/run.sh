# One decoder layer against two, on the same CPU-extracted features (2-core CPU, INT4 GPTQ target),
# both served by vLLM's CPU build: tau from the server's counters, 20 held-out prompts a benchmark.
set -ex
. .venv/bin/activate
VLLM=${VLLM:?the python of a vLLM CPU install}
D=data/ab3
python extract.py data.limit=300 output_dir=$D/sg
python extract.py data=gsm8k data.limit=200 output_dir=$D/gsm
python train.py -m experiment=train-cpu features_dir="'$D/sg,$D/gsm'" output_dir=$D/L drafter.num_layers=1,2
for j in 0 1; do
  python evaluate.py engine=vllm engine.python=$VLLM drafter_dir=$D/L/$j/export/vllm \
    train_features_dir="'$D/sg,$D/gsm'" "data.names=[gsm8k,sharegpt]" data.limit=20 max_new_tokens=128 \
    "concurrency=[1]" output_dir=$D/eval-$j
done
