#!/bin/bash
# variant plans: GPU tests, then host time per call old vs new tree
cd "$(dirname "$0")/.."
export PYTHONPATH=src:tests
timeout 240 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/variants/test_variants_gpu.py tests/ops/test_launch_plan.py > $OUT/tests.txt 2>&1
echo "tests rc=$?" >> $OUT/tests.txt
tail -n 3 $OUT/tests.txt
for tree in new old; do
  src=src; [ $tree = old ] && src=.gpu/old/src
  mkdir -p $OUT/overhead_$tree
  PYTHONPATH=$src timeout 150 python3 benchmarks/suites/overhead.py --out $OUT/overhead_$tree --rounds 5 > $OUT/overhead_$tree/log.txt 2>&1
  echo "$tree rc=$?"
done
cd $OUT && tar czf results.tgz overhead_* && rm -rf overhead_*
