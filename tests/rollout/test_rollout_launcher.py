"""SGLang launcher logic, exercised by launching the embedded engine (same flags, same HTTP API)."""
import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import psutil
from aiohttp import web

from megatron_rl.rollout.client import EngineClient, EngineConnectionError
from megatron_rl.rollout.engine import EngineManager, HttpEngine
from megatron_rl.rollout.protocol import SamplingParams
from megatron_rl.rollout.router import RouterConfig, RouterProcess, register_worker, unregister_worker
from megatron_rl.rollout.sglang_engine import (ProcessLauncher, SGLangServerConfig, ServerLaunchError, ServerProcess,
                                               args_to_flags, server_command)
from rollout_helpers import greedy_reference, run, tiny_model

EMBEDDED = "megatron_rl.rollout.embedded_server"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3")
    model = tiny_model(0)
    model.save_pretrained(d)
    return str(d), model


def test_command_line_passthrough():
    cfg = SGLangServerConfig(model_path="/m", port=1, tp_size=2, mem_fraction_static=0.7, enable_memory_saver=True,
                             base_gpu_id=4, server_args={"attention_backend": "fa3", "enable_deterministic_inference": True,
                                                         "disable_radix_cache": False, "cuda_graph_bs": [1, 2, 4],
                                                         "json_model_override_args": {"a": 1}})
    cmd = server_command(cfg, 30001)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    s = " ".join(cmd)
    for piece in ("--model-path /m", "--host 127.0.0.1", "--port 30001", "--tp-size 2", "--mem-fraction-static 0.7",
                  "--enable-memory-saver", "--skip-server-warmup", "--base-gpu-id 4", "--attention-backend fa3",
                  "--enable-deterministic-inference", "--cuda-graph-bs 1 2 4",
                  '--json-model-override-args {"a": 1}', "--weight-version 0"):
        assert piece in s, piece
    assert "--disable-radix-cache" not in s
    with pytest.raises(ValueError, match="tp_size"):
        server_command(SGLangServerConfig(model_path="/m", server_args={"tp-size": 4}), 1)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        SGLangServerConfig(model_path="/m", mem_fraction_static=1.5)
    assert args_to_flags({"x_y": None, "flag": True, "n": 3}) == ["--flag", "--n", "3"]


