set -x
. .venv/bin/activate
SG=data/features/smollm2-135m-int4/sharegpt
python extract.py data.limit=100
python extract.py data.offset=100 data.limit=84 output_dir=data/ab/sg-extra
python extract.py data=humaneval data.test_fraction=0.5 output_dir=data/ab/he
python train.py experiment=train-cpu features_dir="'$SG,data/ab/sg-extra'" output_dir=data/ab/A
python train.py experiment=train-cpu features_dir="'$SG,data/ab/he'" output_dir=data/ab/B
for r in A B; do
  python evaluate.py "data.names=[humaneval,sharegpt]" data.limit=20 drafter_dir=data/ab/$r/export/sglang \
    train_features_dir="'$SG,data/ab/he,data/ab/sg-extra'" output_dir=data/ab/eval-$r
done
