"""Real training loops around a compiled step (2 gloo ranks), each against the same loop run eagerly on one device.

Learning-rate schedules (every torch.optim.lr_scheduler a user reaches for, and a hand-written one)
are followed step by step with no recompilation and no PyTorch warning; a new parameter group
recompiles; gradient clipping, accumulation over micro-batches, a compiled evaluation function,
a last batch of another size and train/eval modes give what one device gives.
"""

from __future__ import annotations

import pytest

from torchrun_script import run_torchrun

pytestmark = [pytest.mark.distributed]

COMMON = """
torch.manual_seed(0)
g = torch.Generator().manual_seed(7)
batch = {"x": torch.randn(16, 12, generator=g), "y": torch.randint(0, 5, (16,), generator=g)}

def mlp(dropout=0.0):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Dropout(dropout), torch.nn.GELU(), torch.nn.Linear(32, 5))

def step_fn(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

def max_diff(model, reference):
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))

def close(a, b, what):
    assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (what, a, b)
"""

SCHEDULERS = """
from torch.optim import lr_scheduler as S

def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)

def adamw(params):
    return torch.optim.AdamW(params, lr=5e-3)

def two_groups(params):
    params = list(params)
    return torch.optim.SGD([{"params": params[:2], "lr": 0.05}, {"params": params[2:], "lr": 0.01}], momentum=0.5)

CASES = {
    "LambdaLR": (sgd, lambda o: S.LambdaLR(o, lambda s: 1.0 / (1 + s))),
    "StepLR": (adamw, lambda o: S.StepLR(o, step_size=2, gamma=0.5)),
    "CosineAnnealingLR": (sgd, lambda o: S.CosineAnnealingLR(o, T_max=6)),
    "OneCycleLR-momentum": (sgd, lambda o: S.OneCycleLR(o, max_lr=0.1, total_steps=8)),
    "OneCycleLR-betas": (adamw, lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=8)),
    "SequentialLR-warmup": (adamw, lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.1, total_iters=2), S.CosineAnnealingLR(o, T_max=5)], milestones=[2])),
    "ReduceLROnPlateau": (sgd, lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=0)),
    "per-group": (two_groups, lambda o: S.ExponentialLR(o, gamma=0.8)),
    "hand-written": (adamw, None),
}
STEPS = 6
for name, (make_optimizer, make_scheduler) in CASES.items():
    model, reference = mlp(), mlp()
    optimizer, ref_opt = make_optimizer(model.parameters()), make_optimizer(reference.parameters())
    train_step = metadist.compile(step_fn, mesh=(2,))
    if make_scheduler is not None:
        schedule, ref_schedule = make_scheduler(optimizer), make_scheduler(ref_opt)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            loss = train_step(model, optimizer, batch).item()
            want = step_fn(reference, ref_opt, batch).item()
            close(loss, want, f"{name} loss at step {step}")
            if make_scheduler is None:  # a hand-written warmup then decay, set straight into the groups
                for o in (optimizer, ref_opt):
                    for group in o.param_groups:
                        group["lr"] = 5e-3 * min(1.0, (step + 2) / 3) * 0.7 ** step
            elif name == "ReduceLROnPlateau":
                schedule.step(1.0); ref_schedule.step(1.0)  # no improvement: the lr halves
            else:
                schedule.step(); ref_schedule.step()
            lrs.append(optimizer.param_groups[-1]["lr"])
    complaints = [str(w.message) for w in caught if "step()" in str(w.message)]
    assert not complaints, (name, complaints)
    assert len(set(lrs)) > 2, (name, lrs)  # the schedule really moved
    assert len(train_step._variants) == 1, (name, "recompiled")
    worst = max_diff(model, reference)
    assert worst < 2e-5, (name, worst)
    rank0_print(f"OK {name}: {STEPS} steps, lr {lrs[0]:.3g} -> {lrs[-1]:.3g}, max param diff {worst:.1e}")
finish()
"""


def test_lr_schedulers_are_followed_like_eager(tmp_path):
    result = run_torchrun(tmp_path, COMMON + SCHEDULERS, timeout=900)
    for name in ("LambdaLR", "StepLR", "CosineAnnealingLR", "OneCycleLR-momentum", "OneCycleLR-betas",
                 "SequentialLR-warmup", "ReduceLROnPlateau", "per-group", "hand-written"):
        assert f"OK {name}:" in result.stdout, result.stdout
    print(result.stdout)


