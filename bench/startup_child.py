"""The child processes of ``bench_startup.py``: one launch of each side, up to its first step.

``python startup_child.py asrforge RESULT.json train CONFIG.yaml`` runs ``asrforge train`` in
this process; ``python startup_child.py hf RESULT.json DATA MODEL CACHE OUT LAYOUT BATCH STEPS`` runs
transformers' usual recipe. At the end of the first optimizer step each writes RESULT.json:
``first_step_time`` (``time.time()``), ``since_start`` (seconds since this process started, by
its own record), ``cpu_seconds`` (this process's CPU time, all threads), ``phases`` (seconds),
``VmHWM`` (peak RSS so far), ``RssAnon`` and ``RssFile`` (bytes, at that moment).

Only the standard library is imported before a side starts: its imports are part of what is
measured.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time


def since_process_start() -> float:
    """Seconds since this process started (``/proc/self/stat``, 10 ms ticks)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time since boot
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


def memory() -> dict[str, int]:
    """This process's ``VmHWM`` (peak RSS), ``RssAnon`` and ``RssFile`` now, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def write_result(path: str, phases: dict[str, float], **extra) -> None:
    """The first step's record (see the module docstring), written atomically."""
    record = {"first_step_time": time.time(), "since_start": since_process_start(),
              "cpu_seconds": time.process_time(), "phases": phases, **memory(), **extra}  # fmt: skip
    with open(f"{path}.tmp", "w") as f:
        json.dump(record, f)
    os.replace(f"{path}.tmp", path)


def parse_breakdown(text: str) -> dict[str, float]:
    """asrforge's "imports 3.10, data set 0.31, first step 0.05" -> {name: seconds}."""
    phases = {}
    for part in text.split(", "):
        name, _, seconds = part.rpartition(" ")
        phases[name] = float(seconds)
    return phases


class FirstStepRecord(logging.Handler):
    """Writes the result at asrforge's "time to first step" log record (logged once, right
    after the first optimizer step)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("time to first step"):
            total, breakdown = record.args
            write_result(self.path, parse_breakdown(breakdown), logged_total=total)


def run_asrforge(result_path: str, argv: list[str]) -> int:
    """``asrforge ARGV`` (the CLI, in this process)."""
    logging.getLogger("asrforge").addHandler(FirstStepRecord(result_path))
    from asrforge.cli import main

    return main(argv)


def run_hf(result_path: str, data_dir: str, model_dir: str, cache_dir: str, out_dir: str,
           layout: str, batch_size: int, steps: int) -> int:  # fmt: skip
    """transformers' usual Whisper fine-tuning recipe on ``data_dir``'s manifests.

    ``datasets.load_dataset("json")`` of the train and dev manifests (``layout`` ``dir``), or of
    the train manifest with 16 rows held out by ``train_test_split`` (``carve``); a lazy
    ``with_transform`` computing log-mels and labels of the rows a batch takes;
    ``Seq2SeqTrainer`` with the recipe's padding collator. The audio is read with soundfile in
    the transform: datasets >= 4 decodes ``Audio`` with torchcodec, which is not installed here
    (asrforge reads it with soundfile too).
    """
    phases: dict[str, float] = {}
    import datasets
    import soundfile as sf
    from transformers import (
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
    )

    phases["imports"] = since_process_start()
    t = time.perf_counter()
    datasets.disable_progress_bars()
    train_file = f"{data_dir}/train_manifest.json"
    if layout == "carve":
        ds = datasets.load_dataset(
            "json", data_files=train_file, split="train", cache_dir=cache_dir
        )
        ds = ds.train_test_split(test_size=16, seed=0)
        ds["validation"] = ds.pop("test")
    else:
        files = {"train": train_file, "validation": f"{data_dir}/dev_manifest.json"}
        ds = datasets.load_dataset("json", data_files=files, cache_dir=cache_dir)
    phases["load_dataset"] = time.perf_counter() - t
    t = time.perf_counter()
    features = WhisperFeatureExtractor.from_pretrained(model_dir)
    tokenizer = WhisperTokenizer.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir)
    phases["model"] = time.perf_counter() - t

    def prepare(batch: dict) -> dict:
        arrays = [sf.read(p, dtype="float32")[0] for p in batch["audio_filepath"]]
        mels = features(arrays, sampling_rate=16000, return_tensors="np").input_features
        return {"input_features": list(mels), "labels": tokenizer(batch["text"]).input_ids}

    def collate(items: list[dict]) -> dict:  # the recipe's DataCollatorSpeechSeq2SeqWithPadding
        batch = features.pad([{"input_features": i["input_features"]} for i in items],
                             return_tensors="pt")  # fmt: skip
        labels = tokenizer.pad([{"input_ids": i["labels"]} for i in items], return_tensors="pt")
        ids = labels["input_ids"].masked_fill(labels.attention_mask.ne(1), -100)
        if (ids[:, 0] == model.config.decoder_start_token_id).all():
            ids = ids[:, 1:]  # the model prepends it again
        batch["labels"] = ids
        return batch

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                phases["first step"] = time.perf_counter() - started
                write_result(result_path, phases)

    t = time.perf_counter()
    args = Seq2SeqTrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=batch_size,
        max_steps=steps,
        learning_rate=1e-4,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,  # with_transform needs the raw columns
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        data_collator=collate,
        train_dataset=ds["train"].with_transform(prepare),
        eval_dataset=ds["validation"].with_transform(prepare),
        callbacks=[FirstStep()],
    )
    phases["trainer"] = time.perf_counter() - t
    started = time.perf_counter()
    trainer.train()
    return 0


if __name__ == "__main__":
    side, result, *rest = sys.argv[1:]
    if side == "asrforge":
        sys.exit(run_asrforge(result, rest))
    *paths, layout, batch, steps = rest
    sys.exit(run_hf(result, *paths, layout, int(batch), int(steps)))
