"""Text-only batches: the interleaving is a pure function of (seed, index), the text file is
streamed (only the lines used are read), and training with ``asr_ratio: 0.5`` logs both losses
and resumes bit-identically."""

from __future__ import annotations

import os
import random
import signal
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asrforge.data.dataset import IGNORE
from asrforge.data.synth import WORDS
from asrforge.data.text_only import LINE_LIMIT, TextBatches, interleave, is_text_batch
from asrforge.errors import UserError
from asrforge.model.tokenizer import train_bpe_tokenizer
from asrforge.train.events import Callback
from asrforge.train.loop import Trainer
from tests.conftest import tiny_config

PROMPT = [900, 901, 902, 903]  # ids of a 4-token prompt (any ids work for the batch layout)
EOT = 899


@pytest.fixture(scope="module")
def tok():
    words = [w for ws in WORDS.values() for w in ws]
    rng = random.Random(0)
    return train_bpe_tokenizer([" ".join(rng.choices(words, k=5)) for _ in range(200)], 300)


def english_lines(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS["en"], k=rng.randint(1, 5))) for _ in range(n)]


def text_batches(path: Path, tok, **kw) -> TextBatches:
    args = dict(tokenizer=tok, prompt=PROMPT, eot=EOT, batch_size=4, max_len=32, seed=0)
    return TextBatches(path, **{**args, **kw})


@pytest.mark.fast
def test_interleaving_is_even_and_a_pure_function_of_seed_and_index():
    for seed in range(4):
        half = [is_text_batch(seed, i, 0.5) for i in range(100)]
        assert all(half[i] != half[i + 1] for i in range(99))  # every other micro-batch
        quarter = [is_text_batch(seed, i, 0.75) for i in range(100)]
        assert all(sum(quarter[i : i + 4]) == 1 for i in range(97))
        assert not any(is_text_batch(seed, i, 1.0) for i in range(100))
    tenth = [is_text_batch(7, i, 0.9) for i in range(1000)]
    assert sum(tenth) == 100
    assert [is_text_batch(1, i, 0.5) for i in range(8)] != [
        is_text_batch(0, i, 0.5) for i in range(8)
    ]
    # resuming at any micro-batch index continues the same sequence
    speech = [{"task": "asr"}] * 10

    def tasks(start: int, n_speech_done: int) -> list[str]:
        text = iter([{"task": "lm"}] * 100)
        batches = interleave(speech[n_speech_done:], text, seed=3, asr_ratio=0.6, start=start)
        return [b["task"] for b in batches]

    full = tasks(0, 0)
    assert full.count("lm") in (6, 7) and full[-1] == "asr"
    for m in range(len(full)):
        assert tasks(m, full[:m].count("asr")) == full[m:]


@pytest.mark.fast
def test_batches_hold_prompt_text_and_labels(tmp_path, tok):
    path = tmp_path / "t.txt"
    path.write_text("red cat\n\n  blue dog  \n" + "sun " * 40 + "\n")
    batch = next(text_batches(path, tok).batches())
    assert batch["task"] == "lm" and batch["size"] == 3 + 1 and batch["dropped"] == []
    dec, lab = batch["decoder_input_ids"], batch["labels"]
    assert dec.shape == lab.shape and dec.shape[1] == 32  # the long line is cut at max_len
    texts = set()
    for r in range(batch["size"]):
        assert dec[r, :4].tolist() == PROMPT and (lab[r, :3] == IGNORE).all()
        n = int((lab[r] != IGNORE).sum())
        # labels are the decoder inputs shifted by one: the text tokens, then <|endoftext|>
        assert lab[r, 3 : 3 + n - 1].tolist() == dec[r, 4 : 4 + n - 1].tolist()
        ids = lab[r][lab[r] != IGNORE].tolist()
        assert (ids[-1] == EOT) == (n < 29)  # a cut line has no end
        texts.add(tok.decode([i for i in ids if i != EOT]).strip())
    assert {"red cat", "blue dog"} <= texts and len(texts) == 3  # the empty line is skipped


@pytest.mark.fast
def test_resume_from_a_position_gives_the_same_batches_across_passes(tmp_path, tok, monkeypatch):
    monkeypatch.setattr("asrforge.data.text_only.SHUFFLE_BLOCK", 8)  # several blocks per pass
    path = tmp_path / "t.txt"
    path.write_text("\n".join(english_lines(60)) + "\n")
    tb = text_batches(path, tok, max_lines=30)
    stream = tb.batches()
    first = [next(stream) for _ in range(20)]  # 80 lines: more than two passes of 30
    assert {b["text_position"]["pass"] for b in first} == {0, 1, 2}
    for k in (0, 3, 7, 12):
        resumed = tb.batches(first[k]["text_position"])
        for b in first[k + 1 :]:
            got = next(resumed)
            assert torch.equal(got["decoder_input_ids"], b["decoder_input_ids"])
            assert got["text_position"] == b["text_position"]
    # only the first 30 lines are ever used; each pass uses each once, in a new order
    seen = [tuple(x for x in r if x != IGNORE) for b in first for r in b["labels"].tolist()]
    assert len(set(seen)) <= 30
    assert sorted(seen[:30]) == sorted(seen[30:60]) and seen[:30] != seen[30:60]
    assert tb.bytes_read == len(("\n".join(english_lines(60)[:30]) + "\n").encode())


