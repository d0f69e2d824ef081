"""Embedding rows for new tokens: shared ids keep their rows, new ids are drawn from
``N(mean, cov)`` of the existing rows.

Drawing new rows from the distribution of the old ones (rather than zeros or the init's small
normal) keeps the new tokens' logits in the range of the old ones, so the model neither ignores
nor prefers them before training (Hewitt, "Initializing new word embeddings for pretrained
language models", 2021). The draw is seeded; the covariance is regularized (``+ eps I``, eps
growing) when it is not positive definite, e.g. with fewer rows than dimensions.

The resizing itself is ``asrforge.model.resize.adapt_state_dict``: it refuses any other
difference and reports each adapted tensor.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

import torch

from asrforge.errors import UserError
from asrforge.model.resize import VOCAB_TENSORS, RowInit, adapt_state_dict
from asrforge.model.tokenizer import load_tokenizer
from asrforge.model.vocab import EXTENSION_FILE, VocabExtension, check_base_ids, tokenizer_sha256

log = logging.getLogger(__name__)


def _cholesky(cov: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, float]:
    """(L, jitter) with ``L L^T = cov + jitter I``; jitter 0, else ``eps`` x mean variance,
    growing tenfold until the factorization succeeds."""
    scale = float(cov.diagonal().mean().clamp(min=1e-12))
    jitter = 0.0
    eye = torch.eye(cov.shape[0], dtype=cov.dtype)
    for _ in range(20):
        factor, info = torch.linalg.cholesky_ex(cov + jitter * eye)
        if int(info) == 0:
            return factor, jitter
        jitter = eps * scale if jitter == 0.0 else jitter * 10
    raise ValueError("the embedding covariance is not positive definite even after regularizing")


def sample_like_rows(old: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` rows drawn from ``N(mean, cov)`` of the rows of ``old``.

    The covariance is regularized (``+ eps I``, eps growing) when it is not positive definite,
    e.g. with fewer rows than columns.

    Args:
        old: (rows, d) the existing embedding.
        n: rows to draw.
        generator: a CPU generator (the draw is reproducible from its seed).

    Returns:
        (n, d), old's dtype and device.
    """
    x = old.detach().to("cpu", torch.float64)
    mean = x.mean(0)
    centered = x - mean
    cov = centered.T @ centered / max(1, x.shape[0] - 1)
    factor, jitter = _cholesky(cov)
    if jitter:
        log.info("embedding covariance regularized with %.3g * I", jitter)
    z = torch.randn(n, x.shape[1], generator=generator, dtype=torch.float64)
    return (mean + z @ factor.T).to(old.device, old.dtype)


def new_row_init(seed: int) -> RowInit:
    """A :data:`RowInit` for ``adapt_state_dict`` drawing new rows with :func:`sample_like_rows`,
    seeded by ``seed`` (and the tensor name, so untied tensors get their own draws)."""

    def init(name: str, n: int, old: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return sample_like_rows(old.reshape(old.shape[0], -1), n, g).reshape(n, *old.shape[1:])

    return init


def extend_model(model, vocab_size: int, seed: int) -> list[str]:
    """Grow a Whisper model's vocabulary to ``vocab_size`` rows, in place.

    Rows of the existing ids are kept exactly; new rows are drawn by :func:`new_row_init`. The
    output projection stays tied to the embedding.

    Returns:
        One line per adapted tensor (as ``adapt_state_dict`` reports).
    """
    state = model.state_dict()
    shapes = {k: v.shape for k, v in state.items()}
    for name in VOCAB_TENSORS:
        if name in shapes:
            shapes[name] = torch.Size([vocab_size, *shapes[name][1:]])
    new_state, report = adapt_state_dict(state, shapes, init=new_row_init(seed))
    with torch.random.fork_rng(devices=[]):  # resize's own init must not move the global RNG
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.load_state_dict(new_state, strict=True)
    model.config.vocab_size = vocab_size
    return report


def vocab_row_map(source_tok, target_tok) -> list[int]:
    """For each id of ``target_tok``, the id of the same token in ``source_tok``, or -1.

    The ``row_map`` of ``adapt_state_dict`` for moving weights between the two vocabularies.
    """
    source = {t: i for i, t in enumerate(source_tok.convert_ids_to_tokens(range(len(source_tok))))}
    return [source.get(t, -1) for t in target_tok.convert_ids_to_tokens(range(len(target_tok)))]


def adapt_vocab_state(state, model, *, seed: int, row_map: list[int] | None = None):
    """Fit a state dict of one vocabulary (base or extended) to ``model``'s, with a report.

    Rows of shared ids are copied, new ones drawn as in :func:`extend_model`, rows the model
    no longer has are dropped. ``row_map`` defaults to "ids shared from 0", which is what
    ``asrforge vocab build`` guarantees (see :func:`vocab_row_map`).

    Returns:
        ``(state, report)`` from ``adapt_state_dict``: one line per adapted tensor.
    """
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    return adapt_state_dict(state, shapes, init=new_row_init(seed), row_map=row_map)


def extend_pretrained(model, tokenizer, tokenizer_dir: Path, pretrained: Path, seed: int):
    """Extend a pretrained model to an extended tokenizer, when it is one made for this model.

    Args:
        model: the loaded pretrained model (base vocabulary).
        tokenizer: the loaded ``tokenizer_dir``.
        tokenizer_dir: ``model.tokenizer``; must hold ``vocab_extension.json``.
        pretrained: ``model.pretrained``; when it has tokenizer files, the extension must have
            been made from exactly that tokenizer.
        seed: seeds the draw of the new rows.

    Returns:
        The ``adapt_state_dict`` report, or None when ``tokenizer_dir`` is no extension (the
        caller then refuses the size mismatch as before).

    Raises:
        UserError: an extension that does not fit this model (sizes, base tokenizer, files).
    """
    ext = VocabExtension.read(tokenizer_dir)
    if ext is None:
        return None
    where = Path(tokenizer_dir) / EXTENSION_FILE
    n_model = model.config.vocab_size
    if ext.base_vocab_size != n_model:
        raise UserError(
            f"{where}: extends a {ext.base_vocab_size}-token vocabulary, but model.pretrained "
            f"{pretrained} has {n_model} rows: build the extension from this model's tokenizer"
        )
    base_tok = None
    if (Path(pretrained) / "tokenizer.json").is_file() or (
        Path(pretrained) / "vocab.json"
    ).is_file():
        base_tok = load_tokenizer(pretrained)
        if tokenizer_sha256(base_tok) != ext.base_tokenizer_sha256:
            raise UserError(
                f"{where}: made from another base tokenizer than {pretrained}'s (sha256 differs)"
            )
    if base_tok is not None:  # ``tokenizer`` was checked against its files when loaded
        ids = dict(enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))))
        check_base_ids(ext, base_tok, ids, Path(tokenizer_dir) / "tokenizer.json")
    if len(tokenizer) != ext.vocab_size:
        raise UserError(
            f"{where}: records vocab_size {ext.vocab_size}, the tokenizer has "
            f"{len(tokenizer)} tokens"
        )
    report = extend_model(model, ext.vocab_size, seed)
    log.info(
        "vocabulary extended for %s: %d -> %d tokens (%d new rows ~ N(mean, cov) of the "
        "base rows, seed %d): %s",
        ext.language,
        n_model,
        ext.vocab_size,
        ext.new_tokens,
        seed,
        "; ".join(report),
    )
    return report
