"""A GradScaler's scale and growth tracker saved and restored by metadist.Checkpointer."""

from __future__ import annotations

import pytest
import torch

import metadist
from metadist.frontends.torch.scaler import scaler_state, write_scaler_state
from metadist.runtime.errors import RunInputError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_the_scalers_scale_and_growth_tracker_come_back(tmp_path):
    model, optimizer = _model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    write_scaler_state(scaler, "scale", torch.full((), 1024.0))
    write_scaler_state(scaler, "growth_tracker", torch.full((), 7, dtype=torch.int32))
    checkpointer = metadist.Checkpointer(str(tmp_path), every=1)
    checkpointer.save(3, model, optimizer, scaler=scaler)

    fresh_model, fresh_optimizer = _model_and_optimizer()
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    assert float(scaler_state(fresh, "scale")) == 2.0 ** 16  # before: torch's initial value
    assert metadist.Checkpointer(str(tmp_path), every=1).restore(fresh_model, fresh_optimizer, scaler=fresh) == 3
    assert float(scaler_state(fresh, "scale")) == 1024.0
    assert scaler_state(fresh, "growth_tracker").dtype == torch.int32
    assert int(scaler_state(fresh, "growth_tracker")) == 7
    write_scaler_state(scaler, "scale", torch.full((), 8.0))  # the saved state is a copy, not the live tensor
    assert float(scaler_state(fresh, "scale")) == 1024.0


def test_restoring_a_scaler_from_a_checkpoint_without_one_is_a_clear_error(tmp_path):
    model, optimizer = _model_and_optimizer()
    metadist.Checkpointer(str(tmp_path), every=1).save(1, model, optimizer)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RunInputError, match="does not fit this run"):
        metadist.Checkpointer(str(tmp_path), every=1).restore(model, optimizer, scaler=scaler)
    assert float(scaler_state(scaler, "scale")) == 2.0 ** 16
    with pytest.raises(RunInputError, match="GradScaler"):
        metadist.Checkpointer(str(tmp_path), every=1).save(2, model, optimizer, scaler=object())
