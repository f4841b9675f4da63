"""The user's model and optimizer hold the training state, sharded in place (FSDP2's convention).

Under torchrun on gloo: after compiled steps the model's parameters are DTensors over each rank's
shards holding the trained values (tied weights stay tied), ``model(x)`` between steps gives the
trained model's output, ``optimizer.state_dict()`` and the torch.distributed.checkpoint.state_dict
helpers are current, in-place edits between steps are picked up and replaced parameters refused,
every tensor the process holds after compile adds up to the plan's shards, and checkpoints move
between plain DCP calls and the compiled step's save/load, across plans.
"""

from __future__ import annotations

import pytest

from torchrun_script import run_torchrun

pytestmark = [pytest.mark.distributed]

MODEL = """
from transformers import GPT2Config, GPT2LMHeadModel

def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: eager parity step by step
    return GPT2LMHeadModel(config)

g = torch.Generator().manual_seed(1)
ids = torch.randint(0, 256, (4, 16), generator=g)
batch = {"input_ids": ids, "labels": ids}

def step_fn(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss

def worst(model, reference):
    return max((p.full_tensor() - q).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))
"""


def test_model_holds_current_sharded_state(tmp_path):
    result = run_torchrun(tmp_path, MODEL + """
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

model, reference = gpt2(), gpt2()
# Adam turns summation-order noise in near-zero gradients into steps of about lr: keep lr small so that
# the distributed and eager parameters agree to 1e-4 (losses agree to 1e-5 either way)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
train_step = metadist.compile(step_fn, mesh=(2,), plan="zero3")
for _ in range(3):
    loss = train_step(model, optimizer, batch)
    expected = step_fn(reference, ref_opt, batch)
    assert abs(loss.item() - expected.item()) < 1e-5, (loss.item(), expected.item())

params = dict(model.named_parameters())
assert all(isinstance(p, DTensor) for p in params.values())
assert model.lm_head.weight is model.transformer.wte.weight, "tied weights stay one parameter"
sharded = [name for name, p in params.items() if p.to_local().numel() < p.numel()]
assert len(sharded) >= 8, sharded
assert worst(model, reference) < 1e-4, worst(model, reference)

# state_dict, named_parameters and the DCP helpers are current with no call to make them so
state = model.state_dict()
ref_state = reference.state_dict()
for name, value in ref_state.items():
    got = state[name].full_tensor() if isinstance(state[name], DTensor) else state[name]
    assert torch.allclose(got, value, atol=1e-4), name
opt_state = optimizer.state_dict()["state"]
ref_opt_state = ref_opt.state_dict()["state"]
assert set(opt_state) == set(ref_opt_state)
for index in ref_opt_state:
    assert float(opt_state[index]["step"]) == float(ref_opt_state[index]["step"]) == 3.0
    assert torch.allclose(opt_state[index]["exp_avg"].full_tensor(), ref_opt_state[index]["exp_avg"], atol=1e-5)
msd = get_model_state_dict(model)
osd = get_optimizer_state_dict(model, optimizer)
assert "lm_head.weight" in msd or "transformer.wte.weight" in msd
assert any(key.endswith("exp_avg") for key in osd["state"]["transformer.h.0.attn.c_attn.weight"])

# the model itself evaluates as the trained model between steps (a collective, on every rank)
model.eval(); reference.eval()
with torch.no_grad():
    outside = model(**batch).loss.item()
    wanted = reference(**batch).loss.item()
assert abs(outside - wanted) < 1e-5, (outside, wanted)
assert isinstance(model.transformer.wte.weight, DTensor), "the shards are back after the call"
model.train(); reference.train()

# in-place edits between steps are picked up
with torch.no_grad():
    model.transformer.ln_f.weight.mul_(0.5)
    reference.transformer.ln_f.weight.mul_(0.5)
loss = train_step(model, optimizer, batch)
expected = step_fn(reference, ref_opt, batch)
assert abs(loss.item() - expected.item()) < 1e-5, (loss.item(), expected.item())
assert worst(model, reference) < 1e-4, worst(model, reference)

# a replaced parameter is refused, clearly
model.transformer.ln_f.weight = torch.nn.Parameter(torch.ones(64))
try:
    train_step(model, optimizer, batch)
except Exception as err:
    assert "replaced" in str(err) and "ln_f" in str(err), err
else:
    raise AssertionError("a replaced parameter must be refused")
rank0_print("OK state-in-model")
finish()
""")
    assert "OK state-in-model" in result.stdout


