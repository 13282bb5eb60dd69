"""reward_model.sandbox_fusion (trainer/rewards/sandbox_fusion.py): code responses scored by a sandbox over verl's
HTTP API, against a real server on a loopback socket that runs each program in a Python subprocess, as
SandboxFusion's /run_code does; an unreachable URL is one line before any step."""

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.config import load_config
from trainer.errors import RunSetupError
from trainer.rewards.managers import build_rule_reward
from trainer.rewards.sandbox_fusion import SandboxFusion, SandboxScore


class RunCode(BaseHTTPRequestHandler):
    """SandboxFusion's /run_code, in small: runs the code with the stdin, answers in its JSON."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(request)
        try:
            done = subprocess.run([sys.executable, "-c", request["code"]], input=request["stdin"] or "",
                                  capture_output=True, text=True, timeout=request["run_timeout"])
            run = {"status": "Finished", "stdout": done.stdout, "stderr": done.stderr,
                   "return_code": done.returncode, "execution_time": 0.01}
        except subprocess.TimeoutExpired:
            run = {"status": "TimeLimitExceeded", "stdout": "", "stderr": "", "return_code": None}
        ok = run["status"] == "Finished" and run["return_code"] == 0
        body = json.dumps({"status": "Success" if ok else "Failed", "run_result": run,
                           "compile_result": None}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def sandbox_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RunCode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    RunCode.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


DOUBLE = "Here it is:\n```python\nprint(2 * int(input()))\n```"
CASES = {"inputs": ["2\n", "5\n", "7\n", "0\n"], "outputs": ["4\n", "10\n", "14\n", "0\n"]}


def test_a_response_scores_the_share_of_test_cases_its_code_passes(sandbox_url):
    score = SandboxScore(SandboxFusion(sandbox_url, memory_limit_mb=256))
    assert score("codecontests", DOUBLE, json.dumps(CASES)) == 1.0
    # squares: right for 2 (4) and 0 (0), wrong for 5 and 7
    assert score("apps", "```python\nx = int(input())\nprint(x * x)\n```", CASES) == 0.5
    assert score("taco", "```python\nraise SystemExit(1)\n```", CASES) == 0.0  # a failing run passes nothing
    assert score("codeforces", "print(4)", CASES) == 0.0  # no code block: verl scores 0 without a request
    assert len(RunCode.requests) == 12
    sent = RunCode.requests[0]
    assert sent["memory_limit_MB"] == 256 and sent["language"] == "python" and sent["run_timeout"] == 10
    assert sorted(sent) == ["code", "compile_timeout", "fetch_files", "files", "language", "memory_limit_MB",
                            "run_timeout", "stdin"]


def test_assert_cases_run_after_the_code(sandbox_url):
    code = "```python\ndef double(x):\n    return 2 * x\n```"
    cases = {"assert_case": ["assert double(3) == 6", "assert double(3) == 7"]}
    assert SandboxScore(SandboxFusion(sandbox_url))("apps", code, cases) == 0.5


def test_other_data_sources_keep_the_built_in_scorers(sandbox_url):
    assert SandboxScore(SandboxFusion(sandbox_url))("gsm8k", "#### 42", "42") == 1.0
    assert RunCode.requests == []


def test_the_config_routes_code_to_the_sandbox_and_an_unreachable_url_is_one_line(sandbox_url):
    config = load_config(None, [f"reward_model.sandbox_fusion.url={sandbox_url}",
                                "reward_model.sandbox_fusion.max_concurrent=2"])
    build_rule_reward(config, tokenizer=None)
    assert RunCode.requests[0]["code"] == "print(1)"  # the start's probe
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = load_config(None, [f"reward_model.sandbox_fusion.url=http://127.0.0.1:{port}/run_code"])
    with pytest.raises(RunSetupError) as caught:
        build_rule_reward(config, tokenizer=None)
    message = str(caught.value)
    assert message.startswith(f"reward_model.sandbox_fusion.url: the sandbox at 'http://127.0.0.1:{port}/run_code' "
                              "did not run the code (ConnectError: ")
    assert "\n" not in message and message.endswith("allowed: the URL of a running SandboxFusion service's /run_code")
