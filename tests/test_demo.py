"""README's main job runs, and what it prints holds: every flash mode emits plain's tokens."""

from flashspec import demo


def test_demo_runs_and_every_mode_matches_plain(capsys):
    assert demo.main(["--samples", "2000"]) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if "same tokens as plain" in line]
    assert len(lines) == 8
    assert all(line.split("same tokens as plain: ")[1].startswith("True") for line in lines), printed
    assert "identical to plain sampling: False" not in printed
