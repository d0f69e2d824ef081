"""Long-form transcription: Whisper's timestamp rules on crafted logits, the seek logic with a
scripted decoder, subtitles, and a multi-minute espeak-ng recording transcribed sequentially by
Whisper tiny.en without a sentence lost."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile as sf
import torch
from audio_fixtures import synthesize
from test_bundle import one_thread  # noqa: F401  (autouse: one torch thread)
from test_ct2_import import ct2_tiny_en, hf_tiny_en  # noqa: F401  (session fixtures)

from asrforge.cli import main
from asrforge.errors import UserError
from asrforge.model.alignment import Word, place_words
from asrforge.model.decoding import TimestampRules, TimestampVocab
from asrforge.model.longform import (
    Segment,
    parse_window,
    transcribe_by_silence,
    transcribe_by_timestamps,
)

SR = 16_000
NEG = float("-inf")

# ---------------------------------------------------------------------------------------------
# Timestamp rules on crafted logits. A toy vocabulary: text 0-9, EOT 10, specials 11-14
# (<|notimestamps|> is 14), timestamps 15-24 (<|0.00|> ... <|0.18|>), extended text 25-26.

SMALL = TimestampVocab(begin=15, count=10, eot=10, no_timestamps=14)
V = 27
TEXT = set(range(10)) | {25, 26}
STAMPS = set(range(15, 25))


def _allowed(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if x != NEG}


def _apply(generated: list[int], logits: torch.Tensor | None = None, **kw) -> torch.Tensor:
    rules = TimestampRules(SMALL, **kw)
    if logits is None:  # text and EOT clearly likelier than all timestamps together
        logits = torch.zeros(V)
        logits[[*sorted(TEXT), 10]] = 5.0
    x = logits[None]
    return rules(x, torch.tensor([generated], dtype=torch.long).reshape(1, len(generated)))[0]


@pytest.mark.fast
def test_the_first_token_is_a_timestamp_no_later_than_the_initial_limit() -> None:
    assert _allowed(_apply([], max_initial_timestamp=0.04)) == {15, 16, 17}
    assert _allowed(_apply([], max_initial_timestamp=None)) == STAMPS


@pytest.mark.fast
def test_timestamps_come_in_pairs_and_never_go_back() -> None:
    # after the opening stamp: text only (no empty segment, no special token)
    assert _allowed(_apply([17])) == TEXT | {10}
    # after text: text, EOT, or a closing stamp later than the opening one
    assert _allowed(_apply([17, 3])) == TEXT | {10} | set(range(18, 25))
    # after a closing stamp: the next segment's start (at or after it) or EOT, never text
    assert _allowed(_apply([17, 3, 20])) == {10} | set(range(20, 25))
    # after a pair: text
    assert _allowed(_apply([17, 3, 20, 20])) == TEXT | {10}
    # <|notimestamps|> and the other specials are never picked
    assert not _allowed(_apply([17, 3])) & {11, 12, 13, 14}


@pytest.mark.fast
def test_a_timestamp_wins_when_all_timestamps_together_outweigh_any_text_token() -> None:
    logits = torch.full((V,), -20.0)
    logits[3] = 0.0  # the likeliest single token is text ...
    logits[18:25] = -0.5  # ... but the seven timestamps together are likelier
    assert _allowed(_apply([17, 3], logits)) == set(range(18, 25))
    logits[18:25] = -3.0  # now they are not
    assert 3 in _allowed(_apply([17, 3], logits))


@pytest.mark.fast
def test_rules_apply_per_row() -> None:
    rules = TimestampRules(SMALL)
    logits = torch.zeros(2, V)
    logits[:, [*sorted(TEXT), 10]] = 5.0
    out = rules(logits, torch.tensor([[17, 3, 3, 20], [17, 3, 20, 20]]))
    assert _allowed(out[0]) == {10} | set(range(20, 25)) and _allowed(out[1]) == TEXT | {10}


def test_the_vocabulary_of_a_from_scratch_bpe_has_no_timestamps(hf_tiny_en) -> None:  # noqa: F811
    from asrforge.model.tokenizer import load_tokenizer, train_bpe_tokenizer

    bpe = train_bpe_tokenizer(["hello world, the cat sat on the mat"] * 20, vocab_size=300)
    assert TimestampVocab.of(bpe, len(bpe), 30.0) is None
    whisper = TimestampVocab.of(load_tokenizer(hf_tiny_en), 51864, 30.0)
    assert whisper == TimestampVocab(begin=50363, count=1501, eot=50256, no_timestamps=50362)
    assert TimestampVocab.of(load_tokenizer(hf_tiny_en), 51000, 30.0) is None  # cut-off vocab


# ---------------------------------------------------------------------------------------------
# The seek logic

BIG = TimestampVocab(begin=1000, count=1501, eot=50, no_timestamps=999)


def ts(seconds: float) -> int:
    return BIG.begin + round(seconds / 0.02)


@pytest.mark.fast
def test_parse_window_cases() -> None:
    # complete segments, the last closed by a single timestamp: move past the whole window
    segs, seek, tail = parse_window([ts(0), 1, 2, ts(2), ts(2.5), 3, ts(4)], BIG)
    assert seek is None and tail is None
    assert [(a, b, [t for t in ids if t < 50]) for a, b, ids in segs] == [
        (0, 100, [1, 2]),
        (125, 200, [3]),
    ]
    # an unfinished segment: dropped, and the next window starts where the last complete
    # segment ended (so the unfinished one is decoded whole there)
    segs, seek, tail = parse_window([ts(0), 1, ts(2), ts(2.5), 3], BIG)
    assert [(a, b) for a, b, _ in segs] == [(0, 100)] and seek == 100
    assert tail == 125  # where the text it cut off opens
    # a pair at the very end: the next window starts there
    segs, seek, tail = parse_window([ts(0), 1, ts(2), ts(2.5), 3, ts(4), ts(4)], BIG)
    assert [(a, b) for a, b, _ in segs] == [(0, 100), (125, 200)] and seek == 200
    assert tail is None  # nothing after the pair
    # no timestamps: one segment over the window's audio, move past it
    assert parse_window([1, 2, 3], BIG) == ([(0, None, [1, 2, 3])], None, None)
    # one segment without a following pair
    assert parse_window([ts(0.5), 1, ts(3)], BIG) == (
        [(25, 150, [ts(0.5), 1, ts(3)])],
        None,
        None,
    )
    assert parse_window([], BIG) == ([(0, None, [])], None, None)


def _whisper_rule(tokens: list[int], begin: int, window_steps: int):
    """openai-whisper's ``transcribe()`` (c0d2f62; faster-whisper's and transformers' are the
    same), literally: segments as (start, end) steps and how far the window moves, in steps."""
    stamp = [t >= begin for t in tokens]
    single_timestamp_ending = stamp[-2:] == [False, True]
    consecutive = [i + 1 for i in range(len(tokens) - 1) if stamp[i] and stamp[i + 1]]
    if consecutive:
        slices = consecutive + ([len(tokens)] if single_timestamp_ending else [])
        segments, last = [], 0
        for cut in slices:
            segments.append((tokens[last] - begin, tokens[cut - 1] - begin))
            last = cut
        return segments, window_steps if single_timestamp_ending else tokens[last - 1] - begin
    stamps = [t for t in tokens if t >= begin]
    end = stamps[-1] - begin if stamps and stamps[-1] != begin else window_steps
    return [(0, end)], window_steps


def _rule_abiding_window(rng: random.Random) -> list[int]:
    """What the timestamp rules let a window be: an opening stamp, segments closed by a later
    stamp, each followed by the next one's opening stamp or the end; the last one may be left
    unfinished (text, no closing stamp) or end on a pair."""
    t = rng.randrange(0, 50)
    ids = [ts(t * 0.02)]
    for _ in range(rng.randrange(0, 5)):
        ids += [rng.randrange(1, 40) for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.2:
            return ids  # unfinished
        t = min(t + rng.randrange(1, 300), 1500)
        ids.append(ts(t * 0.02))  # closed
        if rng.random() < 0.3 or t == 1500:
            return ids  # a lone timestamp at the end: nothing after it
        t = min(t + rng.randrange(0, 50), 1500)
        ids.append(ts(t * 0.02))  # the next one's start
    return ids + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 3))]


@pytest.mark.fast
def test_parse_window_seeks_as_openai_whisper_does() -> None:
    """The seek rule next to openai-whisper's on windows the rules allow, the lone timestamp
    early in the window included: then Whisper (and this) moves past the whole window, taking
    it for "no speech after this point" (the model emitted EOT there), as its comment says."""
    rng = random.Random(0)
    windows = [_rule_abiding_window(rng) for _ in range(500)]
    windows += [[ts(0), 1, ts(1)], [ts(0), 1, ts(1), ts(1), 2, ts(2)], [ts(0), 1, ts(1), ts(1)]]
    for ids in windows:
        segments, seek, _ = parse_window(ids, BIG)
        want_segments, want_seek = _whisper_rule(ids, BIG.begin, 1500)
        assert (1500 if seek is None else seek) == want_seek, ids
        stamp = [BIG.is_timestamp(t) for t in ids]
        paired = any(a and b for a, b in zip(stamp, stamp[1:], strict=False))
        if paired:  # segments cut at the pairs: the same
            assert [(a, 1500 if b is None else b) for a, b, _ in segments] == want_segments, ids
        # else one segment, timed differently on purpose: Whisper from the window's start to
        # the last stamp (the opening one when it is unfinished: before its text); here from
        # the opening stamp to the closing one, else to the end of the window
    early_lone = [ts(0), 1, ts(1), ts(1), 2, ts(2)]
    assert parse_window(early_lone, BIG)[1] is None  # the whole window, as Whisper


def _ramp(seconds: float) -> np.ndarray:
    """Audio whose every sample is its own time: a window's first sample says where it is."""
    return np.arange(round(seconds * SR), dtype=np.float64) / SR


