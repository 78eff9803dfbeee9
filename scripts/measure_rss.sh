#!/bin/bash
# RSS after warm-up: llmserve serve (defaults) vs llama-server at the same KV token capacity.
# Usage: scripts/measure_rss.sh (needs `make install` and `make bench-peers-llama`);
# LLAMA_CTX=32768 scripts/measure_rss.sh gives llama-server a 32k-token context instead.
cd "$(dirname "$0")/.."
GGUF=$(.venv/bin/python -c "import llmserve.default_model as d; print(d.default_model_path())" 2>/dev/null)
.venv/bin/llmserve serve --port 8811 > /tmp/rss_llmserve.log 2>&1 &
P=$!
for i in $(seq 1 300); do curl -s localhost:8811/ready | grep -q ready && break; sleep 1; done
for i in 1 2 3 4; do curl -s localhost:8811/v1/completions -H 'content-type: application/json' -d '{"prompt":"Hello there, tell me a story","max_tokens":64}' > /dev/null; done
RSS1=$(grep VmRSS /proc/$P/status | awk '{print $2}')
TOK=$(grep -o "KV pool: [0-9]* blocks x [0-9]* tokens" /tmp/rss_llmserve.log | awk '{print $3*$6}')
kill $P; wait $P 2>/dev/null
LS=${LLAMA_SERVER:-$(ls -d ${LLMSERVE_CACHE_DIR:-$HOME/.cache/llmserve}/llama.cpp/*/bin/llama-server | head -1)}
$LS -m "$GGUF" --port 8812 -np 8 -c ${LLAMA_CTX:-$TOK} -t 2 > /tmp/rss_llama.log 2>&1 &
Q=$!
for i in $(seq 1 120); do curl -s localhost:8812/health | grep -q ok && break; sleep 1; done
for i in 1 2 3 4; do curl -s localhost:8812/v1/completions -H 'content-type: application/json' -d '{"prompt":"Hello there, tell me a story","max_tokens":64}' > /dev/null; done
RSS2=$(grep VmRSS /proc/$Q/status | awk '{print $2}')
kill $Q; wait $Q 2>/dev/null
echo "KV tokens: $TOK  llmserve RSS: $((RSS1/1024)) MiB  llama-server RSS: $((RSS2/1024)) MiB  ratio: $(python3 -c "print(round($RSS1/$RSS2,2))")"
