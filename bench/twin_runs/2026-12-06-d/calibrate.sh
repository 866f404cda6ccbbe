#!/bin/bash
# Attempt 4, session C (the benchmark lock held): `turnkv plan calibrate` (a stack of its own), then the
# calibration capacity run (attempt 3's calibration shape, a new seed) on a fresh stack, stack down.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-d/calibrate.sh
set -u
D=bench/twin_runs/2026-12-06-d
TK="nice -n 19 /work/main/.venv/bin/turnkv"
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/calibrate.log
uptime >> $D/calibrate.log
vmstat -t 2 > $D/calibrate-vmstat.txt & VM=$!
mkdir -p $D/state
$TK plan calibrate --state-dir $D/state >> $D/calibrate.log 2>&1
cp $D/state/plan-calibration.json $D/calibration.json
uptime >> $D/calibrate.log
$TK local up >> $D/calibrate.log 2>&1
$TK bench capacity --concurrency-levels 1,2,4,8 --turns 10 --system-words 150 --first-user-words 250 \
  --turn-words 150 --max-tokens 32 --seed 111 --records --out $D/calib-capacity > $D/calib-capacity.log 2>&1
uptime >> $D/calibrate.log
$TK local down >> $D/calibrate.log 2>&1
kill $VM
date -u +"end %FT%TZ" >> $D/calibrate.log
