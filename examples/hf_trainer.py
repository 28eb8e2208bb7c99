"""DRO fine-tuning of a causal language model with Hugging Face's ``transformers.Trainer``.

    python examples/hf_trainer.py [--steps 30] [--divergence chi2] [--lam 0.5] [--per-sequence]

The per-token DRO objective replaces the mean cross-entropy: ``DROLinearCrossEntropyLoss`` takes the last hidden
states and the LM head's weight, so the (tokens x vocabulary) logits are never materialized (a chunk of rows at a
time), and its dual variable ``eta`` is a parameter of the model, trained by the Trainer's own optimizer beside the
weights (and saved in its checkpoints). What changes against a stock Trainer is ``compute_loss``.

``--per-sequence`` makes the sequences, not the tokens, the units the DRO objective weighs (sequence-level DRO): each
sequence of a batch is a group (``groups`` of shape ``(batch,)``, broadcast over its tokens), its loss the mean over
its tokens, and the objective is the penalized divergence over those means. It costs one more matmul per chunk (the
logits are recomputed in the backward), still without forming them whole. For domain-level DRO, pass each
sequence's domain id instead of its position in the batch, with ``num_groups`` the number of domains.

The model here is a small GPT-2 built from a local config with random weights, trained on synthetic token
sequences (each sequence counts up from a random start, with a few noisy tokens): nothing is downloaded. For a real
model, load it with ``AutoModelForCausalLM.from_pretrained`` and keep the rest.

Needs ``pip install "dro_ext[examples]"`` (transformers).
"""
from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import dro_ext


class CountingSequences(torch.utils.data.Dataset):
    """Sequences t, t+1, t+2, ... (mod vocab) from a random start t, with a share of random tokens: learnable, and
    with a hard minority (the noisy positions) for the DRO objective to weigh up."""

    def __init__(self, size: int, length: int, vocab: int, noise: float = 0.1, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (size, 1), generator=gen)
        ids = (start + torch.arange(length)) % vocab
        noisy = torch.rand(size, length, generator=gen) < noise
        self.ids = torch.where(noisy, torch.randint(0, vocab, (size, length), generator=gen), ids)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class DROTrainer(Trainer):
    """A Trainer whose loss is the DRO objective over the tokens, from the hidden states (no logits).

    The model carries the loss module as ``model.dro_loss`` (see :func:`add_dro_loss`), so ``eta`` is one of the
    model's parameters: the Trainer's optimizer, gradient clipping, mixed precision and checkpoints all see it.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model.transformer(**inputs)  # the body only: the LM head's weight goes to the fused loss
        hidden = outputs.last_hidden_state[:, :-1]  # position i predicts token i + 1
        groups = None
        if model.dro_loss.num_groups is not None:  # sequence-level: sequence b of the batch is group b
            groups = torch.arange(labels.shape[0], device=labels.device)
        loss = model.dro_loss(hidden, model.lm_head.weight, labels[:, 1:], groups=groups)
        return (loss, outputs) if return_outputs else loss


def add_dro_loss(model, divergence: str = "chi2", lam: float = 0.5, chunk_size: int | None = None,
                 num_groups: int | None = None, **params):
    """Registers ``DROLinearCrossEntropyLoss`` on the model as ``model.dro_loss``: its ``eta`` becomes a model
    parameter (in ``model.parameters()`` and the state dict). ``num_groups``: the objective over that many groups of
    sequences (here the batch size: one group per sequence) instead of over tokens."""
    model.add_module("dro_loss", dro_ext.DROLinearCrossEntropyLoss(divergence, lam, chunk_size=chunk_size,
                                                                   num_groups=num_groups, **params))
    return model


def tiny_gpt2(vocab: int = 128, length: int = 32, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=length, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def train(steps: int = 30, divergence: str = "chi2", lam: float = 0.5, chunk_size: int | None = None,
          output_dir: str = "hf_trainer_out", batch_size: int = 8, length: int = 32, vocab: int = 128,
          seed: int = 0, per_sequence: bool = False) -> tuple[DROTrainer, list[float]]:
    """Trains for `steps` steps; returns the trainer and the training loss of every step."""
    model = add_dro_loss(tiny_gpt2(vocab, length, seed), divergence, lam, chunk_size,
                         num_groups=batch_size if per_sequence else None)
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
                             learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=not torch.cuda.is_available(), seed=seed,
                             disable_tqdm=True)
    trainer = DROTrainer(model=model, args=args, train_dataset=CountingSequences(512, length, vocab, seed=seed))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--divergence", default="chi2", choices=dro_ext.DIVERGENCES)
    parser.add_argument("--lam", type=float, default=0.5)
    parser.add_argument("--output-dir", default="hf_trainer_out")
    parser.add_argument("--per-sequence", action="store_true", help="DRO over the sequences, not the tokens")
    args = parser.parse_args(argv)
    trainer, losses = train(args.steps, args.divergence, args.lam, output_dir=args.output_dir,
                            per_sequence=args.per_sequence)
    print(f"DRO objective: {losses[0]:.3f} (first step) -> {losses[-1]:.3f} (step {len(losses)}); "
          f"eta = {trainer.model.dro_loss.eta.item():.3f}")


if __name__ == "__main__":
    main()