def test_memory_saver_strips_expandable_segments(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    env = ServerProcess(SGLangServerConfig(model_path="/m", enable_memory_saver=True, cuda_visible_devices="2,3"))._env()
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64" and env["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.slow
def test_launch_health_wait_and_relaunch_after_kill(model_dir, tmp_path):
    path, model = model_dir
    cfg = SGLangServerConfig(model_path=path, launch_module=EMBEDDED, log_dir=str(tmp_path), health_poll_s=0.2,
                             watchdog_interval_s=0.3, startup_timeout_s=120,
                             server_args={"device": "cpu", "max_running_requests": 4})
    server = ServerProcess(cfg)
    try:
        url = server.start()
        engine = HttpEngine(url, launcher=ProcessLauncher(server))
        expected = greedy_reference(model, [1, 2, 3], 6)
        assert run(engine.generate([1, 2, 3], GREEDY), engine.client).token_ids == expected
        assert "--max-running-requests 4" in open(server.log_path).readline()

        first_pid = server.pid
        os.kill(first_pid, signal.SIGKILL)  # the server dies; the watchdog must bring it back
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.pid == first_pid:
            time.sleep(0.1)
        assert server.wait_ready(timeout=120)
        assert server.restarts == 1 and server.pid != first_pid
        r = run(engine.generate([1, 2, 3], GREEDY), engine.client)
        assert r.token_ids == expected and server.url == url

        assert run(EngineManager([engine]).weight_versions(), engine.client) == {engine.name: "0"}
    finally:
        server.stop()
    assert not server.alive()


@pytest.mark.slow
def test_failed_launch_reports_the_log_tail(tmp_path):
    cfg = SGLangServerConfig(model_path=str(tmp_path / "no-such-model"), launch_module=EMBEDDED,
                             log_dir=str(tmp_path), health_poll_s=0.2, watchdog_interval_s=None, startup_timeout_s=120)
    server = ServerProcess(cfg)
    with pytest.raises(ServerLaunchError) as ei:
        server.start()
    msg = str(ei.value)
    assert "exited with code 2" in msg and "no config.json" in msg and "no-such-model" in msg


def test_router_registration_new_api_and_fallback():
    calls = []

    def fake_router(new_api: bool):
        app = web.Application()

        async def workers_post(request):
            calls.append(("POST /workers", await request.json()))
            return web.json_response({"worker_id": "w-1", "status": "accepted"})

        async def workers_delete(request):
            calls.append(("DELETE /workers", request.match_info["wid"]))
            return web.json_response({"status": "ok"})

        async def add_worker(request):
            calls.append(("POST /add_worker", request.query["url"]))
            return web.Response(text="ok")

        async def remove_worker(request):
            calls.append(("POST /remove_worker", request.query["url"]))
            return web.Response(text="ok")

        if new_api:
            app.router.add_post("/workers", workers_post)
            app.router.add_delete("/workers/{wid}", workers_delete)
        else:
            app.router.add_post("/add_worker", add_worker)
            app.router.add_post("/remove_worker", remove_worker)
        return app

    async def scenario(new_api: bool):
        runner = web.AppRunner(fake_router(new_api))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = EngineClient(f"http://127.0.0.1:{port}")
        try:
            wid = await register_worker(client, "http://10.0.0.1:30000")
            await unregister_worker(client, "http://10.0.0.1:30000", wid)
            return wid
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(scenario(True)) == "w-1"
    assert calls == [("POST /workers", {"url": "http://10.0.0.1:30000", "worker_type": "regular"}),
                     ("DELETE /workers", "w-1")]
    calls.clear()
    assert asyncio.run(scenario(False)) == "http://10.0.0.1:30000"
    assert calls == [("POST /add_worker", "http://10.0.0.1:30000"), ("POST /remove_worker", "http://10.0.0.1:30000")]


def test_router_command_line():
    proc = RouterProcess(RouterConfig(port=31000, policy="cache_aware", worker_urls=["http://a:1", "http://b:2"],
                                      router_args={"disable_circuit_breaker": True}))
    cmd = proc.command(31000)
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert " ".join(cmd[3:]) == ("--host 127.0.0.1 --port 31000 --policy cache_aware --worker-urls http://a:1 "
                                 "http://b:2 --disable-circuit-breaker")


def test_manager_dispatch_and_fan_out_errors(model_dir):
    """Least-loaded dispatch over two in-process engines; a dead engine is named in fan-out errors."""
    from megatron_rl.rollout.client import ClientConfig
    from megatron_rl.rollout.engine import EngineGroupError
    from megatron_rl.rollout.sglang_engine import free_port
    from rollout_helpers import start_server

    class Counting(HttpEngine):
        calls = 0

        async def generate(self, input_ids, sampling):
            self.calls += 1
            return await super().generate(input_ids, sampling)

    s1, s2 = start_server(tiny_model(0)), start_server(tiny_model(0))
    try:
        e1, e2 = Counting(s1.url, name="e1"), Counting(s2.url, name="e2")
        dead = HttpEngine(f"127.0.0.1:{free_port()}", name="dead", client_config=ClientConfig(retries=0))
        manager = EngineManager([e1, e2])

        async def go():
            rs = await asyncio.gather(*[manager.generate([i + 1, 2], SamplingParams(temperature=0.0, max_new_tokens=40,
                                                                                     ignore_eos=True))
                                        for i in range(8)])
            await manager.pause()
            await manager.flush_cache()
            await manager.continue_generation()
            with pytest.raises(EngineGroupError) as ei:
                await EngineManager([e1, dead]).pause()
            health = await EngineManager([e1, dead]).health()
            return rs, ei.value, health

        rs, err, health = run(go(), e1.client, e2.client, dead.client)
        assert all(r.finish_reason == "length" for r in rs)
        assert list(err.failures) == ["dead"] and isinstance(err.failures["dead"], EngineConnectionError)
        assert health == {"e1": True, "dead": False}
        assert (e1.calls, e2.calls) == (4, 4)
    finally:
        s1.stop()
        s2.stop()


@pytest.mark.slow
def test_sglang_engine_ray_actor_launches_and_relaunches(model_dir, tmp_path):
    """The Ray actor wrapper: start the server inside the actor, generate over HTTP, relaunch via the manager."""
    ray = pytest.importorskip("ray")
    from megatron_rl.rollout.sglang_engine import launch_sglang_engines

    path, model = model_dir
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        cfg = SGLangServerConfig(model_path=path, launch_module=EMBEDDED, log_dir=str(tmp_path), health_poll_s=0.2,
                                 watchdog_interval_s=None, startup_timeout_s=120, server_args={"device": "cpu"})
        [engine] = launch_sglang_engines([cfg], num_gpus=0)
        manager = EngineManager([engine])
        expected = greedy_reference(model, [5, 6], 6)

        async def go():
            first = await manager.generate([5, 6], GREEDY)
            await manager.relaunch(engine.name)
            return first, await manager.generate([5, 6], GREEDY)

        first, second = run(go(), engine.client)
        assert first.token_ids == second.token_ids == expected
        assert ray.get(engine.launcher.actor.alive.remote())
        ray.get(engine.launcher.actor.stop.remote())
    finally:
        ray.shutdown()


def _launcher_with_server(model: str) -> tuple[subprocess.Popen, int]:
    """A process that serves ``model`` through ``serve_embedded`` and then waits; (it, its server's pid)."""
    code = textwrap.dedent(f"""
        import sys, time
        from megatron_rl.rollout.local_engine import serve_embedded
        with serve_embedded({model!r}, max_batch_size=2, threads=1):
            print("up", flush=True)
            time.sleep(600)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root,
                                env=dict(os.environ, PYTHONPATH=root))
    assert launcher.stdout.readline().strip() == "up"
    servers = psutil.Process(launcher.pid).children()
    assert len(servers) == 1, servers
    return launcher, servers[0].pid


def _gone(pid: int, within_s: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout=within_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        os.kill(pid, signal.SIGKILL)
        return False
    return True


def test_a_killed_launcher_leaves_no_server_behind(model_dir):
    """The server runs in its own session; a plain kill of the tool that launched it (RFT, evaluation) unwinds
    the tool and stops it, and a SIGKILL ends it through its watch on the launcher's pid. Both launchers start
    side by side (the start-up is most of the test's time)."""
    launched = {sig: _launcher_with_server(model_dir[0]) for sig in (signal.SIGTERM, signal.SIGKILL)}
    for sig, (launcher, _) in launched.items():
        launcher.send_signal(sig)
    for sig, (launcher, server) in launched.items():
        launcher.wait(timeout=30)
        assert _gone(server, within_s=20), f"server {server} outlived its launcher ({signal.Signals(sig).name})"
    assert launched[signal.SIGTERM][0].returncode == 128 + signal.SIGTERM   # unwound through SystemExit
