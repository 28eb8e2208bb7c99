"""The README's Python blocks run as written. Each block is executed with stand-ins for the names it leaves to the
reader (a model, a batch, a loader, losses, group ids, hidden states), so a renamed function, argument or attribute
fails here before a user copies it; what a block's comments claim of its results (a distribution sums to one, has
one entry per group) is checked too. A block that passes a process group runs in a process of its own, in a one-rank
gloo group, bounded in time."""
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import dro_ext

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
DISTRIBUTED_TIMEOUT_S = 120


class MyNet(torch.nn.Module):
    """The README's model: 10 features, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def stand_ins(directory: pathlib.Path) -> dict:
    """A fresh namespace with every name a README block uses without defining it."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 10, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    group_ids = torch.arange(64) % 4
    batch, time, hidden_size, vocabulary = 4, 6, 16, 50
    return {
        "torch": torch, "dro_ext": dro_ext, "F": F, "MyNet": MyNet, "model": MyNet(), "x": x, "y": y,
        "batch": (x, y), "per_sample_losses": lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"),
        "losses": torch.rand(64, generator=gen), "group_ids": group_ids,
        "test_loader": [(x[:40], y[:40], group_ids[:40]), (x[40:], y[40:], group_ids[40:])],  # (x, y, group)
        "train_group_sizes": torch.tensor([100.0, 50.0, 20.0, 5.0]), "path": directory / "group_dro.pt",
        "hidden": torch.randn(batch, time, hidden_size, generator=gen, requires_grad=True),
        "head": torch.nn.Linear(hidden_size, vocabulary, bias=False),
        "targets": torch.randint(0, vocabulary, (batch, time), generator=gen),
        "domain_of_sequence": torch.randint(0, 8, (batch,), generator=gen),
    }


def sums_to_one(q: torch.Tensor) -> bool:
    return torch.isclose(q.double().sum(), torch.tensor(1.0, dtype=torch.float64)).item()


# What a block's comments say of its results, keyed by a line of that block: namespace -> bool.
CLAIMS = {
    'q = dro_ext.worst_case_weights(losses, 0.1, "cvar", alpha=0.1)': lambda ns: sums_to_one(ns["q"]),
    'q = dro_ext.worst_case_weights(losses, 0.1, "chi2", groups=group_ids, num_groups=4)':
        lambda ns: ns["q"].shape == (4,) and sums_to_one(ns["q"]),
    "torch.save(group_dro.state_dict(), path)":
        lambda ns: {"log_q", "ema_loss", "last_loss", "seen"} <= set(torch.load(ns["path"])) and
        sums_to_one(ns["group_dro"].q),
    "loss.backward()                                              # logits.grad and criterion.eta.grad":
        lambda ns: ns["logits"].grad is not None and ns["criterion"].eta.grad is not None,
}


def test_the_readme_has_its_blocks_and_every_claim_names_one():
    assert len(BLOCKS) >= 8
    for line in CLAIMS:
        assert sum(line in block for block in BLOCKS) == 1, line


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i + 1}")
@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available:UserWarning")
def test_a_readme_block_runs_as_written(index, tmp_path):
    block = BLOCKS[index]
    if "torch.distributed" in block:
        run_in_a_one_rank_group(index, tmp_path)
        return
    namespace = stand_ins(tmp_path)
    exec(compile(block, f"README.md, Python block {index + 1}", "exec"), namespace)
    for line, claim in CLAIMS.items():
        if line in block:
            assert claim(namespace), line


def run_in_a_one_rank_group(index: int, directory: pathlib.Path) -> None:
    script = textwrap.dedent(f"""
        import pathlib, sys
        import torch.distributed as dist
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from test_readme import BLOCKS, stand_ins
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            exec(compile(BLOCKS[{index}], "README.md, Python block {index + 1}", "exec"),
                 stand_ins(pathlib.Path({str(directory)!r})))
        finally:
            dist.destroy_process_group()
        print("ran")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=DISTRIBUTED_TIMEOUT_S)
    assert done.returncode == 0 and done.stdout.strip().endswith("ran"), done.stderr[-3000:]
