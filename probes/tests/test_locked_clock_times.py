"""probes/locked_clock_times.py: reading Nsight Compute's per-launch durations and the table
(the profiling itself needs a CUDA machine with ncu)."""

import json

import pytest

from script_module import PROBES, load_script

times = load_script("locked_clock_times", PROBES)

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def _row(launch: int, kernel: str, ns: str) -> str:
    return (f'"{launch}","3089","python3.12","127.0.0.1","{kernel}","1","7","(384, 1, 1)",'
            f'"(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum",'
            f'"ns","{ns}"')


# ncu's own lines come first on stdout; launches as they were profiled (ID order), three calls
# of two kernels each; durations carry thousands separators.
VERIFY_CSV = "\n".join([
    "==PROF== Connected to process 3089 (/usr/bin/python3.12)",
    "==PROF== Disconnected from process 3089", HEADER,
    _row(0, "lm_head_tiles_ws_kernel", "525,920"), _row(1, "lm_head_rows_kernel", "5,696"),
    _row(2, "lm_head_tiles_ws_kernel", "516,992"), _row(3, "lm_head_rows_kernel", "5,700"),
    _row(5, "lm_head_rows_kernel", "5,800"), _row(4, "lm_head_tiles_ws_kernel", "521,000"),
]) + "\n"


def test_reads_launches_in_order_in_milliseconds():
    launches = times.read_durations(VERIFY_CSV)
    assert [name for name, _ in launches] == ["lm_head_tiles_ws_kernel", "lm_head_rows_kernel"] * 3
    assert launches[0][1] == pytest.approx(0.52592)
    assert launches[5][1] == pytest.approx(0.0058)


def test_summarizes_medians_per_kernel_and_the_call_total():
    point = times.summarize_point(times.read_durations(VERIFY_CSV))
    assert point["kernels"]["lm_head_tiles_ws_kernel"] == dict(median_ms=pytest.approx(0.521),
                                                               per_call=1)
    assert point["kernels"]["lm_head_rows_kernel"]["median_ms"] == pytest.approx(0.0057)
    assert point["call_ms"] == pytest.approx((525.920 + 516.992 + 521.0 + 5.696 + 5.7 + 5.8)
                                             / 3 / 1000)


def test_refuses_launches_that_do_not_split_into_the_calls():
    launches = times.read_durations(VERIFY_CSV)[:5]
    with pytest.raises(ValueError, match="5 launches profiled for 3 calls"):
        times.summarize_point(launches)


def test_table_gives_ratios_to_matmul_at_the_same_rows(tmp_path, capsys):
    verify = dict(kernel="verify", rows=256, drafts=3,
                  **times.summarize_point(times.read_durations(VERIFY_CSV)))
    matmul = dict(kernel="matmul", rows=256, drafts=3,
                  kernels={"nvjet_sm90_tst_256x128": dict(median_ms=0.51, per_call=1)},
                  call_ms=0.51)
    lonely = dict(verify, rows=512)
    path = tmp_path / "locked_clock_times.json"
    path.write_text(json.dumps(dict(device="test", points=[matmul, verify, lonely])))
    assert times.main(["--summarize", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "sum of its kernels" in lines[0] and "x1.000" in lines[1]
    assert f"x{verify['call_ms'] / 0.51:.3f}" in lines[2]
    assert lines[3].split()[2:5] == ["512", f"{verify['call_ms']:.4f}", "-"]  # no matmul there


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        times.main(["--kernels", "softmax"])
    with pytest.raises(SystemExit):
        times.main(["--kernels", "verify", "--rows", "255"])
    with pytest.raises(SystemExit):
        times.main(["--drafts", "0"])
