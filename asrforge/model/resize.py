"""Load a state dict into a model whose vocabulary size differs, explicitly.

Only the vocabulary tensors (by default Whisper's token embedding and output projection, both
``(vocab, d_model)``) may change size, and only along dimension 0. Rows of ids both vocabularies
share are copied; rows of new ids come from an initializer, the model's own values, or the mean
of the old rows; rows of ids the target no longer has are dropped and reported. Any other
difference (a missing, unexpected or differently shaped tensor) raises: nothing is loaded with
a silent ``strict=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from asrforge.errors import CheckpointNotSupportedError

VOCAB_TENSORS = ("model.decoder.embed_tokens.weight", "proj_out.weight")

RowInit = Callable[[str, int, torch.Tensor], torch.Tensor]
"""``(tensor name, number of new rows, old tensor) -> (n, *old.shape[1:])`` rows."""


def _tie_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _ranges(ids: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3..5, 9"`` (at most 4 pieces shown)."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}..{ids[j]}")
        i = j + 1
    more = f", … ({len(parts) - 4} more ranges)" if len(parts) > 4 else ""
    return ", ".join(parts[:4]) + more


def _resize_rows(
    name: str,
    old: torch.Tensor,
    n_new: int,
    row_map: Sequence[int] | None,
    init: RowInit | None,
    model_state: Mapping[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, str]:
    n_old = old.shape[0]
    if row_map is None:
        row_map = [i if i < n_old else -1 for i in range(n_new)]
    if len(row_map) != n_new:
        raise ValueError(f"row_map has {len(row_map)} entries, the target vocabulary {n_new}")
    src = torch.as_tensor(list(row_map), dtype=torch.long)
    if bool((src >= n_old).any()) or bool((src < -1).any()):
        raise ValueError(f"row_map holds ids outside the checkpoint's vocabulary (0..{n_old - 1})")
    out = old.new_empty((n_new, *old.shape[1:]))
    kept = (src >= 0).nonzero().flatten()
    out[kept] = old[src[kept]]
    fresh = (src < 0).nonzero().flatten()
    how = ""
    if len(fresh):
        if init is not None:
            rows = init(name, len(fresh), old)
            how = "from the initializer"
        elif model_state is not None and name in model_state:
            rows = model_state[name][fresh]
            how = "kept from the model"
        else:
            rows = old.float().mean(dim=0, keepdim=True).expand(len(fresh), *old.shape[1:])
            how = "mean of the old rows"
        out[fresh] = rows.to(device=out.device, dtype=out.dtype)
    used = set(src[kept].tolist())
    dropped = [i for i in range(n_old) if i not in used]
    line = f"{name}: {tuple(old.shape)} -> {tuple(out.shape)}: {len(kept)} rows copied"
    if len(fresh):
        line += f", {len(fresh)} new rows ({how})"
    if dropped:
        line += f", {len(dropped)} rows dropped (old ids {_ranges(dropped)})"
    return out, line


def adapt_state_dict(
    state: Mapping[str, torch.Tensor],
    target_shapes: Mapping[str, torch.Size],
    vocab_tensors: Sequence[str] = VOCAB_TENSORS,
    *,
    init: RowInit | None = None,
    model_state: Mapping[str, torch.Tensor] | None = None,
    row_map: Sequence[int] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Resize the vocabulary tensors of ``state`` to ``target_shapes``; refuse anything else.

    Args:
        state: the checkpoint's state dict. Tied tensors (the same storage under two names, as
            :func:`load_weights` returns them) are resized once and stay tied.
        target_shapes: name -> shape of every tensor of the model,
            ``{n: p.shape for n, p in model.state_dict().items()}``.
        vocab_tensors: names whose dimension 0 is the vocabulary.
        init: fills rows of new ids (see :data:`RowInit`); takes precedence over ``model_state``.
        model_state: the model's current state dict; rows of new ids are taken from it when no
            ``init`` is given ("left to the model's initialization").
        row_map: for each target id, the checkpoint id it continues, or -1 for a new id. Default:
            the first ``min(old, new)`` ids are shared (a vocabulary grown or cut at the end).

    Returns:
        ``(new_state, report)``: the adapted state dict (untouched tensors are the same objects)
        and one line per adapted tensor, empty when nothing was adapted.

    Raises:
        CheckpointNotSupportedError: a tensor is missing, unexpected, or has a shape that is not
            a vocabulary resize; the message names the first ones with expected and got shapes.
    """
    missing = [n for n in target_shapes if n not in state]
    unexpected = [n for n in state if n not in target_shapes]
    mismatched = []
    resize = []
    for name, t in state.items():
        if name not in target_shapes:
            continue
        want = torch.Size(target_shapes[name])
        if t.shape == want:
            continue
        if (
            name in vocab_tensors
            and t.ndim >= 1
            and t.ndim == len(want)
            and t.shape[1:] == want[1:]
        ):
            resize.append((name, want))
        else:
            mismatched.append(f"{name}: expected {tuple(want)}, got {tuple(t.shape)}")
    if missing or unexpected or mismatched:
        lines = mismatched[:5]
        if len(mismatched) > 5:
            lines.append(f"… and {len(mismatched) - 5} more shape mismatches")
        if missing:
            lines.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing[:5])}")
        if unexpected:
            lines.append(f"not in the model ({len(unexpected)}): {', '.join(unexpected[:5])}")
        raise CheckpointNotSupportedError(
            "the checkpoint does not fit the model:\n" + "\n".join(f"  {x}" for x in lines)
        )

    new_state = dict(state)
    report: list[str] = []
    done: dict[tuple, tuple[str, torch.Tensor]] = {}
    for name, want in resize:
        old = state[name]
        key = _tie_key(old) if old.numel() else None
        if key is not None and key in done and done[key][1].shape == want:
            first, resized = done[key]
            new_state[name] = resized
            report.append(f"{name}: tied to {first}, resized with it to {tuple(want)}")
            continue
        resized, line = _resize_rows(name, old, want[0], row_map, init, model_state)
        new_state[name] = resized
        report.append(line)
        if key is not None:
            done[key] = (name, resized)
    return new_state, report
