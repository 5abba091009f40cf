"""`python -m rlhpc.plots RUN_DIR ...` as a user runs it: a plot of real runs, a clear error for a wrong argument, and a
note (not a crash) for a file a run is still writing."""

from __future__ import annotations

import pytest

from rlhpc.plots import main
from test_status import a_run


def plot(capsys, *args: str) -> tuple[int, str, str]:
    code = main([*args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_run_is_plotted_to_the_file_named(tmp_path, capsys):
    run = a_run(tmp_path)
    png = tmp_path / "curves.png"
    code, out, err = plot(capsys, str(run.root), "--out", str(png))
    assert code == 0, err
    assert out.strip() == str(png) and png.stat().st_size > 0
    assert err == ""


def test_without_out_the_plot_goes_into_the_first_run_directory_and_its_path_is_printed(tmp_path, capsys,
                                                                                         monkeypatch):
    """It used to be ./curves.png, wherever the command ran (and over the last plot made there)."""
    one, two = a_run(tmp_path / "1"), a_run(tmp_path / "2")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = plot(capsys, str(one.root), str(two.root))
    assert code == 0, err
    assert out.strip() == str(one.root / "curves.png") and (one.root / "curves.png").stat().st_size > 0
    assert list(elsewhere.iterdir()) == [] and not (two.root / "curves.png").exists()


def test_an_out_that_cannot_be_written_is_one_line_naming_out(tmp_path, capsys):
    """A folder that cannot hold the plot (here a file where a folder should be: refused to root too, unlike a
    read-only folder) is one line naming --out, not a traceback."""
    run = a_run(tmp_path)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    code, out, err = plot(capsys, str(run.root), "--out", str(blocker / "curves.png"))
    assert code == 2 and out == ""
    assert err == (f"error: --out: cannot write {blocker / 'curves.png'}: {blocker} is a file, not a folder; name "
                   "another file with --out\n")


def test_a_path_that_does_not_exist_is_an_error_and_nothing_is_drawn(tmp_path, capsys):
    png = tmp_path / "curves.png"
    code, _, err = plot(capsys, str(tmp_path / "rnu"), "--out", str(png))
    assert code == 2
    assert err.strip() == f"error: run directory {tmp_path / 'rnu'} does not exist"
    assert not png.exists()


@pytest.mark.parametrize("what", ["a file", "a folder without config.yaml"])
def test_a_path_that_is_not_a_run_directory_is_an_error(tmp_path, capsys, what):
    path = tmp_path / "not-a-run"
    if what == "a file":
        path.write_text("")
    else:
        (path / "logs").mkdir(parents=True)
    code, _, err = plot(capsys, str(path), "--out", str(tmp_path / "curves.png"))
    assert code == 2
    assert err.strip() == f"error: {path} is not a run directory (no config.yaml written by rlhpc.launch)"


def test_labels_that_do_not_match_the_runs_are_an_error(tmp_path, capsys):
    one, two = a_run(tmp_path / "1"), a_run(tmp_path / "2")
    code, _, err = plot(capsys, str(one.root), str(two.root), "--labels", "a", "--out", str(tmp_path / "curves.png"))
    assert code == 2
    assert err.strip() == "error: --labels: 1 label(s) for 2 run(s); give one per run directory"


@pytest.mark.parametrize("name,content", [("summary.json", ""), ("evals/v000002.json", '{"vers'),
                                          ("logs/trainer-0.metrics.jsonl", '{"step": "x", "rollout/reward": 1.0}\n')])
def test_a_file_the_run_is_still_writing_is_left_out_with_a_note(tmp_path, capsys, name, content):
    run = a_run(tmp_path)
    with open(run.root / name, "a" if name.endswith(".jsonl") else "w") as f:
        f.write(content)
    png = tmp_path / "curves.png"
    code, out, err = plot(capsys, str(run.root), "--out", str(png))
    assert code == 0, err
    assert png.stat().st_size > 0
    assert err.startswith(f"note: {run.root / name}: ") and err.rstrip().endswith("left out of the plot")
