"""Speech data: the synthetic corpora, features, datasets, batching."""
