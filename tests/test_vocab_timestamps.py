"""An extended vocabulary's new tokens come after the timestamp tokens (<|30.00|>): transformers'
Whisper decoding reads them as timestamps; asrforge's own timestamp parsing stops at the last
timestamp, and an export says so (ct2, for faster-whisper, is refused)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from asrforge.data.targets import TimestampTokens
from asrforge.errors import UserError
from asrforge.model.decoding import TimestampRules, TimestampVocab
from asrforge.model.longform import parse_window, transcribe_by_timestamps
from asrforge.model.tokenizer import load_tokenizer, train_bpe_tokenizer
from asrforge.model.vocab import build_extended_tokenizer, ids_read_as_timestamps

SR = 16_000


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> tuple:
    """(base, extended): a small English BPE with Whisper's 30 s of timestamp tokens, and the
    same extended with Georgian tokens (appended after <|30.00|>, as `vocab build` does)."""
    d = tmp_path_factory.mktemp("vocab-ts")
    english = ["the cat sat on the mat", "a dog ran in the park", "hello world again"] * 30
    train_bpe_tokenizer(english, vocab_size=300, timestamp_seconds=30.0).save_pretrained(
        str(d / "base")
    )
    rng = random.Random(0)
    syllables = [c + v for c in "ბგდვზთკლმნპ" for v in "აეიოუ"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(60)]
    georgian = [" ".join(rng.choices(words, k=6)) for _ in range(400)]
    build_extended_tokenizer(d / "base", georgian, language="ka", vocab_size=400, out=d / "ext")
    return load_tokenizer(d / "base"), load_tokenizer(d / "ext"), georgian[0]


def _window(tok, sentence: str) -> tuple[list[int], list[int]]:
    """``<|0.00|> sentence <|2.00|><|2.00|> sentence <|4.00|>`` and the sentence's ids."""
    words = tok.encode(" " + sentence, add_special_tokens=False)
    t0 = tok.convert_tokens_to_ids("<|0.00|>")
    return [t0, *words, t0 + 100, t0 + 100, *words, t0 + 200], words


def test_the_new_tokens_follow_the_timestamps(tokenizers):
    base, ext, sentence = tokenizers
    last = ext.convert_tokens_to_ids("<|30.00|>")
    _, words = _window(ext, sentence)
    assert max(words) > last  # the sentence is spelled with new tokens
    assert ids_read_as_timestamps(base) == range(0)
    assert ids_read_as_timestamps(ext) == range(last + 1, len(ext))


def test_transformers_reads_the_new_tokens_as_timestamps(tokenizers):
    """What docs/decoding.md ("Extended vocabularies") tells users of transformers' pipeline: if
    this fails, transformers bounds its timestamps now, and that section and the export warning
    can go."""
    from transformers.models.whisper.tokenization_whisper import _decode_asr

    _, ext, sentence = tokenizers
    seq, words = _window(ext, sentence)
    assert ext.decode(seq, skip_special_tokens=True).split() == sentence.split() * 2  # plain: OK
    offsets = ext.decode(seq, output_offsets=True)["offsets"]
    assert [o["timestamp"] for o in offsets] != [(0.0, 2.0), (2.0, 4.0)]
    assert all(o["text"].strip() != sentence for o in offsets)
    # the ASR pipeline's decoding drops every new token, with or without return_timestamps
    text, _ = _decode_asr(
        ext,
        [{"tokens": torch.tensor([words])}],
        return_timestamps=False,
        return_language=False,
        time_precision=0.02,
    )
    assert text.split() != sentence.split()


