set -x
. .venv/bin/activate
SG=data/features/smollm2-135m-int4/sharegpt
F="'$SG,data/ab/he,data/ab/he-s1,data/ab/he-s2'"
ALL="'$SG,data/ab/he,data/ab/sg-extra,data/ab/he-s1,data/ab/he-s2'"
time python train.py -m experiment=train-cpu features_dir="$F" output_dir=data/ab2/temp drafter.target_temperature=0.5,0.2
for d in data/ab2/temp/0 data/ab2/temp/1; do
  n=$(echo $d | tr '/' '-')
  time python evaluate.py "data.names=[humaneval,sharegpt]" data.limit=20 drafter_dir=$d/export/sglang \
    train_features_dir="$ALL" output_dir=data/ab2/eval-$n
done
time python train.py experiment=train-cpu features_dir="$F" output_dir=data/ab2/temp2 drafter.target_temperature=2.0
time python evaluate.py "data.names=[humaneval,sharegpt]" data.limit=20 drafter_dir=data/ab2/temp2/export/sglang \
  train_features_dir="$ALL" output_dir=data/ab2/eval-temp2
