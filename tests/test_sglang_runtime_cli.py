"""`dialspec runtime`: the SGLang command line, checked against SGLang 0.5.23's real parser."""

from __future__ import annotations

import shlex

import pytest

from server import cli, runtime_cli
from server.sglang_plugin import args_hook, params


def _argv(tiny_pair, *more):
    target, draft = tiny_pair
    return ["runtime", "print-command", "--target", str(target), "--draft", str(draft), *more]


def test_registered_in_the_cli():
    assert "server.runtime_cli" in cli.SUBCOMMAND_MODULES


def test_print_command_parses_with_sglangs_own_argument_parser(tiny_pair, capsys):
    assert (
        cli.main(_argv(tiny_pair, "-n", "4", "--default-w", "0.5", "--port", "31000", "--", "--tp-size", "1"))
        == 0
    )
    words = shlex.split(capsys.readouterr().out)
    env = dict(w.split("=", 1) for w in words[:2])
    assert env == {params.ENV_ENABLE: "1", params.ENV_DEFAULT_W: "0.5"}
    assert words[3:5] == ["-m", "sglang.launch_server"]
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(words[5:])  # SGLang's parser, unresolved (no GPU needed)
    assert server_args.speculative_algorithm == "STANDALONE"
    assert server_args.speculative_num_steps == 4 and server_args.speculative_num_draft_tokens == 5
    assert server_args.speculative_eagle_topk == 1
    assert server_args.speculative_use_rejection_sampling is True
    assert server_args.enable_metrics is True and server_args.port == 31000
    assert server_args.model_path == str(tiny_pair[0].resolve())
    assert server_args.speculative_draft_model_path == str(tiny_pair[1].resolve())


