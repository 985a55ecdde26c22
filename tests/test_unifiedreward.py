"""The unifiedreward reward: UnifiedReward on an OpenAI-compatible chat server. The parser on answers written here; the
requests against a stdlib server that records them (what is sent, concurrency, retries, refusals); the protocol end
to end against `transformers serve` (transformers' own server) with a tiny random LLaVA judge, started and stopped
here; and one vgrpo iteration that logs the share of answers without a score."""

import base64
import http.server
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import reward
from tests import hub_standins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- the parser and the instruction


@pytest.mark.parametrize("answer,score", [
    ("The image matches.\nFinal Score: 4", 0.8),
    ("Final Score:5", 1.0),
    ("cat (object): 1\nFinal Score: 3.5 overall", 0.7),
    ("Final Score: 2\nFinal Score: 5", 0.4),             # the first one counts, as re.search finds it
    ("Final Score: 7", None),                            # outside 1-5: no score
    ("final score: 4", None),                            # the judge's own capitalisation only
    ("I would give it a 4.", None),
    ("", None),
    (None, None),
])
def test_the_score_is_the_final_score_over_five(answer, score):
    got = reward.unifiedreward_score(answer)
    assert got == pytest.approx(score) if score is not None else got is None


def test_the_instruction_holds_the_caption_and_the_judges_wording():
    llava = reward.unifiedreward_instruction("a red cube", "llava")
    qwen = reward.unifiedreward_instruction("a red cube", "qwen")
    for text in (llava, qwen):
        assert text.startswith("You are given a text caption and a generated image based on that caption.")
        assert text.endswith("Your task is provided as follows:\nText Caption: [a red cube]")
        assert "after 'Final Score:'" in text and "<image>" not in text
    assert "Based on the above criteria, assign a score from 1 to 5" in llava and "element (type)" not in llava
    assert "'element (type): value'" in qwen and "Based on the above criteria" not in qwen


def test_the_spec_names_url_model_and_options():
    spec = "unifiedreward@http://10.0.0.7:8000/v1/?model=CodeGoat24/UnifiedReward-qwen-7b&max_tokens=64"
    assert reward.parse_reward_spec(f"hpsv2:1,{spec}:0.5") == [("hpsv2", 1.0), (spec, 0.5)]
    assert reward.parse_unifiedreward_spec(spec) == ("http://10.0.0.7:8000/v1", {
        "model": "CodeGoat24/UnifiedReward-qwen-7b", "max_tokens": 64})
    assert reward.parse_reward_spec("unifiedreward@http://h:8000") == [("unifiedreward@http://h:8000", 1.0)]
    assert reward.metric_name(spec) == "unifiedreward"
    # a proxy's credentials before the host, and TLS
    assert reward.parse_unifiedreward_spec("unifiedreward@https://user:token@judge.internal/v1?timeout=30") == (
        "https://user:token@judge.internal/v1", {"timeout": 30.0})
    for bad, why in (("unifiedreward@h:8000/v1", "expected unifiedreward@http"),
                     ("unifiedreward@ftp://h/v1", "expected unifiedreward@http(s)://host:port/v1[?model=ID]"),
                     ("unifiedreward@http://h:8000:0.5", "the port is not a number"),
                     ("unifiedreward@http://h/v1?modle=x", "unknown option 'modle'; valid: model, instruction, "
                                                           "max_tokens, concurrency, timeout, retries"),
                     ("unifiedreward@http://h/v1?concurrency=many", "is not a int"),
                     ("unifiedreward@http://h/v1?max_tokens=", "max_tokens='' is not a int")):   # not left out
        with pytest.raises(ValueError, match=re.escape(why)):
            reward.parse_reward_spec(bad)


# --------------------------------------------------------------------------- the requests, against a recording server


def _images(n=4, side=16):
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(n))


