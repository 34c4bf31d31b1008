"""Building blocks shared by every model: norms, rotary embeddings, sampling."""
