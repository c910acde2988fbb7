# The gateway image: `docker build -t llm-gateway .` then `docker run -p 8080:8080 llm-gateway`
# with GATEWAY_BACKENDS or GATEWAY_DISCOVERY__DNS set. compose.yaml and deploy/k8s use it.
# The same image runs the simulator: `docker run llm-gateway sim --host 0.0.0.0 --port 8000`.
#
# PYTHON_IMAGE names another base with Python 3.11 (a local one where no registry is reachable,
# as scripts/compose_env.sh makes). Wheels found in deploy/wheelhouse/ are installed offline,
# without PyPI; with none there (the usual case), pip fetches the dependencies.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY backends ./backends
COPY policies ./policies
COPY loadtest ./loadtest
COPY tools ./tools
COPY deploy/wheelhouse ./wheelhouse
RUN python3 -m venv /opt/llm-gateway \
    && if ls wheelhouse/*.whl >/dev/null 2>&1; then \
         offline="--no-index --find-links wheelhouse"; \
       fi \
    && /opt/llm-gateway/bin/pip install --no-cache-dir --disable-pip-version-check $offline .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/llm-gateway/bin:$PATH
RUN groupadd --system --gid 10001 gateway \
    && useradd --system --uid 10001 --gid gateway --home-dir /home/gateway --create-home gateway
COPY --from=build /opt/llm-gateway /opt/llm-gateway
USER 10001:10001
WORKDIR /home/gateway
# Listen on every interface inside the container; logs as JSON lines for the log collector.
ENV GATEWAY_HOST=0.0.0.0 \
    GATEWAY_PORT=8080 \
    GATEWAY_LOG_FORMAT=json
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)"]
ENTRYPOINT ["llm-gateway"]
CMD ["serve"]
