"""DRO fine-tuning of a causal language model with Hugging Face's ``transformers.Trainer``.

    python examples/hf_trainer.py [--steps 30] [--divergence chi2] [--lam 0.5] [--per-sequence]

The per-token DRO objective replaces the mean cross-entropy: ``DROLinearCrossEntropyLoss`` takes the last hidden
states and the LM head's weight, so the (tokens x vocabulary) logits are never materialized in training (a chunk of
rows at a time), and its dual variable ``eta`` is a parameter of the model, trained by the Trainer's own optimizer
beside the weights (and saved in its checkpoints). What changes is the model's forward (:func:`add_dro_loss`): the
loss is computed inside it, so whatever wraps the model (DDP or FSDP across processes, the Trainer's mixed
precision) wraps the loss as well, and the stock ``compute_loss`` takes it from the forward's output. The Trainer
subclass only keeps ``eta`` out of weight decay.

With gradient accumulation the Trainer divides each micro-batch's objective by the number of micro-batches: the step
follows the mean of the micro-batches' DRO objectives, as it follows the mean of their mean losses without DRO. That
is not the objective of the accumulated batch taken whole, which weighs every token against all the others (the DRO
objective is no mean over tokens); a larger batch per device is. Under DDP likewise each rank's objective is over
its own batch and DDP averages their gradients (``DROLinearCrossEntropyLoss`` takes no process group).

``--per-sequence`` makes the sequences, not the tokens, the units the DRO objective weighs (sequence-level DRO): each
sequence of a batch is a group (``groups`` of shape ``(batch,)``, broadcast over its tokens), its loss the mean over
its tokens, and the objective is the penalized divergence over those means. It costs one more matmul per chunk (the
logits are recomputed in the backward), still without forming them whole. For domain-level DRO, pass each
sequence's domain id instead of its position in the batch, with ``num_groups`` the number of domains.

The model here is a small GPT-2 built from a local config with random weights, trained on synthetic token
sequences (each sequence counts up from a random start, with a few noisy tokens): nothing is downloaded. For a real
model, load it with ``AutoModelForCausalLM.from_pretrained`` and keep the rest, for an architecture whose logits are
the LM head's linear map of the last hidden state (GPT-2, Llama-like models; not those that scale or cap them).

Needs ``pip install "dro_ext[examples]"`` (transformers).
"""
from __future__ import annotations

import argparse
import types

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.modeling_outputs import CausalLMOutput

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
    """A stock Trainer but for weight decay, which leaves out ``eta``: it is the DRO objective's dual variable, not a
    weight, and decay would pull it toward 0 (the objective is a minimum over ``eta``)."""

    def get_decay_parameter_names(self, model):
        return [name for name in super().get_decay_parameter_names(model) if not name.endswith("dro_loss.eta")]


def dro_forward(self, input_ids=None, attention_mask=None, labels=None, groups=None, **kwargs):
    """The forward of a causal LM with the DRO objective as its loss: the body (``base_model``), then the fused loss
    of the last hidden states against the LM head's weight, position i predicting token i + 1 (labels of -100, the
    padding of Hugging Face's collators, count nowhere). In training the logits are never formed; in evaluation the
    output also holds them, for metrics and predictions. ``groups``: one id per sequence for domain-level DRO (a
    column of the batch); by default, with ``num_groups`` on the loss, sequence b of the batch is group b. Without
    labels (``generate``, say) it is the model's own forward."""
    if labels is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
    head = self.get_output_embeddings()
    if groups is None and self.dro_loss.num_groups is not None:
        groups = torch.arange(labels.shape[0], device=labels.device)
    loss = self.dro_loss(hidden[:, :-1], head.weight, labels[:, 1:], bias=head.bias, groups=groups)
    return CausalLMOutput(loss=loss, logits=None if self.training else head(hidden))


def add_dro_loss(model, divergence: str = "chi2", lam: float = 0.5, chunk_size: int | None = None,
                 num_groups: int | None = None, **params):
    """Makes ``model`` (a causal LM of ``transformers``: GPT-2 here, any ``AutoModelForCausalLM``) compute the DRO
    objective in its forward (:func:`dro_forward`), with ``DROLinearCrossEntropyLoss`` registered on it as
    ``model.dro_loss``: its ``eta`` becomes a model parameter (in ``model.parameters()`` and the state dict).
    ``num_groups``: the objective over that many groups of sequences (one group per sequence of a batch, so at least
    the largest batch, evaluation's included) instead of over tokens."""
    model.add_module("dro_loss", dro_ext.DROLinearCrossEntropyLoss(divergence, lam, chunk_size=chunk_size,
                                                                   num_groups=num_groups, **params))
    model.forward = types.MethodType(dro_forward, model)
    # The loss is the objective of this batch alone, not a sum to be divided by the tokens of every micro-batch of
    # an accumulated step: the Trainer then averages the micro-batches' objectives, as for a mean loss.
    model.accepts_loss_kwargs = False
    return model


def tiny_gpt2(vocab: int = 128, length: int = 32, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=length, n_embd=64, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def train(steps: int = 30, divergence: str = "chi2", lam: float = 0.5, chunk_size: int | None = None,
          output_dir: str = "hf_trainer_out", batch_size: int = 8, length: int = 32, vocab: int = 128,
          seed: int = 0, per_sequence: bool = False, **training_args) -> tuple[DROTrainer, list[float]]:
    """Trains for `steps` steps; returns the trainer and the training loss of every step. ``training_args`` go to
    ``TrainingArguments`` (e.g. ``gradient_accumulation_steps``, ``bf16``)."""
    model = add_dro_loss(tiny_gpt2(vocab, length, seed), divergence, lam, chunk_size,
                         num_groups=batch_size if per_sequence else None)
    settings = dict(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
                    per_device_eval_batch_size=batch_size, learning_rate=3e-3, lr_scheduler_type="constant",
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                    seed=seed, disable_tqdm=True)
    args = TrainingArguments(**{**settings, **training_args})
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
    if torch.distributed.is_initialized():  # under torchrun: the Trainer's process group, left in order
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