def _sequential(seconds: float, decode, speech_end=None) -> list:
    """The segments :func:`transcribe_by_timestamps` gives one :func:`_ramp` recording of
    ``seconds`` through ``decode`` (text ids joined as text, 30 s windows)."""
    [segs] = transcribe_by_timestamps(
        [_ramp(seconds)],
        [[7]],
        decode,
        BIG,
        decode_text=lambda ids: " ".join(map(str, ids)),
        window_samples=30 * SR,
        speech_end=speech_end,
    )
    return segs


def _scripted(sentences: list[tuple[float, float]], calls: list) -> callable:
    """A decoder that 'hears' the sentences: complete ones in the window as timestamped
    segments (sentence k is text id k), then the start of one the window cuts off."""

    def decode(windows, prompts):
        calls.append((windows, prompts))
        out = []
        for w in windows:
            t0, t1 = float(w[0]), float(w[0]) + w.shape[0] / SR
            ids = []
            for k, (a, b) in enumerate(sentences):
                if a >= t0 - 1e-6 and b <= t1 + 1e-6:
                    ids += [ts(a - t0), k, ts(b - t0)]
                elif t0 - 1e-6 <= a < t1:
                    ids += [ts(a - t0), k]  # cut off by the window's end
                    break
            out.append(ids)
        return out

    return decode


