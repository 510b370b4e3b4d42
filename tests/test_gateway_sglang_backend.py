"""`dialspec serve --backend sglang`: the gateway fronting an SGLang runtime (a loopback fake).

The deploy files select the backend through DIALSPEC_BACKEND / DIALSPEC_SGLANG_URL /
DIALSPEC_TOKENIZER, so the end-to-end test configures it exactly that way.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import openai

from tests.fake_sglang import FakeRuntime, free_port

DIALSPEC = [sys.executable, "-c", "import sys; from server.cli import main; sys.exit(main(sys.argv[1:]))"]


def test_serve_sglang_backend_from_environment(tiny_pair):
    target, _ = tiny_pair
    runtime = FakeRuntime().start()
    env = dict(
        os.environ,
        DIALSPEC_BACKEND="sglang",
        DIALSPEC_SGLANG_URL=runtime.url,
        DIALSPEC_TOKENIZER=str(target),
    )
    cmd = [
        *DIALSPEC,
        "serve",
        "--port",
        str(free_port()),
        "--served-name",
        "gpu-pair",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"(http://\S+/v1)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        cli = openai.OpenAI(base_url=match.group(1), api_key="x", max_retries=0, timeout=60)
        r = cli.chat.completions.create(
            model="gpu-pair",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            extra_body={"quality": 0.3},
        )
        assert r.choices[0].message.content.startswith("Hello")
        stats = r.model_extra["dialspec"]
        assert stats["draft_tokens"] > 0 and stats["accepted_tokens"] <= stats["draft_tokens"]
        sent = runtime.requests[-1]["sampling_params"]
        assert abs(sent["custom_params"]["dialspec_w"] - 0.3) < 1e-9
        assert sent["max_new_tokens"] == 6
        # The backend's limits are refused at the edge, never served as something else.
        sent_before = len(runtime.requests)
        for extra, param in (({"verifier": "lossy"}, "verifier"), ({"num_draft": 1}, "num_draft")):
            try:
                cli.completions.create(model="gpu-pair", prompt="hi", max_tokens=2, extra_body=extra)
                raise AssertionError(f"{extra} was served")
            except openai.BadRequestError as exc:
                assert exc.body["param"] == param and exc.body["code"] == "unsupported_by_backend", exc.body
        assert len(runtime.requests) == sent_before
        ready = httpx.get(match.group(1).removesuffix("/v1") + "/ready", timeout=30)
        assert ready.status_code == 200, ready.text  # the plugin probe (w = 0 accepts all) passed
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) in (0, 130)
        assert "Traceback" not in proc.stderr.read()
        runtime.stop()


def test_serve_sglang_backend_needs_url_and_tokenizer():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIALSPEC_")}
    out = subprocess.run(
        [*DIALSPEC, "serve", "--backend", "sglang", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--sglang-url" in out.stderr
