"""`dialspec eval` on a tiny slice writes every artefact; the frontier comparison; CLI errors."""

from __future__ import annotations

import json

import pytest

from server import cli
from server.engine.head_store import head_for_pair, save_head
from training.eval_report import frontier_score, verdicts


@pytest.fixture
def run_cli(monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", ["training.commands"])
    return cli.main


def test_eval_writes_every_artefact(tiny_pair, tmp_path, run_cli, capsys):
    target, draft = tiny_pair
    save_head(head_for_pair(target, draft, "tiny-pair"), tmp_path / "head")
    out = tmp_path / "eval"
    argv = ["eval", "--target", str(target), "--draft", str(draft), "--pair-name", "tiny-pair"]
    argv += ["--head", str(tmp_path / "head"), "--out", str(out), "--quick", "--limit", "2"]
    argv += ["--max-tokens", "10", "--tasks", "math,summary,code"]
    assert run_cli(argv) == 0
    for name in ("results.json", "table.md", "acceptance_vs_w.png", "acceptance_vs_w.svg"):
        assert (out / name).stat().st_size > 0, name
    for stem in ("score_vs_time", "score_vs_acceptance"):
        assert (out / f"{stem}.png").stat().st_size > 0 and (out / f"{stem}.svg").stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["tasks"]) == {"math", "summary", "code"}
    families = {r["family"] for r in results["tasks"]["math"]["policies"]}
    assert families == {"ar", "sd", "sd_lossy", "cascade", "static", "learned"}
    for task in results["tasks"].values():
        assert 0 <= task["mean_tv"] <= 1
        for row in task["policies"]:
            assert row["completion_tokens"] > 0 and row["tokens_per_s"] > 0
            if row["family"] == "ar":
                assert row["acceptance"] is None and row["norm_time"] == 1.0
            else:
                assert 0 <= row["acceptance"] <= 1
        w0 = next(r for r in task["policies"] if r["policy"] == "static w=0")
        assert w0["acceptance"] == 1.0  # w = 0: every draft is accepted
    assert set(results["verdict"]) == {"math", "summary", "code"}
    table = (out / "table.md").read_text()
    assert "| method |" in table and "learned d=0.25" in table and "static frontier" in table


def test_frontier_score():
    pts = [(1.0, 0.8), (0.5, 0.6), (0.2, 0.3), (0.6, 0.5)]  # (norm time, score); (0.6, 0.5) is dominated
    assert frontier_score(pts, 0.5, higher_x_better=False) == pytest.approx(0.6)
    assert frontier_score(pts, 0.75, higher_x_better=False) == pytest.approx(0.7)
    assert frontier_score(pts, 0.1, higher_x_better=False) == pytest.approx(0.3)
    assert frontier_score(pts, 2.0, higher_x_better=False) == pytest.approx(0.8)
    acc = [(0.2, 0.8), (0.6, 0.6), (1.0, 0.3)]  # (acceptance, score): higher acceptance is better
    assert frontier_score(acc, 0.4, higher_x_better=True) == pytest.approx(0.7)
    row = dict(score_se=0.01, acceptance=0.6)
    results = {
        "tasks": {
            "t": {
                "policies": [
                    dict(row, family="sd", norm_time=1.0, score=0.8, acceptance=0.2),
                    dict(row, family="static", norm_time=0.2, score=0.3, acceptance=1.0),
                    dict(row, family="learned", policy="learned d=0.5", norm_time=0.5, score=0.7),
                ]
            }
        }
    }
    v = verdicts(results)["t"]
    assert v["beats_time"] and v["beats_acceptance"] and v["beats_clearly"]


def test_cli_mistakes_are_one_line_errors(tiny_pair, tmp_path, run_cli, capsys):
    target, draft = tiny_pair
    assert run_cli(["eval", "--target", str(target)]) == 2
    assert "give both --target and --draft" in capsys.readouterr().err
    base = ["--target", str(target), "--draft", str(draft)]
    assert run_cli(["eval", *base, "--head", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dialspec: error: no weight head at") and err.count("\n") == 1
    save_head(head_for_pair(target, draft, "tiny-pair"), tmp_path / "head")
    assert run_cli(["eval", *base, "--pair-name", "other", "--head", str(tmp_path / "head")]) == 2
    assert "trained for pair 'tiny-pair', not 'other'" in capsys.readouterr().err
    assert run_cli(["train", *base, "--resume", "--run-dir", str(tmp_path / "empty")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
