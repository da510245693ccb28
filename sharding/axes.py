"""The canonical logical axis names models use; rules map each onto mesh axes (or none)."""

LOGICAL_AXES: dict[str, str] = {
    "batch": "examples in a batch (activations, data)",
    "length": "token positions in a sequence (activations; context parallelism splits them)",
    "kv_length": "the key/value positions attention reads (whole on every device, so context "
                 "parallelism gathers keys and values inside attention)",
    "embed": "the model (residual stream) width",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads (fewer than heads under grouped-query attention)",
    "head_dim": "the width of one attention head",
    "mlp": "the hidden width of the feed-forward block (of each expert in a mixture of experts)",
    "experts": "the experts of a mixture-of-experts layer (expert weights, router outputs)",
    "vocab": "token ids of the vocabulary (embedding rows, logits)",
    "layers": "the stacked-layer axis of scanned transformer blocks",
    "norm": "the scale vector of a normalization layer",
    "classes": "output classes of a classifier head",
    "patch": "flattened image-patch features",
    "trial": "the trials of a population sweep, trained together in one program",
    "lora_rank": "the rank of a LoRA adapter's low-rank update (small: replicated everywhere)",
    "table_rows": "the rows of a recommendation model's embedding table (row-wise placement)",
    "table_embed": "the width of an embedding table's rows (column-wise placement)",
    "features": "the widths of a recommendation model's dense layers (small: replicated)",
}
