"""probes/race_skip_rate.py: the --quick run (CPU, kernels interpreted)."""

import json

import pytest
import torch

from script_module import PROBES, load_script


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the --quick run is the CPU twin; on a GPU it is a full run")
def test_skip_rate_script_quick_run(tmp_path):
    """probes/race_skip_rate.py --quick (the interpreter, tiny shape) reports tiles beaten."""
    script = load_script("race_skip_rate", PROBES)
    assert script.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "race_skip_rate.json").read_text())
    (result,) = report["results"]
    assert result["config"]["race"] and 0.3 < result["beaten"] <= 1.0