class ChatServer:
    """An OpenAI-compatible chat server on localhost that records each request body. `answers` maps the caption in
    the text to the answer (or to a whole payload); `fail_first` requests get HTTP `fail_code` at once; answers take
    `delay` seconds."""

    def __init__(self, answers, fail_first=0, fail_code=503, delay=0.0, models=("judge",)):
        self.bodies, self.active, self.most_active, self.lock = [], 0, 0, threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append((self.path, self.headers.get("Authorization"), body))
                    failing = len(server.bodies) <= fail_first
                    server.active += 1
                    server.most_active = max(server.most_active, server.active)
                time.sleep(0 if failing else delay)
                with server.lock:
                    server.active -= 1
                if failing:
                    return self._send(fail_code, {"error": "busy" if fail_code >= 500 else "no such model"})
                caption = re.search(r"Text Caption: \[(.*)\]$", body["messages"][0]["content"][1]["text"]).group(1)
                answer = answers[caption]   # a dict is the whole payload
                self._send(200, answer if isinstance(answer, dict) else
                           {"choices": [{"message": {"role": "assistant", "content": answer}}]})

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()


def test_each_image_is_one_chat_request_as_the_peers_send_it(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "flowgrpo")
    answers = {"a": "Final Score: 5", "b": "Final Score: 2.5", "c": "no idea", "d": "Final Score: 1"}
    images = _images()
    with ChatServer(answers) as server:
        fn = reward.load_reward(f"unifiedreward@{server.base}?max_tokens=77")
        got = fn(images, list("abcd"))
        assert got.tolist() == pytest.approx([1.0, 0.5, 0.0, 0.2])       # no score: 0, as the peers
        assert fn.last_counts == {"unifiedreward_unparsed": 0.25}
        assert len(server.bodies) == 4 and {b[0] for b in server.bodies} == {"/v1/chat/completions"}
        assert {b[1] for b in server.bodies} == {"Bearer flowgrpo"}
        from PIL import Image
        for (_, _, body), caption, image in zip(sorted(server.bodies, key=lambda b: b[2]["messages"][0]["content"][1]
                                                       ["text"]), "abcd", reward.to_uint8_images(images)):
            assert body["model"] == "judge" and body["temperature"] == 0 and body["max_tokens"] == 77   # /models' one
            assert set(body) == {"model", "messages", "temperature", "max_tokens"}  # transformers serve refuses others
            image_part, text_part = body["messages"][0]["content"]
            assert body["messages"][0]["role"] == "user" and text_part["type"] == "text"
            assert text_part["text"] == reward.unifiedreward_instruction(caption, "llava")   # no qwen in 'judge'
            url = image_part["image_url"]["url"]
            assert image_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
            sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
            assert sent.shape == (512, 512, 3)                           # resized to 512 px as the peers do
            assert np.array_equal(sent, np.asarray(image.resize((512, 512))))


def test_requests_run_concurrently_up_to_the_limit():
    answers = {str(i): "Final Score: 3" for i in range(8)}
    # each request's PNG takes ~0.1 s to encode on a loaded 2-core machine, holding the GIL: a round of 4 reaches the
    # server over ~0.3 s, so each answer takes 1 s for the 4 to be seen at once
    with ChatServer(answers, delay=1.0) as server:
        t0 = time.time()
        fn = reward.load_reward(f"unifiedreward@{server.base}?model=judge&concurrency=4")
        fn(_images(8), list(map(str, range(8))))
        assert server.most_active == 4                       # 8 requests, 4 at a time: two rounds of 1 s
        assert time.time() - t0 >= 2.0


def test_the_judges_instruction_follows_the_model_id_or_the_spec(capsys):
    with ChatServer({"a": "Final Score: 4"}, models=("my-served-name",)) as server:
        for spec, kind in (("", "llava"), ("?instruction=qwen", "qwen"),
                           ("?model=CodeGoat24/UnifiedReward-qwen-7b", "qwen")):
            reward.load_reward(f"unifiedreward@{server.base}{spec}")(_images(1), ["a"])
            assert server.bodies[-1][2]["messages"][0]["content"][1]["text"] == \
                reward.unifiedreward_instruction("a", kind)
            assert f"the {kind} judges' instruction" in capsys.readouterr().err
        with pytest.raises(reward.RewardError, match="instruction='plain' is none of llava, qwen"):
            reward.load_reward(f"unifiedreward@{server.base}?instruction=plain")


def test_calls_run_in_order_and_none_starts_after_the_first_failure():
    def slow_square(i):
        time.sleep(0.01 * (5 - i))                                    # the later calls end first
        return i * i

    assert reward.map_failing_fast(slow_square, [(i,) for i in range(6)], concurrency=3) == [0, 1, 4, 9, 16, 25]
    calls = []

    def failing_at_1(i):
        calls.append(i)
        if i == 1:
            raise ValueError("call 1 failed")
        return i

    for _ in range(20):   # one worker: the cancelled pool alone let it start every queued call
        calls.clear()
        with pytest.raises(ValueError, match="call 1 failed"):
            reward.map_failing_fast(failing_at_1, [(i,) for i in range(6)], concurrency=1)
        time.sleep(0.01)
        assert calls == [0, 1]