@pytest.mark.parametrize(
    "more, message",
    [
        (["-n", "0"], "num-draft"),
        (["--default-w", "1.5"], "default-w"),
        (["--head", "/no/such/head.pt"], "no such head"),
    ],
)
def test_user_mistakes_are_one_line_errors(tiny_pair, capsys, more, message):
    assert cli.main(_argv(tiny_pair, *more)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dialspec: error:") and message in err and "\n" not in err


def test_bad_model_reference(capsys):
    assert cli.main(["runtime", "print-command", "--target", "./nope", "--draft", "org/draft"]) == 2
    assert "neither a model directory" in capsys.readouterr().err


def test_launch_without_sglang_says_how_to_install(tiny_pair, capsys, monkeypatch):
    monkeypatch.setattr(runtime_cli.importlib.util, "find_spec", lambda name: None)
    argv = _argv(tiny_pair)
    argv[1] = "launch"
    assert cli.main(argv) == 2
    assert "pip install 'dialspec[sglang]'" in capsys.readouterr().err


def test_launch_execs_sglang_with_the_plugin_environment(tiny_pair, monkeypatch):
    seen = {}
    monkeypatch.setattr(runtime_cli.os, "execvpe", lambda f, a, e: seen.update(file=f, argv=a, env=e))
    argv = _argv(tiny_pair, "--default-w", "0.25")
    argv[1] = "launch"
    assert cli.main(argv) == 0
    assert seen["argv"][1:3] == ["-m", "sglang.launch_server"]
    assert seen["env"][params.ENV_ENABLE] == "1" and seen["env"][params.ENV_DEFAULT_W] == "0.25"


def test_head_turns_every_cuda_graph_off(tiny_pair, tmp_path, capsys, monkeypatch):
    head = tmp_path / "head"
    head.mkdir()
    assert cli.main(_argv(tiny_pair, "--head", str(head))) == 0
    words = shlex.split(capsys.readouterr().out)
    assert f"{params.ENV_HEAD_PATH}={head}" in words
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(words[words.index("-m") + 2 :])
    assert server_args.disable_cuda_graph is True
    monkeypatch.setenv(params.ENV_HEAD_PATH, str(head))
    assert args_hook.cuda_graph_phases_on(server_args) == []  # what the plugin requires of a head


# ---------------------------------------------------------------------------- environment (deploy files)

RUNTIME_ENV = (
    runtime_cli.ENV_TARGET,
    runtime_cli.ENV_DRAFT,
    runtime_cli.ENV_NUM_DRAFT,
    runtime_cli.ENV_HOST,
    runtime_cli.ENV_PORT,
    runtime_cli.ENV_EXTRA,
    params.ENV_DEFAULT_W,
    params.ENV_HEAD_PATH,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No runtime variable leaks in from the caller's environment."""
    for var in RUNTIME_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _printed(capsys) -> list[str]:
    return shlex.split(capsys.readouterr().out)


def test_options_come_from_the_environment_the_deploy_files_set(clean_env, capsys):
    clean_env.setenv(runtime_cli.ENV_TARGET, "org/target")
    clean_env.setenv(runtime_cli.ENV_DRAFT, "org/draft")
    clean_env.setenv(runtime_cli.ENV_NUM_DRAFT, "4")
    clean_env.setenv(runtime_cli.ENV_PORT, "31000")
    clean_env.setenv(runtime_cli.ENV_EXTRA, "--tp-size 2 --mem-fraction-static '0.8'")
    clean_env.setenv(params.ENV_DEFAULT_W, "0.75")
    clean_env.setenv(params.ENV_HEAD_PATH, "")  # compose's ${HEAD_PATH:-}: no head
    assert cli.main(["runtime", "print-command", "--host", "0.0.0.0", "--", "--log-level", "info"]) == 0
    words = _printed(capsys)
    assert words[:2] == [f"{params.ENV_ENABLE}=1", f"{params.ENV_DEFAULT_W}=0.75"]
    flags = words[5:]
    pairs = dict(zip(flags, flags[1:], strict=False))
    assert pairs["--model-path"] == "org/target" and pairs["--speculative-draft-model-path"] == "org/draft"
    assert pairs["--speculative-num-steps"] == "4" and pairs["--speculative-num-draft-tokens"] == "5"
    assert pairs["--host"] == "0.0.0.0" and pairs["--port"] == "31000"
    assert flags[-6:] == ["--tp-size", "2", "--mem-fraction-static", "0.8", "--log-level", "info"]
    assert "--disable-cuda-graph" not in flags and params.ENV_HEAD_PATH not in " ".join(words[:3])
    from sglang.srt.server_args import prepare_server_args

    assert prepare_server_args(flags).tp_size == 2


def test_flags_win_over_the_environment(clean_env, tiny_pair, capsys):
    clean_env.setenv(runtime_cli.ENV_NUM_DRAFT, "7")
    clean_env.setenv(runtime_cli.ENV_TARGET, "org/ignored")
    assert cli.main(_argv(tiny_pair, "-n", "2")) == 0
    flags = _printed(capsys)
    assert flags[flags.index("--speculative-num-steps") + 1] == "2"
    assert flags[flags.index("--model-path") + 1] == str(tiny_pair[0].resolve())


@pytest.mark.parametrize(
    "env, message",
    [
        ({runtime_cli.ENV_DRAFT: "org/d"}, "--target is required (or set DIALSPEC_TARGET_MODEL)"),
        (
            {runtime_cli.ENV_TARGET: "org/t", runtime_cli.ENV_DRAFT: "org/d", runtime_cli.ENV_NUM_DRAFT: "x"},
            "DIALSPEC_NUM_DRAFT='x'",
        ),
        (
            {runtime_cli.ENV_TARGET: "org/t", runtime_cli.ENV_DRAFT: "org/d", runtime_cli.ENV_PORT: "0"},
            "--port must lie",
        ),
        (
            {runtime_cli.ENV_TARGET: "/models/none", runtime_cli.ENV_DRAFT: "org/d"},
            "neither a model directory",
        ),
        (
            {
                runtime_cli.ENV_TARGET: "org/t",
                runtime_cli.ENV_DRAFT: "org/d",
                runtime_cli.ENV_EXTRA: "--x 'open",
            },
            "SGLANG_EXTRA_ARGS",
        ),
    ],
)
def test_bad_environment_is_a_one_line_error(clean_env, capsys, env, message):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert cli.main(["runtime", "print-command"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dialspec: error:") and message in err and "\n" not in err


def test_launch_refuses_without_the_plugin_entry_point(tiny_pair, capsys, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    monkeypatch.setattr(runtime_cli.os, "execvpe", lambda *a: pytest.fail("must not exec"))
    argv = _argv(tiny_pair)
    argv[1] = "launch"
    assert cli.main(argv) == 2
    assert "plugin is not registered" in capsys.readouterr().err
