"""`specdecode distill --target MODEL --out DIR`: train a drafter for any target.

Steps (each resumable): 1 corpus of the target's own answers (DIR/corpus, reused), 2 target
features (DIR/features.pt, reused), 3 training with periodic held-out evaluation and
checkpoints (DIR/checkpoint.pt; --resume), 4 the drafter directory (DIR/drafter) and a real
speculative run on held-out Spec-Bench prompts with the engine (DIR/eval.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    from ..cli_common import number, positive_int
    p = sub.add_parser("distill",
                       help="train a drafter (EAGLE-style head, Medusa heads or small draft LM) for a target",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--target", default=None, help="target model: .gguf, HF directory or Hugging Face id "
                   "(docs/models.md; default: embedded SmolLM2)")
    p.add_argument("--out", required=True, help="output directory (corpus, features, checkpoints, drafter)")
    p.add_argument("--kind", default="eagle", choices=["eagle", "draft-lm", "medusa"],
                   help="eagle: one-layer head on the target's features (default); draft-lm: small standalone "
                        "Llama model initialised from the target's layers, saved as an HF checkpoint; medusa: "
                        "--heads residual heads on the target's features, head i predicting i+2 tokens ahead")
    p.add_argument("--corpus", default=None,
                   help="use the corpus already built in this directory as it is (default: build or finish "
                        "building OUT/corpus)")
    p.add_argument("--max-prompts", type=positive_int("--max-prompts", 1), default=None,
                   help="use only the first N training prompts (default: all ~1700)")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens", 8, 2048), default=256,
                   help="length of the target's answers in the corpus (default 256)")
    p.add_argument("--minutes", type=number("--minutes"), default=60.0, help="training time budget (default 60)")
    p.add_argument("--epochs", type=number("--epochs"), default=20.0, help="stop after this many epochs (default 20)")
    p.add_argument("--draft-vocab", type=positive_int("--draft-vocab", 16), default=8192,
                   help="eagle, medusa: size of the reduced draft vocabulary (default 8192)")
    p.add_argument("--unroll", type=positive_int("--unroll", 1, 8), default=3,
                   help="eagle: training-time unroll depth (default 3)")
    p.add_argument("--heads", type=positive_int("--heads", 1), default=4,
                   help="medusa: number of heads, i.e. the draft tree's depth (default 4)")
    p.add_argument("--batch-tokens", type=positive_int("--batch-tokens", 256), default=2048,
                   help="tokens per training step (default 2048)")
    p.add_argument("--layers", type=positive_int("--layers", 1, 64), default=4,
                   help="draft-lm: number of decoder layers (default 4)")
    p.add_argument("--lr", type=number("--lr"), default=None, help="learning rate (default 1e-3 eagle, 2e-4 draft-lm)")
    p.add_argument("--eval-every", type=number("--eval-every"), default=5.0, help="minutes between evaluations")
    p.add_argument("--eval-prompts", type=positive_int("--eval-prompts", 0), default=3,
                   help="held-out Spec-Bench prompts per task for the final engine run (default 3; 0 = skip)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="target dtype (default auto: as `generate` loads it, a GGUF file on its own quantized "
                        "weights, so the features are those the drafter sees at run time)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--threads", type=positive_int("--threads", 1, 1024), default=None)
    p.set_defaults(run=cmd_distill)
    return p


def _validate(args) -> None:
    from ..cli_common import CliError
    if args.minutes <= 0:
        raise CliError(f"--minutes must be > 0, got {args.minutes}")
    if args.epochs <= 0:
        raise CliError(f"--epochs must be > 0, got {args.epochs}")
    if args.lr is not None and not 0 < args.lr < 1:
        raise CliError(f"--lr must be in (0, 1), got {args.lr}")
    from ..drafters.medusa import MAX_HEADS
    if args.heads > MAX_HEADS:
        raise CliError(f"--heads must be in [1, {MAX_HEADS}], got {args.heads}")
    if args.eval_every <= 0:
        raise CliError(f"--eval-every must be > 0 minutes, got {args.eval_every}")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    if args.resume and not (out / "checkpoint.pt").is_file():
        raise CliError(f"--resume: no checkpoint at {out / 'checkpoint.pt'}")


def cmd_distill(args: argparse.Namespace) -> int:
    import torch

    from ..cli_common import CliError
    from ..models.loader import load_model
    from .corpus import build_corpus, load_corpus
    from .features import corpus_features
    _validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    target = load_model(args.target, args.dtype, args.device)
    corpus_dir = Path(args.corpus).expanduser() if args.corpus else out / "corpus"
    print(f"[1/4] corpus of {target.name}'s own answers in {corpus_dir}", file=sys.stderr)
    if args.corpus:
        corpus = load_corpus(corpus_dir / "corpus.jsonl")
        if not corpus:
            raise CliError(f"--corpus {corpus_dir} holds no corpus.jsonl (build one with --out first)")
    else:
        corpus = load_corpus(build_corpus(target, corpus_dir, args.max_prompts, args.max_new_tokens))
    print(f"      {len(corpus)} sequences, {sum(len(r['output_ids']) for r in corpus)} answer tokens", file=sys.stderr)
    print(f"[2/4] target features -> {out / 'features.pt'}", file=sys.stderr)
    data = corpus_features(target, corpus, corpus_dir, out / "features.pt")
    print(f"[3/4] training a {args.kind} drafter for {args.minutes:g} min (at most {args.epochs:g} epochs)",
          file=sys.stderr)
    if args.kind in ("eagle", "medusa"):
        drafter_dir = _train_head(args, target, data, out)
    else:
        from .draft_lm import train_draft_lm
        drafter_dir = train_draft_lm(args, target, data, out)
    print(f"[4/4] drafter saved in {drafter_dir}", file=sys.stderr)
    if args.eval_prompts:
        from .evaluate import engine_eval
        result = engine_eval(target, drafter_dir, args.kind, args.eval_prompts)
        (out / "eval.json").write_text(json.dumps(result, indent=1))
        print(f"      held-out Spec-Bench, greedy, k=5: mean accepted length {result['mean_accepted_length']:.2f}, "
              f"acceptance {result['acceptance_rate']:.2f}", file=sys.stderr)
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min", file=sys.stderr)
    return 0


def _train_head(args, target, data, out: Path) -> Path:
    """An EAGLE head or Medusa heads: the same trainer loop (train.py), another module and loss."""
    from ..drafters.format import save_eagle, save_medusa
    from .medusa import MedusaTrainConfig, MedusaTrainer
    from .train import TrainConfig, Trainer
    config_class, trainer_class, save, kind_options = (
        (MedusaTrainConfig, MedusaTrainer, save_medusa, {"heads": args.heads}) if args.kind == "medusa"
        else (TrainConfig, Trainer, save_eagle, {"unroll": args.unroll}))
    config = config_class(draft_vocab_size=args.draft_vocab, minutes=args.minutes, batch_tokens=args.batch_tokens,
                          epochs=args.epochs, eval_every_minutes=args.eval_every,
                          checkpoint_every_minutes=args.eval_every, **kind_options,
                          **({"lr": args.lr} if args.lr else {}))
    trainer = trainer_class(target, data, config, out, device=str(target.model.device))
    print(f"      draft vocabulary {config.draft_vocab_size} tokens covers {trainer.vocab_coverage:.1%} of the "
          f"target's predictions; {len(trainer.train_ids)} train / {len(trainer.held_ids)} held-out sequences",
          file=sys.stderr)
    if args.resume:
        trainer.load_checkpoint(out / "checkpoint.pt")
        print(f"      resumed at step {trainer.state.step} ({trainer.state.seconds / 60:.1f} min)", file=sys.stderr)

    def report(point: dict) -> None:
        mal = point["mean_accepted_length"]
        heads = f", per-head top-1 {point['head_top1']}" if "head_top1" in point else ""
        print(f"\n      eval @ {point['seconds'] / 60:.1f} min, epoch {point['epoch']:.2f}: held-out acceptance by "
              f"depth {point['accept_depth'][:5]}, mean accepted length k=1..8 {mal}{heads}", file=sys.stderr)
    final = trainer.run(on_eval=report)
    drafter_dir = out / "drafter"
    save(trainer.head, drafter_dir, target,
               {"corpus_sequences": data.num_sequences, "train_tokens": trainer.state.tokens,
                "train_seconds": round(trainer.state.seconds, 1), "steps": trainer.state.step,
                "config": {k: v for k, v in vars(config).items()}, "final_eval": final,
                "vocab_coverage": round(trainer.vocab_coverage, 4)})
    _plot_curve(trainer.state.curve, out / "curve.png")
    return drafter_dir


def _plot_curve(curve: list[dict], path: Path) -> None:
    if not curve:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    minutes = [p["seconds"] / 60 for p in curve]
    for k in (1, 3, 5, 8):
        ax.plot(minutes, [p["mean_accepted_length"][k - 1] for p in curve], marker="o", label=f"k={k}")
    ax.set_xlabel("training time (min, CPU)")
    ax.set_ylabel("mean accepted length (held-out)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