LOOP = """
# gradients left behind on parameters the optimizer does not update are refused, clearly
model = mlp()
optimizer = torch.optim.SGD([p for name, p in model.named_parameters() if name.startswith("0.")], lr=0.05)
try:
    metadist.compile(step_fn, mesh=(2,))(model, optimizer, batch)
except Exception as err:
    assert "leaves gradients behind on 3.weight, 3.bias" in str(err), err
else:
    raise AssertionError("gradients left behind must be refused")

# unfreezing a layer and adding it as a parameter group mid-training recompiles and trains as eager does
model, reference = mlp(), mlp()
def layer(m, prefix):
    return [p for name, p in m.named_parameters() if name.startswith(prefix)]
for m in (model, reference):
    for p in layer(m, "3."):
        p.requires_grad_(False)
optimizer = torch.optim.SGD(layer(model, "0."), lr=0.05)
ref_opt = torch.optim.SGD(layer(reference, "0."), lr=0.05)
train_step = metadist.compile(step_fn, mesh=(2,))
close(train_step(model, optimizer, batch).item(), step_fn(reference, ref_opt, batch).item(), "before the new group")
for m, o in ((model, optimizer), (reference, ref_opt)):
    for p in layer(m, "3."):
        p.requires_grad_(True)
    o.add_param_group({"params": layer(m, "3."), "lr": 0.02})
for _ in range(2):
    close(train_step(model, optimizer, batch).item(), step_fn(reference, ref_opt, batch).item(), "after the new group")
assert len(train_step._variants) == 2
assert max_diff(model, reference) < 1e-5, max_diff(model, reference)

# clipping (global norm across shards, and by value) and accumulation over micro-batches
def accumulate_and_clip(model, optimizer, batch):
    total = 0.0
    for x, y in zip(batch["x"].chunk(4), batch["y"].chunk(4)):
        loss = torch.nn.functional.cross_entropy(model(x), y) / 4
        loss.backward()
        total = total + loss.detach()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.004)
    optimizer.step()
    optimizer.zero_grad()
    return total, norm

for plan in ("solver", "zero3"):
    model, reference = mlp(), mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    train_step = metadist.compile(accumulate_and_clip, mesh=(2,), plan=plan)
    for step in range(3):
        loss, norm = train_step(model, optimizer, batch)
        want_loss, want_norm = accumulate_and_clip(reference, ref_opt, batch)
        close(loss.item(), want_loss.item(), f"accumulated loss ({plan})")
        close(norm.item(), want_norm.item(), f"global gradient norm ({plan})")
        assert norm.item() > 0.05, "the clip is active"
    assert max_diff(model, reference) < 1e-5, (plan, max_diff(model, reference))

# train/eval modes, a compiled evaluation function on the state where it lies, a last batch of another size
model, reference = mlp(dropout=0.3), mlp(dropout=0.3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
train_step = metadist.compile(step_fn, mesh=(2,))

@metadist.compile(mesh=(2,))
def eval_step(model, batch):
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

for step in range(2):
    torch.manual_seed(100 + step)
    loss = train_step(model, optimizer, batch).item()
    torch.manual_seed(100 + step)
    want = step_fn(reference, ref_opt, batch).item()
    close(loss, want, "a training step with dropout")
model.eval(); reference.eval()
evaluated = eval_step(model, batch).item()
with torch.no_grad():
    want_eval = torch.nn.functional.cross_entropy(reference(batch["x"]), batch["y"]).item()
close(evaluated, want_eval, "compiled evaluation")
placements = {name: p.placements for name, p in model.named_parameters()}
model.train(); reference.train()
last = {"x": batch["x"][:6], "y": batch["y"][:6]}  # the last, smaller batch of an epoch
torch.manual_seed(5)
loss = train_step(model, optimizer, last).item()
torch.manual_seed(5)
close(loss, step_fn(reference, ref_opt, last).item(), "a last batch of another size")
assert {name: p.placements for name, p in model.named_parameters()} == placements, "state stays where it lies"
assert len(train_step._variants) == 2 and len(eval_step._variants) == 1
assert max_diff(model, reference) < 1e-5
rank0_print("OK loop")
finish()
"""


def test_clipping_accumulation_evaluation_modes_and_a_new_group(tmp_path):
    result = run_torchrun(tmp_path, COMMON + LOOP, timeout=900)
    assert "OK loop" in result.stdout
