#!/bin/sh
# llmserve serve on 0.0.0.0:$LLMSERVE_PORT; --model from $LLMSERVE_MODEL when set (a mounted
# HF folder or .gguf), else the baked-in default model. Extra arguments are serve flags.
set -eu
if [ -n "${LLMSERVE_MODEL:-}" ]; then
    set -- --model "${LLMSERVE_MODEL}" "$@"
fi
exec llmserve serve --host 0.0.0.0 --port "${LLMSERVE_PORT:-8000}" "$@"
