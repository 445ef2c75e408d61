#!/usr/bin/env bash
# Embed an image with curl: POST /v1/embeddings with a data URL (the OpenAI embeddings shape).
#   python -m deployments --port 8000    # in another terminal (or: serve run deployments:app)
#   bash examples/http_curl.sh [BASE_URL] [IMAGE]
set -euo pipefail
URL="${1:-http://127.0.0.1:8000}"
IMAGE="${2:-$(dirname "$0")/images/gradient.jpg}"
# the body goes through stdin: a base64 image can be longer than a command line
printf '{"input": ["data:image/jpeg;base64,%s"], "encoding_format": "float"}' "$(base64 < "$IMAGE" | tr -d '\n')" |
  curl -sS --fail-with-body -X POST "$URL/v1/embeddings" -H 'Content-Type: application/json' --data-binary @-
echo
