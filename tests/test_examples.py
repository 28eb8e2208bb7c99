"""The framework recipes of examples/ (Hugging Face Trainer, PyTorch Lightning): a few steps each on the CPU, from
local configs with random weights (nothing downloaded). The DRO objective falls, eta moves, and the language
model's logits are never formed whole."""
import importlib.util
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_example(name: str):
    """examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def largest_cpu_allocation(fn) -> int:
    """The most bytes any single operator allocated itself (not counting the operators it called) on the CPU while
    fn() ran: torch.profiler's memory records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max((event.self_cpu_memory_usage for event in prof.events()), default=0)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["tokens", "sequences"])
def test_hf_trainer_recipe_trains_eta_and_never_forms_the_logits(tmp_path, per_sequence):
    pytest.importorskip("transformers", reason="the examples extra: pip install 'dro_ext[examples]'")
    recipe = load_example("hf_trainer")
    # The batch's logits (256 x 2048 floats, 2 MiB) outsize every weight and gradient (at most 2048 x 64: 0.5 MiB).
    batch, length, vocab, chunk = 8, 33, 2048, 16
    tokens = batch * (length - 1)
    head_calls = []
    model_init = recipe.tiny_gpt2

    def tiny_gpt2_counting_head_calls(*args, **kwargs):
        model = model_init(*args, **kwargs)
        model.lm_head.register_forward_hook(lambda *_: head_calls.append(1))
        return model

    recipe.tiny_gpt2 = tiny_gpt2_counting_head_calls
    result = {}

    def run():
        result["trainer"], result["losses"] = recipe.train(steps=12, chunk_size=chunk, output_dir=str(tmp_path),
                                                           batch_size=batch, length=length, vocab=vocab,
                                                           per_sequence=per_sequence)

    largest = largest_cpu_allocation(run)
    trainer, losses = result["trainer"], result["losses"]
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) < sum(losses[:3])  # the DRO objective falls
    eta = trainer.model.dro_loss.eta
    assert any(p is eta for p in trainer.model.parameters()) and eta.item() != 0.0  # trained with the model
    assert "dro_loss.eta" in trainer.model.state_dict()
    assert trainer.model.dro_loss.num_groups == (batch if per_sequence else None)
    assert head_calls == []  # the LM head module never ran: its weight went to the fused loss
    # One chunk of float32 logits is chunk x vocab; the whole batch's would be tokens x vocab.
    assert chunk * vocab * 4 <= largest < tokens * vocab * 4, largest


def _chi2_objective(losses: torch.Tensor, eta: torch.Tensor, lam: float) -> torch.Tensor:
    """The chi2 DRO objective in float64, from the formula: eta + mean lam psi*((l - eta)/lam), psi*(t) =
    -1 + (t + 2)_+^2 / 4."""
    t = (losses.double() - eta.double()) / lam
    return eta.double() + (lam * (-1 + torch.clamp(t + 2, min=0) ** 2 / 4)).mean()


