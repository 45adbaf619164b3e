#!/bin/bash
# The variants benchmark's PARTS (examples, captured or packed) on the tree under test (src) and
# on the tree before the change (.gpu/old/src, from `git archive 3aa7dcd src/flashkit`), one
# process each, in one run: bash run_variants.sh PARTS [TIMEOUT_S]. With TESTS=1 the variant
# GPU tests run first (the captured and packed runs).
cd "$(dirname "$0")/.."
parts=$1
if [ "${TESTS:-0}" = 1 ]; then
  PYTHONPATH=src:tests timeout 220 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
    tests/variants/test_variants_gpu.py > $OUT/tests.txt 2>&1
  echo "tests rc=$?" >> $OUT/tests.txt
fi
for tree in new old; do
  src=src; [ $tree = old ] && src=.gpu/old/src
  mkdir -p $OUT/${parts}_$tree
  PYTHONPATH=$src timeout ${2:-250} python3 benchmarks/run.py variants --parts $parts \
    --out $OUT/${parts}_$tree > $OUT/${parts}_$tree/log.txt 2>&1
  echo "$tree rc=$?"
done
cd $OUT && tar czf results.tgz ${parts}_* && rm -rf ${parts}_*
