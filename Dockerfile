# The container image for `scripts/launch/gke_jobset.py --image=...`: Python 3.11 with meshkit and
# its `tpu` extra (libtpu) installed from this checkout, WORKDIR at the checkout so that
# `--config=experiments/lm.py:...` resolves. For GPUs build with --build-arg EXTRA=cuda.
#
#   docker build -t us-docker.pkg.dev/PROJECT/REPO/meshkit:latest .
#   docker push us-docker.pkg.dev/PROJECT/REPO/meshkit:latest
FROM python:3.11-slim
ARG EXTRA=tpu
WORKDIR /meshkit
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY sharding sharding
COPY models models
COPY toolkit toolkit
COPY experiments experiments
COPY scripts scripts
RUN pip install -e ".[${EXTRA}]"
CMD ["python", "-m", "toolkit.train", "--help"]
