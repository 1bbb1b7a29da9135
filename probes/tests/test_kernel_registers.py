"""probes/kernel_registers.py: stage 1 compiled for sm_90a on the CPU (Triton + ptxas)."""

import json
import os
import subprocess
import sys

import pytest

from flashspec import kernels
from script_module import PROBES, load_script

registers = load_script("kernel_registers", PROBES)


def _reports(tmp_path, kernel: str, configs: str, *options: str) -> list[dict]:
    """kernel_registers.py's reports, run in a process of its own: under TRITON_INTERPRET=1
    (set by conftest) Triton's own jitted helpers are interpreted functions and nothing
    compiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROBES.parent), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, str(PROBES / "kernel_registers.py"), "--kernel", kernel,
                    "--configs", configs, "--out", str(tmp_path), *options],
                   env=env, check=True, capture_output=True, timeout=300)
    return json.loads((tmp_path / "kernel_registers.json").read_text())["reports"]


def _config_text(config) -> str:
    """A Gluon TileConfig as kernel_registers.py's --configs item."""
    c = config
    return (f"{c.block_v},{c.block_r},{c.block_d},{c.num_warps},{c.num_stages},ws"
            + (",screen" if c.screen else ""))


def test_reports_registers_shared_memory_and_programs_per_sm(tmp_path):
    reports = _reports(tmp_path, "verify", "64,16,64,4,2 128,16,128,4,3")
    assert [r["config"]["block_v"] for r in reports] == [64, 128]
    for r in reports:
        assert 16 <= r["registers"] <= 255 and r["spill_store_bytes"] >= 0
        # As many programs as fit: n do (shared memory with its 1 KB reserve, registers in
        # units of 8 per thread, threads) and n + 1 do not.
        threads = 32 * r["config"]["num_warps"]
        registers_per_program = -(-r["registers"] // 8) * 8 * threads
        fits = lambda n: (n * (r["shared_bytes"] + 1024) <= 228 * 1024  # noqa: E731
                          and n * registers_per_program <= 65536 and n * threads <= 2048)
        assert r["programs_per_sm"] >= 1 and fits(r["programs_per_sm"])
        assert not fits(r["programs_per_sm"] + 1)
    # Pipeline buffers of a 128-token by 128-deep weight tile and a 16-row hidden tile.
    assert reports[1]["shared_bytes"] >= 2 * (128 * 128 + 16 * 128) * 2


def test_writes_the_disassembly_and_counts_its_instructions(tmp_path):
    report, = _reports(tmp_path, "sample", "128,128,64,4,5,ws,screen", "--sass")
    sass = open(report["sass_path"]).read()
    assert report["sass_instructions"] == len(registers.SASS_INSTRUCTION.findall(sass)) > 1000
    # The Gluon kernel's wgmma and the screen's SFU logarithms, as compiled for sm_90a.
    assert "HGMMA.64x128x16.F32.BF16" in sass and "MUFU.LG2" in sass


def test_reports_the_warp_specialized_kernel(tmp_path):
    report, = _reports(tmp_path, "qwen", "128,128,64,8,4,ws")
    assert report["config"]["warp_specialized"] and report["programs_per_sm"] == 1
    # Every warp's share at launch: 65,536 over 16 warps; the load warp gives back to 24,
    # the MMA warpgroup takes 160 for its 128-register accumulator.
    assert report["registers"] == 128
    assert {24, 160} <= set(report["partition_registers"])
    # Four stages of 128x64 hidden and weight tiles and the 128x128 fp32 hand-over tile.
    assert report["shared_bytes"] >= 4 * 2 * 128 * 64 * 2 + 128 * 128 * 4


def test_reports_the_screened_epilogue_of_the_default_table(tmp_path):
    """The default table's untruncated Gluon configuration up to 256 rows (4 epilogue warps,
    noise screen, 5 stages) compiles without spilling, and its five stages and the
    hand-over tile fit in the 227 KB of shared memory a Hopper program may take: what its
    timing assumed."""
    default = kernels.default_config(256, warp_specialized=True)
    assert (default.block_r, default.num_warps, default.num_stages, default.screen) \
        == (128, 4, 5, True)
    report, = _reports(tmp_path, "sample", _config_text(default))
    assert report["registers"] == 168
    assert report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0
    assert 5 * 2 * 128 * 64 * 2 + 128 * 128 * 4 <= report["shared_bytes"] <= 227 * 1024


@pytest.mark.parametrize("kernel, rows, truncation", [("sample", 128, False), ("qwen", 64, True)])
def test_the_64_row_entries_fit_their_eight_stages(tmp_path, kernel, rows, truncation):
    """The default table's 64-row Gluon entries: eight stages of 64x64 hidden and 128x64
    weight tiles and the 64x128 fp32 hand-over tile in the 227 KB a Hopper program may take."""
    default = kernels.default_config(rows, truncation=truncation, warp_specialized=True)
    assert (default.block_r, default.num_stages) == (64, 8)
    report, = _reports(tmp_path, kernel, _config_text(default))
    assert 8 * (64 + 128) * 64 * 2 + 64 * 128 * 4 <= report["shared_bytes"] <= 227 * 1024


@pytest.mark.parametrize("verification", [False, True])
def test_the_512_deep_entry_keeps_two_programs_per_sm_and_fits_100_kb(tmp_path, verification):
    """Up to 16 bf16 rows: one 80 KB buffer (2 stages), two programs per SM on Hopper, and
    within the ~100 KB a block may take on other GPUs; 4-byte inputs keep the 64-deep steps
    on 3 stages, since 256-deep ones would need 144 KB."""
    default = kernels.default_config(16, verification=verification)
    assert (default.block_d, default.num_stages) == (512, 2)
    c = default
    report, = _reports(tmp_path, "verify" if verification else "sample",
                       f"{c.block_v},{c.block_r},{c.block_d},{c.num_warps},{c.num_stages}")
    assert report["shared_bytes"] <= 99 * 1024 and report["programs_per_sm"] == 2
    fp32 = kernels.default_config(16, element_size=4, verification=verification)
    assert (fp32.block_d, fp32.num_stages) == (64, 3)


def test_interpreter_is_refused_by_name(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registers.main(["--configs", "64,16,64,4,2"]) == 2
    assert "unset TRITON_INTERPRET" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--configs", "64,16"], "expected 5 or 6 integers"),
    (["--configs", "64,16,64,4,2", "--kernel", "topk"], "invalid choice"),
    ([], "--configs"),
])
def test_bad_arguments_are_refused_by_name(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        registers.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
