# syntax=docker/dockerfile:1
# Multi-stage image: build a wheel with its dependencies, run as a non-root user.
#   docker build -t ingest .
#   docker run --rm -v $PWD/config/example.yaml:/etc/ingest/config.yaml:ro -p 9464:9464 ingest
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
WORKDIR /src
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY ingest ./ingest
RUN python -m venv /opt/ingest \
 && /opt/ingest/bin/pip install --upgrade pip \
 && /opt/ingest/bin/pip install ".[clickhouse,columnar]"

FROM python:${PYTHON_VERSION}-slim AS runtime
LABEL org.opencontainers.image.title="ingest" \
      org.opencontainers.image.description="Kafka to PostgreSQL / ClickHouse batch ingestion"
RUN groupadd --system --gid 10001 ingest \
 && useradd --system --uid 10001 --gid ingest --no-create-home --shell /usr/sbin/nologin ingest
COPY --from=build /opt/ingest /opt/ingest
ENV PATH="/opt/ingest/bin:${PATH}" \
    PYTHONUNBUFFERED=1 \
    INGEST_CONFIG=/etc/ingest/config.yaml \
    INGEST_METRICS_PORT=9464
USER ingest:ingest
EXPOSE 9464
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import sys,urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["ingest"]
CMD ["run", "--config", "/etc/ingest/config.yaml"]
