"""Process lifecycle of the real server: signals stop both processes with nothing left
behind; a dead worker fails in-flight requests with 503 at once and ends the server
(or is restarted with --restart-worker); a killed front takes its worker along."""

import json
import os
import signal
import threading
import time

import httpx
import psutil
from test_server_harness import assert_clean_exit, process_gone, server_factory, wait_for  # noqa: F401 (fixture)

# With the harness pool (96 blocks x 16), one such request needs ~94 blocks: they run one
# at a time and stay in flight for seconds.
LONG = {"prompt": "go", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def test_sigterm_stops_front_and_worker(tiny_llama_dir, server_factory):
    srv = server_factory(tiny_llama_dir)
    r = httpx.post(srv.api + "/completions", json={"model": srv.model, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert "KV pool: 96 blocks x 16 tokens = 1536 tokens" in srv.log()
    assert_clean_exit(srv, srv.stop(signal.SIGTERM))


def test_sigint_during_a_stream_stops_front_and_worker(tiny_llama_dir, server_factory):
    srv = server_factory(tiny_llama_dir)
    body = {"model": srv.model, **LONG, "stream": True}
    with httpx.stream("POST", srv.api + "/completions", json=body, timeout=60) as r:
        next(r.iter_lines())
        code = srv.stop(signal.SIGINT)
    assert_clean_exit(srv, code)


def _post_in_thread(url, body, results, key):
    def run():
        t0 = time.monotonic()
        try:
            if body.get("stream"):
                with httpx.stream("POST", url, json=body, timeout=60) as r:
                    lines = [ln for ln in r.iter_lines() if ln]
                    results[key] = (r.status_code, lines, time.monotonic() - t0)
            else:
                r = httpx.post(url, json=body, timeout=60)
                results[key] = (r.status_code, r.json(), time.monotonic() - t0)
        except httpx.HTTPError as e:
            results[key] = ("error", repr(e), time.monotonic() - t0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dead_worker_fails_requests_with_503_and_the_server_exits(tiny_llama_dir, server_factory):
    srv = server_factory(tiny_llama_dir)
    url = srv.api + "/completions"
    results: dict = {}
    threads = [_post_in_thread(url, {"model": srv.model, **LONG}, results, i) for i in range(3)]
    # a stream that has started (status 200 sent) before the worker dies
    stream_lines = []
    with httpx.stream("POST", url, json={"model": srv.model, **LONG, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        stream_lines.append(next(it))
        # the other three are in the engine too (running or queued)
        wait_for(lambda: (m := srv.metrics())["radixkv_num_requests_running"] + m["radixkv_num_requests_waiting"] >= 4)
        killed_at = time.monotonic()
        os.kill(srv.worker_pid, signal.SIGKILL)
        stream_lines += [ln for ln in it if ln]
    stream_done = time.monotonic() - killed_at
    for t in threads:
        t.join(timeout=30)
    assert stream_done < 5.0
    assert stream_lines[-1] == "data: [DONE]"
    err = json.loads(stream_lines[-2][6:])["error"]
    assert err["code"] == "engine_unavailable" and "died" in err["message"]
    for status, body, _ in results.values():
        assert status == 503, body
        assert body["error"]["code"] == "engine_unavailable"
    # the server goes away by itself, with code 1, leaving nothing behind
    code = srv.proc.wait(timeout=30)
    assert_clean_exit(srv, code, expected_code=1)


def test_restart_worker_brings_the_engine_back(tiny_llama_dir, server_factory):
    srv = server_factory(tiny_llama_dir, "--restart-worker")
    old = srv.worker_pid
    os.kill(old, signal.SIGKILL)

    def new_worker():
        kids = [p for p in psutil.Process(srv.proc.pid).children() if p.pid != old and p.status() != "zombie"]
        return kids and httpx.get(srv.url + "/health", timeout=5).status_code == 200 and kids[0].pid

    srv.worker_pid = wait_for(new_worker, timeout=120, interval=0.3)
    r = httpx.post(srv.api + "/completions", json={"model": srv.model, "prompt": "again", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert "restarting the engine worker" in srv.log()
    assert_clean_exit(srv, srv.stop())


def test_killed_front_takes_the_worker_along(tiny_llama_dir, server_factory):
    srv = server_factory(tiny_llama_dir)
    srv.proc.kill()
    srv.proc.wait()
    wait_for(lambda: process_gone(srv.worker_pid), timeout=30, what="the orphaned worker's exit")
    # it removed the ipc sockets the front could not
    assert not os.path.exists(srv.ipc_dir), os.listdir(srv.ipc_dir)
