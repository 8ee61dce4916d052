#!/usr/bin/env bash
# `raydit serve` on a Ray cluster, called with OpenAI's Python client.
#
# On the head node of a running cluster (`ray up cluster/ray-aws.yaml`, KubeRay, or
# `ray start --head` here):
#   bash examples/serve_on_cluster.sh                 # serves until Ctrl-C / SIGTERM
# and from any machine that can reach the head's port:
#   RAYDIT_URL=http://HEAD:8000 RAYDIT_API_TOKEN=$(cat ~/.raydit/api_token) \
#     python examples/openai_client.py "a paper boat on a rainy street"
#
# The server plans on the cluster's GPUs (or CPU slots), starts the engine's ranks there,
# and keeps videos and their status JSON in --output-dir on this node (served again after
# a restart). It listens on 127.0.0.1 unless --host says otherwise; every /v1 route needs
# the bearer token from --token-file (created with mode 0600 if absent) or
# $RAYDIT_API_TOKEN. For a service that Kubernetes keeps up, see
# cluster/kuberay-rayservice.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${RAY_ADDRESS:-}" ] && ! ray status >/dev/null 2>&1; then
  echo "no Ray cluster here: starting a head node (ray stop to end it)" >&2
  ray start --head --dashboard-host 127.0.0.1 >/dev/null
fi
exec raydit serve --config examples/serve.yaml --address "${RAY_ADDRESS:-auto}" \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" "$@"