def _hf_recipe_trainer(recipe, model, output_dir, record=None, callbacks=(), **settings):
    """The recipe's Trainer on `model` for one step of batch 4 (sequences of 16 tokens over 128 ids); `record` gets
    each micro-batch's input ids."""
    from transformers import TrainingArguments

    class Recording(recipe.DROTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if record is not None:
                record.append(inputs["input_ids"].clone())
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = TrainingArguments(output_dir=str(output_dir), **{
        **dict(max_steps=1, per_device_train_batch_size=4, learning_rate=1e-3, max_grad_norm=0.0, report_to=[],
               use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1), **settings})
    return Recording(model=model, args=args, train_dataset=recipe.CountingSequences(64, 16, 128),
                     callbacks=list(callbacks))


@pytest.mark.parametrize("accumulation", [1, 3])
def test_hf_trainer_recipe_steps_on_the_mean_of_the_micro_batches_objectives(tmp_path, accumulation):
    """With gradient accumulation the recipe's gradient and logged loss are those of the mean of the micro-batches'
    DRO objectives, as a stock Trainer's are for a mean loss (they were the sum: the Trainer took the model's
    loss for one already divided by the tokens of the whole accumulated batch)."""
    pytest.importorskip("transformers", reason="the examples extra: pip install 'dro_ext[examples]'")
    from transformers import TrainerCallback

    recipe = load_example("hf_trainer")
    lam = 0.5
    model = recipe.add_dro_loss(recipe.tiny_gpt2(128, 16, seed=0), "chi2", lam)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with torch.no_grad():
        model.dro_loss.eta.fill_(0.3)
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    batches, grads = [], {}

    class GradientsBeforeTheStep(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads.update({name: p.grad.clone() for name, p in model.named_parameters()})

    trainer = _hf_recipe_trainer(recipe, model, tmp_path, batches, [GradientsBeforeTheStep()],
                                 gradient_accumulation_steps=accumulation)
    trainer.train()
    assert len(batches) == accumulation
    reference = recipe.tiny_gpt2(128, 16, seed=0).eval()  # no dropout, as the trained model above
    reference.register_parameter("eta", torch.nn.Parameter(torch.tensor(0.3)))
    reference.load_state_dict({k.replace("dro_loss.", ""): v for k, v in initial.items()})
    objective = 0
    for ids in batches:
        hidden = reference.transformer(input_ids=ids).last_hidden_state[:, :-1]
        logits = (hidden @ reference.lm_head.weight.T).double()
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1), reduction="none")
        objective = objective + _chi2_objective(losses, reference.eta, lam) / accumulation
    objective.backward()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == pytest.approx([objective.item()], rel=1e-5)
    expected = dict(reference.named_parameters())
    for name, grad in grads.items():
        want = expected[name.replace("dro_loss.", "")].grad
        assert torch.allclose(grad, want.to(grad.dtype), rtol=1e-4, atol=1e-6 * want.abs().max().item()), name


def test_hf_trainer_recipe_runs_through_the_trainers_wrappers_and_evaluates(tmp_path):
    """The loss is computed in the model's forward: the Trainer's mixed precision reaches the body (the recipe
    called the body past the wrapped forward, in float32); evaluation hands the logits, not the hidden states, to
    metrics and leaves eta alone; eta is kept out of weight decay; generation is the model's own."""
    pytest.importorskip("transformers", reason="the examples extra: pip install 'dro_ext[examples]'")
    recipe = load_example("hf_trainer")
    model = recipe.add_dro_loss(recipe.tiny_gpt2(128, 16, seed=0))
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    predictions = []

    def metrics(prediction):
        predictions.append(prediction.predictions)
        return {}

    trainer = _hf_recipe_trainer(recipe, model, tmp_path, bf16=True, weight_decay=0.1,
                                 per_device_eval_batch_size=4)
    trainer.compute_metrics = metrics
    trainer.train()
    assert seen and set(seen) == {torch.bfloat16}
    decayed = [p for group in trainer.optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]]
    assert decayed and not any(p is model.dro_loss.eta for p in decayed)
    eta = model.dro_loss.eta.item()
    trainer.evaluate(recipe.CountingSequences(8, 16, 128, seed=1))
    assert model.dro_loss.eta.item() == eta
    (logits,) = predictions
    assert logits.shape == (8, 16, 128)
    generated = model.generate(torch.arange(4).unsqueeze(0), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


def test_lightning_recipe_trains_the_classifier_and_eta():
    pytest.importorskip("lightning", reason="the examples extra: pip install 'dro_ext[examples]'")
    recipe = load_example("lightning_classifier")
    torch.manual_seed(0)
    untrained = recipe.DROClassifier()
    x, y = recipe.load_imbalanced_digits(seed=0)[:2]

    def objective(module):
        with torch.no_grad():
            return module.dro_loss(torch.nn.functional.cross_entropy(module(x), y, reduction="none")).item()

    module, trainer, metrics = recipe.train(epochs=3)
    assert objective(module) < 0.5 * objective(untrained)
    assert module.dro_loss.eta.item() != 0.0
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, recipe.dro_ext.NormalizedSGD)
    assert any(p is module.dro_loss.eta for group in optimizer.param_groups for p in group["params"])
    assert 0.0 <= metrics["worst_class_accuracy"] <= metrics["test_accuracy"] <= 1.0
