#!/bin/bash
# Attempt 4, pressure p3 (the benchmark lock held), after the prediction was committed: bench pressure on a stack of
# its own (retained_kv_share 0.02), levels 1,2,4,8 x what fits, 4 turns,
# 3 s think, exact 48-token replies, at most 8 minutes.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-d/pressure.sh
set -u
D=bench/twin_runs/2026-12-06-d
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/pressure3.log
uptime >> $D/pressure3.log
vmstat -t 2 > $D/pressure3-vmstat.txt & VM=$!
nice -n 19 /work/main/.venv/bin/python -m bench.pressure --levels 1,2,4,8 \
  --variant "device only=retained_kv_share=0.02" --stack-per variant --turns 4 --think fixed:3 \
  --system-words 120 --first-user-words 200 --turn-words 80 --max-tokens 48 --exact-replies --seed 717 \
  --max-minutes 8 --state-dir .turnkv/pressure --out $D/p3-pressure >> $D/pressure3.log 2>&1
uptime >> $D/pressure3.log
kill $VM
date -u +"end %FT%TZ" >> $D/pressure3.log
