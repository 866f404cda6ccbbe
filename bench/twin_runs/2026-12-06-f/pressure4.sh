#!/bin/bash
# p4 again, after the lost wake-up fix (connector/idle.py: the CPU spin cut bounds the shm recheck to 10 ms); attempt 5, pressure p4 (the benchmark lock held), after the prediction was committed: bench pressure on a stack of
# its own (retained_kv_share 0.015: room for 5 of these conversations), levels 1,2,4,8 x what fits, 4 turns,
# 1.5 s think, exact 32-token replies, at most 8 minutes.
#   flock /work/heavy.lock timeout 900 bash bench/twin_runs/2026-12-06-f/pressure4.sh
set -u
D=bench/twin_runs/2026-12-06-f
export PYTHONPATH=$PWD COLUMNS=150
date -u +"start %FT%TZ" > $D/pressure4.log
uptime >> $D/pressure4.log
vmstat -t 2 > $D/pressure4-vmstat.txt & VM=$!
nice -n 19 /work/main/.venv/bin/python -m bench.pressure --levels 1,2,4,8 \
  --variant "device only=retained_kv_share=0.015" --stack-per variant --turns 4 --think fixed:1.5 \
  --system-words 60 --first-user-words 300 --turn-words 60 --max-tokens 32 --exact-replies --seed 727 \
  --max-minutes 8 --state-dir .turnkv/pressure --out $D/p4-pressure >> $D/pressure4.log 2>&1
uptime >> $D/pressure4.log
kill $VM
date -u +"end %FT%TZ" >> $D/pressure4.log
