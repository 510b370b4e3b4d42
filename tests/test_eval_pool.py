"""`dialspec eval-pool`: runs with different seeds pooled into one evaluation; what it refuses."""

from __future__ import annotations

import json

import pytest

from server import cli
from training.eval_pool import pool


@pytest.fixture
def run_cli(monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", ["training.commands"])
    return cli.main


@pytest.fixture(scope="module")
def two_runs(tiny_pair, tmp_path_factory):
    """Two quick evals of the tiny pair that differ only in --seed."""
    target, draft = tiny_pair
    base = tmp_path_factory.mktemp("pool")
    outs = []
    for seed in (0, 1):
        out = base / f"s{seed}"
        argv = [
            "eval",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--pair-name",
            "tiny-pair",
            "--head",
            "none",
        ]
        argv += ["--out", str(out), "--quick", "--limit", "3", "--max-tokens", "8", "--tasks", "math,code"]
        argv += ["--seed", str(seed)]
        old = cli.SUBCOMMAND_MODULES
        cli.SUBCOMMAND_MODULES = ["training.commands"]
        try:
            assert cli.main(argv) == 0
        finally:
            cli.SUBCOMMAND_MODULES = old
        outs.append(out)
    return outs


def _load(out):
    return json.loads((out / "results.json").read_text())


def test_pooled_rows_are_the_runs_prompts_concatenated(two_runs, run_cli, tmp_path, capsys):
    runs = [_load(o) for o in two_runs]
    out = tmp_path / "pooled"
    assert run_cli(["eval-pool", *map(str, two_runs), "--out", str(out)]) == 0
    assert "pooled 2 runs (seeds [0, 1]" in capsys.readouterr().out
    pooled = _load(out)
    assert pooled["config"]["pooled_seeds"] == [0, 1]
    for task, res in pooled["tasks"].items():
        assert res["prompts"] == 6
        for i, row in enumerate(res["policies"]):
            parts = [r["tasks"][task]["policies"][i] for r in runs]
            assert row["policy"] == parts[0]["policy"] == parts[1]["policy"]
            for key in ("scores", "accepted", "proposed"):
                assert row["per_prompt"][key] == parts[0]["per_prompt"][key] + parts[1]["per_prompt"][key]
            assert row["score"] == pytest.approx(sum(row["per_prompt"]["scores"]) / 6)
            assert row["completion_tokens"] == sum(p["completion_tokens"] for p in parts)
            for key in ("wall_s", "tokens"):  # each run's timed chunks, side by side
                assert row["chunks"][key] == parts[0]["chunks"][key] + parts[1]["chunks"][key]
            if row["family"] == "ar":
                assert row["acceptance"] is None and row["norm_time"] == pytest.approx(1.0)
            else:
                pp = row["per_prompt"]
                assert row["acceptance"] == pytest.approx(sum(pp["accepted"]) / sum(pp["proposed"]))
                ar = next(r for r in res["policies"] if r["family"] == "ar")
                assert row["norm_time"] == pytest.approx(row["time_per_token_s"] / ar["time_per_token_s"])
    assert set(pooled["verdict"]) == {"math", "code"}  # the frontier analysis ran on the pooled rows
    assert "(6 prompts" in (out / "table.md").read_text()


def test_pool_refuses_what_would_double_count_or_mismatch(two_runs, run_cli, tmp_path, capsys):
    a, b = (_load(o) for o in two_runs)
    with pytest.raises(ValueError, match="share a seed"):
        pool([a, a])
    with pytest.raises(ValueError, match="at least 2"):
        pool([a])
    fewer = json.loads(json.dumps(b))
    fewer["tasks"]["math"]["policies"].pop()
    with pytest.raises(ValueError, match="tasks or policy rows"):
        pool([a, fewer])
    other = json.loads(json.dumps(b))
    other["config"]["limit"] = 96
    with pytest.raises(ValueError, match="prompt count"):
        pool([a, other])
    for argv, needle in (
        ([str(two_runs[0]), str(two_runs[0])], "share a seed"),
        ([str(two_runs[0]), str(tmp_path / "missing")], "not found"),
    ):
        assert run_cli(["eval-pool", *argv, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