def _paused_sentences() -> tuple[list[tuple[float, float]], float]:
    """22 sentences of 3.2-6.4 s with 0.1-1.0 s pauses (seeded), on the 0.02 s grid, and where
    the last pause ends."""
    rng = np.random.default_rng(1)
    sentences, t = [], 0.3
    for _ in range(22):
        a = round(t / 0.02) * 0.02
        b = round((a + rng.uniform(3.2, 6.4)) / 0.02) * 0.02
        sentences.append((a, b))
        t = b + rng.uniform(0.1, 1.0)
    return sentences, t


@pytest.mark.fast
def test_sequential_windows_decode_every_sentence_once_in_order() -> None:
    # 22 sentences of 3.2-6.4 s with pauses over ~2.4 min; 30 s windows cut many of them
    sentences, t = _paused_sentences()
    wave = _ramp(t + 0.5)
    calls = []
    [segs] = transcribe_by_timestamps(
        [wave],
        [[7]],
        _scripted(sentences, calls),
        BIG,
        decode_text=lambda ids: str(ids),
        window_samples=30 * SR,
    )
    assert [s.text for s in segs] == [str([k]) for k in range(len(sentences))]
    for s, (a, b) in zip(segs, sentences, strict=True):
        assert s.start == pytest.approx(a, abs=1e-6) and s.end == pytest.approx(b, abs=1e-6)
    starts = [float(w[0]) for ws, _ in calls for w in ws]
    assert starts == sorted(starts) and len(starts) >= t / 30  # windows only move forward
    # a window starts where a sentence ended (the next one was cut off), or where the window
    # before it ended (its last sentence was complete)
    for before, s in zip(starts, starts[1:], strict=False):
        assert any(abs(s - b) < 1e-6 for _, b in sentences) or s == pytest.approx(before + 30)
    assert any(abs(s - b) < 1e-6 for _, b in sentences for s in starts)


@pytest.mark.fast
def test_windows_without_timestamps_move_by_a_whole_window() -> None:
    wave = _ramp(70.0)
    calls = []

    def decode(windows, prompts):
        calls.append(windows)
        return [[3, 4] for _ in windows]

    [segs] = transcribe_by_timestamps(
        [wave], [[7]], decode, BIG, decode_text=lambda ids: "x", window_samples=30 * SR
    )
    assert [(s.start, s.end) for s in segs] == [(0.0, 30.0), (30.0, 60.0), (60.0, 70.0)]


@pytest.mark.fast
def test_a_window_that_would_not_move_is_skipped_not_repeated() -> None:
    wave = _ramp(65.0)
    calls = []

    def decode(windows, prompts):  # a pair at 0: "seek to 0.00" (the rules forbid it)
        calls.append(windows)
        return [[ts(0), ts(0), 5] for _ in windows]

    transcribe_by_timestamps(
        [wave], [[7]], decode, BIG, decode_text=lambda ids: "", window_samples=30 * SR
    )
    assert len(calls) == 3


@pytest.mark.fast
def test_segments_stay_within_the_audio() -> None:
    wave = _ramp(10.0)  # the model claims speech until 29 s of a 10 s recording
    [segs] = transcribe_by_timestamps(
        [wave],
        [[7]],
        lambda ws, ps: [[ts(1), 5, ts(29)]],
        BIG,
        decode_text=lambda ids: "x",
        window_samples=30 * SR,
    )
    assert [(s.start, s.end) for s in segs] == [(1.0, 10.0)]


