"""`dialspec eval` on a tiny slice writes every artefact; the frontier comparison; CLI errors."""

from __future__ import annotations

import json

import pytest

from server import cli
from server.engine.head_store import head_for_pair, save_head
from training.eval_report import frontier_groups, verdicts


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
    assert families == {"ar", "sd", "sd_lossy", "cascade", "typical", "static", "learned"}
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
        for row in task["policies"]:  # per-prompt data for the paired bootstrap
            pp = row["per_prompt"]
            assert len(pp["scores"]) == len(pp["accepted"]) == len(pp["proposed"]) == 2
    assert set(results["verdict"]) == {"math", "summary", "code"}
    assert set(results["verdict"]["math"]["goals"]) == {
        "beats_cascade_at_acceptance", "beats_static_at_acceptance", "not_worse_than_static_at_time"
    }  # fmt: skip
    table = (out / "table.md").read_text()
    assert "| method |" in table and "learned d=0.25" in table and "cascade vs learned" in table


def _row(family, policy, acc, score, scores, time=1.0):
    n = len(scores)
    return dict(
        family=family, policy=policy, acceptance=acc, score=score, score_se=0.01, norm_time=time,
        per_prompt={"scores": scores, "accepted": [round(100 * (acc or 0))] * n, "proposed": [100] * n},
    )  # fmt: skip


def test_verdicts_call_a_clearly_better_learned_head():
    lo, hi = [0.0] * 48 + [1.0] * 48, [1.0] * 90 + [0.0] * 6  # 0.5 vs ~0.94, 96 prompts
    results = {
        "tasks": {
            "t": {
                "policies": [
                    _row("ar", "AR", None, 1.0, [1.0] * 96),
                    _row("sd", "SD", 0.6, 1.0, [1.0] * 96, 0.8),
                    _row("static", "static w=0.5", 0.8, 0.5, lo, 0.6),
                    _row("static", "static w=0", 1.0, 0.2, [0.0] * 77 + [1.0] * 19, 0.5),
                    _row("cascade", "SpecCascade a=0.5", 0.8, 0.5, lo, 0.6),
                    _row("cascade", "SpecCascade a=4", 1.0, 0.2, [0.0] * 77 + [1.0] * 19, 0.5),
                    _row("learned", "learned d=1", 0.6, 1.0, [1.0] * 96, 0.8),
                    _row("learned", "learned d=0.5", 0.8, 0.94, hi, 0.6),
                    _row("learned", "learned d=0", 1.0, 0.5, lo, 0.5),
                ]
            }
        }
    }
    groups = frontier_groups(results["tasks"]["t"])
    assert set(groups) == {"static", "sd_lossy", "cascade", "learned"}  # SD joins static and lossy
    goals = verdicts(results, boot=100)["t"]["goals"]
    assert goals == {
        "beats_cascade_at_acceptance": True, "beats_static_at_acceptance": True,
        "not_worse_than_static_at_time": True,
    }  # fmt: skip


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


def test_chunk_bounds_cover_the_prompts_with_at_least_a_batch_each():
    from training.policy_eval import chunk_bounds

    assert chunk_bounds(96, 8, 8) == [(12 * i, 12 * i + 12) for i in range(8)]
    assert chunk_bounds(6, 8, 8) == [(0, 6)]  # fewer prompts than a batch: one chunk
    for prompts, chunks, batch in ((100, 8, 8), (17, 3, 4), (5, 1, 8)):
        b = chunk_bounds(prompts, chunks, batch)
        assert b[0][0] == 0 and b[-1][1] == prompts
        assert all(x[1] == y[0] for x, y in zip(b, b[1:], strict=False))  # contiguous
        assert len(b) == 1 or min(hi - lo for lo, hi in b) >= batch


def test_interleaved_chunks_change_the_timing_not_the_draws(tiny_pair, monkeypatch):
    """Chunk j of every policy runs before chunk j + 1, forward then reversed; the per-prompt
    results are those of one batch run per policy (the draws are seeded per request and batch-
    invariant), and each row's chunks add up to its wall time and tokens."""
    import training.policy_eval as pe

    target, draft = tiny_pair
    cfg = pe.EvalConfig(
        target_path=str(target), draft_path=str(draft), pair_name="tiny-pair", tasks=("math",), limit=6,
        max_tokens=8, max_batch=2, w_sweep=(0.5,), lenience_sweep=(), alpha_sweep=(0.5,), typical_sweep=(),
        dials=(), time_chunks=3,
    )  # fmt: skip
    calls = []
    real = pe.generate_batch

    def spy(engine, reqs):
        if reqs[0].request_id.startswith("math-"):  # not the warm-up
            calls.append((reqs[0].request_id, reqs[0].verify))
        return real(engine, reqs)

    monkeypatch.setattr(pe, "generate_batch", spy)
    chunked = pe.run_eval(cfg)["tasks"]["math"]["policies"]
    specs = [s.verify for s in pe.policy_specs(cfg)]
    assert [v for _, v in calls] == specs + specs[::-1] + specs
    assert [i for i, _ in calls] == ["math-0"] * 4 + ["math-2"] * 4 + ["math-4"] * 4
    calls.clear()
    cfg.time_chunks = 1
    whole = pe.run_eval(cfg)["tasks"]["math"]["policies"]
    assert len(calls) == len(specs)
    for a, b in zip(chunked, whole, strict=True):
        assert a["per_prompt"] == b["per_prompt"] and a["completion_tokens"] == b["completion_tokens"]
        assert len(a["chunks"]["wall_s"]) == 3 and len(b["chunks"]["wall_s"]) == 1
        assert sum(a["chunks"]["tokens"]) == a["completion_tokens"]
        assert sum(a["chunks"]["wall_s"]) == pytest.approx(a["wall_s"])
