"""Beam search: asrforge's ``beam_search`` against transformers' ``generate(num_beams=5)``, and
greedy against beam 5 in WER, on Whisper tiny.en and espeak-ng English clips.

Every side gets the same encoder output (computed once per batch, outside the timing), the same
prompt and the same suppressed tokens (tiny.en's generation config), batches of ``--batch-size``
clips, ``max_new_tokens`` 96:

* ``greedy``: ``greedy_decode`` (what evaluation and ``transcribe`` run by default);
* ``beam5``: ``beam_search(beam_size=5)``, openai-whisper's conventions (patience 1, ranking by
  the summed log-probability per token);
* ``generate-beam5``: ``GenerationMixin.generate(num_beams=5)`` with transformers' defaults
  (``length_penalty=1.0``, ``early_stopping=False``);
* ``beam5-lp0`` / ``generate-beam5-lp0``: both with the convention they share (rank by the plain
  sum, stop at 5 finished): the row ``same`` counts the clips whose hypotheses are equal (tiny.en
  suppresses tokens at every step, which transformers does not renormalize and openai-whisper
  does; a clip where that flips a choice is counted as different).

The clips are the sentences of ``workload.py`` in each of its voices (``--clips N``). WER is on
``asrforge.text.normalize``-d text.

``--baseline DIR`` also times the greedy and beam-5 decoders of another asrforge checkout
(``DIR/asrforge/model/{decoding,beam}.py``, e.g. ``git archive`` of the commit before a change)
in this process, each pair alternating which runs first, and counts the clips whose hypotheses
equal this checkout's.

Run::

    .venv/bin/python bench/bench_beam.py --threads 1            # 24 clips
    .venv/bin/python bench/bench_beam.py --quick                 # 4 clips
    .venv/bin/python bench/bench_beam.py --threads 1 --baseline /tmp/before

Prints one row per method, then ``RESULT beam wer greedy=X beam5=Y s/utt beam5=A generate=B``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import (  # noqa: E402 - the bench directory is not a package
    SENTENCES,
    VOICES,
    add_session_args,
    bench_session,
    load_average,
    synthesize,
    tiny_en_dir,
)

from asrforge.text import normalize, wer  # noqa: E402

MAX_NEW_TOKENS = 96


def clips(n: int) -> tuple[list[np.ndarray], list[str]]:
    """``n`` espeak-ng clips (16 kHz float32) and their texts."""
    waves, texts = [], []
    for k in range(n):
        text = SENTENCES[k % len(SENTENCES)]
        voice, wpm = VOICES[(k // len(SENTENCES) + k) % len(VOICES)]
        waves.append(synthesize(text, voice, wpm).astype(np.float32))
        texts.append(text)
    return waves, texts


def encode(bundle, waves: list[np.ndarray], batch_size: int) -> list[torch.Tensor]:
    """The encoder output of each batch: (batch, 1500, d_model)."""
    out = []
    with torch.no_grad():
        for k in range(0, len(waves), batch_size):
            feats = bundle.features(
                waves[k : k + batch_size], sampling_rate=16_000, return_tensors="pt"
            ).input_features
            out.append(bundle.model.model.encoder(feats).last_hidden_state)
    return out


def run(
    decode, encoded: list[torch.Tensor], prompt: list[int]
) -> tuple[list[list[int]], float, float]:
    """``decode(enc, prompts) -> ids per clip`` over every batch: ids, wall s, CPU s."""
    ids: list[list[int]] = []
    t, c = time.perf_counter(), time.process_time()
    for enc in encoded:
        ids += decode(enc, torch.tensor([prompt] * enc.shape[0]))
    return ids, time.perf_counter() - t, time.process_time() - c


def generate_decoder(model, eot: int, **kwargs):
    from transformers import GenerationConfig, GenerationMixin
    from transformers.modeling_outputs import BaseModelOutput

    from asrforge.model.decoding import suppressed_ids

    always, at_begin = suppressed_ids(model)
    config = GenerationConfig(
        num_beams=5,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=model.config.decoder_start_token_id,
        suppress_tokens=always,
        begin_suppress_tokens=at_begin,
        **kwargs,
    )

    def decode(enc, prompts):
        with torch.no_grad():
            out = GenerationMixin.generate(
                model,
                encoder_outputs=BaseModelOutput(last_hidden_state=enc),
                decoder_input_ids=prompts,
                generation_config=config,
            )
        seqs = []
        for row in out[:, prompts.shape[1] :].tolist():
            seqs.append(row[: row.index(eot)] if eot in row else row)
        return seqs

    return decode


def baseline_decoders(root: Path):
    """``(greedy_decode, beam_decode, DecodeOptions)`` of the asrforge checkout at ``root``,
    loaded under other module names; its ``beam.py`` imports that checkout's ``decoding.py``."""

    def load(name: str, module: str):
        spec = importlib.util.spec_from_file_location(name, root / "asrforge" / "model" / module)
        loaded = importlib.util.module_from_spec(spec)
        # dataclasses look their module up by name while the class is being built
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
        return loaded

    decoding = load("baseline_decoding", "decoding.py")
    ours = importlib.import_module("asrforge.model.decoding")
    sys.modules["asrforge.model.decoding"] = decoding
    try:
        beam = load("baseline_beam", "beam.py")
    finally:
        sys.modules["asrforge.model.decoding"] = ours
    return decoding.greedy_decode, beam.beam_decode, decoding.DecodeOptions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=24, help="espeak-ng clips")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="4 clips")
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another asrforge checkout whose greedy and beam decoders to time alongside",
    )
    add_session_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print the table and the RESULT line; return the figures."""
    args = parse_args(argv)
    n = 4 if args.quick else args.clips
    with bench_session("bench-beam-", args) as (_tmp, work):
        from asrforge.bundle.export import bundle_from_checkpoint
        from asrforge.model.beam import beam_decode
        from asrforge.model.decoding import DecodeOptions, greedy_decode

        bundle = bundle_from_checkpoint(tiny_en_dir(work))
        model, eot = bundle.model.eval(), bundle.specials.eot
        prompt = bundle.specials.prompt("en", "transcribe")
        waves, refs = clips(n)
        encoded = encode(bundle, waves, args.batch_size)

        def ours(**kw):
            return lambda enc, p: beam_decode(
                model, enc, p, eot, MAX_NEW_TOKENS, DecodeOptions(**kw)
            )[0]

        methods = {
            "greedy": lambda enc, p: greedy_decode(model, enc, p, eot, MAX_NEW_TOKENS)[0],
            "beam5": ours(beam_size=5),
            "generate-beam5": generate_decoder(model, eot),
            "beam5-lp0": ours(beam_size=5, length_penalty=0.0),
            "generate-beam5-lp0": generate_decoder(
                model, eot, length_penalty=0.0, early_stopping=True
            ),
        }
        pairs = []
        if args.baseline is not None:
            greedy_then, beam_then, options_then = baseline_decoders(args.baseline)
            beam5_then = options_then(beam_size=5)
            for name, then in (
                ("greedy", lambda enc, p: greedy_then(model, enc, p, eot, MAX_NEW_TOKENS)[0]),
                (
                    "beam5",
                    lambda enc, p: beam_then(model, enc, p, eot, MAX_NEW_TOKENS, beam5_then)[0],
                ),
            ):
                pairs.append((name, f"{name}@baseline"))
                methods[f"{name}@baseline"] = then
        refs_n = [normalize(r, "en") for r in refs]
        print(f"{n} clips, batch {args.batch_size}; load {load_average()}")
        print(f"{'method':<20} {'WER %':>6} {'wall s/utt':>10} {'CPU s/utt':>10}")
        out: dict = {"clips": n}
        hyps: dict[str, list[list[int]]] = {}
        paired = {name for pair in pairs for name in pair}
        order = [m for m in methods if m not in paired]
        # A pair runs twice, alternating which goes first; the table keeps each one's faster run.
        for a, b in pairs:
            order += [a, b, b, a]
        timings: dict[str, list[tuple[float, float]]] = {}
        for name in order:
            ids, wall, cpu = run(methods[name], encoded, prompt)
            hyps[name] = ids
            timings.setdefault(name, []).append((wall, cpu))
        for name in methods:
            ids = hyps[name]
            wall, cpu = min(timings[name], key=lambda x: x[1])
            texts = [
                normalize(bundle.tokenizer.decode(x, skip_special_tokens=True), "en") for x in ids
            ]
            error = wer(refs_n, texts)
            out[name] = {"wer": error, "seconds_per_utt": wall / n, "cpu_per_utt": cpu / n}
            print(f"{name:<20} {100 * error:6.2f} {wall / n:10.3f} {cpu / n:10.3f}")
        same = sum(
            a == b for a, b in zip(hyps["beam5-lp0"], hyps["generate-beam5-lp0"], strict=True)
        )
        out["same_hypotheses_lp0"] = same
        print(f"same hypotheses, beam5-lp0 vs generate-beam5-lp0: {same} of {n}")
        for a, b in pairs:
            equal = sum(x == y for x, y in zip(hyps[a], hyps[b], strict=True))
            speedup = out[b]["cpu_per_utt"] / out[a]["cpu_per_utt"]
            out[f"{a}_same_as_baseline"] = equal
            print(f"{a} vs {b}: {equal} of {n} hypotheses equal, CPU {speedup:.2f}x")
    g, b, h = out["greedy"], out["beam5"], out["generate-beam5"]
    print(
        f"RESULT beam wer greedy={g['wer']:.4f} beam5={b['wer']:.4f} "
        f"generate={h['wer']:.4f} s/utt greedy={g['seconds_per_utt']:.3f} "
        f"beam5={b['seconds_per_utt']:.3f} generate={h['seconds_per_utt']:.3f} "
        f"same_lp0={same}/{n}"
    )
    return out


if __name__ == "__main__":
    main()