def _drifting(sentences: list[tuple[float, float]], drift_at: float, calls: list):
    """As :func:`_scripted`, except that the window starting at ``drift_at`` is what tiny.en
    decoded at 77.44 s of ``bench/bench_vad.py``'s recording: whole seconds, early, the last
    sentence closed at 15.00 and a segment opened there with nothing after it."""
    scripted = _scripted(sentences, calls)

    def decode(windows, prompts):
        out = scripted(windows, prompts)
        for k, w in enumerate(windows):
            if abs(float(w[0]) - drift_at) < 1e-6:
                out[k] = [ts(0), 0, ts(7), ts(7), 1, ts(15), ts(15)]
        return out

    return decode


def _heard_end(sentences: list[tuple[float, float]]):
    """A :data:`SpeechEnd` that knows where each sentence (text id k) really ends."""

    def speech_end(window, prompt, said):
        return sentences[said[-1][2][-1]][1] - float(window[0])

    return speech_end


@pytest.mark.fast
def test_a_sentence_timed_too_early_is_not_decoded_again() -> None:
    # sentence 1 really spans 15.1-18.9 s; the first window says it ended at 15.00
    sentences = [(6.1, 9.5), (15.1, 18.9), (25.0, 28.0), (40.0, 44.0)]
    for speech_end, want in ((None, [0, 1, 1, 2, 3]), (_heard_end(sentences), [0, 1, 2, 3])):
        calls = []
        segs = _sequential(50.0, _drifting(sentences, 0.0, calls), speech_end)
        assert [int(s.text) for s in segs] == want
    starts = [float(w[0]) for ws, _ in calls for w in ws]
    assert starts[:2] == [0.0, pytest.approx(18.9)]  # past the sentence, not at 15.00
    assert all(a.end <= b.start for a, b in zip(segs, segs[1:], strict=False))


@pytest.mark.fast
def test_a_late_heard_end_never_skips_the_sentence_a_window_cut_off() -> None:
    # window 1 closes sentence 2 at 26.4 and opens sentence 3 at <|27.00|>; an alignment that
    # drifts late says the text ended at 29.7
    sentences = [(2.0, 8.0), (10.0, 18.0), (21.0, 26.4), (27.0, 33.0)]
    calls = []
    segs = _sequential(40.0, _scripted(sentences, calls), lambda w, p, said: 29.7)
    assert [int(s.text) for s in segs] == [0, 1, 2, 3]
    assert float(calls[1][0][0][0]) == pytest.approx(27.0)  # at the cut-off sentence's start
    # the drift case has nothing after its closing pair: the window bounds the heard end alone
    calls = []
    sentences = [(6.1, 9.5), (15.1, 18.9), (25.0, 28.0), (40.0, 44.0)]
    _sequential(50.0, _drifting(sentences, 0.0, calls), lambda w, p, said: 21.3)
    assert float(calls[1][0][0][0]) == pytest.approx(21.3)


@pytest.mark.fast
def test_the_seek_floor_holds_a_late_last_word_to_its_segments_end() -> None:
    # openai-whisper's clamp: a last word ending more than 0.5 s after its segment's end
    # timestamp is cut back to it (times in seconds from the window's start)
    times = [(21.0, 23.0), (23.0, 25.9), (25.9, 29.7)]
    words = [Word(f" {k}", a, b, 0.9, (k,)) for k, (a, b) in enumerate(times, 1)]
    spans = [(2.0, 8.0, 1), (21.0, 26.4, 3)]
    _, end = place_words([Word(" 0", 2.0, 8.0, 0.9, (0,)), *words], 0.3, spans)
    assert end == pytest.approx(26.4)
    # within 0.5 s of it, the aligned end stands, less the heads' lag
    words[-1].end = 26.8
    assert place_words(words, 0.3, spans[1:], lag=0.1)[1] == pytest.approx(26.7)


class _BigTokenizer:
    """The tokens :data:`BIG` names, as a Whisper tokenizer spells them."""

    unk_token_id = 50
    all_special_ids = [50, 51, 999]

    def convert_tokens_to_ids(self, token: str) -> int | None:
        names = {"<|endoftext|>": 50, "<|startoftranscript|>": 51, "<|notimestamps|>": 999}
        if token in names:
            return names[token]
        stamp = re.fullmatch(r"<\|(\d+\.\d\d)\|>", token)
        return ts(float(stamp[1])) if stamp else self.unk_token_id

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(t) for t in ids if t < 50)


