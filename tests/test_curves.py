"""trainers.curves: validation curves read back from the Lightning CSV logs of training runs."""
from __future__ import annotations

import pytest

from trainers.curves import main, read_curve


def write_log(run, version: int, text: str) -> None:
    folder = run / "logs" / f"version_{version}"
    folder.mkdir(parents=True)
    (folder / "metrics.csv").write_text(text)


def test_curves_merge_resumed_logs_by_step(tmp_path, capsys):
    run = tmp_path / "run_a"
    write_log(run, 0, "epoch,step,train/loss_step,val/top1,val/accept_len_est\n"
                      "0,4,2.0,,\n0,9,,0.50,2.10\n0,19,,0.55,2.30\n")
    write_log(run, 1, "epoch,step,train/loss_step,val/top1,val/accept_len_est\n0,19,,0.56,2.31\n0,29,,0.60,2.50\n")
    curve = read_curve(run)
    assert [r["step"] for r in curve] == [9, 19, 29]          # train-only rows dropped, the resumed log wins
    assert curve[1]["val/top1"] == 0.56 and curve[2]["val/accept_len_est"] == 2.5
    main([str(run), "--out", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert "| 29 | 0.6000 | 2.5000 |" in out and (tmp_path / "c.png").stat().st_size > 0


def test_a_folder_without_logs_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])
    assert exit_info.value.code == 1 and "no logs/version_*/metrics.csv" in capsys.readouterr().err
