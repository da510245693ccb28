"""Latency histograms for /metrics (prometheus_client), measured by the server per request:

  time to first token   submission -> the first generated token
  inter-token latency   between consecutive tokens of a request (one observation per gap)
  time per output token (last token - first token) / (tokens - 1), per request
  end-to-end latency    submission -> the request's end

Times are taken on the batcher's thread as each token is accepted (perf_counter), so they
cover queueing, prefill and decode but not the HTTP transfer. Prometheus keeps cumulative
buckets; `histogram_quantile()` over them gives percentiles for any window.
"""
from __future__ import annotations

from collections.abc import Sequence

import prometheus_client

# Seconds, 0.5 ms (a decode step of a small model on one CPU) to 10 minutes.
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
           10.0, 25.0, 50.0, 100.0, 250.0, 600.0)


class Histograms:
  """The four histograms in a registry of their own (several servers in one process, as in
  the tests, do not share them). `observe` is thread-safe."""

  def __init__(self, prefix: str = "meshkit"):
    self.registry = prometheus_client.CollectorRegistry(auto_describe=True)

    def histogram(name: str, help_text: str) -> prometheus_client.Histogram:
      return prometheus_client.Histogram(f"{prefix}_{name}", help_text, buckets=BUCKETS,
                                         registry=self.registry)

    self.time_to_first_token = histogram(
        "time_to_first_token_seconds", "Submission to the first generated token.")
    self.inter_token_latency = histogram(
        "inter_token_latency_seconds", "Between consecutive generated tokens of a request.")
    self.time_per_output_token = histogram(
        "time_per_output_token_seconds", "Per request: (last token - first token) / (tokens - "
        "1).")
    self.e2e_request_latency = histogram(
        "e2e_request_latency_seconds", "Submission to the end of the request.")

  def observe(self, submitted: float, token_times: Sequence[float], ended: float) -> None:
    """One finished request: its submission time, each token's time, its end (perf_counter
    seconds)."""
    self.e2e_request_latency.observe(max(0.0, ended - submitted))
    if not token_times:
      return
    self.time_to_first_token.observe(max(0.0, token_times[0] - submitted))
    for earlier, later in zip(token_times, token_times[1:]):
      self.inter_token_latency.observe(later - earlier)
    if len(token_times) > 1:
      self.time_per_output_token.observe(
          (token_times[-1] - token_times[0]) / (len(token_times) - 1))

  def exposition(self) -> str:
    """Prometheus text of the four histograms."""
    return prometheus_client.generate_latest(self.registry).decode()