@pytest.mark.fast
def test_a_round_of_many_recordings_holds_at_most_its_budget_of_encodings(monkeypatch) -> None:
    from types import SimpleNamespace

    from asrforge.model import longform

    # each recording's first window cuts sentence 1 off, so its seek is found by alignment
    sentences = [(1.0, 4.0), (26.0, 33.0), (36.0, 39.0)]
    scripted = _scripted(sentences, [])
    held, encoded = [], []

    def decode_windows(model, extractor, windows, prompts, *, keep, **kw):
        for w in windows:
            keep.add(w, torch.zeros(2, 4))
        held.append(len(keep))
        return scripted(windows, prompts)

    def encode_waves(model, extractor, windows, device, sample_rate):
        encoded.extend(float(w[0]) for w in windows)
        return torch.zeros(len(windows), 2, 4)

    def align_words(model, enc, prompt, text, n_samples, **kw):
        return [Word(f" {t}", 0.0, sentences[t][1], 0.9, (t,)) for t in text], 0.3

    monkeypatch.setattr(longform, "decode_windows", decode_windows)
    monkeypatch.setattr(longform, "encode_waves", encode_waves)
    monkeypatch.setattr(longform, "align_words", align_words)
    # a budget of two windows' encoder output (one decode batch)
    monkeypatch.setattr(longform, "HELD_BYTES", 2 * 1500 * 4 * 4)
    model = SimpleNamespace(config=SimpleNamespace(
        max_source_positions=1500, d_model=4, vocab_size=2600, max_target_positions=448
    ))  # fmt: skip
    out = longform.transcribe_long(
        model, _BigTokenizer(), None, [_ramp(40.0) + k * 1e-4 for k in range(6)], [[51, 999]] * 6,
        chunking="timestamps", no_timestamps=999, eot=50, max_new_tokens=100, batch_size=2,
        heads=[(0, 0)],
    )  # fmt: skip
    assert [[s.text for s in segs] for segs in out] == [["0", "1", "2"]] * 6
    assert max(held) == 2
    assert len(encoded) == 4  # the first round's windows beyond the budget: encoded again


@pytest.mark.fast
def test_the_heard_end_moves_no_window_where_the_timestamps_do_not_drift() -> None:
    sentences, t = _paused_sentences()
    runs = []
    for heard in (None, lambda w, p, said: sentences[said[-1][2][-1]][1] - float(w[0]) - 0.3):
        calls = []
        [segs] = transcribe_by_timestamps(
            [_ramp(t + 0.5)],
            [[7]],
            _scripted(sentences, calls),
            BIG,
            decode_text=lambda ids: str(ids),
            window_samples=30 * SR,
            speech_end=heard,
        )
        runs.append(
            ([(s.start, s.end, s.text) for s in segs], [float(w[0]) for ws, _ in calls for w in ws])
        )
    assert runs[0] == runs[1]


@pytest.mark.fast
def test_segments_never_overlap_even_when_a_decoders_timestamps_go_back() -> None:
    segs = _sequential(
        10.0, lambda ws, ps: [[ts(0), 1, ts(5), ts(3), 2, ts(8), ts(4), 3, ts(4.5)]]
    )
    assert [(s.start, s.end, s.text) for s in segs] == [(0.0, 5.0, "1"), (5.0, 8.0, "2")]


@pytest.mark.fast
def test_condition_on_previous_text_prompts_with_the_text_before() -> None:
    sentences = [(0.0, 20.0), (22.0, 35.0), (36.0, 40.0)]
    calls = []
    transcribe_by_timestamps(
        [_ramp(41.0)],
        [[7, 8]],
        _scripted(sentences, calls),
        BIG,
        decode_text=lambda ids: "x",
        window_samples=30 * SR,
        startofprev=9,
    )
    prompts = [p for _, ps in calls for p in ps]
    assert prompts[0] == [7, 8]
    assert prompts[1] == [9, ts(0), 0, ts(20), 7, 8]  # window 1 saw sentence 0, cut sentence 1


@pytest.mark.fast
def test_recordings_are_decoded_together_each_at_its_own_position() -> None:
    calls = []
    out = transcribe_by_timestamps(
        [_ramp(50.0), _ramp(5.0), np.zeros(0)],
        [[7]] * 3,
        _scripted([(1.0, 4.0), (31.0, 45.0)], calls),
        BIG,
        decode_text=lambda ids: str(ids),
        window_samples=30 * SR,
    )
    assert [[(s.start, s.end) for s in segs] for segs in out] == [
        [(1.0, 4.0), (31.0, 45.0)],
        [(1.0, 4.0)],
        [],
    ]
    assert [len(ws) for ws, _ in calls] == [2, 1]


@pytest.mark.fast
def test_silence_cuts_give_one_segment_per_piece_with_text() -> None:
    wave = np.concatenate([np.ones(3 * SR), np.zeros(SR), np.ones(3 * SR)]).astype(np.float32)
    [segs] = transcribe_by_silence(
        [wave],
        [[7]],
        lambda ws, ps: [[1] for _ in ws],
        decode_text=lambda ids: "a",
        window_seconds=5.0,
    )
    assert len(segs) == 2 and segs[0].start == 0 and segs[-1].end == wave.shape[0] / SR
    assert segs[0].end == segs[1].start and 3.0 <= segs[0].end <= 4.0


# ---------------------------------------------------------------------------------------------
# Subtitles


@pytest.mark.fast
def test_srt_and_vtt() -> None:
    from asrforge.bundle.subtitles import to_srt, to_vtt

    segs = [Segment(0.0, 2.5, "Hello there."), Segment(3661.0014, 3663.9996, "A\n\nB --> C")]
    assert to_srt(segs) == (
        "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
        "2\n01:01:01,001 --> 01:01:04,000\nA B -> C\n"
    )
    assert to_vtt(segs) == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
        "01:01:01.001 --> 01:01:04.000\nA B --&gt; C\n"
    )


