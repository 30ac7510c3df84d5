# The hosted queen: `apiary[queen]` only (no Qt, no llama.cpp), run as a non-root user.
#
#   docker build -f deploy/queen.Dockerfile -t apiary-queen .      (from the repository root)
#
# It listens on 0.0.0.0:8000 and reads every setting from APIARY_* variables: APIARY_DB
# (postgresql://user:password@host/db), APIARY_REDIS_URL (redis://...), APIARY_PUBLIC_URL,
# APIARY_FORWARDED_ALLOW_IPS (the TLS proxy's network). `docker run ... apiary-queen db upgrade`
# runs the migrations once (compose.yaml does it in its one-shot `migrate` service).

#
# BASE_IMAGE: any Debian bookworm image with python3 (3.11) and its venv module; by default
# Docker Hub's official python image. Where Docker Hub is out of reach, deploy/offline/ makes one
# from Debian's packages (compose.offline.yaml passes it). The dependencies come from the package
# index, or from deploy/wheels/ when it holds wheels (deploy/offline/wheels.sh fills it).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# --- build: a virtualenv with the queen's dependencies and the apiary package -----------------
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/apiary
WORKDIR /src
# Only what the queen's wheel holds: the worker's package stays out of the image.
COPY pyproject.toml README.md ./
COPY shared_schema ./shared_schema
COPY queen_server ./queen_server
COPY deploy/wheels/ /wheels/
RUN if ls /wheels/*.whl > /dev/null 2>&1; \
    then /opt/apiary/bin/pip install --no-index --find-links /wheels ".[queen]"; \
    else /opt/apiary/bin/pip install ".[queen]"; fi \
    && /opt/apiary/bin/python -c "import queen_server.app, asyncpg, redis.asyncio"

# --- run: the virtualenv on a clean slim image, as an unprivileged user -----------------------
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 apiary \
    && useradd --system --uid 10001 --gid apiary --home-dir /var/lib/apiary --create-home \
       --shell /usr/sbin/nologin apiary
COPY --from=build /opt/apiary /opt/apiary
ENV PATH=/opt/apiary/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    APIARY_HOST=0.0.0.0 \
    APIARY_PORT=8000 \
    HF_HOME=/var/lib/apiary/hf
USER apiary:apiary
WORKDIR /var/lib/apiary
EXPOSE 8000
# /health answers 200 while the queen serves (it needs no key); the proxy checks it too.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2); sys.exit(0 if r.status == 200 else 1)"]
ENTRYPOINT ["apiary-queen"]
CMD []
