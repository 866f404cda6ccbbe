#!/bin/bash
# Attempt 4, pressure p2 (the benchmark lock held), after the prediction was committed: bench pressure on a stack of
# its own (retained_kv_share 0.01: room for about two of these conversations), levels 1,2,4,8 x what fits, 4 turns,
# 2 s think, exact 64-token replies, at most 8 minutes.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-d/pressure.sh
set -u
D=bench/twin_runs/2026-12-06-d
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/pressure2.log
uptime >> $D/pressure2.log
vmstat -t 2 > $D/pressure2-vmstat.txt & VM=$!
nice -n 19 /work/main/.venv/bin/python -m bench.pressure --levels 1,2,4,8 \
  --variant "device only=retained_kv_share=0.01" --stack-per variant --turns 4 --think fixed:2 \
  --system-words 80 --first-user-words 150 --turn-words 120 --max-tokens 64 --exact-replies --seed 707 \
  --max-minutes 8 --state-dir .turnkv/pressure --out $D/p2-pressure >> $D/pressure2.log 2>&1
uptime >> $D/pressure2.log
kill $VM
date -u +"end %FT%TZ" >> $D/pressure2.log
