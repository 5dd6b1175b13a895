#!/bin/bash
# One preset run from the command line, the way a user runs it, then its evaluation on both held-out texts.
# usage: bench/preset_run.sh NAME [quantize args...]
#   env: MODEL (default smollm2-135m-instruct), METHOD (default vptq), WINDOWS (eval windows, default 16),
#        OUT (default /tmp/presets), THREADS (default 2), SPLIT (the held-out split `eval` reads: test by
#        default; dev to choose settings, its files then named NAME_dev_TEXT.json)
# writes $OUT/NAME (checkpoint), $OUT/NAME.log (quantize log with /usr/bin/time -v), $OUT/NAME_wiki.json and
# $OUT/NAME_pydocs.json; `python bench/preset_summary.py NAME` prints the run's summary block.
# example: bench/preset_run.sh s25 --preset 2.5 && python bench/preset_summary.py s25
#          METHOD=lrq bench/preset_run.sh w4a8 --preset w4a8
set -e
cd "$(dirname "$0")/.."
out_root=${OUT:-/tmp/presets}
mkdir -p "$out_root"
name=$1; shift
out=$out_root/$name
echo "== $(date -u +%F\ %H:%M:%S) $name: $*" > "$out_root/$name.log"
/usr/bin/time -v python -m vptq_core quantize --model "${MODEL:-smollm2-135m-instruct}" --method "${METHOD:-vptq}" "$@" \
  --threads "${THREADS:-2}" --out "$out" >> "$out_root/$name.log" 2>&1
split=${SPLIT:-test}
tag=$([ "$split" = test ] && echo "" || echo "_$split")
for t in wiki pydocs; do
  python -m vptq_core eval --model "$out" --text $t --split "$split" --max-windows "${WINDOWS:-16}" --dtype bfloat16 \
    --head-bits 0 --json --threads "${THREADS:-2}" > "$out_root/${name}${tag}_$t.json" 2>> "$out_root/$name.log"
done
echo "== $(date -u +%H:%M:%S) done" >> "$out_root/$name.log"