def test_the_first_refusal_fails_the_batch_without_sending_the_rest():
    answers = {str(i): "Final Score: 3" for i in range(8)}
    # two at a time; the refusal comes at once while the request beside it takes 1 s to answer, so the refused
    # request's worker is free to take the next queued one at once, before the batch can be cancelled
    images = _images(8)
    with ChatServer(answers, fail_first=1, fail_code=400, delay=1.0) as server:
        fn = reward.unifiedreward_reward(server.base, model="judge", concurrency=2, retries=0)
        t0 = time.time()
        with pytest.raises(reward.RewardError, match="refused the request"):
            fn(images, list(map(str, range(8))))
        assert time.time() - t0 < 2.5                        # not the 4 rounds the batch would take
        time.sleep(1.5)
        assert len(server.bodies) <= 2                       # the refused one and the one beside it: nothing after


def test_busy_answers_are_retried_and_refusals_are_one_line():
    with ChatServer({"a": "Final Score: 4"}, fail_first=2) as server:
        fn = reward.unifiedreward_reward(server.base, model="judge", retries=2, backoff=0.05)
        assert fn(_images(1), ["a"]).tolist() == pytest.approx([0.8])
        assert len(server.bodies) == 3                        # two 503s, then the answer
    with ChatServer({"a": "Final Score: 4"}, fail_first=5) as server:
        fn = reward.unifiedreward_reward(server.base, model="judge", retries=2, backoff=0.05)
        with pytest.raises(reward.RewardError, match=r"unifiedreward server .*/v1/chat/completions failed 3 times "
                                                     r"\(HTTP 503: .*busy"):
            fn(_images(1), ["a"])
    with ChatServer({"a": "Final Score: 4"}, fail_first=5, fail_code=400) as server:
        fn = reward.unifiedreward_reward(server.base, model="other", retries=2, backoff=0.05)
        with pytest.raises(reward.RewardError, match=r"refused the request \(HTTP 400: .*no such model"):
            fn(_images(1), ["a"])
        assert len(server.bodies) == 1                        # a refusal is not retried
    with ChatServer({}, models=("a", "b")) as server:
        with pytest.raises(reward.RewardError, match=r"lists 2 models \(a, b\); name one with \?model=ID"):
            reward.load_reward(f"unifiedreward@{server.base}")


def test_a_payload_without_a_chat_completion_is_named():
    with ChatServer({"a": {"error": "model is loading"}, "b": {"choices": []}}) as server:
        fn = reward.unifiedreward_reward(server.base, model="judge", retries=0)
        for caption, payload in (("a", "{'error': 'model is loading'}"), ("b", "{'choices': []}")):
            with pytest.raises(reward.RewardError, match=re.escape(f"answered no chat completion: {payload}")):
                fn(_images(1), [caption])


def test_a_server_that_is_down_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    fn = reward.unifiedreward_reward(base, model="judge", retries=1, backoff=0.05)
    with pytest.raises(reward.RewardError, match=re.escape(f"unifiedreward server {base}/chat/completions failed 2")):
        fn(_images(1), ["a"])


