"""n-gram LM shallow fusion: greedy, beam 5 and beam 5 + LM, WER and CPU time per utterance,
per language, on two corpora the repo builds.

* ``english``: a Whisper bundle (``--bundle``; default: tiny.en as shipped, imported) on an
  espeak-ng English corpus (``--corpus``; default: ``asrforge corpus --languages en`` built here,
  fortunes sentences when Debian's ``fortunes`` is installed). The LM (trigram) is built from
  the corpus's ``train`` transcripts, its weights tuned on ``validation`` (as ``asrforge lm
  tune`` does; ``+lm*``: the best weights with an LM when the tuned ones are none), and all
  decoders are scored on ``test`` (sentences and speakers the other
  splits lack).
* ``tones``: a tiny from-scratch model trained ``--tones-steps`` steps on the tones data set
  (English and Spanish words as chords); the LM is built from its train split (``by-language``).
  Its sentences are words drawn uniformly at random: an LM can learn little beyond the
  vocabulary there, and this row says what fusion costs and does when it cannot help.

The encoder output is computed once per batch outside the timing; the time is the CPU time of
decoding (``time.process_time``, one torch thread unless ``--threads``), per utterance. WER is
corpus WER on ``asrforge.text.normalize``-d text.

Run::

    .venv/bin/python bench/bench_lm.py --threads 1 --bundle runs/demo-*/bundle \\
        --corpus data/generated/espeak-en-fortunes
    .venv/bin/python bench/bench_lm.py --quick           # tones only, few steps

Prints one row per corpus, language and decoder, then ``RESULT lm ...``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_session_args, bench_session, load_average, tiny_en_dir  # noqa: E402

from asrforge.text import normalize, wer  # noqa: E402

BEAM = 5
ALPHAS = (0.25, 0.5, 1.0)
BETAS = (0.0, 1.0, 2.0)


def encode(bundle, data: Path, split: str, batch_size: int, max_samples: int | None) -> list:
    """``[(encoder output, prompts, [(language, reference)])]`` per evaluation batch."""
    from asrforge.evaluation.evaluate import prompt_length, split_loader

    loader, _n, _report = split_loader(
        bundle, data, split, batch_size=batch_size, max_samples=max_samples
    )
    out = []
    with torch.no_grad():
        for batch in loader:
            if not batch.get("size"):
                continue
            enc = bundle.model.model.encoder(batch["input_features"]).last_hidden_state
            prompts = batch["decoder_input_ids"][:, : prompt_length(batch["labels"])]
            out.append((enc, prompts, list(zip(batch["language"], batch["text"], strict=True))))
    return out


def decode(bundle, batches, method: str, fusion=None, max_new_tokens: int = 96) -> tuple:
    """``(hypotheses, CPU seconds)`` of ``method`` (``greedy`` or ``beam``) over the batches."""
    from asrforge.model.beam import beam_decode
    from asrforge.model.decoding import DecodeOptions, greedy_decode

    eot, hyps = bundle.specials.eot, []
    t0 = time.process_time()
    with torch.no_grad():
        for enc, prompts, _refs in batches:
            if method == "greedy":
                seqs, _ = greedy_decode(bundle.model, enc, prompts, eot, max_new_tokens)
            else:
                options = DecodeOptions(beam_size=BEAM, fusion=fusion)
                seqs, _ = beam_decode(bundle.model, enc, prompts, eot, max_new_tokens, options)
            hyps += [bundle.tokenizer.decode(s, skip_special_tokens=True).strip() for s in seqs]
    return hyps, time.process_time() - t0


def attach_lm(bundle, arpa: Path) -> None:
    """Give a loaded bundle the LM at ``arpa`` in memory (as ``export --lm`` would on disk)."""
    from asrforge.bundle.schema import LMInfo
    from asrforge.lm.ngram import read_arpa

    lm = read_arpa(arpa)
    info = LMInfo(order=lm.order, vocab_size=lm.vocab_size, normalizer=lm.normalizer,
                  languages=lm.meta["languages"])  # fmt: skip
    bundle.lm = lm
    bundle.config = bundle.config.model_copy(update={"lm": info})


def tune(bundle, batches, alphas, betas) -> list[tuple[float, float]]:
    """The ``(alpha, beta)`` with the lowest WER on ``batches`` (``(0, 0)``, no LM, included),
    and, when that is ``(0, 0)``, also the best with ``alpha > 0`` (what the LM does at best)."""
    from asrforge.bundle.options import fusion

    refs = [r for _, _, rs in batches for r in rs]
    scores = {}
    for alpha in sorted({0.0, *alphas}):
        for beta in betas if alpha else (0.0,):
            hyps, _ = decode(bundle, batches, "beam", fusion(bundle, alpha, beta))
            scores[(alpha, beta)] = corpus_wer(refs, hyps)
            print(f"  tune alpha {alpha:g} beta {beta:g}: WER {100 * scores[(alpha, beta)]:.2f}",
                  flush=True)  # fmt: skip
    best = min(scores, key=lambda p: (scores[p], p))
    with_lm = [p for p in scores if p[0] > 0]
    if best[0] == 0 and with_lm:
        return [best, min(with_lm, key=lambda p: (scores[p], p))]
    return [best]


def corpus_wer(refs, hyps) -> float:
    r = [normalize(text, lang) for lang, text in refs]
    h = [normalize(text, lang) for (lang, _), text in zip(refs, hyps, strict=True)]
    return float(wer(r, h))


def measure(bundle, batches, corpus: str, points: list[tuple[float, float]]) -> list[dict]:
    """One row per language and decoder: greedy, beam, beam + LM at the tuned weights and (when
    those are no LM) ``+lm*`` at the best weights with an LM."""
    from asrforge.bundle.options import fusion

    refs = [r for _, _, rs in batches for r in rs]
    runs = {
        "greedy": decode(bundle, batches, "greedy"),
        f"beam{BEAM}": decode(bundle, batches, "beam"),
    }
    weights = {}
    for name, (alpha, beta) in zip([f"beam{BEAM}+lm", f"beam{BEAM}+lm*"], points, strict=False):
        runs[name] = decode(bundle, batches, "beam", fusion(bundle, alpha, beta))
        weights[name] = (alpha, beta)
    rows = []
    for lang in sorted({lang for lang, _ in refs}):
        idx = [i for i, (lg, _) in enumerate(refs) if lg == lang]
        for name, (hyps, seconds) in runs.items():
            rows.append({
                "corpus": corpus, "language": lang, "decoder": name, "n": len(idx),
                "wer": corpus_wer([refs[i] for i in idx], [hyps[i] for i in idx]),
                "cpu_s_per_utt": seconds / len(refs),
                "alpha_beta": weights.get(name),
            })  # fmt: skip
    return rows


def english(args, work: Path) -> list[dict]:
    from asrforge.bundle.export import bundle_from_checkpoint
    from asrforge.bundle.load import load_bundle
    from asrforge.lm.build import build_lm_file
    from asrforge.recipes.corpus import CorpusSpec, build_corpus

    corpus = args.corpus
    if corpus is None:
        corpus = work / "espeak-en"
        if not corpus.exists():
            sizes = {"train": 1000, "validation": 30, "test": 40}
            build_corpus(CorpusSpec(languages=["en"], sizes=sizes), corpus)
    if args.bundle is not None:
        bundle = load_bundle(args.bundle)
    else:
        bundle = bundle_from_checkpoint(tiny_en_dir(work))
    arpa = work / "english.arpa"
    lm = build_lm_file(arpa, 3, data=corpus, split="train")
    print(f"english LM: {lm.meta['sentences']} sentences, {lm.vocab_size} unigrams", flush=True)
    attach_lm(bundle, arpa)
    dev = encode(bundle, corpus, "validation", args.batch_size, args.max_samples)
    points = tune(bundle, dev, args.alphas, args.betas)
    test = encode(bundle, corpus, "test", args.batch_size, args.max_samples)
    return measure(bundle, test, "espeak-en", points)


def tones(args, work: Path) -> list[dict]:
    from accelerate.state import AcceleratorState

    from asrforge.bundle.export import bundle_from_checkpoint
    from asrforge.config import load_config
    from asrforge.data.synth import make_tones_dataset
    from asrforge.lm.build import build_lm_file
    from asrforge.train.loop import Trainer

    data = work / "tones"
    if not data.exists():
        make_tones_dataset(data, sizes={"train": 400, "validation": 40, "test": 60})
    run = work / f"tones-run-{args.tones_steps}"
    if not (run / "checkpoints").is_dir():
        cfg = load_config(data={
            "output_dir": str(run), "seed": 0,
            "model": {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2,
                      "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                      "encoder_ffn_dim": 256, "decoder_ffn_dim": 256, "max_source_positions": 100,
                      "max_target_positions": 32, "bpe_vocab_size": 300},
            "data": {"path": str(data), "batch_size": 16, "num_workers": 0},
            "optim": {"lr": 3e-3, "warmup_steps": 10},
            "train": {"max_steps": args.tones_steps, "log_every": 50, "precision": "no"},
            "eval": {"eval_steps": None, "at_end": True, "max_new_tokens": 24},
            "checkpoint": {"save_total_limit": 1},
        })  # fmt: skip
        AcceleratorState._reset_state()
        Trainer(cfg, []).fit()
    bundle = bundle_from_checkpoint(run)
    arpa = work / "tones.arpa"
    build_lm_file(arpa, 3, data=data, split="train")
    attach_lm(bundle, arpa)
    dev = encode(bundle, data, "validation", args.batch_size, args.max_samples)
    points = tune(bundle, dev, args.alphas, args.betas)
    test = encode(bundle, data, "test", args.batch_size, args.max_samples)
    return measure(bundle, test, "tones", points)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tones only, --tones-steps 20")
    p.add_argument("--bundle", type=Path, default=None, help="english: the model (a bundle)")
    p.add_argument("--corpus", type=Path, default=None, help="english: an espeak-ng corpus")
    p.add_argument("--tones-steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=None, help="utterances per split")
    p.add_argument("--skip", choices=["english", "tones"], default=None)
    p.add_argument("--alphas", type=_floats, default=ALPHAS, help="LM weights to tune over")
    p.add_argument("--betas", type=_floats, default=BETAS, help="word bonuses to tune over")
    add_session_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.skip, args.tones_steps = "english", min(args.tones_steps, 20)
    rows: list[dict] = []
    with bench_session("asrforge-bench-lm-", args) as (_tmp, work):
        print(f"load {load_average()}", flush=True)
        if args.skip != "english":
            rows += english(args, work)
        if args.skip != "tones":
            rows += tones(args, work)
    print(
        f"{'corpus':<10} {'lang':<5} {'decoder':<10} {'n':>4} {'WER %':>7} {'CPU-s/utt':>9}  alpha,beta"
    )
    for r in rows:
        ab = "" if r["alpha_beta"] is None else "{:g},{:g}".format(*r["alpha_beta"])
        print(f"{r['corpus']:<10} {r['language']:<5} {r['decoder']:<10} {r['n']:>4} "
              f"{100 * r['wer']:7.2f} {r['cpu_s_per_utt']:9.3f}  {ab}")  # fmt: skip
    summary = " ".join(
        f"{r['corpus']}/{r['language']}/{r['decoder']}={100 * r['wer']:.2f}" for r in rows
    )
    print(f"RESULT lm wer {summary}")
    return rows


if __name__ == "__main__":
    main()
