"""`turnkv plan`: a capacity planner for multi-turn P/D serving with bi-directional KV reuse.

Small modules, one job each: ``architectures`` (model architecture -> FLOPs and KV bytes), ``hardware`` (the one
table of hardware constants with sources), ``workload`` (vLLM's multi-turn generator format),
``closed_form`` (the closed form), ``simulate`` (a vectorized fleet simulation), ``calibrate`` (local-cpu
constants measured on real engines). All pure except ``calibrate``.
"""
