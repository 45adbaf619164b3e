#!/bin/bash
cd "$(dirname "$0")/.."
for tree in new old; do
  src=src; [ $tree = old ] && src=.gpu/old/src
  mkdir -p $OUT/variants_$tree
  PYTHONPATH=$src timeout 250 python3 benchmarks/run.py variants --parts examples --out $OUT/variants_$tree > $OUT/variants_$tree/log.txt 2>&1
  echo "$tree rc=$?"
done
cd $OUT && tar czf results.tgz variants_* && rm -rf variants_*
