#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
# Run every build step of one flavor in order (what the Image Builder components do one by one).
# Usage: build.sh gpu|neuron [--verify]. The steps read their pins from the environment (TURNKV_*):
# `python -m ami.recipes --env FLAVOR` prints them from turnkv/versions.py.
STEP=build
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

flavor="${1:-}"
case "$flavor" in
    gpu) steps=("${STEPS_gpu[@]}") ;;
    neuron) steps=("${STEPS_neuron[@]}") ;;
    *) die "usage: build.sh gpu|neuron [--verify]" ;;
esac
shift
export TURNKV_FLAVOR="$flavor"
for step in "${steps[@]}"; do
    log "step $step"
    bash "$SCRIPTS_DIR/$step.sh" "$@"
done
log "all ${#steps[@]} steps done for $flavor"