@pytest.mark.fast
def test_a_multi_gigabyte_file_is_streamed_not_read(tmp_path, tok):
    path = tmp_path / "big.txt"
    lines = english_lines(200)
    head = ("\n".join(lines) + "\n").encode()
    with path.open("wb") as f:  # a sparse 3 GiB file: the needed lines, a hole, a tail
        f.write(head)
        f.seek(3 * 2**30)
        f.write(b"the tail line\n")
    assert path.stat().st_size > 3 * 2**30
    tracemalloc.start()
    t0 = time.perf_counter()
    tb = text_batches(path, tok, max_lines=50, batch_size=8)
    tb.check()
    stream = tb.batches()
    batches = [next(stream) for _ in range(20)]  # 160 lines: three passes over the first 50
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert {b["text_position"]["pass"] for b in batches} == {0, 1, 2, 3}
    assert tb.bytes_read == len(("\n".join(lines[:50]) + "\n").encode())  # nothing past line 50
    assert peak < 2 * 2**20, peak  # ~1 MB of Python objects for a 3 GB file
    assert seconds < 5


@pytest.mark.fast
def test_an_overlong_line_is_skipped_in_bounded_reads(tmp_path, tok):
    path = tmp_path / "long.txt"
    path.write_bytes(b"red cat\n" + b"a" * (3 * LINE_LIMIT + 5) + b"\nblue dog\n")
    tb = text_batches(path, tok, batch_size=2)
    batch = next(tb.batches())
    texts = {
        tok.decode([i for i in r if i >= 0 and i != EOT]).strip() for r in batch["labels"].tolist()
    }
    assert texts == {"red cat", "blue dog"} and tb.skipped_long == 1


@pytest.mark.fast
def test_unusable_text_files_fail_at_start_up(tmp_path, tok):
    with pytest.raises(UserError, match="data.text_path: .* is not a file"):
        text_batches(tmp_path / "missing.txt", tok).check()
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(UserError, match="no non-empty line"):
        text_batches(tmp_path / "blank.txt", tok).check()


# ---------------------------------------------------------------------------------------------
# Training


class Steps(Callback):
    name = "steps"

    def __init__(self, preempt_at: int | None = None):
        self.metrics: dict[int, dict] = {}
        self.preempt_at = preempt_at

    def on_step_end(self, state, *, metrics):
        self.metrics[state.step] = dict(metrics)
        if state.step == self.preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)


def _multitask_config(tmp_path: Path, out: str, tones_dir: Path, **train):
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("\n".join(english_lines(300, seed=1)) + "\n")
    return tiny_config(
        tmp_path / out,
        tones_dir,
        model={"dropout": 0.1},
        data={"asr_ratio": 0.5, "text_path": str(text), "max_text_lines": 20},
        train={"max_steps": 6, "grad_accum": 2, **train},
        eval={"eval_steps": 3},
        checkpoint={"save_total_limit": 5},
    )


def test_training_with_asr_ratio_half_logs_both_losses_and_resumes_exactly(tmp_path, tones_dir):
    full = Steps()
    result = Trainer(_multitask_config(tmp_path, "full", tones_dir), [full]).fit()
    assert result.status == "completed" and sorted(full.metrics) == [1, 2, 3, 4, 5, 6]
    for m in full.metrics.values():  # grad_accum 2, every other micro-batch text-only
        assert m["loss_asr"] > 0 and m["loss_lm"] > 0
        assert m["loss"] == pytest.approx((m["loss_asr"] + m["loss_lm"]) / 2)

    cfg = _multitask_config(tmp_path, "split", tones_dir)
    first = Steps(preempt_at=3)
    assert Trainer(cfg, [first]).fit().status == "interrupted"
    second = Steps()
    Trainer(cfg, [second]).fit(resume=True)
    assert {**first.metrics, **second.metrics}.keys() == full.metrics.keys()
    for step, m in {**first.metrics, **second.metrics}.items():
        for key in ("loss", "loss_asr", "loss_lm"):
            assert m[key] == full.metrics[step][key], (step, key)
    a = load_file(tmp_path / "full" / "checkpoints" / "latest" / "model.safetensors")
    b = load_file(tmp_path / "split" / "checkpoints" / "latest" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    import json

    sa, sb = (
        json.loads((tmp_path / run / "checkpoints" / "latest" / "train_state.json").read_text())
        for run in ("full", "split")
    )
    assert sa["text_position"] == sb["text_position"] and sa["text_position"]["pass"] >= 1
    assert sa["batch_in_epoch"] == sb["batch_in_epoch"]


@pytest.mark.fast
def test_a_missing_text_file_stops_the_run_before_step_one(tmp_path, tones_dir):
    cfg = tiny_config(
        tmp_path / "run",
        tones_dir,
        data={"asr_ratio": 0.5, "text_path": str(tmp_path / "nope.txt")},
    )
    steps = Steps()
    with pytest.raises(UserError, match="data.text_path"):
        Trainer(cfg, [steps]).fit()
    assert steps.metrics == {}
