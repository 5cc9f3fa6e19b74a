# kestrel-runtime image: the package and its CLI (without the embedded PostgreSQL: give it
# KESTREL_DSN). Build it with `docker build -t kestrel-runtime .`; your workflows go in with
# your own layer (tests/unit/test_deploy.py checks this recipe against this file):
#   FROM kestrel-runtime
#   COPY myapp/ /app/myapp/
#   CMD ["--app", "myapp.workflows", "--procs", "4"]
# CMD holds only the arguments: the entrypoint is kestrel-runtime. /app is the working
# directory and on PYTHONPATH, so `--app myapp.workflows` imports /app/myapp/workflows.py.
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
    KESTREL_METRICS_PORT=9464 \
    PYTHONPATH=/app
EXPOSE 9464
# The HTTP API and web UI, when started with --http-port 8080 (or `serve`); set
# KESTREL_HTTP_HOST=0.0.0.0 to reach it from outside the container. Every route needs a token.
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=2)"
ENTRYPOINT ["kestrel-runtime"]
CMD ["--app", "kestrel.demo", "--procs", "4"]
