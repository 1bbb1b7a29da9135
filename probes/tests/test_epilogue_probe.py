"""probes/epilogue_probe.py: its variants compile for sm_90a on the CPU with the partitions
swapped (and restored), its arguments and its table (the timing needs a CUDA machine with
ncu)."""

import json
import os
import subprocess
import sys

import pytest

from script_module import PROBES, load_script

probe = load_script("epilogue_probe", PROBES)

# Compiles stage 1 for sampling (128x128 tiles, 4 epilogue warps, the screen; "variant@kernel"
# for another kernel) under each variant named on the command line, and prints what its PTX
# holds: wgmma instructions, TMA copies, Philox's second multiplier (0xD2511F53 as PTX's signed
# decimal) and the stand-in words' multiplier.
COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import triton
import epilogue_probe as probe
import kernel_registers as kr
from sweep_tiles import parse_configs

compile_ = triton.compile
ptx = {}
def keep_ptx(*args, **kwargs):
    compiled = compile_(*args, **kwargs)
    ptx["last"] = compiled.asm["ptx"]
    return compiled
triton.compile = keep_ptx
config = parse_configs("128,128,64,4,5,ws,screen")[0]
found = []
for text in sys.argv[2:]:
    variant, _, kernel = text.partition("@")  # "variant@kernel"; sampling by default
    kernel = kernel or "sample"
    with probe.variant_installed(probe.parse_variant(variant)):
        kr._warp_specialized_report(kernel, config, *kr.KERNELS[kernel])
    text_ptx = ptx["last"]
    found.append(dict(variant=text, wgmma=text_ptx.count("wgmma.mma_async"),
                      tma=text_ptx.count("cp.async.bulk.tensor"),
                      philox=text_ptx.count("-766435501"), stand_in=text_ptx.count("40503"),
                      xor=text_ptx.count("xor.b32")))
