#!/bin/bash
# Session B (the benchmark lock held), after the predictions were committed: stack up, the two validation
# workloads (never seen by the twin), stack down, then `turnkv plan calibrate` again as a drift check only
# (the predictions use session A's constants).
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-c/validate.sh
set -u
D=bench/twin_runs/2026-12-06-c
TK="nice -n 19 /work/main/.venv/bin/turnkv"
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/validate.log
uptime >> $D/validate.log
vmstat -t 2 > $D/validate-vmstat.txt & VM=$!
$TK local up >> $D/validate.log 2>&1
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 12 --system-words 250 --first-user-words 150 \
  --turn-words 100 --max-tokens 16 --seed 202 --records --out $D/w5-capacity > $D/w5-capacity.log 2>&1
uptime >> $D/validate.log
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 12 --system-words 80 --first-user-words 500 \
  --turn-words 120 --max-tokens 48 --seed 303 --records --out $D/w6-capacity > $D/w6-capacity.log 2>&1
uptime >> $D/validate.log
$TK local down >> $D/validate.log 2>&1
mkdir -p $D/drift
$TK plan calibrate --state-dir $D/drift >> $D/validate.log 2>&1
cp $D/drift/plan-calibration.json $D/calibration-drift.json
$TK local down --state-dir $D/drift >> $D/validate.log 2>&1
kill $VM
date -u +"end %FT%TZ" >> $D/validate.log
