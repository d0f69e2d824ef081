"""The training loop, its state, events and evaluation."""