print(json.dumps(found))
"""


def _compiled(variants: list[str]) -> list[dict]:
    # In a process of its own: under TRITON_INTERPRET=1 (conftest) nothing compiles.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(PROBES.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE, str(PROBES), *variants], env=env,
                            check=True, capture_output=True, text=True, timeout=600)
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.skipif(probe.lm_head_ws.gluon is None, reason="Gluon needs Triton 3.6")
def test_each_variant_compiles_without_what_it_switches_off_and_full_is_restored():
    full, no_mma, no_load, cheap, padded, full_again = _compiled(
        ["full", "no-mma", "no-load", "cheap-bits", "pad-16", "full"])
    assert full["wgmma"] > 0 and full["tma"] > 0 and full["philox"] > 0
    assert full["stand_in"] == 0
    assert no_mma["wgmma"] == 0 and no_mma["tma"] == full["tma"]
    assert no_load["tma"] == 0 and no_load["wgmma"] == full["wgmma"]
    # The words of the screen and of the exact fallback; the leader's exact noise still
    # calls Philox once per row.
    assert cheap["stand_in"] > 0 and 0 < cheap["philox"] < full["philox"] // 4
    assert cheap["wgmma"] == full["wgmma"]
    # 8 xorshift rounds per word, each a shift and a xor, on the screen's and the fallback's
    # 32 words a thread: 256 more xors at least.
    assert padded["philox"] == full["philox"] and padded["xor"] >= full["xor"] + 2 * 8 * 32
    assert full_again == dict(full, variant="full")


def test_a_failed_point_is_kept_and_the_others_are_measured(monkeypatch, tmp_path):
    written = []
    monkeypatch.setattr(probe.lct, "measure_point", lambda kernel, rows, drafts: dict(
        kernel=kernel, rows=rows, kernels={"k": dict(median_ms=0.5, per_call=1)}, call_ms=0.5))

    def measure(kernel, rows, config, flags, drafts):
        if flags == ("pad-16",):
            raise SystemExit("ncu took more than 300 s")
        return dict(kernel=kernel, rows=rows, config=config, variant=probe.variant_name(flags),
                    kernels={"lm_head_tiles_ws_kernel": dict(median_ms=0.6, per_call=1)},
                    call_ms=0.6)
    monkeypatch.setattr(probe, "measure_point", measure)
    monkeypatch.setattr(probe.lct, "write_report",
                        lambda points, path, table=None: written.append((list(points), table)))
    assert probe.main(["--kernels", "sample", "--variants", "full,pad-16,no-mma",
                       "--out", str(tmp_path)]) == 0
    # Rewritten after each of the 5 points, then once more with the table.
    assert len(written) == 6 and written[-1][1] is probe.format_table
    points = written[-1][0]
    assert [p.get("variant") for p in points] == [None, None, "full", "pad-16", "no-mma"]
    assert points[3] == dict(kernel="sample", rows=256, config="128,128,64,4,5,ws,screen",
                             variant="pad-16", error="ncu took more than 300 s")


@pytest.mark.skipif(probe.lm_head_ws.gluon is None, reason="Gluon needs Triton 3.6")
def test_variants_are_swapped_in_and_restored():
    ws = probe.lm_head_ws
    shipped = (ws._load_partition, ws._mma_partition, ws._tile_bits)
    with probe.variant_installed(("no-load", "no-mma")):
        assert ws._load_partition is probe._load_partition_no_copy
        assert ws._mma_partition is probe._mma_partition_idle
        assert ws._tile_bits is shipped[2]
    assert (ws._load_partition, ws._mma_partition, ws._tile_bits) == shipped
    with pytest.raises(RuntimeError), probe.variant_installed(("cheap-bits",)):
        assert ws._tile_bits is probe._cheap_tile_bits
        raise RuntimeError
    assert ws._tile_bits is shipped[2]


def test_variant_names_parse_to_sorted_flags():
    assert probe.parse_variant("full") == ()
    assert probe.parse_variant("no-mma+no-load") == ("no-load", "no-mma")
    assert probe.variant_name(("no-load", "no-mma")) == "no-load+no-mma"
    assert probe.variant_name(()) == "full"
    assert probe.parse_variant("pad-16+no-mma") == ("no-mma", "pad-16")
    for bad in ("no-epilogue", "no-mma+", "", "cheap-bits+pad-8", "pad-8+pad-16"):
        with pytest.raises(Exception, match="variant"):
            probe.parse_variant(bad)


def test_table_gives_ratios_to_matmul_and_to_the_full_variant(tmp_path, capsys):
    stage1 = lambda ms: {"lm_head_tiles_ws_kernel": dict(median_ms=ms, per_call=1),  # noqa: E731
                         "lm_head_rows_kernel": dict(median_ms=0.006, per_call=1)}
    config = "128,128,64,4,5,ws,screen"
    points = [
        dict(kernel="matmul", rows=256, kernels={"nvjet": dict(median_ms=0.5, per_call=1)},
             call_ms=0.5),
        dict(kernel="sample", rows=256, config=config, variant="full", kernels=stage1(0.6),
             call_ms=0.606),
        dict(kernel="sample", rows=256, config=config, variant="no-load+no-mma",
             kernels=stage1(0.45), call_ms=0.456),
        dict(kernel="sample", rows=512, config=config, variant="no-mma", kernels=stage1(0.9),
             call_ms=0.906),
        dict(kernel="verify", rows=256, config=config, variant="pad-16",
             error="ncu took more than 300 s for verify, 256 rows"),
        dict(kernel="sample", rows=256, config=config, variant="pad-16", kernels=stage1(0.63),
             call_ms=0.636),
    ]
    path = tmp_path / "epilogue_probe.json"
    path.write_text(json.dumps(dict(device="test", points=points)))
    assert probe.main(["--summarize", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-3:] == ["0.5000", "x1.000", "-"]
    assert lines[2].split()[-3:] == ["0.6000", "x1.200", "x1.000"]
    assert lines[3].split()[-3:] == ["0.4500", "x0.900", "x0.750"]
    assert lines[4].split()[-3:] == ["0.9000", "-", "-"]  # no matmul, no full at 512 rows
    assert "pad-16" in lines[5] and lines[5].endswith("failed: ncu took more than 300 s for "
                                                      "verify, 256 rows")
    # +0.03 ms at 1.413 GHz = 42,390 cycles, over 481 / 32 instructions per logit on 256 rows
    # of 151,936 logits: 256 * 151,936 * 15.03 / 32 / 528 = 34,598 per scheduler.
    assert lines[-1] == (f"pad-16 against full, sample R=256 {config}: +15.0 instructions per "
                         f"logit, 1.23 cycles each per scheduler")


def test_arguments_are_checked():
    for argv in (["--configs", "128,128,64,4,5,screen"],  # not the Gluon kernel
                 ["--kernels", "matmul"], ["--variants", "no-epilogue"],
                 ["--kernels", "verify", "--rows", "255"], ["--drafts", "0"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            probe.main(argv)