# --------------------------------------------------------------------------- against transformers serve


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_judge(tmp_path_factory):
    """`transformers serve FOLDER` with the tiny LLaVA judge, on the CPU, stopped after the module's tests."""
    folder = tmp_path_factory.mktemp("judge")
    hub_standins.build_llava_judge(str(folder), seed=0)
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    cli = os.path.join(os.path.dirname(sys.executable), "transformers")
    log = open(folder / "serve.log", "w")
    server = subprocess.Popen([cli, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--device",
                               "cpu"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 120
        while True:
            try:
                reward.post_json(f"http://127.0.0.1:{port}/health", None, "health", timeout=2, retries=0)
                break
            except reward.RewardError:
                assert server.poll() is None and time.time() < deadline, (folder / "serve.log").read_text()[-2000:]
                time.sleep(0.5)
        yield base, str(folder)
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def test_the_reward_scores_every_image_on_transformers_serve(served_judge):
    base, model = served_judge
    fn = reward.load_reward(f"unifiedreward@{base}?max_tokens=6&concurrency=3")   # the model asked from /models
    images = _images(5, side=32)
    got = fn(images, ["a cat", "a dog", "a red cube", "two cups", "a sign"])
    # the stand-in judge answers "Final Score: 4" (repeated up to max_tokens) to every image: 4 / 5, read from the
    # server's reply for each image
    assert got.tolist() == pytest.approx([0.8] * 5) and fn.last_counts["unifiedreward_unparsed"] == 0
    again = reward.load_reward(f"unifiedreward@{base}?model={model}&max_tokens=6")(images, ["a cat", "a dog",
                                                                                         "a red cube", "two cups",
                                                                                         "a sign"])
    assert torch.equal(again, got)                                        # greedy: the same answers


def test_transformers_serve_refuses_another_model_in_one_line(served_judge):
    base, _ = served_judge
    fn = reward.unifiedreward_reward(base, model="CodeGoat24/UnifiedReward-qwen-7b", max_tokens=4, retries=0)
    with pytest.raises(reward.RewardError, match="refused the request"):
        fn(_images(1), ["a"])


def run_one_iteration(reward_spec, out, *flags):
    """`python vgrpo.py` on the tiny model for one iteration, as a user runs it -> (process, its metrics line)."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "vgrpo.py"), "--model", "tiny", "--iterations", "1", "--sample-steps", "2",
         "--prompts-per-step", "2", "--group-size", "2", "--n-mc", "1", "--save-every", "100",
         "--reward", reward_spec, "--output-dir", str(out), *flags],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def test_a_run_logs_the_share_of_answers_without_a_score(served_judge, tmp_path):
    """On `transformers serve`, the judge's "Final Score: 4" for every image: share 0, nothing said. On a scripted
    server whose judge gives one prompt a score and the other none: share 0.5, scored 0, said once on stderr."""
    base, _ = served_judge
    proc, m = run_one_iteration(f"jpeg:100,unifiedreward@{base}?max_tokens=6:1", tmp_path / "served")
    assert m["reward_unifiedreward"] == pytest.approx(0.8) and "reward_jpeg" in m
    assert m["reward_unifiedreward_unparsed"] == 0 and "an answer without 'Final Score" not in proc.stderr
    (tmp_path / "two.txt").write_text("a cat\na dog\n")                # both prompts in the iteration's 2 slots
    with ChatServer({"a cat": "Final Score: 4", "a dog": "I cannot tell."}) as server:
        proc, m = run_one_iteration(f"jpeg:100,unifiedreward@{server.base}:1", tmp_path / "scripted",
                                    "--prompts", str(tmp_path / "two.txt"), "--eval-prompts", str(tmp_path / "two.txt"),
                                    "--eval-every", "1")
    assert m["reward_unifiedreward"] == pytest.approx((0.8 + 0.8 + 0 + 0) / 4)   # 2 images of each prompt
    assert m["reward_unifiedreward_unparsed"] == 0.5
    assert proc.stderr.count("an answer without 'Final Score") == 1 and "I cannot tell." in proc.stderr
    evaluations = [json.loads(line) for line in (tmp_path / "scripted" / "eval.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in evaluations] == [0, 1]          # the held-out share too: scored 0 there as well
    assert all(e["eval_unifiedreward_unparsed"] == 0.5 and e["eval_unifiedreward"] == pytest.approx(0.4)
               for e in evaluations)


def test_flux_preference_says_how_to_add_the_papers_fourth_reward(capsys, monkeypatch, tmp_path):
    import vgrpo

    monkeypatch.delenv("RANK", raising=False)
    out = ["--output-dir", str(tmp_path)]
    vgrpo.validate(vgrpo.parse_args(["--preset", "flux-preference", *out]), 1)
    assert "vllm serve CodeGoat24/UnifiedReward-qwen-7b" in capsys.readouterr().err
    spec = "hpsv2:1,pickscore:1,imagereward:1,unifiedreward@http://localhost:8000/v1"
    vgrpo.validate(vgrpo.parse_args(["--preset", "flux-preference", "--reward", spec, *out]), 1)
    assert "UnifiedReward" not in capsys.readouterr().err
