# The router image: `pagedserve serve --role router` on a slim Python, with no torch and no CUDA.
# Build from the repository root:  make images  (or: docker build -f docker/router.Dockerfile .)
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}

# tini is PID 1: it hands SIGTERM to the router, which then lets running requests finish
# (--shutdown-grace), and reaps what it spawns.
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
# The same extra the tests install alone (tests/test_install.py); the gRPC code is generated
# now (-P: into the installed copy, not this folder's), so that the root filesystem can be
# read-only at run time.
RUN pip install --no-cache-dir '/opt/pagedserve[router]' \
    && python -P -m common.pb \
    && rm -rf /opt/pagedserve

RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin pagedserve
USER 10001
WORKDIR /tmp
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# gRPC API, HTTP (OpenAI) API, Prometheus /metrics
EXPOSE 50051 8000 9090
ENTRYPOINT ["tini", "--", "pagedserve", "serve", "--role", "router"]
