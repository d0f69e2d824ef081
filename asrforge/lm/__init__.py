"""Word n-gram language models: built from training text with Kneser–Ney smoothing, stored as
ARPA text in a bundle, fused into beam search at word boundaries (shallow fusion)."""
