"""Inference: the KV-cache engine and its continuous batcher (`engine`), per-request sampling
(`sampling`), restoring parameters (`restore`), text in and out (`text`, `requests`), offline
generation (`offline`), the HTTP server (`server`) and classifier prediction (`classify`)."""
