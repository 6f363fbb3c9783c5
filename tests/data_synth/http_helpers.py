"""A tiny local HTTP teacher for the distill tests: OpenAI ``/v1/chat/completions`` answered by a script."""
import asyncio
import re
import socket
import threading
from typing import Callable

from aiohttp import web


class ScriptedTeacher:
    """Answers each chat request with ``script(task_id, turn, messages)``; records every request."""

    def __init__(self, script: Callable[[str, int, list], str]):
        self.script = script
        self.requests: list[dict] = []
        self.port = None
        self._loop = None
        self._runner = None
        self._thread = None

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        msgs = body["messages"]
        found = (re.search(r"\(task ([^)]+)\)", x["content"]) for x in msgs if x["role"] == "user")
        m = next((f for f in found if f), None)
        task_id = m.group(1) if m else "?"
        turn = sum(1 for x in msgs if x["role"] == "assistant") + 1
        text = self.script(task_id, turn, msgs)
        return web.json_response({"id": "x", "object": "chat.completion", "model": body.get("model"),
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": text}}]})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted-teacher", "object": "model"}]})

    def start(self) -> str:
        sock = socket.socket()   # bound here and handed to the site: no window for another process to take the port
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_get("/v1/models", self._models)
            self._runner = web.AppRunner(app)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
            fut.result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

