"""probes/stall_profile.py: reading Nsight Compute's exported source page and summing its
stall samples by address block (the profiling itself needs a CUDA machine with ncu)."""

import pytest

from script_module import PROBES, load_script

profile = load_script("stall_profile", PROBES)

# The layout of `ncu --page source --print-source sass --csv`: a kernel-name line, the header,
# one row per SASS instruction (numbers may carry thousands separators).
SOURCE_CSV = '''"Kernel Name","lm_head_tiles_ws_kernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x7f0000000400","UTMALDG.2D [UR8], [UR4]","10","9","1,000","0","8","2","7"
"0x7f0000000410","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R4","30","30","1,000","0","30","0","30"
"0x7f0000001000","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24","50","40","2,000","5","0","45","0"
"0x7f0000001010","@!P0  BAR.SYNC.DEFER_BLOCKING 0x3, 0x80","8","8","2,000","8","0","0","0"
"0x7f0000002000","MUFU.LG2 R5, R4","2","1","4,000","0","0","2","0"
'''


@pytest.fixture
def source_csv(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text(SOURCE_CSV)
    return path


def test_reads_every_instruction_with_its_samples_and_reasons(source_csv):
    rows = profile.read_source_csv(source_csv)
    assert [r["address"] - rows[0]["address"] for r in rows] == [0, 0x10, 0xC00, 0xC10, 0x1C00]
    assert [r["samples"] for r in rows] == [10, 30, 50, 8, 2]
    assert rows[2]["executed"] == 2000
    # Only the "All Samples" reasons, by their short names.
    assert rows[1]["reasons"] == {"barrier": 0, "long_sb": 30, "wait": 0}


def test_sums_samples_by_block_and_names_the_markers(source_csv):
    text = profile.summarize(profile.read_source_csv(source_csv), block=0x400, top=2)
    lines = text.splitlines()
    assert lines[0].startswith("100 stall samples, 5 instructions")
    load, mma, epilogue = lines[2:5]
    # The load block (TMA issue and its mbarrier wait), the MMA block (a predicated barrier
    # is still a barrier), the epilogue block.
    assert load.split()[:3] == ["0x0", "40", "40.0%"] and "TRYWAIT UTMALDG;" in load
    assert "long_sb=38" in load
    assert mma.split()[:3] == ["0xc00", "58", "58.0%"] and "BAR HGMMA;" in mma
    assert "wait=45" in mma and "barrier=13" in mma
    assert epilogue.split()[:2] == ["0x1c00", "2"] and "MUFU;" in epilogue
    # Then the instructions with the most samples, most first.
    assert "HGMMA" in lines[-2] and "TRYWAIT" in lines[-1]


def test_small_blocks_are_left_out(source_csv):
    text = profile.summarize(profile.read_source_csv(source_csv), block=0x400, min_share=0.05)
    assert "MUFU;" not in text.split("instructions with the most samples")[0]


def test_summarize_from_the_command_line(source_csv, capsys):
    assert profile.main(["--summarize", str(source_csv), "--block", "0x1000", "--top", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "blocks of 0x1000 bytes" in lines[0]
    # Load and MMA code now share the first block; the epilogue's instruction is the second.
    assert [line.split()[:2] for line in lines[2:4]] == [["0x0", "98"], ["0x1000", "2"]]
    assert len(lines) == 6 and "HGMMA" in lines[-1]


def test_rows_are_checked_by_name(capsys):
    with pytest.raises(SystemExit) as exit_info:
        profile.main(["--kernel", "verify", "--rows", "3", "--drafts", "3"])
    assert exit_info.value.code == 2
    assert "--rows=3: at least 1 (verify: a multiple of --drafts + 1 = 4)" in capsys.readouterr().err
