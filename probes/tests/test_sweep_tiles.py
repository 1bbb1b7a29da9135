"""probes/sweep_tiles.py: the --quick run (CPU, kernels interpreted) and its refusals."""

import argparse
import json
import os

import pytest
import torch

from script_module import PROBES, load_script

from flashspec import kernels

sweep = load_script("sweep_tiles", PROBES)


def _run(tmp_path, *args):
    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    code = sweep.main(["--quick", *args, "--out", str(tmp_path)])
    return code, json.loads((tmp_path / "sweep_tiles.json").read_text())


@pytest.mark.parametrize("kernel, rows, drafts", [("sample", "2", "3"), ("verify-qwen", "4", "1"),
                                                  ("topp", "3", "1")])
def test_quick_run_times_default_and_given_configs(tmp_path, kernel, rows, drafts):
    code, report = _run(tmp_path, "--kernel", kernel, "--rows", rows, "--drafts", drafts,
                        "--configs", "64,16,16,4,2 128,16,32,4,3,2")
    assert code == 0 and report["kernel"] == kernel
    results = report["results"]
    assert [r["default"] for r in results] == [True, False, False]
    weight = torch.empty(8, 8, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
    assert results[0]["config"] == sweep.default_config_of(kernel, int(rows), weight, weight).__dict__
    assert [r["config"]["block_v"] for r in results[1:]] == [64, 128]
    assert results[2]["config"]["epilogue_parts"] == 2
    for r in results:
        assert r["error"] is None and r["ms"] > 0 and r["matmul_ms"] > 0 and r["rows"] == int(rows)
        assert r["timing"] == ("graph" if torch.cuda.is_available() else "eager")


@pytest.mark.parametrize("kernel, setting, truncation", [
    ("argmax", None, False), ("sample", "sample", False), ("verify", "sample", False),
    ("qwen", "qwen", True), ("verify-qwen", "qwen", True), ("topp", "topp", True),
    ("verify-topp", "topp", True)])
def test_each_kernel_names_its_setting_and_tile_table(kernel, setting, truncation):
    if setting is not None:  # argmax has none
        assert sweep.setting_of(kernel) == setting
    weight = torch.empty(8, 8, dtype=torch.bfloat16)
    assert sweep.default_config_of(kernel, 40, weight, weight) == kernels.default_config(
        40, 2, truncation=truncation, verification=kernel.startswith("verify"))


def test_suffixes_ask_for_the_warp_specialized_kernel_and_the_screen():
    config, = sweep.parse_configs("128,128,64,4,4,ws")
    assert config.warp_specialized and config.block_d == 64 and not config.screen
    plain, = sweep.parse_configs("128,128,64,4,4")
    assert not plain.warp_specialized and not plain.screen
    both, = sweep.parse_configs("128,128,64,4,4,ws,screen")
    assert both.warp_specialized and both.screen
    assert sweep.parse_configs("64,16,128,4,3,screen")[0].screen
    with pytest.raises(argparse.ArgumentTypeError, match="ws"):
        sweep.parse_configs("128,128,64,4,4,fast")


@pytest.mark.parametrize("rows, block_rs", [(1, {16}), (16, {16}), (17, {16, 32}),
                                            (64, {32, 64}), (65, {64, 128}), (256, {64, 128})])
def test_default_grid_fits_the_rows(rows, block_rs):
    grid = sweep.default_grid(rows)
    assert len(grid) == len({repr(c) for c in grid}) == 24 * len(block_rs)
    assert {c.block_r for c in grid} == block_rs


@pytest.mark.parametrize("args, message", [
    (["--configs", "64,16"], "expected 5 or 6 integers"),
    (["--configs", "64,16,16,4,2,3"], "epilogue_parts=3"),
    (["--configs", "128,32,64,4,4,ws"], "block_r a multiple of 64"),
    (["--configs", "48,16,16,4,2"], "block_v=48 must be a power of two"),
    (["--rows", "0"], "must be positive"),
    (["--rows", "2,x"], "comma-separated positive integers"),
    (["--kernel", "verify", "--rows", "3", "--drafts", "1"], "multiple of --drafts + 1 = 2"),
    (["--kernel", "topk"], "invalid choice"),
])
def test_bad_arguments_are_refused_by_name(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        sweep.main(["--quick", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
