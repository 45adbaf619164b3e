#!/bin/bash
cd "$(dirname "$0")/.."
export PYTHONPATH=src:tests
timeout 220 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/variants/test_variants_gpu.py > $OUT/tests.txt 2>&1
echo "tests rc=$?" >> $OUT/tests.txt
tail -n 4 $OUT/tests.txt
for tree in new old; do
  src=src; [ $tree = old ] && src=.gpu/old/src
  mkdir -p $OUT/packed_$tree
  PYTHONPATH=$src timeout 90 python3 benchmarks/run.py variants --parts packed --out $OUT/packed_$tree > $OUT/packed_$tree/log.txt 2>&1
  echo "$tree rc=$?"
done
cd $OUT && tar czf results.tgz packed_* && rm -rf packed_*
