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