@pytest.mark.fast
def test_vtt_escapes_what_it_would_read_as_markup_and_srt_keeps_it() -> None:
    from asrforge.bundle.subtitles import to_srt, to_vtt

    segs = [Segment(0.0, 1.0, "R&D <b>x</b> &amp; 3 > 2")]
    assert to_vtt(segs).splitlines()[-1] == "R&amp;D &lt;b&gt;x&lt;/b&gt; &amp;amp; 3 &gt; 2"
    assert to_srt(segs).splitlines()[-1] == "R&D <b>x</b> &amp; 3 > 2"


# ---------------------------------------------------------------------------------------------
# Whisper tiny.en on a multi-minute recording

SENTENCES = [
    "We will meet at the library tomorrow morning to discuss the project.",
    "It is a beautiful day and the children are playing in the park.",
    "The train to the city leaves from the station at nine o'clock.",
    "Please remember to buy some bread, milk and eggs on your way home.",
    "My brother has been learning to play the piano for three years.",
    "The weather forecast says it will rain heavily over the weekend.",
    "She opened the window to let some fresh air into the room.",
    "Our team finished the report just before the deadline on Friday.",
    "He likes to read the newspaper while drinking his morning coffee.",
    "The doctor told him to get more sleep and to drink more water.",
    "They are planning a trip to the mountains during the summer holidays.",
    "I forgot my umbrella at the office and got wet on the way back.",
    "Students should hand in their homework by the end of the month.",
    "The concert was cancelled because the singer had lost her voice.",
    "He repaired the old bicycle with a few simple tools from the garage.",
    "The library will extend its opening hours during the exam period.",
    "The pilot announced that the plane would land twenty minutes early.",
    "The teacher asked the students to write an essay about their town.",
    "We watched the sunset from the top of the hill near the lake.",
    "She keeps her passport and tickets in a folder in the top drawer.",
    "Please turn off the lights when you are the last one to leave.",
    "The museum is closed on Mondays but open every other day of the week.",
    "A strong wind knocked down several trees along the river path.",
    "The company hired three new engineers to work on the software.",
]


def _words(text: str) -> list[str]:
    text = text.lower().replace("nine", "9").replace("twenty", "20")
    return re.sub(r"[^a-z0-9' ]", " ", text).split()


def sentence_recall(sentences: list[str], hyp: str) -> list[float]:
    """For each sentence, the share of its words the hypothesis has at the aligned positions
    (a lost sentence scores 0, a doubled one does not score twice)."""
    ref_words = [_words(s) for s in sentences]
    owner = [k for k, ws in enumerate(ref_words) for _ in ws]
    out = jiwer.process_words(" ".join(sum(ref_words, [])), " ".join(_words(hyp)))
    hits = [0] * len(sentences)
    for chunk in out.alignments[0]:
        if chunk.type == "equal":
            for i in range(chunk.ref_start_idx, chunk.ref_end_idx):
                hits[owner[i]] += 1
    return [h / len(ws) for h, ws in zip(hits, ref_words, strict=True)]


@pytest.fixture(scope="module")
def tiny_en(hf_tiny_en):  # noqa: F811
    from asrforge.bundle.export import bundle_from_checkpoint

    return bundle_from_checkpoint(hf_tiny_en)


@pytest.fixture(scope="module")
def recording() -> np.ndarray:
    """About 2 minutes: the sentences, each followed by 0.3-1.2 s of silence."""
    rng = np.random.default_rng(0)
    parts = []
    for sentence in SENTENCES:
        parts += [synthesize(sentence), np.zeros(int(SR * rng.uniform(0.3, 1.2)), np.float32)]
    return np.concatenate(parts)


@pytest.mark.slow
def test_sequential_long_form_decoding_loses_no_sentence(tiny_en, recording) -> None:
    seconds = recording.shape[0] / SR
    assert seconds > 110
    t0 = time.perf_counter()
    [result] = tiny_en.recognize([recording])
    took = time.perf_counter() - t0
    recall = sentence_recall(SENTENCES, result.text)
    ref = " ".join(_words(" ".join(SENTENCES)))
    error = jiwer.wer(ref, " ".join(_words(result.text)))
    print(f"\n{seconds:.0f} s: {took:.1f} s, WER {error:.3f}, recall {min(recall):.2f}")
    assert result.chunking == "timestamps"
    assert min(recall) >= 0.6, [(s, r) for s, r in zip(SENTENCES, recall, strict=True) if r < 0.6]
    assert error <= 0.15
    segs = result.segments
    assert all(0 <= s.start < s.end <= seconds + 1e-6 for s in segs)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(segs, segs[1:], strict=False))
    assert len(segs) >= len(SENTENCES) // 2