def test_memory_after_compile_is_the_plans_shards(tmp_path):
    result = run_torchrun(tmp_path, MODEL + """
import gc
from torch._subclasses.fake_tensor import FakeTensor

def live_bytes():
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter) and not isinstance(obj, DTensor):
            if obj.device.type != "cpu" or isinstance(obj, FakeTensor):
                continue
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total

model = gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
full_params = sum(p.numel() * p.element_size() for p in model.parameters())
full_state = 3 * full_params  # AdamW: parameters, exp_avg, exp_avg_sq
train_step = metadist.compile(step_fn, mesh=(4,), plan="zero3")
train_step.prepare(model, optimizer, batch)
gc.collect()
program = train_step.compiled.program
predicted = sum(
    torch.Size(pi.local_shape).numel() * getattr(torch, pi.spec.dtype).itemsize
    for pi in program.inputs if train_step.compiled._slots[pi.name].kind in ("param", "buffer", "state")
)
held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
held += sum(b.to_local().numel() * b.element_size() for b in model.buffers())
held += sum(v.to_local().numel() * v.element_size() if isinstance(v, DTensor) else v.numel() * v.element_size()
            for s in optimizer.state.values() for v in s.values())
assert held == predicted, (held, predicted)
assert predicted < 0.3 * full_state, (predicted, full_state)
everything = live_bytes()
batch_bytes = sum(t.numel() * t.element_size() for t in batch.values())
assert everything <= 1.1 * predicted + batch_bytes + (256 << 10), (everything, predicted)
rank0_print("OK memory", f"full state {full_state} B, predicted per rank {predicted} B, held {held} B, "
            f"all live tensors {everything} B")
finish()
""", nproc=4)
    assert "OK memory" in result.stdout
    print(result.stdout)


def test_checkpoints_move_between_plain_dcp_and_the_compiled_step(tmp_path):
    result = run_torchrun(tmp_path, MODEL + """
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)

ckpt_plain, ckpt_step = sys.argv[1], sys.argv[2]
model = gpt2()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
train_step = metadist.compile(step_fn, mesh=(2,), plan="zero3")
for _ in range(2):
    train_step(model, optimizer, batch)
# as torchtitan does: plain DCP on the model and optimizer
dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
         checkpoint_id=ckpt_plain)
train_step.save(ckpt_step)
next_loss = train_step(model, optimizer, batch).item()

def fresh(plan, seed):
    torch.manual_seed(seed)
    other = gpt2()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))  # other weights: the checkpoint must overwrite them
    opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    step = metadist.compile(step_fn, mesh=(2,), plan=plan)
    step.prepare(other, opt, batch)
    return other, opt, step

# a plain-DCP checkpoint resumes in a compiled step under another plan
other, opt, step = fresh("dp", 5)
step.load(ckpt_plain)
assert abs(step(other, opt, batch).item() - next_loss) < 1e-5

# the compiled step's checkpoint loads with plain DCP calls into a model sharded by another plan
other2, opt2, step2 = fresh("zero2", 6)
state = {"model": get_model_state_dict(other2), "optim": get_optimizer_state_dict(other2, opt2)}
dcp.load(state, checkpoint_id=ckpt_step)
set_model_state_dict(other2, state["model"])
set_optimizer_state_dict(other2, opt2, state["optim"])
assert abs(step2(other2, opt2, batch).item() - next_loss) < 1e-5

# a checkpoint of another model is refused and changes nothing
small = torch.nn.Linear(4, 4)
dcp.save({"model": get_model_state_dict(small)}, checkpoint_id=ckpt_plain + "-other")
before = [p.full_tensor().clone() for p in other.parameters()]
try:
    step.load(ckpt_plain + "-other")
except Exception as err:
    assert "failed" in str(err) and "Missing key" in str(err), err
else:
    raise AssertionError("a checkpoint of another model must be refused")
assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, other.parameters()))
rank0_print("OK checkpoints", next_loss)
finish()
""", args=(str(tmp_path / "plain"), str(tmp_path / "step")))
    assert "OK checkpoints" in result.stdout
