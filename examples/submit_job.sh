#!/usr/bin/env bash
# Submit a raydit generation to a running Ray cluster as a Ray job.
#
#   RAY_DASHBOARD=http://127.0.0.1:8265 bash examples/submit_job.sh
#
# Ray 2.60 turns on token authentication by default: the client reads the cluster's
# token from ~/.ray/auth_token, or from the file named by RAY_AUTH_TOKEN_PATH (with
# RAY_AUTH_MODE=token). Copy the head node's token there before submitting.
set -euo pipefail
DASHBOARD=${RAY_DASHBOARD:-http://127.0.0.1:8265}
OUT=${OUT:-/tmp/raydit-job.mp4}
RAY_AUTH_MODE=token ray job submit --address "$DASHBOARD" \
  --runtime-env "$(dirname "$0")/runtime_env.yaml" \
  -- raydit generate --prompt "a paper boat on a rainy street" --steps 8 --out "$OUT" --json
