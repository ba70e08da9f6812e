"""Does MTP training work? Train the ``qwen3_5_mtp_debug`` recipe (embedded toy text corpus, MTP loss weight
0.1), then measure the MTP head's top-1 accuracy (token ``t + 2`` at position ``t``) on held-out toy text
(documents of another generator seed, the same tokenizer), against

- the untrained model (the recipe's seeded initialisation), and
- the trained trunk with an untrained MTP block (the seeded initial MTP weights),

and the trunk's own next-token top-1 for scale. A measurement, not a test (it trains for minutes on CPU):

    python -m benchmarks.mtp_top1 --steps 60
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from hyper_parallel.config import ConfigManager
from hyper_parallel.data.packing import add_mtp_targets, shift_labels
from hyper_parallel.data.text.toy_text import ToyTextSpec, cached_toy_text, make_toy_documents


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def top1(model, docs: list[list[int]]) -> tuple[float, float]:
    """(MTP top-1 over positions with a target two ahead, next-token top-1), token-weighted over ``docs``."""
    hit = n = hit_main = n_main = 0
    for ids in docs:
        x = torch.tensor(ids).view(1, -1)
        labels = torch.from_numpy(shift_labels(x[0].numpy())).view(1, -1)
        b = add_mtp_targets({"input_ids": x, "labels": labels})
        out = model(x, mtp_input_ids=b["mtp_input_ids"])
        valid = b["mtp_labels"] != -100
        hit += int(((out.mtp_logits.argmax(-1) == b["mtp_labels"]) & valid).sum())
        n += int(valid.sum())
        valid = labels != -100
        hit_main += int(((out.logits.argmax(-1) == labels) & valid).sum())
        n_main += int(valid.sum())
    return hit / n, hit_main / n_main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--held_out_docs", type=int, default=128)
    p.add_argument("--global_batch_tokens", type=int, default=1024, help="tokens per step (the recipe's 1024)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as dump:
        cfg = ConfigManager().parse_args([
            "--module", "qwen3_5", "--config", "qwen3_5_mtp_debug", "--training.steps", str(args.steps),
            "--dump_folder", dump, "--checkpoint.enable", "False", "--metrics.log_freq", "10",
            "--data.global_batch_tokens", str(args.global_batch_tokens),
        ])  # fmt: skip
        trainer = cfg.build()
        try:
            trainer.train()
            trained_sd = {k: _full(v).detach().clone() for k, v in trainer.model.state_dict().items()}
            log = (Path(dump) / "metrics.jsonl").read_text().splitlines()
        finally:
            trainer.close()
    torch.manual_seed(cfg.debug.seed)  # the trainer's initialisation
    untrained = cfg.model.build()
    untrained.init_weights()
    untrained.eval()
    trained = cfg.model.build()
    trained.load_state_dict(trained_sd)
    trained.eval()
    fresh_head = cfg.model.build()
    initial_mtp = {k: v for k, v in untrained.state_dict().items() if k.startswith("mtp.")}
    fresh_head.load_state_dict({**trained_sd, **initial_mtp})
    fresh_head.eval()

    toy = cached_toy_text()
    tok = Tokenizer.from_file(str(Path(toy.tokenizer_dir) / "tokenizer.json"))
    held_out = make_toy_documents(ToyTextSpec(seed=1, num_documents=args.held_out_docs))
    docs = [tok.encode(d["text"]).ids for d in held_out]
    print(f"trained {args.steps} steps; last log line: {log[-1]}")
    print(f"held-out: {len(docs)} documents (toy generator seed 1), {sum(len(d) for d in docs)} tokens")
    for name, model in (("untrained model", untrained), ("trained trunk + untrained MTP", fresh_head),
                        ("trained (MTP on)", trained)):  # fmt: skip
        mtp, main_top1 = top1(model, docs)
        print(f"  {name:32s} mtp/top1 {mtp:.4f}   next-token top1 {main_top1:.4f}")


if __name__ == "__main__":
    main()
