"""Periodic checkpoints you can trust, and resuming from the latest complete one.

A :class:`Checkpointer` owns a folder of checkpoints, one per saved step
(``step-00000100``), each a torch.distributed.checkpoint directory holding:

* ``model`` and ``optim``: the model's and optimizer's state as
  ``torch.distributed.checkpoint.state_dict`` gives them (DTensor shards, so
  every rank writes only its own; the layout plain DCP users and torchtitan
  write, see :mod:`.checkpoint`);
* ``progress``: the step, and the RNG states of the CPU and the accelerator
  (every rank holds rank 0's: a compiled step keeps them alike);
* ``scaler``: a ``torch.amp.GradScaler``'s scale and growth tracker (``scaler=``; a captured step keeps
  them in the user's scaler, :mod:`metadist.frontends.torch.scaler`), so a resumed fp16 run scales its loss
  where the saved one left off;
* any *stateful* objects the caller names (an LR scheduler, a data loader
  or sampler, anything with ``state_dict()``/``load_state_dict()``), and plain
  Python values (``extra``: a data position, a config), pickled.

A save writes into a partial folder that is renamed only once every rank has
finished (asynchronously when asked: the state is staged to memory, the step
goes on, and the rename happens when the write completes), so a checkpoint
that was being written when a process died is never taken for a complete
one; :meth:`Checkpointer.restore` loads the newest complete checkpoint, on
any mesh or world size (DCP reshards), into the model and optimizer where
they lie, and returns the step to continue from. Older checkpoints beyond
``keep`` are removed after a newer one is complete.

Every rank must see the same folder (one machine, or a shared filesystem).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .checkpoint import require_complete, training_state_dict
from .errors import RunInputError

__all__ = ["Checkpointer", "restore_rng", "rng_state"]

log = logging.getLogger(__name__)

_STEP_FOLDER = re.compile(r"^step-(\d{8,})$")


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random number generator states: the CPU's, and the current CUDA device's if there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Checkpointer:
    """Checkpoints every ``every`` steps into ``directory``; :meth:`restore` resumes from the newest complete one.

    ::

        checkpointer = metadist.Checkpointer("ckpt/", every=100, keep=3)
        train_step.prepare(model, optimizer, batch)            # places the state (or run a first step)
        start = checkpointer.restore(model, optimizer, scheduler=scheduler)
        for step in range(start, total_steps):
            loss = train_step(model, optimizer, next_batch(step))
            scheduler.step()
            checkpointer.maybe_save(step + 1, model, optimizer, scheduler=scheduler)
        checkpointer.wait()
    """

    directory: str | os.PathLike
    every: int
    """Save when the step count is a multiple of this (see :meth:`maybe_save`)."""
    keep: int = 2
    """Complete checkpoints kept; older ones are removed once a newer one is complete (0: keep all)."""
    async_save: bool = False
    """Write in the background (torch.distributed.checkpoint.async_save): the state is copied to memory first,
    the training goes on, and the checkpoint is renamed complete when the write finishes."""
    _pending: list = field(default_factory=list, init=False, repr=False)
    _group: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be at least 1 (save every N steps), got {self.every}")
        if self.keep < 0:
            raise ValueError(f"keep must be 0 (keep all) or more, got {self.keep}")
        self.directory = Path(self.directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise RunInputError(f"checkpoint directory {str(self.directory)!r} is a file; pass a folder")

    # -- where -----------------------------------------------------------------
    def path(self, step: int) -> Path:
        return Path(self.directory) / f"step-{step:08d}"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first (partial folders are ignored)."""
        folder = Path(self.directory)
        if not folder.is_dir():
            return []
        steps = []
        for entry in folder.iterdir():
            match = _STEP_FOLDER.match(entry.name)
            if match and (entry / ".metadata").is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> int | None:
        """The newest step with a complete checkpoint, or None."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    # -- saving ----------------------------------------------------------------
    def maybe_save(self, step: int, model: torch.nn.Module, optimizer: Any, *, extra: Mapping[str, Any] | None = None,
                   scaler: Any = None, **stateful: Any) -> bool:
        """Save if ``step`` is a multiple of ``every``; returns whether it saved."""
        if step % self.every:
            return False
        self.save(step, model, optimizer, extra=extra, scaler=scaler, **stateful)
        return True

    def save(self, step: int, model: torch.nn.Module, optimizer: Any, *, extra: Mapping[str, Any] | None = None,
             scaler: Any = None, **stateful: Any) -> None:
        """Save the state after ``step`` steps (collective: every rank calls it with the same step).

        ``scaler``: the step's ``torch.amp.GradScaler``, whose scale and growth tracker are saved with the state."""
        self.wait()  # one save in flight at a time: a newer one must not finish before an older one
        state = training_state_dict(model, optimizer)
        state["progress"] = {"step": step, "rng": rng_state()}
        if scaler is not None:
            state["scaler"] = _scaler_tensors(scaler, clone=True)
        state["extra"] = io.BytesIO(pickle.dumps(dict(extra or {})))
        for name, value in stateful.items():
            if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
                raise RunInputError(f"{name}={type(value).__name__}: pass objects with state_dict()/load_state_dict() "
                                    "by name (an LR scheduler, a sampler); plain values go in extra={...}")
            state[f"stateful.{name}"] = value.state_dict()
        final, partial = self.path(step), Path(self.directory) / f".step-{step:08d}.partial"
        if _is_coordinator():
            Path(self.directory).mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that died
        _barrier()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=os.fspath(partial), process_group=self._checkpoint_group())
            self._pending.append((future, partial, final))
        else:
            dcp.save(state, checkpoint_id=os.fspath(partial))
            _barrier()
            self._complete(partial, final)

    def wait(self) -> None:
        """Finish every save in flight (collective when one is in flight)."""
        pending, self._pending = self._pending, []
        for future, partial, final in pending:
            future.result()
            _barrier(self._checkpoint_group())
            self._complete(partial, final)

    def _complete(self, partial: Path, final: Path) -> None:
        if _is_coordinator():
            if final.exists():  # the same step saved again (after a restart): the newer one wins
                shutil.rmtree(final)
            partial.rename(final)
            self._remove_old()
        _barrier(self._checkpoint_group() if self.async_save else None)
        log.info("checkpoint %s complete", final)

    def _remove_old(self) -> None:
        if self.keep == 0:
            return
        for step in self.complete_steps()[:-self.keep]:
            shutil.rmtree(self.path(step), ignore_errors=True)

    def _checkpoint_group(self) -> Any:
        """A gloo group of its own for background saves, so that they never interleave with the step's collectives."""
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        return self._group

    # -- restoring ---------------------------------------------------------------
    def restore(self, model: torch.nn.Module, optimizer: Any, *, step: int | None = None,
                extra: dict[str, Any] | None = None, scaler: Any = None, **stateful: Any) -> int:
        """Load the newest complete checkpoint (or the one of ``step``) into the model, optimizer and ``stateful``
        objects, in place; returns its step (0 when the folder holds no checkpoint: start from scratch).

        ``extra``: a dict that receives the saved plain values. The checkpoint may come from another mesh or
        world size. A checkpoint of another model, or a damaged one, is an error naming its folder; nothing
        of the running state is changed then. ``scaler``: a ``torch.amp.GradScaler`` that takes the saved scale
        and growth tracker (the checkpoint must hold them: saved with ``scaler=``).
        """
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        from .checkpoint import _first_line, _staged

        chosen = self.latest() if step is None else step
        if chosen is None:
            return 0
        path = self.path(chosen)
        require_complete(path)
        staged = {key: _staged(value) for key, value in training_state_dict(model, optimizer).items()}
        staged["progress"] = {"step": 0, "rng": rng_state()}
        staged["extra"] = io.BytesIO()
        if scaler is not None:
            staged["scaler"] = _scaler_tensors(scaler, clone=True)
        for name, value in stateful.items():
            staged[f"stateful.{name}"] = value.state_dict()
        try:
            dcp.load(staged, checkpoint_id=os.fspath(path))
        except (Exception, CheckpointException) as err:
            raise RunInputError(
                f"the checkpoint {str(path)!r} does not fit this run: {_first_line(err)}. It must come from the same "
                "model, optimizer and stateful objects (any mesh or world size); remove it or point "
                "Checkpointer at another folder"
            ) from err
        set_model_state_dict(model, staged["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, staged["optim"])
        for name, value in stateful.items():
            value.load_state_dict(staged[f"stateful.{name}"])
        if scaler is not None:
            from ..frontends.torch.scaler import write_scaler_state

            for key, tensor in staged["scaler"].items():
                write_scaler_state(scaler, key, tensor.to(_scaler_tensors(scaler)[key].device))
        restore_rng(staged["progress"]["rng"])
        if extra is not None:
            staged["extra"].seek(0)
            extra.update(pickle.loads(staged["extra"].read()))
        saved_step = int(staged["progress"]["step"])
        log.info("resumed from %s (step %d)", path, saved_step)
        return saved_step


def _scaler_tensors(scaler: Any, clone: bool = False) -> dict[str, torch.Tensor]:
    """A GradScaler's scale and growth tracker (as torch would create them before first use), on the CPU when ``clone``."""
    from ..frontends.torch.scaler import SCALER_STATE_KEYS, scaler_state

    if not isinstance(scaler, torch.amp.GradScaler):
        raise RunInputError(f"scaler={type(scaler).__name__}: pass the step's torch.amp.GradScaler")
    tensors = {key: scaler_state(scaler, key) for key in SCALER_STATE_KEYS}
    return {key: tensor.detach().cpu().clone() for key, tensor in tensors.items()} if clone else tensors


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)