def test_transcribe_and_evaluate_accept_a_transformers_directory(
    hf_tiny_en,  # noqa: F811
    tmp_path,
    capsys,
    tones_dir,
) -> None:
    wav = tmp_path / "two.wav"
    wave = np.concatenate([synthesize(SENTENCES[0]), np.zeros(SR // 2), synthesize(SENTENCES[1])])
    sf.write(wav, wave, SR)
    assert main(["transcribe", str(hf_tiny_en), str(wav), "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert "not a bundle: loaded without verification" in captured.err
    record = json.loads(captured.out)
    assert record["chunking"] == "timestamps" and len(record["segments"]) >= 1
    assert min(sentence_recall(SENTENCES[:2], record["text"])) >= 0.8
    assert record["segments"][-1]["end"] <= record["seconds"]

    assert (
        main(
            [
                "transcribe",
                str(hf_tiny_en),
                str(wav),
                "--format",
                "srt",
                "--output-dir",
                str(tmp_path / "subs"),
            ]
        )
        == 0
    )
    srt = (tmp_path / "subs" / "two.srt").read_text()
    assert srt.startswith("1\n00:00:0") and " --> " in srt

    assert (
        main(
            [
                "evaluate",
                str(hf_tiny_en),
                "--data",
                str(tones_dir),
                "--max-samples",
                "2",
                "--max-new-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "not a bundle: loaded without verification" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["n"] == 2


def test_transcribe_refuses_impossible_options(hf_tiny_en, tmp_path, capsys) -> None:  # noqa: F811
    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(SR, np.float32), SR)
    for argv in (
        [str(wav), str(wav), "--format", "srt"],  # several files to stdout
        [str(wav), "--json", "--format", "vtt"],
        [str(wav), "--chunking", "silence", "--condition-on-previous-text"],
        [str(wav), str(wav), "--output-dir", str(tmp_path / "out")],  # the same output name
    ):
        assert main(["transcribe", str(hf_tiny_en), *argv]) == 2, argv
        assert "asrforge: error:" in capsys.readouterr().err


def test_timestamps_cannot_be_forced_on_a_model_without_them(hf_tiny_en) -> None:  # noqa: F811
    from asrforge.bundle.export import bundle_from_checkpoint
    from asrforge.bundle.options import chunking_for
    from asrforge.model.tokenizer import train_bpe_tokenizer

    bundle = bundle_from_checkpoint(hf_tiny_en)
    bundle.tokenizer = train_bpe_tokenizer(["the cat sat on the mat"] * 20, vocab_size=300)
    assert chunking_for(bundle, None)[0] == "silence"
    with pytest.raises(UserError, match="no timestamp tokens"):
        chunking_for(bundle, "timestamps")
    with pytest.raises(UserError, match="chunking: must be one of"):
        chunking_for(bundle, "words")


# ---------------------------------------------------------------------------------------------
# Long-form evaluation


def _utterances(n: int, langs=("en", "es")) -> list:
    from types import SimpleNamespace

    return [
        SimpleNamespace(
            uid=f"u{i}", language=langs[i % len(langs)], text=f"word{i}", seconds=1 + i % 3
        )
        for i in range(n)
    ]


def _fake_wave(u) -> np.ndarray:
    return np.full(u.seconds * SR, int(u.uid[1:]), np.float32)


@pytest.mark.fast
def test_long_items_are_deterministic_one_language_each_and_in_range() -> None:
    from asrforge.evaluation.longform import build_items

    utts = _utterances(60)
    kw = dict(count=4, min_seconds=8.0, max_seconds=12.0)
    items = build_items(utts, _fake_wave, seed=3, **kw)
    again = build_items(utts, _fake_wave, seed=3, **kw)
    other = build_items(utts, _fake_wave, seed=4, **kw)
    assert [(it.parts, it.wave.tobytes()) for it in items] == [
        (it.parts, it.wave.tobytes()) for it in again
    ]
    assert [it.parts for it in items] != [it.parts for it in other]
    assert [it.language for it in items] == ["en", "es", "en", "es"]
    by_uid = {u.uid: u for u in utts}
    used = [p for it in items for p in it.parts]
    assert len(used) == len(set(used))  # no utterance twice
    for it in items:
        assert {by_uid[p].language for p in it.parts} == {it.language}
        assert it.text == " ".join(by_uid[p].text for p in it.parts)
        assert 8.0 <= it.seconds <= 12.0 + 3 + 0.8  # one utterance and a gap past the target
        speech = sum(by_uid[p].seconds for p in it.parts)
        assert 0.2 * (len(it.parts) - 1) <= it.seconds - speech <= 0.8 * (len(it.parts) - 1) + 1e-3


@pytest.mark.fast
def test_long_items_stop_when_the_split_runs_out(caplog) -> None:
    from asrforge.evaluation.longform import build_items

    items = build_items(
        _utterances(6, ("en",)), _fake_wave, count=3, min_seconds=8, max_seconds=9, seed=0
    )
    assert len(items) == 2 and sum(len(it.parts) for it in items) == 6
    assert "short of 8 s" in caplog.text and "audio for 2 recordings, not 3" in caplog.text


@pytest.mark.fast
def test_eval_config_checks_the_long_form_range() -> None:
    from asrforge.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="longform_min_seconds: must be <= longform_max_seconds"):
        load_config(
            data={
                "output_dir": "x",
                "data": {"path": "d"},
                "eval": {"longform_min_seconds": 9, "longform_max_seconds": 3},
            }
        )


@pytest.fixture(scope="module")
def longform_run(tmp_path_factory, tones_dir) -> Path:
    from accelerate.state import AcceleratorState
    from conftest import tiny_config

    from asrforge.callbacks import build_callbacks
    from asrforge.train.loop import Trainer

    AcceleratorState._reset_state()
    cfg = tiny_config(
        tmp_path_factory.mktemp("longform") / "run",
        tones_dir,
        train={"max_steps": 4, "log_every": 2, "ema_decay": 0.5, "precision": "no"},
        eval={
            "eval_steps": 2,
            "max_new_tokens": 6,
            "longform_items": 2,
            "longform_min_seconds": 4.0,
            "longform_max_seconds": 6.0,
        },
    )
    try:
        Trainer(cfg, build_callbacks(cfg)).fit()
    finally:
        AcceleratorState._reset_state()
    return cfg.output_dir


def test_the_loop_reports_long_form_metrics_decoded_as_transcribe_decodes(
    longform_run, tones_dir
) -> None:
    from asrforge.bundle.export import bundle_from_checkpoint
    from asrforge.evaluation.longform import evaluate_split_longform

    evals = [json.loads(x) for x in (longform_run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("event") == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert e["longform_n"] == 2 and 0 <= e["longform_wer"] and e["longform_cer"] >= 0
        assert e["longform_chunking"] == "silence"  # a from-scratch BPE: no timestamps
        summary = json.loads(
            (longform_run / "eval" / f"step-{e['step']:06d}.jsonl").read_text().splitlines()[-1]
        )
        assert summary["longform_wer"] == e["longform_wer"]
    lines = (longform_run / "eval" / "longform-step-000004.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines[:-1]]
    assert len(records) == 2 and all(4.0 <= r["seconds"] <= 6.0 + 3 for r in records)

    # the same recordings, through a bundle of the last checkpoint's (EMA) weights, as
    # `asrforge evaluate --longform-items` and `transcribe` decode them: the same text
    bundle = bundle_from_checkpoint(longform_run / "checkpoints" / "step-000004")
    metrics, again = evaluate_split_longform(
        bundle,
        tones_dir,
        "validation",
        count=2,
        min_seconds=4.0,
        max_seconds=6.0,
        seed=0,
        batch_size=8,
        max_new_tokens=6,
    )
    # in memory a recording keeps its short names; on disk, an utterance record's
    heard = [(r["parts"], r["hypothesis"]) for r in records]
    assert [(r["parts"], r["hyp"]) for r in again] == heard
    assert metrics["longform_wer"] == pytest.approx(evals[-1]["longform_wer"])


def test_evaluate_cli_reports_long_form(longform_run, tones_dir, capsys) -> None:
    ckpt = longform_run / "checkpoints" / "step-000004"
    argv = [
        "evaluate",
        str(ckpt),
        "--data",
        str(tones_dir),
        "--longform-items",
        "2",
        "--longform-min-seconds",
        "4",
        "--longform-max-seconds",
        "6",
        "--max-new-tokens",
        "6",
    ]
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["longform_n"] == 2 and "longform_wer" in record and "wer" in record
    assert main(argv) == 0
    assert "long-form: WER" in capsys.readouterr().out
    assert main([*argv[:-4], "--longform-min-seconds", "9", "--longform-max-seconds", "3"]) == 2


def test_the_matrix_report_shows_the_best_checkpoints_long_form_wer(longform_run, tmp_path):
    from asrforge.matrix.report import collect, write_report

    [row] = collect(longform_run.parent)
    evals = {e["step"]: e for e in row.evals}
    assert row.best["longform_wer"] == evals[row.best_step]["longform_wer"]
    write_report(longform_run.parent, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "long-form WER" in page and f"{row.best['longform_wer']:.4f}" in page


def test_a_damaged_bundle_is_not_taken_for_a_plain_directory(
    hf_tiny_en,  # noqa: F811
    tmp_path,
    capsys,
) -> None:
    """Only a directory with neither manifest.json nor inference_config.json is loaded
    unverified: a bundle that lost one of them is refused as before."""
    from asrforge.bundle.export import bundle_from_pretrained

    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(SR, np.float32), SR)
    import shutil

    bundle = bundle_from_pretrained(hf_tiny_en, tmp_path / "bundle")
    shutil.copytree(bundle, tmp_path / "bundle2")
    (bundle / "inference_config.json").unlink()
    assert main(["transcribe", str(bundle), str(wav)]) == 2
    assert "inference_config.json: missing (listed in manifest.json)" in capsys.readouterr().err
    bundle = tmp_path / "bundle2"
    (bundle / "manifest.json").unlink()
    assert main(["transcribe", str(bundle), str(wav)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json" in err and "without verification" not in err
