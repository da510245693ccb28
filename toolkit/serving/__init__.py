"""Serving: the HTTP layer over the inference engine's continuous batcher (aiohttp).

- `server`: the app, /generate, /health, /metrics, and the start-up warm-up;
- `openai_api`: the OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions);
- `openai_protocol`: OpenAI's request and response objects as data, checked and turned into
  engine requests (no HTTP);
- `http_request`: one request's life on the event loop (body limits, submissions, deadlines,
  cancellation when the client goes away);
- `text_stream`: a request's text as its tokens come, with stop strings;
- `latency`: the per-request latency histograms /metrics exports;
- `score_api`: the scoring server of a recommendation checkpoint (/v1/score).
"""
