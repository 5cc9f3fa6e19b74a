# kestrel-runtime image: the package and its CLI. Your workflows go in with your own layer:
#   FROM kestrel-runtime
#   COPY myapp/ /app/myapp/
#   CMD ["kestrel-runtime", "--app", "myapp.workflows", "--procs", "4"]
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libpq-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY sql ./sql
COPY src ./src
RUN pip install --no-cache-dir . \
 && useradd --system --uid 10001 kestrel
USER kestrel

# Metrics must be reachable by Prometheus from another container: bind all interfaces here
# (the runtime's own default is 127.0.0.1).
ENV KESTREL_METRICS_HOST=0.0.0.0 \
    KESTREL_METRICS_PORT=9464
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2)"
ENTRYPOINT ["kestrel-runtime"]
CMD ["--app", "kestrel.demo", "--procs", "4"]
