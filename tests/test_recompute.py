"""Models that already recompute (torch.utils.checkpoint): captured with their recomputation, or refused clearly."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from metadist.frontends.torch import CaptureError, capture_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CHECKPOINTED_MLP = '''
import torch, metadist
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.up, self.down, self.drop = torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width), torch.nn.Dropout(dropout)

    def forward(self, x):
        return x + self.down(self.drop(torch.nn.functional.gelu(self.up(x))))


class Checkpointed(torch.nn.Module):
    def __init__(self, width=16, dropout=0.0):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width, dropout) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.square().mean()


def workload():
    torch.manual_seed(0)
    return metadist.Workload(model=Checkpointed(), batch={"x": torch.randn(8, 16)},
                             loss_fn=lambda model, batch: model(batch["x"]),
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
'''

namespace: dict = {}
exec(compile(CHECKPOINTED_MLP, "checkpointed_mlp", "exec"), namespace)
Checkpointed = namespace["Checkpointed"]


def step(model, optimizer, batch):
    loss = model(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_a_checkpointed_model_is_captured_with_its_recomputation_and_matches_eager_exactly():
    torch.manual_seed(0)
    eager = Checkpointed()
    model = copy.deepcopy(eager)
    eager_optimizer, optimizer = torch.optim.AdamW(eager.parameters(), lr=1e-2), torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(8, 16)
    captured = capture_step(step, model, optimizer, batch)
    forward_linears = 4
    linears = captured.graph.op_histogram()["aten.addmm.default"]
    assert linears > forward_linears  # the recomputed forward is in the graph, as it runs in eager
    for _ in range(3):
        assert torch.equal(captured.run(model, optimizer, batch), step(eager, eager_optimizer, batch))
    for a, b in zip(model.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_a_checkpointed_model_with_dropout_is_refused_rather_than_replayed_wrongly():
    torch.manual_seed(0)
    model = Checkpointed(dropout=0.5)
    with pytest.raises(CaptureError, match="restores the random generator's state.*dropout probabilities to 0"):
        capture_step(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16))


def test_dropout_outside_any_checkpoint_is_still_captured():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
    wrapped = lambda m, o, b: step(lambda x: m(x).square().mean(), o, b)  # noqa: E731
    captured = capture_step(wrapped, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 16))
    assert any(node.op.is_random for node in captured.graph.nodes)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpointed_model_runs_on_two_ranks_and_matches_one_device(tmp_path):
    path = tmp_path / "checkpointed_mlp.py"
    path.write_text(CHECKPOINTED_MLP)
    result = subprocess.run([sys.executable, "-m", "metadist.cli.main", "run", str(path), "--nproc", "2", "--steps", "3",
                             "--check", "--timeout-s", "120"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "check: PASS" in result.stdout
