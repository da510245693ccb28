"""Inference: the KV-cache engine and its continuous batcher (`engine`, `scheduler`, `pages`),
per-request sampling (`sampling`), restoring parameters (`restore`), text in and out (`text`,
`codec`, `requests`), offline generation (`offline`), classifier prediction (`classify`) and
the decode step's compile for a target (`decode_cost`). The HTTP server over the engine is
toolkit/serving/."""
