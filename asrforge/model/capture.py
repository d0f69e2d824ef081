"""A decoder step recorded once and replayed: on a GPU a CUDA graph, so a greedy step of a
small batch costs one launch instead of one per kernel (a step there is bound by launches).

The step must read every other tensor (cache, encoder output, mask) at a fixed address and
write its result to one: the static KV cache and the greedy decoder's in-place pick mask are
built for that (``model/decoding.py``). Only the (batch, 1) input tokens change between steps;
they are copied into the graph's own input before each replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class CapturedStep:
    """``step(tokens)`` -> picks, recorded on CUDA and replayed on each call.

    On the CPU nothing is recorded: each call runs ``step`` on the same static input buffer,
    so a test on the CPU runs the captured path's bookkeeping with the same step function.

    Args:
        step: (batch, 1) token ids -> (batch,) picked ids; run at least once on these shapes
            before (a capture needs its lazily built state, e.g. cuBLAS handles, to exist).
        tokens: (batch, 1) an example input, of the shape and device every call will pass.
    """

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor):
        self.step = step
        self.tokens = tokens.clone()
        self.graph = None
        if tokens.device.type == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            # Captured on a side stream, as CUDA requires; torch.cuda.graph() would also run a
            # full garbage collection per capture, which a decode per batch cannot afford.
            stream = torch.cuda.Stream(device=tokens.device)
            stream.wait_stream(torch.cuda.current_stream(tokens.device))
            with torch.cuda.stream(stream):
                self.graph.capture_begin()
                try:
                    self.picked = step(self.tokens)
                finally:
                    self.graph.capture_end()
            torch.cuda.current_stream(tokens.device).wait_stream(stream)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, 1) ids -> (batch,) picked ids (on CUDA the graph's own output tensor,
        overwritten by the next call)."""
        self.tokens.copy_(tokens)
        if self.graph is None:
            return self.step(self.tokens)
        self.graph.replay()
        return self.picked
