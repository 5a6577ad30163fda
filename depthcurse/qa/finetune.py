"""Fine-tune an extractive QA head (and the encoder under it) on SQuAD, resumably.

No SQuAD-fine-tuned encoder installs without the hub, so the Post-LN side of the experiment
needs one made here: `finetune_qa("minilm-l6", out)` puts a span head on an encoder, trains it
on SQuAD questions, scores it on held-out questions and saves a normal checkpoint
(`from_pretrained` reloads it as AutoModelForQuestionAnswering).

Which questions: where the hub is reachable, training draws from SQuAD's train split and the
held-out questions from its validation split. Offline (or with a local file) there is one pool,
the 1,000 dev questions; it is split by PARAGRAPH with a seeded shuffle, so no held-out question
shares a context with a training question. The ids of the training questions are saved in the
checkpoint (`depthcurse_qa.json`), and `--task squad` leaves them out when it evaluates that
checkpoint.

Resuming: the weights (safetensors), optimizer, schedule, step and RNG state are saved every
`save_every` steps and at the end of training, in ``<out>/.finetune-state`` (swapped in whole,
so a crash never leaves half a checkpoint). Rerunning the same command continues from there and
ends in exactly the state an uninterrupted run reaches: each epoch's order comes from the seed
and the epoch number, and dropout's RNG is restored.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from depthcurse import assets
from depthcurse.errors import DepthcurseError
from depthcurse.io import atomic_write, ensure_out_dir, environment, previous_folder, refuse_other_run
from depthcurse.loading import load_model
from depthcurse.tasks.squad import TRAINING_RECORD, SquadTask, collate, load_squad, prepare_features

STATE_DIR = ".finetune-state"


@dataclass
class FinetuneConfig:
    """Everything that decides the result; a resumed run must match it."""

    model: str
    train_examples: int = 800
    eval_examples: int = 200
    epochs: int = 2
    lr: float = 1e-4
    batch_size: int = 16
    warmup: float = 0.1  # fraction of the steps with a linearly rising learning rate
    weight_decay: float = 0.01
    seed: int = 1234
    max_length: int = 384
    stride: int = 128
    data: str = "auto"

    def check(self) -> None:
        if self.train_examples < 1:
            raise DepthcurseError("--train-examples must be at least 1")
        if self.eval_examples < 0:
            raise DepthcurseError("--eval-examples must be 0 or more")
        if self.epochs < 1:
            raise DepthcurseError("--epochs must be at least 1")
        if self.batch_size < 1:
            raise DepthcurseError("--batch-size must be at least 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise DepthcurseError("--lr must be a positive number")
        if not 0 <= self.warmup < 1:
            raise DepthcurseError("the warm-up fraction must be in [0, 1)")


# --------------------------------------------------------------------------- which questions


def split_questions(cfg: FinetuneConfig) -> tuple[list[dict], list[dict], str]:
    """(training rows, held-out rows, data label); disjoint, deterministic for a seed."""
    data = cfg.data
    if data == "auto":
        data = "hub" if assets.hub_reachable() else "offline"
    rng = random.Random(cfg.seed)
    if data == "hub":
        train_pool, train_label = load_squad("hub", split="train")
        eval_pool, eval_label = load_squad("hub", split="validation")
        train = rng.sample(train_pool, min(cfg.train_examples, len(train_pool)))
        held = rng.sample(eval_pool, min(cfg.eval_examples, len(eval_pool)))
        return train, held, f"train from {train_label}, held-out from {eval_label}"
    pool, label = load_squad(data)
    # Whole paragraphs go to one side: a held-out question never shares its context with training.
    paragraphs: dict[str, list[dict]] = {}
    for row in pool:
        paragraphs.setdefault(row["context"], []).append(row)
    groups = list(paragraphs.values())
    rng.shuffle(groups)
    train, held = [], []
    for group in groups:
        if len(train) + len(group) <= cfg.train_examples:
            train.extend(group)
        elif len(held) + len(group) <= cfg.eval_examples:
            held.extend(group)
    if len(train) < cfg.train_examples and len(pool) < cfg.train_examples + cfg.eval_examples:
        raise DepthcurseError(f"{label} holds {len(pool)} questions, fewer than --train-examples {cfg.train_examples} + --eval-examples {cfg.eval_examples}")
    return train, held, f"{label} split by paragraph (seed {cfg.seed})"


# --------------------------------------------------------------------------- checkpoints


def _save_state(out: Path, model, optimizer, scheduler, step: int, losses: list[float], cfg: FinetuneConfig) -> None:
    from safetensors.torch import save_file  # lazy: only checkpoints need it

    def write(folder: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
        torch.save({"step": step, "losses": losses, "config": asdict(cfg), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}, folder / "state.pt")

    atomic_write(out / STATE_DIR, write, folder=True)


def _load_state(out: Path, model, optimizer, scheduler, cfg: FinetuneConfig) -> tuple[int, list[float]] | None:
    from safetensors.torch import load_file  # lazy: as in _save_state

    folder = out / STATE_DIR
    if not (folder / "state.pt").is_file():
        folder = previous_folder(out / STATE_DIR)  # a crash between the two renames of a save
        if folder is None or not (folder / "state.pt").is_file():
            return None
    try:
        state = torch.load(folder / "state.pt", weights_only=True)
        weights = load_file(str(folder / "model.safetensors"))
    except Exception as exc:  # torch and safetensors raise many kinds for a damaged file
        raise DepthcurseError(f"the saved training state in {folder} is damaged ({exc}); delete it to start over") from exc
    refuse_other_run(out, state["config"], asdict(cfg), what="fine-tune")
    model.load_state_dict(weights)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"]), list(state["losses"])


# --------------------------------------------------------------------------- training


def finetune_qa(
    cfg: FinetuneConfig,
    out: Path,
    *,
    device: str = "auto",
    save_every: int = 25,
    on_step: Callable[[int, int, float], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict:
    """Fine-tune `cfg.model` with a QA head into `out`; returns the record saved with it.

    `on_step(step, total, loss)` is called after every optimiser step, `on_phase(text)` when
    a phase (loading, tokenising, held-out evaluation, saving) begins. A finished `out` with the
    same settings is returned as is; one with other settings is refused.
    """
    import transformers  # lazy: its scheduler module imports seconds of model code

    cfg.check()
    if save_every < 1:
        raise DepthcurseError("save_every must be at least 1")
    out = ensure_out_dir(Path(out))
    record_path = out / TRAINING_RECORD
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        refuse_other_run(out, record.get("config", {}), asdict(cfg), what="fine-tune")
        return record
    if (out / "config.json").exists() and not (out / STATE_DIR).exists():
        raise DepthcurseError(f"{out} already holds a model that finetune-qa did not make; choose another --out")
    phase = on_phase or (lambda text: None)
    started = time.perf_counter()

    phase(f"loading {cfg.model}")
    torch.manual_seed(cfg.seed)  # the new head's initial weights
    loaded = load_model(cfg.model, head="qa", dtype="fp32", device=device, new_head=True)
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise DepthcurseError(f"{cfg.model} has no tokenizer")

    phase("reading and tokenising SQuAD")
    train_rows, held_rows, data_label = split_questions(cfg)
    feats = prepare_features(tok, train_rows, max_length=cfg.max_length, stride=cfg.stride, labels=True)
    steps_per_epoch = math.ceil(len(feats) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs

    # The usual BERT recipe: AdamW, no weight decay on biases and LayerNorm gains, linear warm-up then decay.
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n or "layer_norm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n or "layer_norm" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, int(cfg.warmup * total), total)
    resumed = _load_state(out, model, optimizer, scheduler, cfg)
    step, losses = resumed if resumed is not None else (0, [])
    if resumed is None:
        torch.manual_seed(cfg.seed + 1)  # dropout's stream, the same whether or not a run was resumed at step 0

    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    starts, ends = torch.tensor(feats.start_positions), torch.tensor(feats.end_positions)
    model.train()
    for epoch in range(step // steps_per_epoch, cfg.epochs):
        order = torch.randperm(len(feats), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch)).tolist()
        for b in range(step - epoch * steps_per_epoch, steps_per_epoch):
            index = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            batch = collate(feats, index, pad_id, loaded.device)
            loss = model(**batch, start_positions=starts[index].to(loaded.device), end_positions=ends[index].to(loaded.device)).loss
            if not torch.isfinite(loss):
                raise DepthcurseError(f"the training loss became {loss.item()} at step {step + 1}: lower --lr")
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            losses.append(round(loss.item(), 6))
            if step % save_every == 0 or step == total:
                _save_state(out, model, optimizer, scheduler, step, losses, cfg)
            if on_step:
                on_step(step, total, losses[-1])
    model.eval()

    metrics = {}
    if held_rows:
        phase(f"scoring {len(held_rows)} held-out questions")
        task = SquadTask(tok, held_rows, source=data_label, max_length=cfg.max_length, stride=cfg.stride, batch_size=cfg.batch_size)
        metrics = task.evaluate(model).metrics

    phase(f"saving to {out}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    record = {
        "config": asdict(cfg),
        "base_model": loaded.describe(),
        "data": data_label,
        "train_questions": len(train_rows),
        "train_windows": len(feats),
        "steps": total,
        "heldout_questions": len(held_rows),
        "heldout": metrics,
        "train_ids": [r["id"] for r in train_rows],
        "heldout_ids": [r["id"] for r in held_rows],
        "losses": losses,
        "wall_time_s": round(time.perf_counter() - started, 3),
        "environment": environment(),
    }
    # The record is written last: it marks the folder as finished.
    atomic_write(record_path, json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out / STATE_DIR, ignore_errors=True)
    return record
