# The omni-runtime image: one image for the orchestrator, every stage worker and the clients
# (compose.yaml picks the role with the command). The repository is the working directory, so
# pipeline paths such as workers/omni.yaml resolve as they do in a checkout.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 omni \
    && useradd --system --uid 10001 --gid omni --no-create-home --shell /usr/sbin/nologin omni

WORKDIR /app
COPY . .
RUN pip install --no-cache-dir '.[serve]' && rm -rf build ./*.egg-info

# The code stays root-owned and read-only for the process; write outputs (e.g. --wav) to /tmp.
USER omni
CMD ["omni-runtime", "--help"]
