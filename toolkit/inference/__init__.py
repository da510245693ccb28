"""Inference: the engines that generate, predict and score. The HTTP server over it is
toolkit/serving/.

- `engine`: the paged KV cache's compiled step and how a step's rows are laid out;
- `scheduler`: continuous batching over the paged cache (prefix caching, chunked prefill,
  cancellation);
- `pages`: the cache's pages and cached prefixes, on the host;
- `sampling`: per-request sampling settings and the batched sampler;
- `restore`: a checkpoint's parameters restored into a config's shardings;
- `codec`, `text`, `requests`: text in and out (byte-level or a tokenizer), continuing a
  prompt, requests and results as JSON;
- `offline`: offline batch generation (`python -m toolkit.generate`);
- `classify`: classifier prediction (`python -m toolkit.predict`);
- `scoring`: click scores of a recommendation model, requests batched across clients;
- `score_requests`: scoring requests as JSON, checked against a model's features;
- `decode_cost`: the decode step compiled ahead of time for a target.
"""
