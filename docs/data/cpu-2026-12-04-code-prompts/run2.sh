set -x
. .venv/bin/activate
SG=data/features/smollm2-135m-int4/sharegpt
for seed in 1 2; do
  python extract.py data=humaneval data.test_fraction=0.5 sampling.temperature=0.7 sampling.seed=$seed output_dir=data/ab/he-s$seed
done
python train.py experiment=train-cpu features_dir="'$SG,data/ab/he,data/ab/he-s1,data/ab/he-s2'" output_dir=data/ab/C
python evaluate.py "data.names=[humaneval]" data.limit=20 drafter_dir=data/ab/C/export/sglang \
  train_features_dir="'$SG,data/ab/he,data/ab/sg-extra,data/ab/he-s1,data/ab/he-s2'" output_dir=data/ab/eval-C
