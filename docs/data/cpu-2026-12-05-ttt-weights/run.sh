set -x
. .venv/bin/activate
SG=data/features/smollm2-135m-int4/sharegpt
F="'$SG,data/ab/he,data/ab/he-s1,data/ab/he-s2'"
ALL="'$SG,data/ab/he,data/ab/sg-extra,data/ab/he-s1,data/ab/he-s2'"
time python train.py -m experiment=train-cpu features_dir="$F" output_dir=data/ab2/sw drafter.step_weight=1.0,0.5
time python train.py experiment=train-cpu features_dir="$F" output_dir=data/ab2/ttt5 drafter.ttt_steps=5
for d in data/ab2/sw/0 data/ab2/sw/1 data/ab2/ttt5 data/ab/C; do
  n=$(echo $d | tr '/' '-')
  time python evaluate.py "data.names=[humaneval,sharegpt]" data.limit=20 drafter_dir=$d/export/sglang \
    train_features_dir="$ALL" output_dir=data/ab2/eval-$n
done
