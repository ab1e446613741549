export TRITON_INTERPRET=0 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 420 python -m pytest -q -n 8 -p no:cacheprovider tests > $OUT/h100-2026-11-22-full-suite-s18.log 2>&1; echo suite rc $?
tail -3 $OUT/h100-2026-11-22-full-suite-s18.log
grep -E "^FAILED|^ERROR" $OUT/h100-2026-11-22-full-suite-s18.log | head -20
