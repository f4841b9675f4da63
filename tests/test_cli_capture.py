"""`metadist capture`: summaries, JSON output, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from metadist.cli.main import main
from metadist.ir import graph_from_json


def test_capture_builtin_prints_summary_and_writes_json(tmp_path, capsys):
    out = tmp_path / "graph.json"
    assert main(["capture", "mlp", "--json", str(out), "--text", str(tmp_path / "graph.txt")]) == 0
    printed = capsys.readouterr().out
    for expected in ("nodes", "parameters", "captured in", "param", "optim_state", "aten.mm.default"):
        assert expected in printed
    graph = graph_from_json(out.read_text())
    assert json.loads(out.read_text())["format"] == "metadist.graph"
    assert (tmp_path / "graph.txt").read_text() == graph.to_text()


def test_capture_user_model_file(tmp_path, capsys):
    model_file = tmp_path / "my_model.py"
    model_file.write_text(textwrap.dedent(
        """
        import torch
        import metadist

        def workload():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            batch = (torch.randn(4, 8), torch.randn(4, 1))
            return metadist.Workload(
                model=model, batch=batch,
                loss_fn=lambda model, batch: torch.nn.functional.l1_loss(model(batch[0]), batch[1]),
                optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
            )
        """
    ))
    assert main(["capture", f"{model_file}:workload", "--top", "40"]) == 0
    assert "aten.tanh.default" in capsys.readouterr().out


def test_capture_errors_exit_2_with_a_message_and_no_traceback(tmp_path):
    cases = [
        (["capture", "gpt3-huge"], "unknown built-in workload"),
        (["capture", str(tmp_path / "missing.py")], "does not exist"),
    ]
    for args, expected in cases:
        result = subprocess.run(
            [sys.executable, "-m", "metadist.cli.main", *args], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 2, result.stderr
        assert expected in result.stderr
        assert "Traceback" not in result.stderr