def test_asrforge_reads_the_new_tokens_as_text(tokenizers):
    _, ext, sentence = tokenizers
    seq, words = _window(ext, sentence)
    vocab = TimestampVocab.of(ext, len(ext), 30.0)
    assert vocab is not None and vocab.end == ext.convert_tokens_to_ids("<|30.00|>") + 1
    assert all(vocab.is_text(t) and not vocab.is_timestamp(t) for t in words)
    no_ts = ext.convert_tokens_to_ids("<|notimestamps|>")
    assert TimestampTokens.from_tokenizer(ext, no_ts) == TimestampTokens(no_ts + 1, 1501)
    # the window's segments, as openai-whisper would cut them with Whisper's own vocabulary
    segments, seek, _ = parse_window(seq, vocab)
    assert [(a, b) for a, b, _ in segments] == [(0, 100), (100, 200)] and seek is None
    for _, _, ids in segments:
        text = ext.decode([t for t in ids if vocab.is_text(t)], skip_special_tokens=True)
        assert text.split() == sentence.split()
    # after a pair of timestamps the new tokens may follow (they are text); first, they may not
    rules = TimestampRules(vocab)
    after_pair = rules(torch.zeros(1, len(ext)), torch.tensor([seq[: len(words) + 3]]))[0]
    assert torch.isfinite(after_pair[words]).all()
    first = rules(torch.zeros(1, len(ext)), torch.zeros(1, 0, dtype=torch.long))[0]
    assert torch.isinf(first[words]).all()
    # a long recording of two windows, each heard as the scripted window above
    [out] = transcribe_by_timestamps(
        [torch.zeros(45 * SR).numpy()],
        [[0]],
        lambda windows, prompts: [list(seq) for _ in windows],
        vocab,
        decode_text=lambda ids: ext.decode(ids, skip_special_tokens=True),
        window_samples=30 * SR,
    )
    assert [(s.start, s.end) for s in out] == [(0.0, 2.0), (2.0, 4.0), (30.0, 32.0), (32.0, 34.0)]
    assert all(s.text.split() == sentence.split() for s in out)


def test_a_bpe_trained_by_asrforge_keeps_its_text_in_timestamp_mode(tokenizers):
    """asrforge's own BPE has EOT first (id 0), then its text tokens, then the specials and the
    timestamps. The timestamp rules masked every id from EOT + 1 to <|0.00|> -- all text
    tokens of such a model -- and the segment text left them out, so long audio decoded by
    timestamps with a from-scratch model trained with timestamps came out empty."""
    base, _, _ = tokenizers
    vocab = TimestampVocab.of(base, len(base), 30.0)
    words = base.encode(" the cat sat", add_special_tokens=False)
    sot = base.convert_tokens_to_ids("<|startoftranscript|>")
    assert vocab.eot == 0 and vocab.begin > sot > max(words)
    after_open = TimestampRules(vocab)(torch.zeros(1, len(base)), torch.tensor([[vocab.begin]]))[0]
    assert torch.isfinite(after_open[words]).all() and torch.isfinite(after_open[vocab.eot])
    assert torch.isinf(after_open[sot:]).all()  # no special, no timestamp
    [(_, _, ids)], _, _ = parse_window([vocab.begin, *words, vocab.begin + 50], vocab)
    assert base.decode([t for t in ids if vocab.is_text(t)]).strip() == "the cat sat"


@pytest.fixture
def extended_pretrained(tmp_path, tokenizers) -> Path:
    """A tiny transformers Whisper directory with the extended vocabulary."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    _, ext, _ = tokenizers
    eot = ext.convert_tokens_to_ids("<|endoftext|>")
    cfg = WhisperConfig(
        vocab_size=len(ext),
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=64,
        decoder_start_token_id=ext.convert_tokens_to_ids("<|startoftranscript|>"),
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    torch.manual_seed(0)
    path = tmp_path / "pretrained-ka"
    WhisperForConditionalGeneration(cfg).save_pretrained(str(path))
    ext.save_pretrained(str(path))
    return path


def test_a_ct2_export_of_an_extended_vocabulary_is_refused_and_hf_warns(
    extended_pretrained, tmp_path, caplog
):
    """faster-whisper keeps only ids below <|endoftext|> as text: the ct2 bundle would drop
    every new token without a word (it was written before)."""
    from asrforge.bundle.export import export_bundle

    with pytest.raises(UserError, match=r"--format ct2: the vocabulary has \d+ token\(s\) after"):
        export_bundle(extended_pretrained, tmp_path / "ct2", fmt="ct2")
    assert not (tmp_path / "ct2").exists()
    with caplog.at_level(logging.WARNING, logger="asrforge"):
        export_bundle(extended_pretrained, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert any("ASR pipeline" in r.getMessage() for r in caplog.records)
