#!/bin/bash
# Session A, second part: `turnkv plan calibrate` starts a stack of its own, so it runs after the calibration
# capacity run's stack is down (calibrate.sh tried it while that stack was up and was refused).
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-c/calibrate2.sh
set -u
D=bench/twin_runs/2026-12-06-c
export PYTHONPATH=$PWD
date -u +"start %FT%TZ" >> $D/calibrate.log
uptime >> $D/calibrate.log
vmstat -t 2 > $D/calibrate-vmstat.txt & VM=$!
nice -n 19 /work/main/.venv/bin/turnkv plan calibrate >> $D/calibrate.log 2>&1
cp .turnkv/plan-calibration.json $D/calibration.json
uptime >> $D/calibrate.log
kill $VM
date -u +"end %FT%TZ" >> $D/calibrate.log
